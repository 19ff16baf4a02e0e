"""The check an attention benchmark makes before it times an implementation: its output (and its gradients, where a
timed mode runs the backward) on the inputs it is about to time, against a float64 reference of two (batch, head)
slices, the first and the last. A wrong implementation gets an error row (`WrongResult`), never a time; a right one
records its errors (`ERROR_FIELDS`) in its rows.

The error of a tensor is the worst over its blocks of `BLOCK` rows (queries for O and dQ, keys for dK and dV) of
‖x_block − ref_block‖ / (‖ref‖ / √blocks): a block computed wrongly (a mask, a tile, a head) scores about 1 however
long the sequence, where a whole-tensor relative error would dilute it; the slice's own norm as the yardstick keeps
blocks whose reference is small (the last keys of a causal call) from dividing by almost nothing. The bounds
(`BOUNDS`) are several times what rounding in the dtype gives, not the test suite's tight rule (twice PyTorch's
error in the same dtype): this check stops garbage, the tests hold the precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from cs336_systems.bench.timing import free_memory

if TYPE_CHECKING:
    import torch

BOUNDS = {"fp32": 0.02, "fp16": 0.03, "bf16": 0.1}  # fp32 under TF32 (matmul precision "high") included
BLOCK = 128
ERROR_FIELDS = ("err_o", "err_dq", "err_dk", "err_dv")
REFERENCE_BYTES = 2**28  # float64 scores held at once by the reference (rows chunked to fit)


class WrongResult(Exception):
    """An implementation's output or gradients are not attention's on the benchmark's inputs."""


def check(attn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, dtype: str,
          backward: bool) -> dict[str, float]:
    """`attn(q, k, v, is_causal)` (softmax scale 1/√d) against float64 attention on two slices: the errors by name
    (`ERROR_FIELDS`, the gradients' only with `backward`); raises WrongResult when one exceeds `BOUNDS[dtype]` or
    is not finite. q (..., H, S, D) or (B, S, D); k, v with H or a divisor of H heads (grouped queries). The
    device's memory is freed and its peak counter reset afterwards: the check's memory is not the timed call's."""
    try:
        return _check(attn, q, k, v, is_causal, dtype, backward)
    finally:
        free_memory(q.device)


def _check(attn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, dtype: str,
           backward: bool) -> dict[str, float]:
    import torch

    if dtype not in BOUNDS:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(BOUNDS)}")
    if is_causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal check of {q.shape[-2]} queries over {k.shape[-2]} keys: the benchmarks' calls "
                         "have as many of each")
    with torch.enable_grad():
        o = attn(q, k, v, is_causal)
        if tuple(o.shape) != tuple(q.shape):
            raise WrongResult(f"O has shape {tuple(o.shape)}, not q's {tuple(q.shape)}")
        grads = None
        if backward:
            do = torch.randn(q.shape, generator=torch.Generator(q.device).manual_seed(0), device=q.device,
                             dtype=q.dtype)
            # (retain_graph: a compiled backward built for a first call without it would refuse later calls with it)
            grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    q4, k4, v4, o4 = (_heads(t) for t in (q, k, v, o))
    group = q4.shape[1] // k4.shape[1]
    errors: dict[str, float] = {}
    batch, kv_heads = k4.shape[:2]
    for b, kv_head in dict.fromkeys(((0, 0), (batch - 1, kv_heads - 1))):
        heads = range(kv_head * group, (kv_head + 1) * group)
        ref = _reference([q4[b, h] for h in heads], k4[b, kv_head], v4[b, kv_head], is_causal,
                         [_heads(do)[b, h] for h in heads] if backward else None)
        ours = {"err_o": [o4[b, h] for h in heads]}
        if backward:
            dq, dk, dv = (_heads(g) for g in grads)
            ours.update(err_dq=[dq[b, h] for h in heads], err_dk=[dk[b, kv_head]], err_dv=[dv[b, kv_head]])
        for name, tensors in ours.items():
            error = max(block_error(x, r) for x, r in zip(tensors, ref[name]))
            errors[name] = max(errors.get(name, 0.0), error)
            if not error <= BOUNDS[dtype]:
                raise WrongResult(f"{name.removeprefix('err_')} of (batch {b}, kv head {kv_head}): block error "
                                  f"{error:.3g} against float64 attention, above {dtype}'s bound {BOUNDS[dtype]}")
    return errors


def block_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst block's error (module docstring) of x (rows, d) against ref; inf where x is not finite."""
    diff = x.double() - ref
    if not diff.isfinite().all():
        return math.inf
    blocks = -(-ref.shape[0] // BLOCK)
    scale = ref.norm().item() / math.sqrt(blocks)
    if scale == 0:
        return diff.abs().max().item()
    worst = max(diff[i:i + BLOCK].norm().item() for i in range(0, diff.shape[0], BLOCK))
    return worst / scale


def _heads(t: torch.Tensor) -> torch.Tensor:
    """t as (batch, heads, S, D): (B, S, D) inputs as one head each; leading dimensions folded into the batch."""
    return t.unsqueeze(1) if t.dim() == 3 else t.reshape(-1, *t.shape[-3:])


def _reference(qs: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor, is_causal: bool,
               dos: list[torch.Tensor] | None) -> dict[str, list[torch.Tensor]]:
    """float64 O (and dQ per query head, dK and dV summed over the heads that share k and v) of one slice, rows
    chunked so that no more than REFERENCE_BYTES of scores are held."""
    import torch

    k, v = k.double(), v.double()
    n_keys, d = k.shape
    scale = 1 / math.sqrt(d)
    chunk = max(1, REFERENCE_BYTES // (8 * max(n_keys, 1)))
    out: dict[str, list[torch.Tensor]] = {"err_o": [], "err_dq": []}
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    keys = torch.arange(n_keys, device=k.device)
    for i, q in enumerate(qs):
        q = q.double()
        o, dq = torch.empty_like(q), torch.empty_like(q)
        for start in range(0, q.shape[0], chunk):
            rows = slice(start, start + chunk)
            s = q[rows] @ k.T * scale
            if is_causal:
                s.masked_fill_(keys[None, :] > torch.arange(s.shape[0], device=k.device)[:, None] + start, -math.inf)
            p = s.softmax(-1)
            o[rows] = p @ v
            if dos is not None:
                do = dos[i][rows].double()
                dv += p.T @ do
                ds = p * (do @ v.T - (do * o[rows]).sum(-1, keepdim=True))
                dq[rows] = ds @ k * scale
                dk += ds.T @ q[rows] * scale
        out["err_o"].append(o)
        out["err_dq"].append(dq)
    out.update(err_dk=[dk], err_dv=[dv])
    return out

