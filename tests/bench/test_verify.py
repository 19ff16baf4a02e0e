"""The correctness check before timing (`bench.verify`): right implementations pass with their errors recorded;
wrong ones (not finite, a mask, one tile, the last head, the scale, the shape) raise, and a benchmark records an
error row for them instead of a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.bench import impls, verify

from .helpers import rows_of, run_cli


def sdpa(q, k, v, is_causal, scale=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                          enable_gqa=k.dim() == 4 and k.shape[1] != q.shape[1])


def _inputs(*shape, kv_heads=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()
    kv_shape = (*shape[:-3], kv_heads, *shape[-2:]) if kv_heads else shape
    k, v = (torch.randn(*kv_shape, generator=gen, dtype=dtype).requires_grad_() for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("shape,kv_heads", [((2, 4, 200, 16), None), ((2, 4, 136, 16), 2), ((3, 96, 8), None)])
def test_right_attention_passes_with_its_errors(shape, kv_heads, is_causal):
    q, k, v = _inputs(*shape, kv_heads=kv_heads)
    errors = verify.check(sdpa, q, k, v, is_causal, "fp32", backward=True)
    assert set(errors) == set(verify.ERROR_FIELDS)
    assert all(0 <= e < 1e-5 for e in errors.values()), errors
    assert q.grad is None, "the check left gradients behind"
    assert set(verify.check(sdpa, q, k, v, is_causal, "fp32", backward=False)) == {"err_o"}


def test_low_precision_attention_passes():
    q, k, v = _inputs(2, 2, 300, 32, dtype=torch.bfloat16)
    naive = impls.build("naive", impls.Setup(torch.device("cpu"), "bf16", 300))
    errors = verify.check(naive, q, k, v, True, "bf16", backward=True)
    assert max(errors.values()) < verify.BOUNDS["bf16"] / 3, errors


def _tile_off(q, k, v, is_causal):
    o = sdpa(q, k, v, is_causal)
    bump = torch.zeros_like(o)
    bump[..., 128:256, :] = 0.5  # one tile of rows wrong among several
    return o + bump


def _last_head_off(q, k, v, is_causal):
    o = sdpa(q, k, v, is_causal)
    return torch.cat([o[:, :-1], o[:, -1:] * 1.1], 1)


def _dk_off(q, k, v, is_causal):
    class Scaled(torch.autograd.Function):  # right forward, dK half of what it should be
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return g * 0.5

    return sdpa(q, Scaled.apply(k), v, is_causal)


@pytest.mark.parametrize("wrong,what", [
    (lambda q, k, v, c: sdpa(q, k, v, c) * float("nan"), "o of"),
    (lambda q, k, v, c: sdpa(q, k, v, False), "o of"),
    (_tile_off, "o of"),
    (_last_head_off, "kv head 3"),
    (lambda q, k, v, c: sdpa(q, k, v, c, scale=1.1 / q.shape[-1] ** 0.5), "o of"),
    (_dk_off, "dk of"),
    (lambda q, k, v, c: sdpa(q, k, v, c)[..., :-1, :], "shape"),
])
def test_wrong_attention_is_refused(wrong, what):
    q, k, v = _inputs(2, 4, 1024, 16)
    with pytest.raises(verify.WrongResult, match=what):
        verify.check(wrong, q, k, v, True, "fp32", backward=True)


def test_bad_arguments_are_refused():
    q, k, v = _inputs(1, 1, 16, 8)
    with pytest.raises(ValueError, match="dtype"):
        verify.check(sdpa, q, k, v, True, "fp64", backward=False)
    with pytest.raises(ValueError, match="causal"):
        verify.check(sdpa, q, k[..., :8, :], v[..., :8, :], True, "fp32", backward=False)


def test_a_wrong_implementation_gets_an_error_row_not_a_time(tmp_path, monkeypatch):
    """The leaderboard (and every attention benchmark, through the same check) records no time for garbage."""
    build = impls.build

    def garbage(name, setup):
        attn = build(name, setup)
        return lambda q, k, v, is_causal: attn(q, k, v, is_causal) * float("nan")

    monkeypatch.setattr(impls, "build", garbage)
    assert run_cli("leaderboard", "--smoke", "--variant", "naive", "--no-sdpa", "--seq", "32", "--n-heads", "2",
                   "--out", str(tmp_path)) == 1  # (error rows: exit code 1)
    rows = rows_of(tmp_path, "leaderboard")
    assert {r["mode"] for r in rows} == {"fwd", "fwd_bwd"}
    for r in rows:
        assert r["status"].startswith("error: WrongResult") and r["ms"] is None, r
