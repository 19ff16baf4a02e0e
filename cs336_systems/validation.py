"""Input checks shared by the FlashAttention-2 implementations.

Bad input gets a `TypeError` (wrong kind or dtype) or a `ValueError` (wrong shape or device)
that names the problem, instead of garbage output or a crash inside a kernel.
"""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_attention_inputs(q: object, k: object, v: object, is_causal: object) -> None:
    """Check q (..., Nq, D), k (..., Nk, D), v (..., Nk, D) and the causal flag."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {t.dtype}; supported: float32, float16, bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(
            "q, k, v must have the same number of dimensions (..., seq, d) with at least 2, "
            f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[:-2] != k.shape[:-2] or q.shape[:-2] != v.shape[:-2]:
        raise ValueError(
            "batch dimensions of q, k, v differ: "
            f"{tuple(q.shape[:-2])}, {tuple(k.shape[:-2])}, {tuple(v.shape[:-2])}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v lengths differ: k has {k.shape[-2]} keys, v has {v.shape[-2]} values")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f"head dims differ: q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}")
    if q.shape[-1] < 1 or q.shape[-2] < 1 or k.shape[-2] < 1:
        raise ValueError(
            f"head dim and sequence lengths must be at least 1, got Nq={q.shape[-2]}, "
            f"Nk={k.shape[-2]}, d={q.shape[-1]}"
        )
