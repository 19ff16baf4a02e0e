"""Input checks shared by the FlashAttention-2 implementations.

Bad input gets a `TypeError` (wrong kind or dtype) or a `ValueError` (wrong shape or device)
that names the problem, instead of garbage output or a crash inside a kernel.
"""

from __future__ import annotations

import math

import numpy as np
import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_flag(name: str, value: object) -> bool:
    """A Python or NumPy bool, returned as a Python bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


# Scales whose scale·log2(e) is a normal float32 (the kernels' exponent base 2): beyond them inf, NaN or 0
SCALE_RANGE = (2.0**-126 / math.log2(math.e), (2 - 2.0**-23) * 2.0**127 / math.log2(math.e))


def check_scale(scale: object, d: int) -> float:
    """The softmax scale: None means 1/sqrt(d); otherwise a positive finite number."""
    if scale is None:
        return d ** -0.5
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not 0 < scale < math.inf:  # comparisons, not math.isfinite: torch.compile traces them on a symbolic float
        raise ValueError(f"scale must be positive and finite, got {scale}")
    if not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]:
        raise ValueError(f"scale {scale} is outside [{SCALE_RANGE[0]:.3g}, {SCALE_RANGE[1]:.3g}]: the kernels take "
                         "scale·log2(e) as a normal float32")
    return scale


def check_window(window: object) -> tuple[int, int]:
    """A sliding window (left, right): two ints, each -1 (unbounded) or more; returned as a tuple of ints. Under
    torch.compile a window's ints may be symbolic (a second call with another window): they are specialized here,
    one graph per window, as the kernels specialize on it."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a (left, right) tuple of two ints, got {window!r}")
    for name, side in zip(("left", "right"), window):
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer, torch.SymInt)):
            raise TypeError(f"window {name} must be an int, got {type(side).__name__}")
        if side < -1:
            raise ValueError(f"window {name} must be -1 (unbounded) or at least 0, got {side}")
    return int(window[0]), int(window[1])


def check_attention_inputs(q: object, k: object, v: object, is_causal: object, enable_gqa: object = False) -> bool:
    """Check q (..., Nq, D), k (..., Nk, D), v (..., Nk, D) and the flags; return is_causal as a bool.

    With `enable_gqa`, q is (..., Hq, Nq, D) and k, v are (..., Hkv, Nk, D) with Hkv dividing Hq
    (grouped-query attention, as in `F.scaled_dot_product_attention(enable_gqa=True)`).
    Good inputs pass one combined condition (a few µs less host time per call); any other input
    goes through the checks one by one, which raise naming the problem.
    """
    if (type(is_causal) is bool and type(enable_gqa) is bool and isinstance(q, torch.Tensor)
            and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        qs, ks = q.shape, k.shape
        n = len(qs)
        if (q.dtype in SUPPORTED_DTYPES and q.dtype == k.dtype == v.dtype and q.device == k.device == v.device
                and ks == v.shape and len(ks) == n >= 2 and qs[-1] == ks[-1] >= 1 and qs[-2] >= 1 and ks[-2] >= 1
                and (n >= 3 and qs[:-3] == ks[:-3] and ks[-3] >= 1 and qs[-3] % ks[-3] == 0 if enable_gqa
                     else qs[:-2] == ks[:-2])):
            return is_causal
    return _check_one_by_one(q, k, v, is_causal, enable_gqa)


def _check_one_by_one(q: object, k: object, v: object, is_causal: object, enable_gqa: object) -> bool:
    """`check_attention_inputs`'s checks in turn: the first that fails raises."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    is_causal = check_flag("is_causal", is_causal)
    enable_gqa = check_flag("enable_gqa", enable_gqa)
    _check_dtypes_and_device(q, k, v)
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(
            "q, k, v must have the same number of dimensions (..., seq, d) with at least 2, "
            f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v lengths differ: k has {k.shape[-2]} keys, v has {v.shape[-2]} values")
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"batch dimensions of k and v differ: {tuple(k.shape[:-2])} vs {tuple(v.shape[:-2])}")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f"head dims differ: q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}")
    lead = -3 if enable_gqa else -2
    if enable_gqa and q.ndim < 3:
        raise ValueError(f"enable_gqa needs (..., heads, seq, d) inputs, got {q.ndim} dimensions")
    if not enable_gqa and q.ndim >= 3 and q.shape[:-3] == k.shape[:-3] and q.shape[-3] != k.shape[-3]:
        raise ValueError(_heads_differ(q.shape, k.shape))
    if q.shape[:lead] != k.shape[:lead]:
        raise ValueError(
            f"batch dimensions of q and k, v differ: {tuple(q.shape[:lead])} vs {tuple(k.shape[:lead])}")
    if enable_gqa and (k.shape[-3] < 1 or q.shape[-3] % k.shape[-3]):
        raise ValueError(
            f"enable_gqa: k, v heads ({k.shape[-3]}) must divide q heads ({q.shape[-3]})")
    if q.shape[-1] < 1 or q.shape[-2] < 1 or k.shape[-2] < 1:
        raise ValueError(
            f"head dim and sequence lengths must be at least 1, got Nq={q.shape[-2]}, "
            f"Nk={k.shape[-2]}, d={q.shape[-1]}"
        )
    return is_causal


def _check_dtypes_and_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v: supported dtypes, one dtype, one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {t.dtype}; supported: float32, float16, bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _heads_differ(q_shape: torch.Size, k_shape: torch.Size) -> str:
    """The message for q and k, v differing only in dim -3 (heads, or the batch of (batch, seq, d) inputs)."""
    hq, hk = q_shape[-3], k_shape[-3]
    what = "head counts (or, for (batch, seq, d) inputs, batch sizes)" if len(q_shape) == 3 else "head counts"
    hint = ("enable_gqa=True allows this (grouped-query attention: each k, v head serves "
            f"{hq // hk} q heads)" if hk and hq % hk == 0 else
            f"enable_gqa=True would need k, v's {hk} heads to divide q's {hq}")
    return f"{what} of q and k, v differ: q has {hq}, k and v have {hk}; {hint}"


def refuse_double_backward(name: str) -> None:
    """Raise in a backward asked to build a graph (create_graph=True): ours is not differentiable."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}'s backward is not differentiable (double backward, e.g. a gradient penalty through "
            "attention, is not supported); use the materialized reference attention for that")


