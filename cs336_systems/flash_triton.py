"""FlashAttention-2 in Triton: forward, backward (delta, dK/dV pass, dQ pass), autograd, functional API.

Layout, top-down:
  1. `_fwd_tiles`, `_bwd_dkdv_tiles`, `_bwd_dq_tiles`: the inner loops, each taking a constexpr
     MASKED flag. The kernels call them first over the tiles that need no mask, then over the
     tiles on the causal diagonal (and the ragged last key tile), with MASKED=True.
  2. The kernels: `flash_fwd_kernel` (the handout's signature plus a head axis: grid (Tq, batch·heads)),
     `flash_bwd_delta_kernel`, `flash_bwd_dkdv_kernel`, `flash_bwd_dq_kernel`. No atomics: the backward
     recomputes P once per pass, so it is deterministic.
  3. Host launchers: input checks, flattening of leading dims to (batch, heads), allocation, grid.
  4. `FlashAttention2Triton` (autograd.Function), the ablation variants, and `flash_attention`.

Scores are kept in base 2 (`qk_scale = scale·log2 e`, exp2) and converted back for the saved
logsumexp L, which is in natural log as the handout defines it. Causally hidden scores are -1e6.
Head dims that are not a power of two are padded inside the kernel (zero-filled loads of a
power-of-two block), never copied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cs336_systems.flash_pytorch import flash_backward_compiled
from cs336_systems.validation import check_attention_inputs

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
MAX_HEAD_DIM = 128  # the largest head dim tested on the GPU
MAX_GRID_Y = 65535


def padded_dim(n: int) -> int:
    """A length as the kernels tile it: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(n))


if INTERPRET:
    from cs336_systems import triton_interpreter_fixes

    triton_interpreter_fixes.apply()


# ----------------------------------------------------------------------------------------------
# 1. Inner loops
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fwd_tiles(
    acc, m_i, l_i, q, K_block_ptr, V_block_ptr, offs_q, start, stop, N_KEYS, qk_scale,
    K_TILE_SIZE: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr,
):
    """Online softmax over key tiles [start, stop). Scores are in log2 units."""
    K_block_ptr = tl.advance(K_block_ptr, (start, 0))
    V_block_ptr = tl.advance(V_block_ptr, (start, 0))
    for k_start in range(start, stop, K_TILE_SIZE):
        k = tl.load(K_block_ptr, boundary_check=(0, 1), padding_option="zero")
        v = tl.load(V_block_ptr, boundary_check=(0, 1), padding_option="zero")
        s = tl.dot(q, tl.trans(k)) * qk_scale                          # (Bq, Bk) fp32
        if MASKED:
            offs_k = k_start + tl.arange(0, K_TILE_SIZE)
            keep = offs_k[None, :] < N_KEYS
            if is_causal:
                keep = keep & (offs_q[:, None] >= offs_k[None, :])
            s = tl.where(keep, s, -1.0e6 * LOG2E)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
        K_block_ptr = tl.advance(K_block_ptr, (K_TILE_SIZE, 0))
        V_block_ptr = tl.advance(V_block_ptr, (K_TILE_SIZE, 0))
    return acc, m_i, l_i


@triton.jit
def _bwd_dkdv_tiles(
    dk, dv, k, v, Q_block_ptr, dO_block_ptr, L_ptr, Delta_ptr, stride_lq, offs_k,
    start, stop, N_QUERIES, qk_scale,
    Q_TILE_SIZE: tl.constexpr, MASKED: tl.constexpr,
):
    """Accumulate dK, dV of one key tile over query tiles [start, stop), in transposed form.

    Query rows past N_QUERIES load as zeros (q, dO, L, delta), so they add nothing: no mask needed.
    """
    Q_block_ptr = tl.advance(Q_block_ptr, (start, 0))
    dO_block_ptr = tl.advance(dO_block_ptr, (start, 0))
    for q_start in range(start, stop, Q_TILE_SIZE):
        q = tl.load(Q_block_ptr, boundary_check=(0, 1), padding_option="zero")
        do = tl.load(dO_block_ptr, boundary_check=(0, 1), padding_option="zero")
        offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
        in_range = offs_q < N_QUERIES
        lse = tl.load(L_ptr + offs_q * stride_lq, mask=in_range, other=0.0) * LOG2E
        delta = tl.load(Delta_ptr + offs_q, mask=in_range, other=0.0)
        sT = tl.dot(k, tl.trans(q)) * qk_scale                         # (Bk, Bq)
        pT = tl.math.exp2(sT - lse[None, :])
        if MASKED:
            pT = tl.where(offs_q[None, :] >= offs_k[:, None], pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))                                   # (Bk, Bq)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)
        Q_block_ptr = tl.advance(Q_block_ptr, (Q_TILE_SIZE, 0))
        dO_block_ptr = tl.advance(dO_block_ptr, (Q_TILE_SIZE, 0))
    return dk, dv


