"""Seeded random calls over the options at once (layouts, grouped-query heads, Nq != Nk, windows, scales, odd head
dims; packed batches with empty documents and documents without keys), forward and backward against float64.

The other tests check each option on its own; these check that combinations of them hold. On the CPU the kernels
run through Triton's interpreter: sizes stay tiny. fp32 inputs: the bound follows the matmul precision; bf16 and fp16
inputs: at most twice the error of the attention materialized in their dtype.
"""

from __future__ import annotations

import random

import pytest
import torch

from cs336_systems.flash_triton import flash_attention, flash_attention_varlen

from .helpers import DEVICE, band_reference, grads_of, max_err

WINDOWS = [(-1, -1), (-1, -1), (3, 0), (8, 8), (0, 5), (200, -1), (-1, 2)]


def bound() -> float:
    return 2e-3 if torch.get_float32_matmul_precision() == "highest" else 5e-2


def reference(q, k, v, is_causal, window, scale):
    """float64 attention with the band mask, at `scale` (band_reference scales by D^-0.5)."""
    return band_reference(q * (scale * q.shape[-1] ** 0.5), k, v, is_causal, window)


def dense_case(rnd: random.Random) -> dict:
    kv_heads, group = rnd.choice([1, 2]), rnd.choice([1, 2, 3])
    n_q = rnd.choice([1, 3, 16, 17, 64, 65, 100, 130])
    n_k = rnd.choice([n_q, n_q, 1, 5, 33, 64, 129])
    window = rnd.choice(WINDOWS) if n_q == n_k else (-1, -1)
    return dict(batch=rnd.choice([1, 2]), heads=kv_heads * group, kv_heads=kv_heads, n_q=n_q, n_k=n_k,
                d=rnd.choice([16, 32, 40, 64, 128]), is_causal=rnd.random() < 0.5, window=window,
                scale=rnd.choice([None, 0.3]), layout=rnd.choice(["bhsd", "bshd", "strided"]))


@pytest.mark.parametrize("seed", range(6))
def test_random_dense_calls_match_float64(seed):
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(8):
        c = dense_case(rnd)

        def make(heads, n):
            b, d = c["batch"], c["d"]
            if c["layout"] == "bhsd":
                t = torch.randn(b, heads, n, d, generator=gen)
            elif c["layout"] == "bshd":
                t = torch.randn(b, n, heads, d, generator=gen).transpose(1, 2)
            else:  # every other element of the last dim
                t = torch.randn(b, heads, n, 2 * d, generator=gen)[..., ::2]
            return t.to(DEVICE)

        q, k, v = make(c["heads"], c["n_q"]), make(c["kv_heads"], c["n_k"]), make(c["kv_heads"], c["n_k"])
        do = torch.randn(q.shape, generator=gen).to(DEVICE)
        scale = c["scale"] if c["scale"] is not None else c["d"] ** -0.5
        kwargs = dict(is_causal=c["is_causal"], window=c["window"], enable_gqa=c["heads"] != c["kv_heads"])
        if c["scale"] is not None:
            kwargs["scale"] = c["scale"]
        ours = grads_of(lambda q, k, v: flash_attention(q, k, v, **kwargs), q, k, v, do)
        exact = grads_of(lambda q, k, v: reference(q, k, v, c["is_causal"], c["window"], scale),
                         *(t.double() for t in (q, k, v)), do.double())
        for name, x, ref in zip(("O", "dQ", "dK", "dV"), ours, exact):
            err = max_err(x, ref)
            assert err <= bound(), f"{c}: {name} max |ours - fp64| = {err:.3g}"