def check_varlen_inputs(q: object, k: object, v: object, cu_seqlens_q: object, cu_seqlens_k: object,
                        max_seqlen_q: object, max_seqlen_k: object, is_causal: object) -> bool:
    """Check packed inputs q (total_q, H, D), k and v (total_k, Hkv, D) with Hkv dividing H, cu_seqlens_q and
    cu_seqlens_k (int32, (batch + 1,), on q's device), max_seqlen_q and max_seqlen_k (ints >= 0; symbolic ones under
    torch.compile) and the flag, from
    metadata alone (no device sync); return is_causal as a bool. `check_varlen_offsets` checks the offsets' values."""
    is_causal = check_flag("is_causal", is_causal)
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    assert isinstance(cu_seqlens_q, torch.Tensor) and isinstance(cu_seqlens_k, torch.Tensor)
    _check_dtypes_and_device(q, k, v)
    if not (q.ndim == k.ndim == v.ndim == 3):
        raise ValueError("packed q, k, v must be (total, heads, d), got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head dims differ: q {q.shape[2]}, k and v {k.shape[2]}")
    if q.shape[2] < 1 or k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"k, v heads ({k.shape[1]}) must divide q heads ({q.shape[1]}), and the head dim "
                         f"({q.shape[2]}) be at least 1")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.ndim != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D of length batch + 1 >= 1, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer, torch.SymInt)):
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"{name} must be at least 0, got {n}")
    return is_causal


def check_varlen_offsets(cu_seqlens: torch.Tensor, total: int, max_seqlen: int, name: str) -> None:
    """The values of cu_seqlens (`name`, checked by `check_varlen_inputs`): 0 first, non-decreasing, `total` last, no
    sequence longer than max_seqlen. Reads the offsets on the host: a device sync for CUDA tensors."""
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"{name} must be non-decreasing, got {name}[{i}] = {offsets[i]} > "
                             f"{name}[{i + 1}] = {offsets[i + 1]}")
    if offsets[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {offsets[-1]}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{name.replace('cu_seqlens', 'max_seqlen')} is {max_seqlen}, but a sequence has "
                         f"{max(lengths)} rows")
