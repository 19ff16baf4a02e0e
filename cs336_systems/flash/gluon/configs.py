"""The Gluon kernels' tile configs per head dim and what each kernel takes: `supported` (the dK/dV passes and the
single passes), `fwd_supported` (the forward), `packed_supported` and `packed_fwd_supported` (packed sequences)."""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl

# (BLOCK_M queries, BLOCK_N keys, num_warps, STAGES) per head dim: the best of the H200 sweeps
# (runs/kernels, plans gluon_kv and gluon_kv128)
CONFIGS = {64: (64, 64, 4, 2), 128: (32, 64, 4, 4)}
# the dK/dV pass with the queries on rows (`flash_bwd_kv_qrows_gluon_kernel`; BLOCK_M = BLOCK_N = 16·num_warps):
# the best of the H200 sweeps (runs/kernels, plans qrows2 and qrows128)
QROWS_CONFIGS = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2)}
# the same kernel as a single-pass backward (DQ_ATOMIC): 128 keys per program halve dQ's reduction traffic
# (H200, plan single_qrows); d 128 keeps the two-pass design (the single pass lost there)
SINGLE_PASS_CONFIGS = {64: (128, 128, 8, 2)}
# the shipped single pass, keys on rows (`flash_bwd_single_keys_gluon_kernel`): FlashAttention-3's d-64 tile of
# 128 keys × 128 queries, two compute warpgroups (its shared memory, 226 KiB, leaves no room for a third stage);
# at d 128, 128 keys × 64 queries (FlashAttention-3's d-128 tile; 226 KiB again)
SINGLE_PASS_KEYS_CONFIGS = {64: (128, 128, 8, 2), 128: (64, 128, 8, 2)}
# the forward: (BLOCK_M query rows per consumer warpgroup, BLOCK_N keys, consumer warps (4 per warpgroup:
# 4, 8 or 12), STAGES)
FWD_CONFIGS = {64: (64, 128, 12, 3), 128: (64, 128, 8, 2)}  # the H200 sweep's best (plans gluon_fwd, gluon_fwd128)
# a forward of one consumer warpgroup launches at this register ceiling per thread (the consumer gets what the
# producer's warpgroup leaves, ~232): two programs then share an SM, one's loads and stores under the other's matmuls
ONE_WARPGROUP_MAXNREG = 128
# the dense forward's config up to ONE_WARPGROUP_MAX_KEYS keys: short key loops leave the three-warpgroup program's
# Q load, pipeline fill and O store exposed, which a second program on the SM hides (H100, runs/ab/
# gluon_fwd_short_one_warpgroup_756b132.jsonl: 0.84x at 32 x 16 x 512, 0.94x at 16 x 16 x 1024, d 128 0.85x at
# 32 x 16 x 512; 1.15x at 4 x 16 x 4096, and 1.09x for packed documents, which keep FWD_CONFIGS)
ONE_WARPGROUP_FWD_CONFIGS = {64: (64, 128, 4, 2), 128: (64, 64, 4, 2)}
ONE_WARPGROUP_MAX_KEYS = 1024


def one_warpgroup_fwd(n_k: int, windowed: bool) -> bool:
    """Whether a dense forward of n_k keys (a window or not) runs one consumer warpgroup: short key loops without a
    window (measured there)."""
    return n_k <= ONE_WARPGROUP_MAX_KEYS and not windowed


def fwd_config(d: int, n_k: int, windowed: bool) -> tuple[int, int, int, int]:
    """The dense forward's config at a call of n_k keys (head dim d, a window or not): ONE_WARPGROUP_FWD_CONFIGS'
    where `one_warpgroup_fwd`, else FWD_CONFIGS'."""
    return ONE_WARPGROUP_FWD_CONFIGS[d] if one_warpgroup_fwd(n_k, windowed) else FWD_CONFIGS[d]

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
GLUON_DTYPES = tuple(GL_DTYPES)  # the input dtypes the Gluon kernels take


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def row_stride(t: torch.Tensor) -> int | None:
    """Where t is a (B, H, S, D) view of (B, S, ·) memory whose rows hold its heads side by side (a model's
    projection output, (B, S, H, D) transposed, or one slice of a fused QKV projection's (B, S, 3·H·D)): the stride
    of its rows in the (B·S, H·D) matrix it is read as; else None (contiguous tensors included)."""
    if t.ndim != 4 or t.is_contiguous():
        return None
    batch, heads, seq, d = t.shape
    s_b, s_h, s_s, s_d = t.stride()
    rows = s_s if seq > 1 else s_b if batch > 1 else heads * d  # (a size-1 dim's stride says nothing)
    if (s_d != 1 and d > 1) or (s_h != d and heads > 1) or rows < heads * d or (batch > 1 and seq > 1
                                                                                and s_b != seq * s_s):
        return None
    return rows