def packed_reference(q, k, v, cu_q, cu_k, is_causal, window):
    """float64 packed attention, document by document; a query without keys gets 0."""
    out = q * 0.0  # (a graph even where no document has keys)
    for i in range(len(cu_q) - 1):
        a, b, c, e = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if b > a and e > c:
            qs, ks, vs = (t.transpose(0, 1) for t in (q[a:b], k[c:e], v[c:e]))
            out[a:b] = band_reference(qs, ks, vs, is_causal, window).transpose(0, 1)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_random_packed_calls_match_float64(seed):
    rnd = random.Random(100 + seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(6):
        kv_heads, group, d = rnd.choice([1, 2]), rnd.choice([1, 2]), rnd.choice([16, 64, 128])
        docs = rnd.randint(1, 5)
        lengths_q = [rnd.choice([0, 1, 2, 17, 64, 100, 130]) for _ in range(docs)]
        cross = rnd.random() < 0.3  # Nq != Nk per document, documents without keys among them
        lengths_k = [rnd.choice([0, 1, 5, 64, 129]) for _ in range(docs)] if cross else list(lengths_q)
        is_causal = rnd.random() < 0.5
        window = (-1, -1) if cross else rnd.choice(WINDOWS)
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
                      for n in (lengths_q, lengths_k))
        q = torch.randn(sum(lengths_q), kv_heads * group, d, generator=gen).to(DEVICE)
        k, v = (torch.randn(sum(lengths_k), kv_heads, d, generator=gen).to(DEVICE) for _ in range(2))
        do = torch.randn(q.shape, generator=gen).to(DEVICE)
        ours = grads_of(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                               is_causal=is_causal, window=window), q, k, v, do)
        exact = grads_of(lambda q, k, v: packed_reference(q, k, v, cu_q, cu_k, is_causal, window),
                         *(t.double() for t in (q, k, v)), do.double())
        case = dict(lengths_q=lengths_q, lengths_k=lengths_k, heads=kv_heads * group, kv_heads=kv_heads, d=d,
                    is_causal=is_causal, window=window)
        for name, x, ref in zip(("O", "dQ", "dK", "dV"), ours, exact):
            err = max_err(x, ref) if x.numel() else 0.0
            assert err <= bound(), f"{case}: {name} max |ours - fp64| = {err:.3g}"


@pytest.mark.parametrize("seed", range(3))
def test_random_low_precision_calls_meet_the_2x_rule(seed):
    """bf16 and fp16 random dense calls (grouped-query heads, windows, odd lengths): each of O, dQ, dK, dV at most
    twice the error of the same attention materialized in the input dtype, both against float64."""
    rnd = random.Random(200 + seed)
    gen = torch.Generator().manual_seed(200 + seed)
    for _ in range(5):
        dtype = rnd.choice([torch.bfloat16, torch.float16])
        kv_heads, group, n, d = rnd.choice([1, 2]), rnd.choice([1, 2]), rnd.choice([16, 17, 64, 100, 130]), \
            rnd.choice([16, 64, 128])
        is_causal, window = rnd.random() < 0.5, rnd.choice([(-1, -1), (8, 0), (20, 20)])
        q = torch.randn(1, kv_heads * group, n, d, generator=gen).to(DEVICE)
        k, v = (torch.randn(1, kv_heads, n, d, generator=gen).to(DEVICE) for _ in range(2))
        do = torch.randn(q.shape, generator=gen).to(DEVICE)
        low = [t.to(dtype) for t in (q, k, v)]
        ours = grads_of(lambda q, k, v: flash_attention(q, k, v, is_causal=is_causal, window=window,
                                                        enable_gqa=group > 1), *low, do.to(dtype))
        same = grads_of(lambda q, k, v: band_reference(q, k, v, is_causal, window), *low, do.to(dtype))
        exact = grads_of(lambda q, k, v: band_reference(q, k, v, is_causal, window), *(t.double() for t in (q, k, v)),
                         do.double())
        case = dict(dtype=dtype, heads=kv_heads * group, kv_heads=kv_heads, n=n, d=d, is_causal=is_causal,
                    window=window)
        for name, x, base, ref in zip(("O", "dQ", "dK", "dV"), ours, same, exact):
            err, base_err = max_err(x, ref), max_err(base, ref)
            assert err <= 2 * base_err + 1e-5, f"{case}: {name} {err:.3g} > 2 x {dtype} reference's {base_err:.3g}"