@triton.jit
def _bwd_dq_tiles(
    dq, q, do, lse, delta, K_block_ptr, V_block_ptr, offs_q, start, stop, N_KEYS, qk_scale,
    K_TILE_SIZE: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr,
):
    """Accumulate dQ of one query tile over key tiles [start, stop)."""
    K_block_ptr = tl.advance(K_block_ptr, (start, 0))
    V_block_ptr = tl.advance(V_block_ptr, (start, 0))
    for k_start in range(start, stop, K_TILE_SIZE):
        k = tl.load(K_block_ptr, boundary_check=(0, 1), padding_option="zero")
        v = tl.load(V_block_ptr, boundary_check=(0, 1), padding_option="zero")
        s = tl.dot(q, tl.trans(k)) * qk_scale                          # (Bq, Bk)
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            offs_k = k_start + tl.arange(0, K_TILE_SIZE)
            keep = offs_k[None, :] < N_KEYS
            if is_causal:
                keep = keep & (offs_q[:, None] >= offs_k[None, :])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))                                    # (Bq, Bk)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
        K_block_ptr = tl.advance(K_block_ptr, (K_TILE_SIZE, 0))
        V_block_ptr = tl.advance(V_block_ptr, (K_TILE_SIZE, 0))
    return dq


@triton.jit
def _key_ranges(q_start, N_KEYS, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
                is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr):
    """Key ranges for one query tile: [0, full_stop) needs no mask, [full_stop, stop) does."""
    whole_tiles_end = (N_KEYS // K_TILE_SIZE) * K_TILE_SIZE
    if is_causal:
        if SKIP_MASKED_TILES:
            stop = tl.minimum(q_start + Q_TILE_SIZE, N_KEYS)
            full_stop = tl.minimum((q_start // K_TILE_SIZE) * K_TILE_SIZE, whole_tiles_end)
        else:  # ablation: visit every key tile and mask them all
            stop = N_KEYS
            full_stop = 0
    else:
        stop = N_KEYS
        full_stop = whole_tiles_end
    return full_stop, stop


@triton.jit
def _tile_ptr(base, batch_index, head_index, stride_b, stride_h, stride_n, stride_d, N, start,
              D: tl.constexpr, TILE: tl.constexpr, D_TILE: tl.constexpr):
    """Block pointer to the (TILE, D_TILE) tile at row `start` of one batch·head's (N, D) matrix."""
    return tl.make_block_ptr(
        base + batch_index * stride_b + head_index * stride_h,
        shape=(N, D), strides=(stride_n, stride_d),
        offsets=(start, 0), block_shape=(TILE, D_TILE), order=(1, 0),
    )


# ----------------------------------------------------------------------------------------------
# 2. Kernels
# ----------------------------------------------------------------------------------------------


def make_configs(shapes, *, a: str = "Q_TILE_SIZE", b: str = "K_TILE_SIZE") -> list[triton.Config]:
    """Autotune configs from (tile_a, tile_b, warps, stages); one pinned config in the interpreter."""
    if INTERPRET:
        shapes = [(16, 16, 1, 1)]
    return [triton.Config({a: ta, b: tb}, num_warps=w, num_stages=s) for ta, tb, w, s in shapes]


def _prune(tile_names: tuple[str, str], len_names: tuple[str, str]):
    """Drop configs whose tiles exceed the padded problem (keeps short sequences cheap to tune)."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        lengths = [padded_dim(args[n]) for n in len_names]
        kept = [c for c in configs if all(c.kwargs[t] <= n for t, n in zip(tile_names, lengths))]
        return kept or [min(configs, key=lambda c: c.kwargs[tile_names[0]] * c.kwargs[tile_names[1]])]

    return prune


FWD_CONFIGS = make_configs(
    [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    a="Q_TILE_SIZE", b="K_TILE_SIZE",
)
DKDV_CONFIGS = make_configs(
    [(128, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3)],
    a="Q_TILE_SIZE", b="K_TILE_SIZE",
)
DQ_CONFIGS = make_configs(
    [(128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    a="Q_TILE_SIZE", b="K_TILE_SIZE",
)
_AUTOTUNE_KEY = ["N_QUERIES", "N_KEYS", "D", "is_causal"]


@triton.jit
def flash_fwd_kernel(
    Q_ptr, K_ptr, V_ptr,
    O_ptr, L_ptr,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_kk, stride_kd,
    stride_vb, stride_vh, stride_vk, stride_vd,
    stride_ob, stride_oh, stride_oq, stride_od,
    stride_lb, stride_lh, stride_lq,
    N_HEADS, N_QUERIES, N_KEYS,
    scale,
    D: tl.constexpr,
    D_TILE: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr,
    SKIP_MASKED_TILES: tl.constexpr = True,
):
    query_tile_index = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch_index = (batch_head // N_HEADS).to(tl.int64)
    head_index = (batch_head % N_HEADS).to(tl.int64)
    q_start = query_tile_index * Q_TILE_SIZE

    Q_block_ptr = _tile_ptr(Q_ptr, batch_index, head_index, stride_qb, stride_qh, stride_qq, stride_qd,
                            N_QUERIES, q_start, D, Q_TILE_SIZE, D_TILE)
    K_block_ptr = _tile_ptr(K_ptr, batch_index, head_index, stride_kb, stride_kh, stride_kk, stride_kd,
                            N_KEYS, 0, D, K_TILE_SIZE, D_TILE)
    V_block_ptr = _tile_ptr(V_ptr, batch_index, head_index, stride_vb, stride_vh, stride_vk, stride_vd,
                            N_KEYS, 0, D, K_TILE_SIZE, D_TILE)
    O_block_ptr = _tile_ptr(O_ptr, batch_index, head_index, stride_ob, stride_oh, stride_oq, stride_od,
                            N_QUERIES, q_start, D, Q_TILE_SIZE, D_TILE)
    L_block_ptr = tl.make_block_ptr(
        L_ptr + batch_index * stride_lb + head_index * stride_lh,
        shape=(N_QUERIES,), strides=(stride_lq,),
        offsets=(q_start,), block_shape=(Q_TILE_SIZE,), order=(0,),
    )

    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    q = tl.load(Q_block_ptr, boundary_check=(0, 1), padding_option="zero")
    m_i = tl.full((Q_TILE_SIZE,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((Q_TILE_SIZE,), dtype=tl.float32)
    acc = tl.zeros((Q_TILE_SIZE, D_TILE), dtype=tl.float32)
    qk_scale = scale * LOG2E

    full_stop, stop = _key_ranges(q_start, N_KEYS, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, K_block_ptr, V_block_ptr, offs_q, 0, full_stop,
                               N_KEYS, qk_scale, K_TILE_SIZE, False, is_causal)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, K_block_ptr, V_block_ptr, offs_q, full_stop, stop,
                               N_KEYS, qk_scale, K_TILE_SIZE, True, is_causal)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2
    tl.store(O_block_ptr, acc.to(O_block_ptr.type.element_ty), boundary_check=(0, 1))
    tl.store(L_block_ptr, lse, boundary_check=(0,))


@triton.jit
def flash_bwd_delta_kernel(
    O_ptr, dO_ptr, Delta_ptr,
    stride_ob, stride_oh, stride_oq, stride_od,
    stride_dob, stride_doh, stride_doq, stride_dod,
    N_HEADS, N_QUERIES,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr,
):
    """delta = rowsum(dO * O) in fp32, stored contiguous (batch·heads, N_QUERIES)."""
    query_tile_index = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch_index = (batch_head // N_HEADS).to(tl.int64)
    head_index = (batch_head % N_HEADS).to(tl.int64)
    q_start = query_tile_index * Q_TILE_SIZE
    O_block_ptr = _tile_ptr(O_ptr, batch_index, head_index, stride_ob, stride_oh, stride_oq, stride_od,
                            N_QUERIES, q_start, D, Q_TILE_SIZE, D_TILE)
    dO_block_ptr = _tile_ptr(dO_ptr, batch_index, head_index, stride_dob, stride_doh, stride_doq, stride_dod,
                             N_QUERIES, q_start, D, Q_TILE_SIZE, D_TILE)
    o = tl.load(O_block_ptr, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    do = tl.load(dO_block_ptr, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    tl.store(Delta_ptr + batch_head.to(tl.int64) * N_QUERIES + offs_q, tl.sum(o * do, 1), mask=offs_q < N_QUERIES)


@triton.jit
def flash_bwd_dkdv_kernel(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dK_ptr, dV_ptr,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_kk, stride_kd,
    stride_vb, stride_vh, stride_vk, stride_vd,
    stride_dob, stride_doh, stride_doq, stride_dod,
    stride_lb, stride_lh, stride_lq,
    stride_dkb, stride_dkh, stride_dkk, stride_dkd,
    stride_dvb, stride_dvh, stride_dvk, stride_dvd,
    N_HEADS, N_QUERIES, N_KEYS,
    scale,
    D: tl.constexpr,
    D_TILE: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr,
    SKIP_MASKED_TILES: tl.constexpr = True,
):
    """One program per (key tile, batch·head): dK, dV from all query tiles that see it."""
    key_tile_index = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch_index = (batch_head // N_HEADS).to(tl.int64)
    head_index = (batch_head % N_HEADS).to(tl.int64)
    k_start = key_tile_index * K_TILE_SIZE

    K_block_ptr = _tile_ptr(K_ptr, batch_index, head_index, stride_kb, stride_kh, stride_kk, stride_kd,
                            N_KEYS, k_start, D, K_TILE_SIZE, D_TILE)
    V_block_ptr = _tile_ptr(V_ptr, batch_index, head_index, stride_vb, stride_vh, stride_vk, stride_vd,
                            N_KEYS, k_start, D, K_TILE_SIZE, D_TILE)
    Q_block_ptr = _tile_ptr(Q_ptr, batch_index, head_index, stride_qb, stride_qh, stride_qq, stride_qd,
                            N_QUERIES, 0, D, Q_TILE_SIZE, D_TILE)
    dO_block_ptr = _tile_ptr(dO_ptr, batch_index, head_index, stride_dob, stride_doh, stride_doq, stride_dod,
                             N_QUERIES, 0, D, Q_TILE_SIZE, D_TILE)
    dK_block_ptr = _tile_ptr(dK_ptr, batch_index, head_index, stride_dkb, stride_dkh, stride_dkk, stride_dkd,
                             N_KEYS, k_start, D, K_TILE_SIZE, D_TILE)
    dV_block_ptr = _tile_ptr(dV_ptr, batch_index, head_index, stride_dvb, stride_dvh, stride_dvk, stride_dvd,
                             N_KEYS, k_start, D, K_TILE_SIZE, D_TILE)
    L_ptr += batch_index * stride_lb + head_index * stride_lh
    Delta_ptr += batch_head.to(tl.int64) * N_QUERIES

    k = tl.load(K_block_ptr, boundary_check=(0, 1), padding_option="zero")
    v = tl.load(V_block_ptr, boundary_check=(0, 1), padding_option="zero")
    offs_k = k_start + tl.arange(0, K_TILE_SIZE)
    dk = tl.zeros((K_TILE_SIZE, D_TILE), dtype=tl.float32)
    dv = tl.zeros((K_TILE_SIZE, D_TILE), dtype=tl.float32)
    qk_scale = scale * LOG2E

    # Query ranges for this key tile: [start, full_start) crosses the diagonal, [full_start, N) does not.
    if is_causal:
        if SKIP_MASKED_TILES:
            start = tl.minimum((k_start // Q_TILE_SIZE) * Q_TILE_SIZE, N_QUERIES)
            full_start = tl.minimum(tl.cdiv(k_start + K_TILE_SIZE, Q_TILE_SIZE) * Q_TILE_SIZE, N_QUERIES)
        else:
            start = 0
            full_start = N_QUERIES
    else:
        start = 0
        full_start = 0
    dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, Q_block_ptr, dO_block_ptr, L_ptr, Delta_ptr, stride_lq, offs_k,
                             start, full_start, N_QUERIES, qk_scale, Q_TILE_SIZE, True)
    dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, Q_block_ptr, dO_block_ptr, L_ptr, Delta_ptr, stride_lq, offs_k,
                             full_start, N_QUERIES, N_QUERIES, qk_scale, Q_TILE_SIZE, False)

    tl.store(dK_block_ptr, (dk * scale).to(dK_block_ptr.type.element_ty), boundary_check=(0, 1))
    tl.store(dV_block_ptr, dv.to(dV_block_ptr.type.element_ty), boundary_check=(0, 1))


@triton.jit
def flash_bwd_dq_kernel(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_ptr,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_kk, stride_kd,
    stride_vb, stride_vh, stride_vk, stride_vd,
    stride_dob, stride_doh, stride_doq, stride_dod,
    stride_lb, stride_lh, stride_lq,
    stride_dqb, stride_dqh, stride_dqq, stride_dqd,
    N_HEADS, N_QUERIES, N_KEYS,
    scale,
    D: tl.constexpr,
    D_TILE: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr,
    SKIP_MASKED_TILES: tl.constexpr = True,
):
    """One program per (query tile, batch·head): dQ from all key tiles it sees."""
    query_tile_index = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch_index = (batch_head // N_HEADS).to(tl.int64)
    head_index = (batch_head % N_HEADS).to(tl.int64)
    q_start = query_tile_index * Q_TILE_SIZE

    Q_block_ptr = _tile_ptr(Q_ptr, batch_index, head_index, stride_qb, stride_qh, stride_qq, stride_qd,
                            N_QUERIES, q_start, D, Q_TILE_SIZE, D_TILE)
    dO_block_ptr = _tile_ptr(dO_ptr, batch_index, head_index, stride_dob, stride_doh, stride_doq, stride_dod,
                             N_QUERIES, q_start, D, Q_TILE_SIZE, D_TILE)
    K_block_ptr = _tile_ptr(K_ptr, batch_index, head_index, stride_kb, stride_kh, stride_kk, stride_kd,
                            N_KEYS, 0, D, K_TILE_SIZE, D_TILE)
    V_block_ptr = _tile_ptr(V_ptr, batch_index, head_index, stride_vb, stride_vh, stride_vk, stride_vd,
                            N_KEYS, 0, D, K_TILE_SIZE, D_TILE)
    dQ_block_ptr = _tile_ptr(dQ_ptr, batch_index, head_index, stride_dqb, stride_dqh, stride_dqq, stride_dqd,
                             N_QUERIES, q_start, D, Q_TILE_SIZE, D_TILE)

    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    in_range = offs_q < N_QUERIES
    q = tl.load(Q_block_ptr, boundary_check=(0, 1), padding_option="zero")
    do = tl.load(dO_block_ptr, boundary_check=(0, 1), padding_option="zero")
    L_ptr += batch_index * stride_lb + head_index * stride_lh
    lse = tl.load(L_ptr + offs_q * stride_lq, mask=in_range, other=0.0) * LOG2E
    delta = tl.load(Delta_ptr + batch_head.to(tl.int64) * N_QUERIES + offs_q, mask=in_range, other=0.0)
    dq = tl.zeros((Q_TILE_SIZE, D_TILE), dtype=tl.float32)
    qk_scale = scale * LOG2E

    full_stop, stop = _key_ranges(q_start, N_KEYS, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES)
    dq = _bwd_dq_tiles(dq, q, do, lse, delta, K_block_ptr, V_block_ptr, offs_q, 0, full_stop,
                       N_KEYS, qk_scale, K_TILE_SIZE, False, is_causal)
    dq = _bwd_dq_tiles(dq, q, do, lse, delta, K_block_ptr, V_block_ptr, offs_q, full_stop, stop,
                       N_KEYS, qk_scale, K_TILE_SIZE, True, is_causal)
    tl.store(dQ_block_ptr, (dq * scale).to(dQ_block_ptr.type.element_ty), boundary_check=(0, 1))


def _autotuned(fn, configs, lengths):
    return triton.autotune(
        configs=configs, key=_AUTOTUNE_KEY,
        prune_configs_by={"early_config_prune": _prune(("Q_TILE_SIZE", "K_TILE_SIZE"), lengths)},
    )(fn)


flash_fwd_autotuned = _autotuned(flash_fwd_kernel, FWD_CONFIGS, ("N_QUERIES", "N_KEYS"))
flash_bwd_dkdv_autotuned = _autotuned(flash_bwd_dkdv_kernel, DKDV_CONFIGS, ("N_QUERIES", "N_KEYS"))
flash_bwd_dq_autotuned = _autotuned(flash_bwd_dq_kernel, DQ_CONFIGS, ("N_QUERIES", "N_KEYS"))


@dataclass(frozen=True)
class KernelSpec:
    """One autotuned kernel, as the benchmarks (autotune, resources) see it.

    `example_launch(dtype, heads, seq, d, causal)` gives the positional arguments (MockTensors for
    tensors, ints/floats otherwise) and constexpr keywords of a launch on contiguous
    (1, heads, seq, d) inputs, without the tile constexprs a config sets.
    """

    name: str
    jit: triton.JITFunction
    autotuned: triton.runtime.Autotuner
    wide_tiles: tuple[tuple[int, int], ...]  # (Q_TILE_SIZE, K_TILE_SIZE) pairs for a wide config search

    @property
    def configs(self) -> list[triton.Config]:
        return self.autotuned.configs

    def example_launch(self, dtype: torch.dtype, heads: int, seq: int, d: int, causal: bool):
        from triton.runtime.jit import MockTensor

        args = []
        for param in self.jit.params:
            name = param.name
            if param.is_constexpr:
                break
            if name.endswith("_ptr"):
                args.append(MockTensor(torch.float32 if name in ("L_ptr", "Delta_ptr") else dtype))
            elif name.startswith("stride_"):
                args.append(_contiguous_stride(name, heads, seq, d))
            elif name == "N_HEADS":
                args.append(heads)
            elif name in ("N_QUERIES", "N_KEYS"):
                args.append(seq)
            elif name == "scale":
                args.append(d ** -0.5)
            else:
                raise ValueError(f"no example value for argument {name!r} of {self.name}")
        return args, dict(D=d, D_TILE=padded_dim(d), is_causal=causal)


def _contiguous_stride(name: str, heads: int, seq: int, d: int) -> int:
    """The stride a contiguous (1, heads, seq, d) launch passes for an argument named stride_<tensor><axis>."""
    tensor_axis = name.removeprefix("stride_")
    axis = tensor_axis[-1]
    if tensor_axis.startswith("l"):  # L: (batch, heads, seq)
        return {"b": heads * seq, "h": seq}.get(axis, 1)
    return {"b": heads * seq * d, "h": seq * d, "d": 1}.get(axis, d)


_WIDE_Q_K = ((64, 32), (64, 64), (64, 128), (128, 64), (128, 128))
KERNELS: dict[str, KernelSpec] = {
    "flash_fwd": KernelSpec("flash_fwd", flash_fwd_kernel, flash_fwd_autotuned, _WIDE_Q_K),
    "flash_bwd_dkdv": KernelSpec(
        "flash_bwd_dkdv", flash_bwd_dkdv_kernel, flash_bwd_dkdv_autotuned,
        ((32, 64), (32, 128), (64, 64), (64, 128), (128, 64), (128, 128))),
    "flash_bwd_dq": KernelSpec(
        "flash_bwd_dq", flash_bwd_dq_kernel, flash_bwd_dq_autotuned,
        ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128))),
}
AUTOTUNED_KERNELS = {name: spec.autotuned for name, spec in KERNELS.items()}


# ----------------------------------------------------------------------------------------------
# 3. Host launchers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelOptions:
    """What a variant of the kernel does; the defaults are the shipped kernel."""

    triton_backward: bool = True     # False: torch.compile'd PyTorch backward
    skip_masked_tiles: bool = True   # False: causal visits every tile and masks it
    autotune: bool = True            # False: one fixed config per kernel


DEFAULT_OPTIONS = KernelOptions()
# (Q_TILE_SIZE, K_TILE_SIZE, num_warps, num_stages) when not autotuning: a plain first kernel.
FIXED_CONFIG = (16, 16, 1, 1) if INTERPRET else (64, 64, 4, 3)
DELTA_TILE = 16 if INTERPRET else 128


def _as_bhsd(t: torch.Tensor) -> torch.Tensor:
    """View (..., S, D) as (B, H, S, D) without copying when the leading dims allow it."""
    if t.ndim == 2:
        return t[None, None]
    if t.ndim == 3:
        return t[:, None]
    if t.ndim == 4:
        return t
    return t.reshape(-1, *t.shape[-3:])  # copies only if the leading dims cannot be merged


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def _check_launchable(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"the Triton kernels need CUDA tensors, got a tensor on {q.device} "
            "(set TRITON_INTERPRET=1 before importing cs336_systems.flash_triton to run them on the CPU)"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[-1]} is larger than the supported maximum {MAX_HEAD_DIM}")


def _launch_args(opts: KernelOptions, kernel_autotuned, kernel_plain):
    """The kernel to launch and its extra keyword arguments (a fixed config if not autotuning)."""
    if opts.autotune:
        return kernel_autotuned, {}
    q_tile, k_tile, warps, stages = FIXED_CONFIG
    return kernel_plain, dict(Q_TILE_SIZE=q_tile, K_TILE_SIZE=k_tile, num_warps=warps, num_stages=stages)


# torch.compile (the leaderboard compiles `.apply`) would re-generate these Triton kernels through
# Inductor, which fails on them (a tl.dot accumulator type assertion in Triton 3.6); the launchers
# run eagerly instead, as a graph break, so compiled and eager callers launch the same kernels.
@torch.compiler.disable
def flash_forward_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
    opts: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """O (..., Nq, D) in q's dtype and L (..., Nq) fp32, for checked inputs."""
    _check_launchable(q)
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    q4, k4, v4, o4 = (_as_bhsd(t) for t in (q, k, v, o))
    l3 = lse.reshape(q4.shape[:-1])
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    if batch * heads > MAX_GRID_Y:
        raise ValueError(f"batch x heads = {batch * heads} exceeds the launch grid limit {MAX_GRID_Y}")
    kernel, extra = _launch_args(opts, flash_fwd_autotuned, flash_fwd_kernel)
    grid = lambda meta: (triton.cdiv(n_q, meta["Q_TILE_SIZE"]), batch * heads)  # noqa: E731
    kernel[grid](
        q4, k4, v4, o4, l3,
        *_strides(q4), *_strides(k4), *_strides(v4), *_strides(o4), *_strides(l3),
        heads, n_q, n_k, d ** -0.5,
        D=d, D_TILE=padded_dim(d), is_causal=is_causal,
        SKIP_MASKED_TILES=opts.skip_masked_tiles, **extra,
    )
    return o, lse


@torch.compiler.disable
def flash_backward_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    do: torch.Tensor, is_causal: bool, opts: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (each in its input's dtype) from the saved forward tensors and dO (any strides)."""
    q4, k4, v4, o4, do4 = (_as_bhsd(t) for t in (q, k, v, o, do))
    l3 = lse.reshape(q4.shape[:-1])
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    d_tile = padded_dim(d)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    dq4, dk4, dv4 = (_as_bhsd(t) for t in (dq, dk, dv))
    delta = torch.empty((batch * heads, n_q), device=q.device, dtype=torch.float32)

    flash_bwd_delta_kernel[(triton.cdiv(n_q, DELTA_TILE), batch * heads)](
        o4, do4, delta, *_strides(o4), *_strides(do4), heads, n_q,
        D=d, D_TILE=d_tile, Q_TILE_SIZE=DELTA_TILE,
    )
    common = dict(D=d, D_TILE=d_tile, is_causal=is_causal, SKIP_MASKED_TILES=opts.skip_masked_tiles)
    kernel, extra = _launch_args(opts, flash_bwd_dkdv_autotuned, flash_bwd_dkdv_kernel)
    kernel[lambda meta: (triton.cdiv(n_k, meta["K_TILE_SIZE"]), batch * heads)](
        q4, k4, v4, do4, l3, delta, dk4, dv4,
        *_strides(q4), *_strides(k4), *_strides(v4), *_strides(do4), *_strides(l3),
        *_strides(dk4), *_strides(dv4),
        heads, n_q, n_k, d ** -0.5, **common, **extra,
    )
    kernel, extra = _launch_args(opts, flash_bwd_dq_autotuned, flash_bwd_dq_kernel)
    kernel[lambda meta: (triton.cdiv(n_q, meta["Q_TILE_SIZE"]), batch * heads)](
        q4, k4, v4, do4, l3, delta, dq4,
        *_strides(q4), *_strides(k4), *_strides(v4), *_strides(do4), *_strides(l3), *_strides(dq4),
        heads, n_q, n_k, d ** -0.5, **common, **extra,
    )
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# 4. autograd.Function, ablation variants, functional API
# ----------------------------------------------------------------------------------------------


def _forward(ctx, Q, K, V, is_causal, opts: KernelOptions):
    check_attention_inputs(Q, K, V, is_causal)
    O, L = flash_forward_triton(Q, K, V, is_causal, opts)
    ctx.save_for_backward(L, Q, K, V, O)
    ctx.is_causal = is_causal
    ctx.opts = opts
    return O


def _backward(ctx, dO):
    L, Q, K, V, O = ctx.saved_tensors
    if ctx.opts.triton_backward:
        dQ, dK, dV = flash_backward_triton(Q, K, V, O, L, dO, ctx.is_causal, ctx.opts)
    else:
        dQ, dK, dV = flash_backward_compiled(Q, K, V, O, dO, L, ctx.is_causal)
    return dQ, dK, dV, None


class FlashAttention2Triton(torch.autograd.Function):
    """FlashAttention-2: Triton forward and backward, causal tile skipping, autotuned tiles.

    `.apply(Q, K, V, is_causal=False)` with Q (..., Nq, D), K and V (..., Nk, D).
    """

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        return _forward(ctx, Q, K, V, is_causal, DEFAULT_OPTIONS)

    @staticmethod
    def backward(ctx, dO):
        return _backward(ctx, dO)


def autograd_function(name: str, opts: KernelOptions) -> type[torch.autograd.Function]:
    """An autograd.Function like FlashAttention2Triton that runs the kernels with `opts`."""

    def forward(ctx, Q, K, V, is_causal=False):
        return _forward(ctx, Q, K, V, is_causal, opts)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(_backward),
        "__doc__": f"FlashAttention-2 (Triton) with {opts}",
    })


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """softmax(q kᵀ/√d [causal]) v for q (..., Nq, D), k and v (..., Nk, D), e.g. (B, H, S, D)."""
    return FlashAttention2Triton.apply(q, k, v, is_causal)


__all__ = [
    "AUTOTUNED_KERNELS", "KERNELS", "FlashAttention2Triton", "KernelOptions", "KernelSpec",
    "autograd_function", "flash_attention", "flash_backward_triton", "flash_forward_triton", "make_configs",
]