def heads_inside(t: torch.Tensor) -> bool:
    """Whether t is a (B, H, S, D) view of (B, S, ·) memory with its heads side by side in each row (`row_stride`):
    the layout the Gluon kernels read where it lies."""
    return row_stride(t) is not None


def _takes(tensors, d: int, configs: dict) -> bool:
    """sm_90, 16-bit, a head dim with a config, contiguous or `heads_inside` (its rows 16-byte aligned), one dtype,
    16-byte aligned."""
    q4 = tensors[0]
    if d not in configs or q4.dtype not in GL_DTYPES or not q4.is_cuda:
        return False
    if not all((t.is_contiguous() or (row_stride(t) or 1) * t.element_size() % 16 == 0) and t.dtype == q4.dtype
               and t.data_ptr() % 16 == 0 for t in tensors):
        return False
    return _is_sm90(q4.device.index)


def kv_configs(qrows: bool, single_pass: bool) -> dict:
    if single_pass:
        return SINGLE_PASS_CONFIGS if qrows else SINGLE_PASS_KEYS_CONFIGS
    return QROWS_CONFIGS if qrows else CONFIGS


def supported(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, do4: torch.Tensor, config=None,
              qrows: bool = False, single_pass: bool = False) -> bool:
    """Whether `kv_pass` (with `qrows`; with a dQ accumulator if `single_pass`) takes these (B, H, S, D)
    tensors: sm_90, 16-bit, a head dim with a config (d 64/128; the queries-on-rows single pass d 64),
    contiguous or `heads_inside` (read where they lie), whole tiles (for the keys-on-rows single pass, queries in
    whole BLOCK_N as well: a causal key tile then sees an even number of BLOCK_M query tiles, as its loop takes
    them)."""
    d = q4.shape[-1]
    configs = kv_configs(qrows, single_pass)
    block_m, block_n, _, _ = config or configs.get(d, (1, 1, 0, 0))
    if q4.shape[2] % block_m or k4.shape[2] % block_n or (single_pass and not qrows and q4.shape[2] % block_n):
        return False
    return _takes((q4, k4, v4, do4), d, configs)


def fwd_supported(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, config=None) -> bool:
    """Whether `forward` takes these (B, H, S, D) tensors: sm_90, 16-bit, d 64/128, each contiguous or a view of
    (B, S, H, D) memory (`heads_inside`: its tiles are read where they lie), query lengths in whole BLOCK_M tiles and
    key lengths in whole BLOCK_N tiles."""
    d = q4.shape[-1]
    block_m, block_n, _, _ = config or FWD_CONFIGS.get(d, (1, 1, 0, 0))
    if q4.shape[2] % block_m or k4.shape[2] % block_n:
        return False
    return _takes((q4, k4, v4), d, FWD_CONFIGS)


# a packed grid's slots run along grid axis 1 (at most 65535 programs)
MAX_SLOTS = 65535


def _packed_takes(tensors, d: int, configs: dict, total: int, block: int, batch: int) -> bool:
    """`_takes`, and a grid of at most MAX_SLOTS slots."""
    return -(-total // block) + batch <= MAX_SLOTS and _takes(tensors, d, configs)


def packed_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, batch: int) -> bool:
    """Whether `packed_kv_pass` takes these packed (total, heads, D) tensors of `batch` sequences: what `supported`
    asks of the keys-on-rows single pass's (contiguous, 16-bit, d 64/128, sm_90), any lengths, its slots in a grid."""
    d = q.shape[-1]
    block_n = SINGLE_PASS_KEYS_CONFIGS.get(d, (1, 1))[1]
    return _packed_takes((q, k, v, do), d, SINGLE_PASS_KEYS_CONFIGS, k.shape[0], block_n, batch)


def packed_fwd_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, batch: int) -> bool:
    """Whether `packed_forward` takes these packed (total, heads, D) tensors of `batch` sequences: what `fwd_supported`
    asks (contiguous, 16-bit, d 64/128, sm_90), any lengths, its slots in a grid."""
    d = q.shape[-1]
    block_m, _, warps, _ = FWD_CONFIGS.get(d, (1, 1, 4, 0))
    return _packed_takes((q, k, v, o), d, FWD_CONFIGS, q.shape[0], block_m * (warps // 4), batch)
