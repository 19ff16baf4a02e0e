"""FlashAttention-2 in Triton: forward, backward (atomic-dQ single pass or deterministic two-pass), ops.

(On sm_90, large calls run Gluon kernels of `flash_gluon` instead: the forward, and for the backward the
single pass at d 64 and 128 (the default, `KernelOptions.deterministic=None`) or the two-pass design's dK/dV pass;
the launchers below choose, by `KernelOptions`.)

Layout, top-down:
  1. jit helpers: tile loads through TMA tensor descriptors or block pointers, and the inner loops
     `_fwd_tiles`, `_bwd_kv_tiles`, `_bwd_dq_tiles`, each with a constexpr MASKED flag. The kernels
     call them first over the tiles that need no mask, then over the tiles on the causal diagonal
     (and a ragged last tile) with MASKED=True.
  2. Kernels, one program per (batch·head, tile):
       `flash_fwd_kernel`         O and the logsumexp L;
       `flash_bwd_prep_kernel`    the atomic design's pre-pass: delta = rowsum(dO·O), the fp32 dQ
                                  accumulator zeroed (the two-pass design's dQ pass does delta itself);
       `flash_bwd_kv_kernel`      per key tile: dK, dV over every query tile (and every query head of a
                                  GQA group) that sees it; with DQ_ATOMIC also dQ, added in fp32 with
                                  atomics (five matmuls per tile pair instead of seven);
       `flash_bwd_dq_kernel`      the deterministic design's dQ pass, run first: dQ per query tile,
                                  delta (and a contiguous copy of an expanded dO) for the dK/dV pass;
       `flash_bwd_dq_cast_kernel` the atomic design's fp32 dQ -> dQ·scale in the input dtype;
       `flash_fwd_combine_kernel`, `flash_split_sum_kernel`
                                  merge the chunks of a split pass (below).
     Causal grids run the longest tiles first (the last wave is short tiles, not long ones). Short
     grids (few heads × long sequences) split each pass's reduction into chunks along grid axis 2
     (`split_rows` decides), merged in a fixed order, so the backward stays bitwise repeatable.
  3. Host launchers: checks, and per input signature a host plan, made once: what a call decides from
     its inputs' metadata (design, Gluon or Triton, splits, TMA, allocations, grids, constexprs, strides);
     a repeat call allocates and calls the compiled kernels' C launches directly.
  4. The ops compiled graphs call (`torch.library.triton_op`s: for short calls Inductor launches the flat
     entry kernels `flash_*_flat_kernel` itself; other calls go to opaque custom ops running the launchers),
     `FlashAttention2Triton` (autograd.Function) and `flash_attention`.

Scores are kept in base 2 (`qk_scale = scale·log2 e`, exp2; the scale folds into one FMA with the
running max) and converted back for the saved logsumexp L, which is in natural log as the handout
defines it. Causally hidden scores are excluded exactly (-inf before the softmax, 0 after), not
replaced by a large negative number. Head dims that are not a power of two are padded inside the
kernel (zero-filled loads of a power-of-two block), never copied. Grouped-query attention indexes
the K/V head in the kernel (no repeated copies); the dK/dV program sums its group's query heads.
fp32 inputs follow `torch.get_float32_matmul_precision()`: "highest" -> IEEE fp32 dots, else TF32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cs336_systems import flash_gluon
from cs336_systems.flash_pytorch import flash_backward_compiled, flash_forward_tiled
from cs336_systems.kernel_launch import CLaunch, scratch
from cs336_systems.validation import check_attention_inputs, check_flag, check_scale, refuse_double_backward

INTERPRET = triton.knobs.runtime.interpret  # TRITON_INTERPRET as Triton itself reads it (1/true/on/yes)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
MAX_HEAD_DIM = 256  # the largest head dim the kernels take (LARGE_D configs above 128)
MAX_GRID_Y = 65535

if INTERPRET:
    from cs336_systems import triton_interpreter_fixes

    triton_interpreter_fixes.apply()


def padded_dim(n: int) -> int:
    """A length as the kernels tile it: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (n - 1).bit_length())  # plain ints: triton.next_power_of_2 costs µs per call


# ----------------------------------------------------------------------------------------------
# 1. jit helpers and inner loops
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_src(ptr, strides, batch, head, N, D: tl.constexpr, TILE: tl.constexpr, D_TILE: tl.constexpr,
              USE_TMA: tl.constexpr):
    """A source of (TILE, D_TILE) tiles of the (N, D) matrix of one (batch, head) of a (B, H, N, D) tensor
    with `strides` (a tuple of four): a TMA descriptor or a block pointer at row 0."""
    base = ptr + batch * strides[0] + head * strides[1]
    if USE_TMA:
        return tl.make_tensor_descriptor(base, shape=[N, D], strides=[strides[2], 1], block_shape=[TILE, D_TILE])
    else:
        return tl.make_block_ptr(base, shape=(N, D), strides=(strides[2], strides[3]), offsets=(0, 0),
                                 block_shape=(TILE, D_TILE), order=(1, 0))


@triton.jit
def _row_ptrs(ptr, strides, batch, head, offs_n, offs_d):
    """Pointers to rows offs_n, columns offs_d of one (batch, head) of a (B, H, N, D) tensor."""
    return (ptr + batch * strides[0] + head * strides[1]
            + offs_n[:, None] * strides[2] + offs_d[None, :] * strides[3])


@triton.jit
def _load_tile(src, row, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr, USE_TMA: tl.constexpr):
    """The tile at `row`, zero-filled outside the matrix (TMA fills by itself; block pointers check)."""
    if USE_TMA:
        return src.load([row, 0])
    else:
        ptr = tl.advance(src, (row, 0))
        if CHECK_ROWS and CHECK_COLS:
            return tl.load(ptr, boundary_check=(0, 1), padding_option="zero")
        elif CHECK_ROWS:
            return tl.load(ptr, boundary_check=(0,), padding_option="zero")
        elif CHECK_COLS:
            return tl.load(ptr, boundary_check=(1,), padding_option="zero")
        else:
            return tl.load(ptr)


@triton.jit
def _store_tile(dst, row, value, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr, USE_TMA: tl.constexpr):
    """Store a tile at `row`; what falls outside the matrix is dropped."""
    if USE_TMA:
        dst.store([row, 0], value.to(dst.dtype))
    else:
        value = value.to(dst.type.element_ty)
        ptr = tl.advance(dst, (row, 0))
        if CHECK_ROWS and CHECK_COLS:
            tl.store(ptr, value, boundary_check=(0, 1))
        elif CHECK_ROWS:
            tl.store(ptr, value, boundary_check=(0,))
        elif CHECK_COLS:
            tl.store(ptr, value, boundary_check=(1,))
        else:
            tl.store(ptr, value)


@triton.jit
def _fwd_tiles(
    acc, m_i, l_i, q, k_src, v_src, offs_q, start, stop, N_KEYS, qk_scale,
    K_TILE_SIZE: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr,
    CHECK_K: tl.constexpr, CHECK_D: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
):
    """Online softmax over key tiles [start, stop); m_i is the running max of the base-2 scores."""
    for k_start in range(start, stop, K_TILE_SIZE):
        k = _load_tile(k_src, k_start, CHECK_K, CHECK_D, USE_TMA)
        v = _load_tile(v_src, k_start, CHECK_K, CHECK_D, USE_TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)              # (Bq, Bk), unscaled
        if MASKED:
            offs_k = k_start + tl.arange(0, K_TILE_SIZE)
            keep = offs_k[None, :] < N_KEYS
            if is_causal:
                keep = keep & (offs_q[:, None] >= offs_k[None, :])
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)         # a row with nothing visible yet
            p = tl.math.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])                 # one FMA per score
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _bwd_kv_tiles(
    dk, dv, k, v, q_src, do_src, dq_dst, L_ptr, Delta_ptr, offs_k, start, stop, N_QUERIES, qk_scale,
    Q_TILE_SIZE: tl.constexpr, D_TILE: tl.constexpr, MASKED: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    CHECK_Q: tl.constexpr, CHECK_D: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    DP_FIRST: tl.constexpr,
):
    """dK, dV of one key tile over query tiles [start, stop), in transposed form (keys on rows).

    Query rows past N_QUERIES load as zeros (q, dO, L, delta), so they add nothing to dK, dV.
    With DQ_ATOMIC, dQ += dS·K of each tile pair is added to the fp32 accumulator `dq_dst`
    (a TMA descriptor, or a pointer to the (N_QUERIES, D) rows with row stride D).
    """
    for q_start in range(start, stop, Q_TILE_SIZE):
        q = _load_tile(q_src, q_start, CHECK_Q, CHECK_D, USE_TMA)
        do = _load_tile(do_src, q_start, CHECK_Q, CHECK_D, USE_TMA)
        offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
        if CHECK_Q:
            in_range = offs_q < N_QUERIES
            lse = tl.load(L_ptr + offs_q, mask=in_range, other=0.0) * LOG2E
            delta = tl.load(Delta_ptr + offs_q, mask=in_range, other=0.0)
        else:
            lse = tl.load(L_ptr + offs_q) * LOG2E
            delta = tl.load(Delta_ptr + offs_q)
        sT = tl.dot(k, tl.trans(q), input_precision=PRECISION)            # (Bk, Bq), unscaled
        if DP_FIRST:  # dP's matmul issued before P's exp2 (lse in base 2): measured faster
            dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)      # (Bk, Bq)
            pT = tl.math.exp2(sT * qk_scale - lse[None, :])
        else:
            pT = tl.math.exp2(sT * qk_scale - lse[None, :])
            dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if MASKED:
            pT = tl.where(offs_q[None, :] >= offs_k[:, None], pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk = tl.dot(dsT, q, dk, input_precision=PRECISION)
        if DQ_ATOMIC:
            dq = tl.dot(tl.trans(dsT), k, input_precision=PRECISION)      # (Bq, D), unscaled
            if USE_TMA:
                dq_dst.atomic_add([q_start, 0], dq)
            else:
                offs_d = tl.arange(0, D_TILE)
                ptrs = dq_dst + offs_q[:, None] * D_TILE + offs_d[None, :]
                if CHECK_Q:
                    tl.atomic_add(ptrs, dq, mask=(offs_q < N_QUERIES)[:, None], sem="relaxed")
                else:
                    tl.atomic_add(ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_dq_tiles(
    dq, q, do, lse, delta, k_src, v_src, offs_q, start, stop, N_KEYS, qk_scale,
    K_TILE_SIZE: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr,
    CHECK_K: tl.constexpr, CHECK_D: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    DP_FIRST: tl.constexpr,
):
    """dQ of one query tile over key tiles [start, stop) (the deterministic design's dQ pass)."""
    for k_start in range(start, stop, K_TILE_SIZE):
        k = _load_tile(k_src, k_start, CHECK_K, CHECK_D, USE_TMA)
        v = _load_tile(v_src, k_start, CHECK_K, CHECK_D, USE_TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)             # (Bq, Bk), unscaled
        if DP_FIRST:
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)       # (Bq, Bk)
            p = tl.math.exp2(s * qk_scale - lse[:, None])
        else:
            p = tl.math.exp2(s * qk_scale - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if MASKED:
            offs_k = k_start + tl.arange(0, K_TILE_SIZE)
            keep = offs_k[None, :] < N_KEYS
            if is_causal:
                keep = keep & (offs_q[:, None] >= offs_k[None, :])
            p = tl.where(keep, p, 0.0)
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)
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
def _query_ranges(k_start, N_QUERIES, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
                  is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr):
    """Query ranges for one key tile: [start, full_start) crosses the diagonal, [full_start, N) does not."""
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
    return start, full_start


@triton.jit
def _tile_index(program, n_tiles, LONGEST_FIRST: tl.constexpr):
    """Causal query tiles grow with their index: hand out the longest first (the reverse order)."""
    if LONGEST_FIRST:
        return n_tiles - 1 - program
    else:
        return program


@triton.jit
def _in_chunk(start, stop, CHUNK, SPLIT: tl.constexpr):
    """[start, stop) cut to this program's chunk of the reduction (grid axis 2, CHUNK rows) when SPLIT."""
    if SPLIT:
        lo = tl.program_id(2) * CHUNK
        start = tl.maximum(start, lo)
        stop = tl.minimum(stop, lo + CHUNK)
    return start, stop


@triton.jit
def _chunk_offset(rows, D_TILE: tl.constexpr, SPLIT: tl.constexpr):
    """Elements before this program's chunk in a split kernel's (chunks, batch·heads, rows, D_TILE)
    partial buffer (0 without SPLIT)."""
    if SPLIT:
        return tl.program_id(2).to(tl.int64) * tl.num_programs(0) * rows * D_TILE
    else:
        return 0


@triton.jit
def _query_program(N_HEADS, KV_GROUP, Q_TILE_SIZE: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """A program of grid (batch·heads, query tiles): its batch·head, batch, head, K/V head, first query."""
    batch_head = tl.program_id(0)
    q_tile = _tile_index(tl.program_id(1), tl.num_programs(1), LONGEST_FIRST)
    batch = (batch_head // N_HEADS).to(tl.int64)
    head = (batch_head % N_HEADS).to(tl.int64)
    return batch_head, batch, head, head // KV_GROUP, q_tile * Q_TILE_SIZE


@triton.jit
def _row_tile_program(N_HEADS, TILE: tl.constexpr, D_TILE: tl.constexpr):
    """A program of grid (batch·heads, row tiles[, ·]) of the small kernels (pre-pass, casts, merges):
    its batch·head, batch, head, first row, row offsets and column offsets."""
    batch_head = tl.program_id(0)
    batch = (batch_head // N_HEADS).to(tl.int64)
    head = (batch_head % N_HEADS).to(tl.int64)
    first = tl.program_id(1) * TILE
    return batch_head, batch, head, first, first + tl.arange(0, TILE), tl.arange(0, D_TILE)


@triton.jit
def _kv_sources(K_ptr, V_ptr, batch, kv_head, stride_k, stride_v, N_KEYS,
                D: tl.constexpr, K_TILE_SIZE: tl.constexpr, D_TILE: tl.constexpr, USE_TMA: tl.constexpr):
    """Tile sources of one (batch, K/V head)'s K and V."""
    k_src = _tile_src(K_ptr, stride_k, batch, kv_head, N_KEYS, D, K_TILE_SIZE, D_TILE, USE_TMA)
    v_src = _tile_src(V_ptr, stride_v, batch, kv_head, N_KEYS, D, K_TILE_SIZE, D_TILE, USE_TMA)
    return k_src, v_src


@triton.jit
def _query_tile_sources(
    Q_ptr, K_ptr, V_ptr, stride_q, stride_k, stride_v, batch, head, kv_head, q_start, N_QUERIES, N_KEYS,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
    CHECK_Q: tl.constexpr, CHECK_D: tl.constexpr, USE_TMA: tl.constexpr,
):
    """What a program of grid (batch·heads, query tiles) (the forward and the dQ pass) reads first: its Q tile
    and the tile sources of its K/V head. (The kernels build their outputs' destinations from `_query_program`'s
    indices themselves: Inductor's mutation analysis of a user-defined kernel counts every argument of a call
    that a stored-to pointer comes out of as written, so a destination built here would mark Q, K and V.)"""
    q_src = _tile_src(Q_ptr, stride_q, batch, head, N_QUERIES, D, Q_TILE_SIZE, D_TILE, USE_TMA)
    k_src, v_src = _kv_sources(K_ptr, V_ptr, batch, kv_head, stride_k, stride_v, N_KEYS,
                               D, K_TILE_SIZE, D_TILE, USE_TMA)
    return _load_tile(q_src, q_start, CHECK_Q, CHECK_D, USE_TMA), k_src, v_src


# ----------------------------------------------------------------------------------------------
# 2. Kernels
# ----------------------------------------------------------------------------------------------


def make_configs(shapes, *, a: str = "Q_TILE_SIZE", b: str = "K_TILE_SIZE") -> list[triton.Config]:
    """Autotune configs from (tile_a, tile_b, warps, stages); one pinned config in the interpreter."""
    if INTERPRET:
        shapes = [(16, 16, 1, 1)]
    return [triton.Config({a: ta, b: tb}, num_warps=w, num_stages=s) for ta, tb, w, s in shapes]


def _prune(configs, named_args, **kwargs):
    """Keep the configs for this head-dim class whose tiles fit the padded problem (short sequences
    stay cheap to tune)."""
    args = {**named_args, **kwargs}
    large_d = args["D_TILE"] > 128
    configs = [c for c in configs if (id(c) in _LARGE_D) == large_d] or configs
    n_q, n_k = padded_dim(args["N_QUERIES"]), padded_dim(args["N_KEYS"])
    kept = [c for c in configs if c.kwargs["Q_TILE_SIZE"] <= n_q and c.kwargs["K_TILE_SIZE"] <= n_k]
    return kept or [min(configs, key=lambda c: c.kwargs["Q_TILE_SIZE"] * c.kwargs["K_TILE_SIZE"])]


# Bounds checks only where a length does not divide its tile (flash-attention's EVEN_M/EVEN_N).
_EVEN_HEURISTICS = {
    "CHECK_Q": lambda a: a["N_QUERIES"] % a["Q_TILE_SIZE"] != 0,
    "CHECK_K": lambda a: a["N_KEYS"] % a["K_TILE_SIZE"] != 0,
    "CHECK_D": lambda a: a["D"] != a["D_TILE"],
}


@triton.jit
def flash_fwd_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, L_ptr,
    stride_q, stride_k, stride_v, stride_o,  # (batch, head, seq, d) strides of each tensor
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, CHUNK,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT: tl.constexpr, CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr, CHECK_D: tl.constexpr,
):
    """Grid (batch·heads, query tiles[, key chunks]). L is contiguous (batch·heads, N_QUERIES), natural log.

    With SPLIT, program (·, ·, c) sees only keys [c·CHUNK, (c+1)·CHUNK) and writes its normalized O
    (fp32) and L into chunk c of (chunks, batch·heads, N_QUERIES, D_TILE) and (chunks, batch·heads,
    N_QUERIES) buffers (L = -inf and O = 0 where it sees no key); `flash_fwd_combine_kernel` merges them.
    """
    O_ptr += _chunk_offset(N_QUERIES, D_TILE, SPLIT)
    L_ptr += _chunk_offset(N_QUERIES, 1, SPLIT)
    batch_head, batch, head, kv_head, q_start = _query_program(N_HEADS, KV_GROUP, Q_TILE_SIZE,
                                                               is_causal and SKIP_MASKED_TILES)
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    q, k_src, v_src = _query_tile_sources(Q_ptr, K_ptr, V_ptr, stride_q, stride_k, stride_v, batch, head, kv_head,
                                          q_start, N_QUERIES, N_KEYS, D, D_TILE, Q_TILE_SIZE, K_TILE_SIZE, CHECK_Q,
                                          CHECK_D, USE_TMA)
    o_dst = _tile_src(O_ptr, stride_o, batch, head, N_QUERIES, D, Q_TILE_SIZE, D_TILE, USE_TMA)
    m_i = tl.full((Q_TILE_SIZE,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((Q_TILE_SIZE,), dtype=tl.float32)
    acc = tl.zeros((Q_TILE_SIZE, D_TILE), dtype=tl.float32)
    qk_scale = scale * LOG2E

    full_stop, stop = _key_ranges(q_start, N_KEYS, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES)
    start, end = _in_chunk(0, full_stop, CHUNK, SPLIT)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_src, v_src, offs_q, start, end, N_KEYS, qk_scale,
                               K_TILE_SIZE, False, is_causal, CHECK_K, CHECK_D, USE_TMA, PRECISION)
    start, end = _in_chunk(full_stop, stop, CHUNK, SPLIT)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_src, v_src, offs_q, start, end, N_KEYS, qk_scale,
                               K_TILE_SIZE, True, is_causal, CHECK_K, CHECK_D, USE_TMA, PRECISION)

    if SPLIT:  # a chunk past the causal diagonal sees no key: O = 0, and L = -inf from m_i (weight 0)
        l_i = tl.where(l_i > 0, l_i, 1.0)
    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2
    _store_tile(o_dst, q_start, acc, CHECK_Q, CHECK_D, USE_TMA)
    l_ptrs = L_ptr + batch_head.to(tl.int64) * N_QUERIES + offs_q
    if CHECK_Q:
        tl.store(l_ptrs, lse, mask=offs_q < N_QUERIES)
    else:
        tl.store(l_ptrs, lse)


@triton.jit
def flash_fwd_combine_kernel(
    Opart_ptr, Lpart_ptr, O_ptr, L_ptr, stride_o,
    N_CHUNKS, N_HEADS, N_QUERIES,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr,
):
    """O and L from a split forward's chunks: L = log sum_c exp(L_c), O = sum_c exp(L_c - L) O_c."""
    batch_head, batch, head, _, offs_q, offs_d = _row_tile_program(N_HEADS, Q_TILE_SIZE, D_TILE)
    in_range = offs_q < N_QUERIES
    rows = batch_head.to(tl.int64) * N_QUERIES + offs_q            # row index within one chunk
    chunk_rows = tl.num_programs(0).to(tl.int64) * N_QUERIES      # rows per chunk
    m = tl.full((Q_TILE_SIZE,), float("-inf"), dtype=tl.float32)
    for c in range(0, N_CHUNKS):
        m = tl.maximum(m, tl.load(Lpart_ptr + c * chunk_rows + rows, mask=in_range, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)                       # rows past N_QUERIES
    total = tl.zeros((Q_TILE_SIZE,), dtype=tl.float32)
    acc = tl.zeros((Q_TILE_SIZE, D_TILE), dtype=tl.float32)
    cols = in_range[:, None] & (offs_d < D)[None, :]
    for c in range(0, N_CHUNKS):
        w = tl.exp(tl.load(Lpart_ptr + c * chunk_rows + rows, mask=in_range, other=float("-inf")) - m)
        o_c = tl.load(Opart_ptr + (c * chunk_rows + rows)[:, None] * D_TILE + offs_d[None, :], mask=cols, other=0.0)
        total += w
        acc += w[:, None] * o_c
    total = tl.where(total > 0, total, 1.0)
    tl.store(_row_ptrs(O_ptr, stride_o, batch, head, offs_q, offs_d), (acc / total[:, None]).to(O_ptr.dtype.element_ty),
             mask=cols)
    tl.store(L_ptr + rows, m + tl.log(total), mask=in_range)


@triton.jit
def flash_split_sum_kernel(
    Part_ptr, Out_ptr, stride_out,
    N_CHUNKS, CHUNK, N_HEADS, N_ROWS,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr, is_causal: tl.constexpr,
    ROWS_ARE_KEYS: tl.constexpr,
):
    """Out = the sum over chunks of a split pass's fp32 (chunks, batch·heads, N_ROWS, D_TILE) partial
    sums, in chunk order (bitwise repeatable), in Out's dtype and strides; one launch per output (dK and
    dV are separate allocations: the custom op's outputs must not share storage). Under causal masking
    only the chunks that can reach a row tile are read: for query rows (dQ: chunks of keys) those
    starting at or before its last row, for key rows (dK, dV: chunks of queries) those ending after its
    first row; the others hold zeros."""
    batch_head, batch, head, first_row, offs, offs_d = _row_tile_program(N_HEADS, Q_TILE_SIZE, D_TILE)
    cols = (offs < N_ROWS)[:, None] & (offs_d < D)[None, :]
    chunk_size = tl.num_programs(0).to(tl.int64) * N_ROWS * D_TILE
    ptrs = Part_ptr + (batch_head.to(tl.int64) * N_ROWS + offs)[:, None] * D_TILE + offs_d[None, :]
    lo = 0
    hi = N_CHUNKS
    if is_causal:
        if ROWS_ARE_KEYS:
            lo = first_row // CHUNK
        else:
            hi = tl.minimum(N_CHUNKS, (first_row + Q_TILE_SIZE - 1) // CHUNK + 1)
    acc = tl.zeros((Q_TILE_SIZE, D_TILE), dtype=tl.float32)
    for c in range(lo, hi):
        acc += tl.load(ptrs + c * chunk_size, mask=cols, other=0.0)
    out = _row_ptrs(Out_ptr, stride_out, batch, head, offs, offs_d)
    tl.store(out, acc.to(Out_ptr.dtype.element_ty), mask=cols)


@triton.jit
def flash_bwd_prep_kernel(
    O_ptr, dO_ptr, Delta_ptr, dQacc_ptr,
    stride_o, stride_do,  # (batch, head, seq, d) strides of each tensor
    N_HEADS, N_QUERIES,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr, ZERO_DQ: tl.constexpr,
):
    """delta = rowsum(dO·O) in fp32, contiguous (batch·heads, N_QUERIES); zero the dQ accumulator."""
    batch_head, batch, head, _, offs_q, offs_d = _row_tile_program(N_HEADS, Q_TILE_SIZE, D_TILE)
    rows = (offs_q < N_QUERIES)[:, None]
    mask = rows & (offs_d < D)[None, :]
    o = tl.load(_row_ptrs(O_ptr, stride_o, batch, head, offs_q, offs_d), mask=mask, other=0.0)
    do = tl.load(_row_ptrs(dO_ptr, stride_do, batch, head, offs_q, offs_d), mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta_ptr + batch_head.to(tl.int64) * N_QUERIES + offs_q, delta, mask=offs_q < N_QUERIES)
    if ZERO_DQ:
        acc_ptrs = (dQacc_ptr + batch_head.to(tl.int64) * N_QUERIES * D_TILE
                    + offs_q[:, None] * D_TILE + offs_d[None, :])
        tl.store(acc_ptrs, tl.zeros((Q_TILE_SIZE, D_TILE), dtype=tl.float32), mask=rows)


@triton.jit
def flash_bwd_kv_kernel(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dK_ptr, dV_ptr, dQacc_ptr,
    stride_q, stride_k, stride_v, stride_do, stride_dk, stride_dv,  # (batch, head, seq, d) strides of each tensor
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, CHUNK,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    DQ_ATOMIC: tl.constexpr, DP_FIRST: tl.constexpr, SPLIT: tl.constexpr,
    CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr, CHECK_D: tl.constexpr,
):
    """Grid (batch·kv_heads, key tiles[, query chunks]); key tile 0 (the longest under causal masking) first.

    L (natural log) and delta are contiguous (batch·heads, N_QUERIES). dQacc is fp32
    (batch·heads, N_QUERIES, D_TILE), used only with DQ_ATOMIC. With SPLIT, program (·, ·, c) sees only
    queries [c·CHUNK, (c+1)·CHUNK) and writes its dK, dV into chunk c of fp32 (chunks, batch·kv_heads,
    N_KEYS, D_TILE) buffers, summed by `flash_split_sum_kernel`.
    """
    dK_ptr += _chunk_offset(N_KEYS, D_TILE, SPLIT)
    dV_ptr += _chunk_offset(N_KEYS, D_TILE, SPLIT)
    batch_kv_head = tl.program_id(0)
    n_kv_heads = N_HEADS // KV_GROUP
    batch = (batch_kv_head // n_kv_heads).to(tl.int64)
    kv_head = (batch_kv_head % n_kv_heads).to(tl.int64)
    k_start = tl.program_id(1) * K_TILE_SIZE

    k_src, v_src = _kv_sources(K_ptr, V_ptr, batch, kv_head, stride_k, stride_v, N_KEYS,
                               D, K_TILE_SIZE, D_TILE, USE_TMA)
    k = _load_tile(k_src, k_start, CHECK_K, CHECK_D, USE_TMA)
    v = _load_tile(v_src, k_start, CHECK_K, CHECK_D, USE_TMA)
    offs_k = k_start + tl.arange(0, K_TILE_SIZE)
    dk = tl.zeros((K_TILE_SIZE, D_TILE), dtype=tl.float32)
    dv = tl.zeros((K_TILE_SIZE, D_TILE), dtype=tl.float32)
    qk_scale = scale * LOG2E
    start, full_start = _query_ranges(k_start, N_QUERIES, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES)

    for g in range(0, KV_GROUP):
        head = kv_head * KV_GROUP + g
        batch_head = batch * N_HEADS + head
        q_src = _tile_src(Q_ptr, stride_q, batch, head, N_QUERIES, D, Q_TILE_SIZE, D_TILE, USE_TMA)
        do_src = _tile_src(dO_ptr, stride_do, batch, head, N_QUERIES, D, Q_TILE_SIZE, D_TILE, USE_TMA)
        dq_base = dQacc_ptr + batch_head * N_QUERIES * D_TILE
        if DQ_ATOMIC and USE_TMA:
            dq_dst = tl.make_tensor_descriptor(dq_base, shape=[N_QUERIES, D_TILE], strides=[D_TILE, 1],
                                               block_shape=[Q_TILE_SIZE, D_TILE])
        else:
            dq_dst = dq_base
        row_L = L_ptr + batch_head * N_QUERIES
        row_delta = Delta_ptr + batch_head * N_QUERIES
        lo, hi = _in_chunk(start, full_start, CHUNK, SPLIT)
        dk, dv = _bwd_kv_tiles(dk, dv, k, v, q_src, do_src, dq_dst, row_L, row_delta, offs_k,
                               lo, hi, N_QUERIES, qk_scale, Q_TILE_SIZE, D_TILE, True, DQ_ATOMIC,
                               CHECK_Q, CHECK_D, USE_TMA, PRECISION, DP_FIRST)
        lo, hi = _in_chunk(full_start, N_QUERIES, CHUNK, SPLIT)
        dk, dv = _bwd_kv_tiles(dk, dv, k, v, q_src, do_src, dq_dst, row_L, row_delta, offs_k,
                               lo, hi, N_QUERIES, qk_scale, Q_TILE_SIZE, D_TILE, False, DQ_ATOMIC,
                               CHECK_Q, CHECK_D, USE_TMA, PRECISION, DP_FIRST)

    dk_dst = _tile_src(dK_ptr, stride_dk, batch, kv_head, N_KEYS, D, K_TILE_SIZE, D_TILE, USE_TMA)
    dv_dst = _tile_src(dV_ptr, stride_dv, batch, kv_head, N_KEYS, D, K_TILE_SIZE, D_TILE, USE_TMA)
    _store_tile(dk_dst, k_start, dk * scale, CHECK_K, CHECK_D, USE_TMA)
    _store_tile(dv_dst, k_start, dv, CHECK_K, CHECK_D, USE_TMA)


@triton.jit
def flash_bwd_dq_kernel(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_ptr, O_ptr, dOcopy_ptr,
    stride_q, stride_k, stride_v, stride_do, stride_dq, stride_o, stride_docopy,  # (batch, head, seq, d)
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, CHUNK,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    DP_FIRST: tl.constexpr, FUSED_PREP: tl.constexpr, COPY_DO: tl.constexpr, SPLIT: tl.constexpr,
    CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr, CHECK_D: tl.constexpr,
):
    """Grid (batch·heads, query tiles), longest first: dQ from every key tile a query tile sees.

    With FUSED_PREP the pass runs before the dK/dV pass and does the pre-pass's work for its query
    tile: dO (any strides, stride 0 included) and O through pointer loads, delta = rowsum(dO·O) stored
    for the dK/dV pass, and with COPY_DO the dO tile stored into the contiguous dOcopy for its TMA loads.
    With SPLIT, program (·, ·, c) sees only keys [c·CHUNK, (c+1)·CHUNK) and writes its dQ into chunk c of
    an fp32 (chunks, batch·heads, N_QUERIES, D_TILE) buffer, summed by `flash_split_sum_kernel`; chunk 0
    stores delta and the dO copy.
    """
    dQ_ptr += _chunk_offset(N_QUERIES, D_TILE, SPLIT)
    batch_head, batch, head, kv_head, q_start = _query_program(N_HEADS, KV_GROUP, Q_TILE_SIZE,
                                                               is_causal and SKIP_MASKED_TILES)
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    q, k_src, v_src = _query_tile_sources(Q_ptr, K_ptr, V_ptr, stride_q, stride_k, stride_v, batch, head, kv_head,
                                          q_start, N_QUERIES, N_KEYS, D, D_TILE, Q_TILE_SIZE, K_TILE_SIZE, CHECK_Q,
                                          CHECK_D, USE_TMA)
    dq_dst = _tile_src(dQ_ptr, stride_dq, batch, head, N_QUERIES, D, Q_TILE_SIZE, D_TILE, USE_TMA)
    row = batch_head.to(tl.int64) * N_QUERIES
    in_range = offs_q < N_QUERIES
    lse = tl.load(L_ptr + row + offs_q, mask=in_range, other=0.0) * LOG2E
    if FUSED_PREP:
        offs_d = tl.arange(0, D_TILE)
        mask = in_range[:, None] & (offs_d < D)[None, :]
        do = tl.load(_row_ptrs(dO_ptr, stride_do, batch, head, offs_q, offs_d), mask=mask, other=0.0)
        o = tl.load(_row_ptrs(O_ptr, stride_o, batch, head, offs_q, offs_d), mask=mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        first = tl.program_id(2) == 0  # every chunk of a split pass needs delta; one stores it
        tl.store(Delta_ptr + row + offs_q, delta, mask=in_range & first)
        if COPY_DO:
            tl.store(_row_ptrs(dOcopy_ptr, stride_docopy, batch, head, offs_q, offs_d), do, mask=mask & first)
    else:
        do_src = _tile_src(dO_ptr, stride_do, batch, head, N_QUERIES, D, Q_TILE_SIZE, D_TILE, USE_TMA)
        do = _load_tile(do_src, q_start, CHECK_Q, CHECK_D, USE_TMA)
        delta = tl.load(Delta_ptr + row + offs_q, mask=in_range, other=0.0)
    dq = tl.zeros((Q_TILE_SIZE, D_TILE), dtype=tl.float32)
    qk_scale = scale * LOG2E

    full_stop, stop = _key_ranges(q_start, N_KEYS, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES)
    start, end = _in_chunk(0, full_stop, CHUNK, SPLIT)
    dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, offs_q, start, end, N_KEYS, qk_scale,
                       K_TILE_SIZE, False, is_causal, CHECK_K, CHECK_D, USE_TMA, PRECISION, DP_FIRST)
    start, end = _in_chunk(full_stop, stop, CHUNK, SPLIT)
    dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, offs_q, start, end, N_KEYS, qk_scale,
                       K_TILE_SIZE, True, is_causal, CHECK_K, CHECK_D, USE_TMA, PRECISION, DP_FIRST)
    _store_tile(dq_dst, q_start, dq * scale, CHECK_Q, CHECK_D, USE_TMA)


@triton.jit
def flash_bwd_dq_cast_kernel(
    dQacc_ptr, dQ_ptr, stride_dq,
    N_HEADS, N_QUERIES, scale,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr,
):
    """dQ = scale · dQacc in dQ's dtype and strides (the atomic design's last step)."""
    batch_head, batch, head, _, offs_q, offs_d = _row_tile_program(N_HEADS, Q_TILE_SIZE, D_TILE)
    rows = (offs_q < N_QUERIES)[:, None]
    acc = tl.load(dQacc_ptr + batch_head.to(tl.int64) * N_QUERIES * D_TILE + offs_q[:, None] * D_TILE
                  + offs_d[None, :], mask=rows, other=0.0)
    out = _row_ptrs(dQ_ptr, stride_dq, batch, head, offs_q, offs_d)
    tl.store(out, (acc * scale).to(dQ_ptr.dtype.element_ty), mask=rows & (offs_d < D)[None, :])


# Entry points for Inductor (`torch.library.triton_op`, section 4): the same kernels, unsplit and with the
# two-pass design's arguments fixed, taking each (batch, head, seq, d) stride as its own integer, since
# the user-defined kernels Inductor launches take tensors and scalars, not tuples.


@triton.jit
def flash_fwd_flat_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, L_ptr,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, so0, so1, so2, so3,
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr, CHECK_D: tl.constexpr,
):
    """`flash_fwd_kernel` without SPLIT."""
    scale = tl.cast(scale, tl.float32)  # Inductor passes a Python float as fp64 (Triton's own launcher as fp32)
    flash_fwd_kernel(Q_ptr, K_ptr, V_ptr, O_ptr, L_ptr, (sq0, sq1, sq2, sq3), (sk0, sk1, sk2, sk3),
                     (sv0, sv1, sv2, sv3), (so0, so1, so2, so3), N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, 0,
                     D, D_TILE, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES, USE_TMA, PRECISION, False,
                     CHECK_Q, CHECK_K, CHECK_D)


@triton.jit
def flash_bwd_dq_flat_kernel(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_ptr, O_ptr, dOcopy_ptr,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sdo0, sdo1, sdo2, sdo3,
    sdq0, sdq1, sdq2, sdq3, so0, so1, so2, so3, sc0, sc1, sc2, sc3,
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    DP_FIRST: tl.constexpr, COPY_DO: tl.constexpr, CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr,
    CHECK_D: tl.constexpr,
):
    """`flash_bwd_dq_kernel` with FUSED_PREP, without SPLIT."""
    scale = tl.cast(scale, tl.float32)
    flash_bwd_dq_kernel(Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_ptr, O_ptr, dOcopy_ptr,
                        (sq0, sq1, sq2, sq3), (sk0, sk1, sk2, sk3), (sv0, sv1, sv2, sv3), (sdo0, sdo1, sdo2, sdo3),
                        (sdq0, sdq1, sdq2, sdq3), (so0, so1, so2, so3), (sc0, sc1, sc2, sc3),
                        N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, 0,
                        D, D_TILE, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES, USE_TMA, PRECISION,
                        DP_FIRST, True, COPY_DO, False, CHECK_Q, CHECK_K, CHECK_D)


@triton.jit
def flash_bwd_kv_flat_kernel(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dK_ptr, dV_ptr,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sdo0, sdo1, sdo2, sdo3,
    sdk0, sdk1, sdk2, sdk3, sdv0, sdv1, sdv2, sdv3,
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    DP_FIRST: tl.constexpr, CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr, CHECK_D: tl.constexpr,
):
    """`flash_bwd_kv_kernel` of the two-pass design (no DQ_ATOMIC: dK stands in for the unused dQ
    accumulator), without SPLIT."""
    scale = tl.cast(scale, tl.float32)
    flash_bwd_kv_kernel(Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dK_ptr, dV_ptr, dK_ptr,
                        (sq0, sq1, sq2, sq3), (sk0, sk1, sk2, sk3), (sv0, sv1, sv2, sv3), (sdo0, sdo1, sdo2, sdo3),
                        (sdk0, sdk1, sdk2, sdk3), (sdv0, sdv1, sdv2, sdv3),
                        N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, 0,
                        D, D_TILE, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES, USE_TMA, PRECISION,
                        False, DP_FIRST, False, CHECK_Q, CHECK_K, CHECK_D)


# (Q_TILE_SIZE, K_TILE_SIZE, warps, stages). The first of each list won the H200 sweeps at d = 64
# (runs/kernels, NOTES.md); 8-warp ones serve d = 128; LARGE_D ones only d > 128 (and only they do).
FWD_CONFIGS = make_configs(
    [(128, 128, 4, 3), (128, 64, 4, 3), (64, 128, 4, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 2)])
KV_CONFIGS = make_configs(  # keys per program are the second number
    [(32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 4)])
DQ_CONFIGS = make_configs(
    [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 3)])
# (the interpreter runs one pinned config for every head dim)
LARGE_D_FWD = [] if INTERPRET else make_configs([(64, 64, 8, 2), (64, 32, 4, 2)])
LARGE_D_KV = [] if INTERPRET else make_configs([(32, 64, 8, 2), (16, 64, 4, 2)])
LARGE_D_DQ = [] if INTERPRET else make_configs([(64, 32, 8, 2), (64, 64, 8, 2)])
_LARGE_D = {id(c) for c in (*LARGE_D_FWD, *LARGE_D_KV, *LARGE_D_DQ)}
_AUTOTUNE_KEY = ["N_QUERIES", "N_KEYS", "D", "KV_GROUP", "is_causal", "USE_TMA", "PRECISION"]


def _autotuned(fn, configs, extra_key=(), reset_to_zero=None):
    return triton.autotune(
        configs=configs, key=[*_AUTOTUNE_KEY, *extra_key], prune_configs_by={"early_config_prune": _prune},
        reset_to_zero=reset_to_zero,
    )(triton.heuristics(_EVEN_HEURISTICS)(fn))


flash_fwd_autotuned = _autotuned(flash_fwd_kernel, FWD_CONFIGS + LARGE_D_FWD, ["SPLIT"])
# the atomic design accumulates into dQacc: each config the autotuner times starts from zeros
flash_bwd_kv_autotuned = _autotuned(flash_bwd_kv_kernel, KV_CONFIGS + LARGE_D_KV, ["DQ_ATOMIC", "DP_FIRST", "SPLIT"],
                                    ["dQacc_ptr"])
flash_bwd_dq_autotuned = _autotuned(flash_bwd_dq_kernel, DQ_CONFIGS + LARGE_D_DQ,
                                    ["DP_FIRST", "FUSED_PREP", "COPY_DO", "SPLIT"])


# Inductor runs their autotuner's configs and prune itself (no `reset_to_zero`: these kv programs write
# all of dK and dV)
flash_fwd_flat_autotuned = _autotuned(flash_fwd_flat_kernel, FWD_CONFIGS + LARGE_D_FWD)
flash_bwd_dq_flat_autotuned = _autotuned(flash_bwd_dq_flat_kernel, DQ_CONFIGS + LARGE_D_DQ, ["DP_FIRST", "COPY_DO"])
flash_bwd_kv_flat_autotuned = _autotuned(flash_bwd_kv_flat_kernel, KV_CONFIGS + LARGE_D_KV, ["DP_FIRST"])


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
    constexprs: tuple[tuple[str, object], ...] = ()  # what this entry fixes beyond the shape's constexprs

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
                fp32 = name in ("L_ptr", "Delta_ptr", "dQacc_ptr")
                args.append(MockTensor(torch.float32 if fp32 else dtype))
            elif name.startswith("stride_"):  # a (batch, head, seq, d) stride tuple
                args.append((heads * seq * d, seq * d, d, 1))
            elif name == "N_HEADS":
                args.append(heads)
            elif name == "KV_GROUP":
                args.append(1)
            elif name in ("N_QUERIES", "N_KEYS"):
                args.append(seq)
            elif name == "scale":
                args.append(d ** -0.5)
            elif name == "CHUNK":  # unused without SPLIT
                args.append(0)
            else:
                raise ValueError(f"no example value for argument {name!r} of {self.name}")
        constexprs = dict(D=d, D_TILE=padded_dim(d), is_causal=causal, SKIP_MASKED_TILES=True,
                          USE_TMA=_tma_default(), PRECISION=_precision(dtype), SPLIT=False, **dict(self.constexprs))
        return args, constexprs


_WIDE_Q_K = ((64, 32), (64, 64), (64, 128), (128, 64), (128, 128))
_WIDE_KV = ((32, 64), (32, 128), (64, 64), (64, 128), (128, 64), (128, 128))
KERNELS: dict[str, KernelSpec] = {
    "flash_fwd": KernelSpec("flash_fwd", flash_fwd_kernel, flash_fwd_autotuned, _WIDE_Q_K),
    "flash_bwd_kv_atomic": KernelSpec(
        "flash_bwd_kv_atomic", flash_bwd_kv_kernel, flash_bwd_kv_autotuned, _WIDE_KV,
        (("DQ_ATOMIC", True), ("DP_FIRST", True))),
    "flash_bwd_kv": KernelSpec(
        "flash_bwd_kv", flash_bwd_kv_kernel, flash_bwd_kv_autotuned, _WIDE_KV,
        (("DQ_ATOMIC", False), ("DP_FIRST", True))),
    "flash_bwd_dq": KernelSpec(
        "flash_bwd_dq", flash_bwd_dq_kernel, flash_bwd_dq_autotuned,
        ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128)),
        (("DP_FIRST", True), ("FUSED_PREP", True), ("COPY_DO", False))),
}
AUTOTUNED_KERNELS = {
    "flash_fwd": flash_fwd_autotuned, "flash_bwd_kv": flash_bwd_kv_autotuned, "flash_bwd_dq": flash_bwd_dq_autotuned,
}


# ----------------------------------------------------------------------------------------------
# 3. Host launchers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelOptions:
    """What a variant of the kernel does; the defaults are the shipped kernel."""

    triton_backward: bool = True     # False: torch.compile'd PyTorch backward
    skip_masked_tiles: bool = True   # False: causal visits every tile and masks it
    autotune: bool = True            # False: one fixed config per kernel
    # True: the two-pass backward (bitwise repeatable). False: the single pass, dQ added in fp32 by atomics
    # or TMA reductions (not bitwise repeatable). None: the single pass where its Gluon kernel applies
    # (flash_gluon.supported(single_pass=True); the kv pass's gluon_kv/GLUON_MIN_WORK rule), else the two-pass
    # (faster than the Triton single pass everywhere).
    deterministic: bool | None = None
    tma: bool | None = None          # TMA tensor descriptors (None: where the GPU and strides allow)
    dp_first: bool = True            # backward passes issue dP's matmul before P's exponentials
    fused_prep: bool = True          # two-pass backward: the dQ pass (run first) computes delta and
                                     # copies an expanded dO, instead of a pre-pass kernel and a copy
    # The two-pass backward's dK/dV pass in Gluon (flash_gluon): None where it applies (sm_90, 16-bit, d 64/128,
    # contiguous, whole tiles, an unsplit grid) and the call is long enough for its launch (GLUON_MIN_WORK),
    # True wherever it applies (with `configs`' "kv" entry as its config when not autotuning), False never.
    gluon_kv: bool | None = None
    # The Gluon dK/dV pass computes S and dP with the queries on rows, P and dS reaching dV's and dK's matmuls
    # through shared memory (FlashAttention-3's layout; flash_gluon.flash_bwd_kv_qrows_gluon_kernel). False: the
    # keys-on-rows Gluon kernel. (The Triton pass has the keys on rows; the queries on rows in Triton lost
    # 17-51% on the H200 and was removed: NOTES.md, session 14.)
    kv_qrows: bool = True
    # The Gluon single pass (deterministic None/False) with the queries on rows as well
    # (flash_gluon.flash_bwd_kv_qrows_gluon_kernel with DQ_ATOMIC; shipped until session 20). False: the keys on
    # rows, P and dS in registers (flash_gluon.flash_bwd_single_keys_gluon_kernel, FlashAttention-3's d-64
    # backward; 5.7% less backward time at the leaderboard shape on the H200, NOTES.md session 21; at d 128 it
    # takes 19% off the two-pass backward, session 22, where the queries-on-rows single pass does not run).
    single_qrows: bool = False
    # The forward in Gluon (flash_gluon.flash_fwd_gluon_kernel: a producer warp and two or three consumer
    # warpgroups taking turns, FlashAttention-3's schedule): None where it applies (sm_90, 16-bit, d 64/128,
    # contiguous, whole 64-row tiles) and the call is long enough for its launch (GLUON_MIN_WORK), True
    # wherever it applies (with `configs`' "fwd" entry as its config when not autotuning), False never.
    gluon_fwd: bool | None = None
    # Rows per chunk where a pass splits its reduction over a third grid axis (keys for the forward and
    # the dQ pass, queries for the dK/dV pass): None chooses per launch (`split_rows`; only short grids
    # split), 0 never splits, a positive multiple of SPLIT_UNIT splits every pass of the two-pass design.
    split_rows: int | None = None
    # Without autotuning: (Q_TILE_SIZE, K_TILE_SIZE, num_warps, num_stages) per kernel ("fwd", "kv",
    # "dq"); a kernel not named runs FIXED_CONFIG.
    configs: tuple[tuple[str, tuple[int, int, int, int]], ...] = ()


    def __post_init__(self):
        if self.split_rows is not None and (
                isinstance(self.split_rows, bool) or not isinstance(self.split_rows, int)
                or self.split_rows < 0 or self.split_rows % SPLIT_UNIT):
            raise ValueError(f"split_rows must be None, 0 or a positive multiple of {SPLIT_UNIT}, "
                             f"got {self.split_rows!r}")


SPLIT_UNIT = 128  # chunks of a split pass are multiples of every tile size
# batch·heads·Nq·Nk from which the forward and the dK/dV pass run in Gluon by default (KernelOptions.gluon_fwd,
# gluon_kv = None): a Gluon launch (host-side TMA descriptors) costs more host time than a Triton kernel's
# cached C launch, so short calls, which are bound by host time, keep the Triton kernels (about 0.25 ms of
# forward kernel time and up at d 64, causal, on the H200)
GLUON_MIN_WORK = 1 << 30
MIN_SPLIT_STEPS = 128  # SPLIT_UNIT steps a reduction needs before it is split (split_rows)
DEFAULT_OPTIONS = KernelOptions()
DETERMINISTIC_OPTIONS = KernelOptions(deterministic=True)
ATOMIC_OPTIONS = KernelOptions(deterministic=False)
# (Q_TILE_SIZE, K_TILE_SIZE, num_warps, num_stages) when not autotuning: a plain first kernel.
FIXED_CONFIG = (16, 16, 1, 1) if INTERPRET else (64, 64, 4, 3)
PREP_TILE = 16 if INTERPRET else 64
SUM_TILE = 16 if INTERPRET else 32  # rows per program of the split sum (more programs: it is latency-bound)


@functools.cache
def _tma_default() -> bool:
    """TMA where the GPU has it (Hopper and newer); asked once, at the first launch, not at import."""
    return not INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_rows(programs: int, n_rows: int, n_reduce: int, causal: bool, sms: int, per_sm: int = 2) -> int:
    """Rows per chunk of a pass's reduction (0: no split) for `programs` (batch·heads) × tiles of n_rows
    rows, each reducing over up to n_reduce rows, on a GPU with `sms` SMs running `per_sm` programs each
    (the shipped configs: two at head dim ≤ 64, one above, by registers and shared memory).

    In 128-row steps: the longest program runs `steps` of them and the whole pass W (about half of
    rows × steps under causal masking). The resident programs share W evenly at W / (per_sm·sms) steps each;
    chunks of that many steps (at least 4, so that merging stays cheap) split the reduction where at
    least two fit in the longest program, and only where that program is long (MIN_SPLIT_STEPS, 16384
    rows: on the H200 shorter calls are bound by host time, which the merge launches add to; session
    10's A/B). So short grids of long sequences split (one head at 16384–32768 tokens); a grid of many
    waves (16 heads × 16384) never does.
    """
    steps = -(-n_reduce // SPLIT_UNIT)
    if steps < MIN_SPLIT_STEPS:
        return 0
    work = programs * -(-n_rows // SPLIT_UNIT) * steps
    if causal:
        work //= 2
    pieces = steps // max(4, -(-work // (per_sm * sms)))
    return -(-steps // pieces) * SPLIT_UNIT if pieces >= 2 else 0


def _split_rows(opts: KernelOptions, programs: int, n_rows: int, n_reduce: int, causal: bool, d: int,
                device: torch.device) -> int:
    if opts.split_rows is not None:
        return opts.split_rows
    if device.type != "cuda":  # the interpreter: only where a test asks for it
        return 0
    return split_rows(programs, n_rows, n_reduce, causal, _sm_count(device.index or 0), 2 if d <= 64 else 1)


def _precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: fp32 follows torch.get_float32_matmul_precision()."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _as_bhsd(t: torch.Tensor) -> torch.Tensor:
    """View (..., H, S, D) as (B, H, S, D) without copying when the leading dims allow it."""
    if t.ndim == 2:
        return t[None, None]
    if t.ndim == 3:
        return t[None]
    if t.ndim == 4:
        return t
    return t.reshape(-1, *t.shape[-3:])  # copies only if the leading dims cannot be merged


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and strides, and a contiguous last dim."""
    return all(t.data_ptr() % 16 == 0 and _tma_strides_ok(t) for t in tensors)


def _tma_strides_ok(t: torch.Tensor) -> bool:
    *outer, last = t.stride()
    per16 = 16 // t.element_size()
    return last == 1 and all(s % per16 == 0 for s in outer)


def _tma_wanted(opts: KernelOptions) -> bool:
    return _tma_default() if opts.tma is None else opts.tma


def _gluon_choice(opts: KernelOptions, flag: bool | None, kernel: str, work: int) -> tuple[bool, tuple | None]:
    """Whether a pass asks for its Gluon kernel (`flag`: KernelOptions.gluon_fwd or gluon_kv; None: where the
    call's batch·heads·Nq·Nk reaches GLUON_MIN_WORK), and the config it hands over: the options' entry for
    `kernel` ("fwd", "kv") only when the Gluon kernel was asked for explicitly without autotuning (a sweep's
    fixed Triton config is not a Gluon config)."""
    wanted = work >= GLUON_MIN_WORK if flag is None else flag
    config = dict(opts.configs).get(kernel) if flag and not opts.autotune else None
    return wanted, config


def launch_hooks_installed() -> bool:
    """Whether a profiler (e.g. proton) hooks Triton's launches: then every launch goes through Triton.
    Triton 3.6 keeps the hooks in a HookChain (never None; empty when none is installed), older
    versions a callable or None."""
    hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def launch_cache_sizes() -> dict[str, int]:
    """Compiled kernels the fast launch path holds, per launcher (argument signatures seen)."""
    return {launcher.name: len(launcher.entries) for launcher in _LAUNCHERS}


class _Compiled:
    """What `_Launcher` keeps per argument signature: the compiled kernel's C launch (None where Triton's
    launcher does not expose it; then its runner is called) and the arguments after the call's own."""

    __slots__ = ("tail", "runner", "c_launch")

    def __init__(self, tail: tuple, runner, c_launch: CLaunch | None):
        self.tail = tail  # the constexprs and tuned meta-parameters
        self.runner, self.c_launch = runner, c_launch


class _Launcher:
    """Launches one kernel; remembers, per argument signature, the compiled kernel and its grid.

    The first launch of a signature goes through Triton (autotuner, heuristics, specialization,
    compilation); later ones call the compiled kernel's C launch directly (`kernel_launch.CLaunch`: the current
    stream, fresh TMA scratch), which saves most of the host time at short sequences. The
    signature holds everything Triton specializes on or tunes by: each tensor's dtype and 16-byte
    alignment, every integer's value, the constexprs and the device. Under the interpreter, or with
    launch hooks installed, every launch goes through Triton; where a compiled kernel's launcher does
    not expose its C launch (another Triton version, a profile scratch), its runner is called.
    """

    def __init__(self, kernel, name: str):
        self.kernel = kernel  # a triton Autotuner over heuristics over the kernel, or a plain kernel
        self.name = name
        self.tuned = isinstance(kernel, triton.runtime.Autotuner)
        self.arg_names = (kernel.fn if self.tuned else kernel).arg_names  # every parameter, in order
        self.entries: dict[tuple, _Compiled] = {}
        # where the tensors and the specialized non-tensors (ints, stride tuples) sit among the arguments:
        # each call site passes one fixed layout, found at its first call
        self.tensor_positions: tuple[int, ...] = ()
        self.other_positions: tuple[int, ...] | None = None

    def _key(self, grid, args: tuple, constexprs: dict) -> tuple:
        """The signature: device, grid (a tuple or a hashable `TilesGrid`: the batch·heads it covers is in
        no argument), constexprs, tensors' dtypes and alignment, the other non-float arguments."""
        if self.other_positions is None:
            self.tensor_positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            self.other_positions = tuple(i for i, a in enumerate(args) if not isinstance(a, (torch.Tensor, float)))
        tensors = [args[i] for i in self.tensor_positions]
        return (torch.cuda.current_device(), grid, *constexprs.values(), *[t.dtype for t in tensors],
                *[t.data_ptr() % 16 == 0 for t in tensors], *[args[i] for i in self.other_positions])

    def __call__(self, grid, args: tuple, opts: KernelOptions = DEFAULT_OPTIONS, **constexprs) -> _Compiled | None:
        """Launch; hand back what this signature's later launches may call directly (`_PlannedLaunch`), or None
        where every launch goes through Triton."""
        if self.tuned and not opts.autotune:
            q_tile, k_tile, warps, stages = dict(opts.configs).get(self.name, FIXED_CONFIG)
            fixed = dict(Q_TILE_SIZE=q_tile, K_TILE_SIZE=k_tile)
            self.kernel.fn[grid(fixed)](*args, **constexprs, **fixed, num_warps=warps, num_stages=stages)
            return None
        if INTERPRET or launch_hooks_installed():
            self.kernel[grid](*args, **constexprs)
            return None
        key = self._key(grid, args, constexprs)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = self._compile(grid, args, constexprs)
        elif entry.c_launch is None:
            entry.runner(*args, *entry.tail)
        else:
            entry.c_launch(key[0], *args, *entry.tail)
        return entry

    def _compile(self, grid, args: tuple, constexprs: dict) -> _Compiled:
        """Launch through Triton (tuning and compiling as needed) and keep what later launches reuse."""
        kernel = self.kernel[grid](*args, **constexprs)
        if hasattr(kernel, "result"):  # Triton's asynchronous compile mode hands back a future
            kernel = kernel.result()
        values = {**dict(zip(self.arg_names, args)), **constexprs}
        if self.tuned:
            values.update(self.kernel.best_config.kwargs)
            values.update({name: rule(values) for name, rule in _EVEN_HEURISTICS.items()})
        tail = tuple(values[name] for name in self.arg_names[len(args):])
        fixed_grid = tuple(grid(values) if callable(grid) else grid)
        return _Compiled(tail, kernel[fixed_grid], CLaunch.of(kernel, fixed_grid))


_fwd_launch = _Launcher(flash_fwd_autotuned, "fwd")
_kv_launch = _Launcher(flash_bwd_kv_autotuned, "kv")
_dq_launch = _Launcher(flash_bwd_dq_autotuned, "dq")
_prep_launch = _Launcher(flash_bwd_prep_kernel, "prep")
_cast_launch = _Launcher(flash_bwd_dq_cast_kernel, "cast")
_combine_launch = _Launcher(flash_fwd_combine_kernel, "combine")
_sum_launch = _Launcher(flash_split_sum_kernel, "sum")
_LAUNCHERS = (_fwd_launch, _kv_launch, _dq_launch, _prep_launch, _cast_launch, _combine_launch, _sum_launch)


@dataclass(frozen=True)
class TilesGrid:
    """Grid (first, tiles of n, chunks) for a config's meta-parameters; hashable, so that the launch
    cache keys on it (first is batch·heads, which no kernel argument carries)."""

    first: int
    n: int
    tile_name: str
    chunks: int = 1

    def __call__(self, meta: dict) -> tuple[int, int, int]:
        tiles = -(-self.n // meta[self.tile_name])
        if tiles > MAX_GRID_Y:
            raise ValueError(f"sequence length {self.n} needs {tiles} tiles, more than the launch grid allows")
        return (self.first, tiles, self.chunks)


def _split_buffers(chunk: int, n_reduce: int, batch: int, heads: int, n_rows: int, d_tile: int, device,
                   count: int = 1) -> tuple[int, list[torch.Tensor]]:
    """(chunks, `count` fp32 partial buffers of a split pass, one allocation, each as chunk 0's (batch,
    heads, n_rows, d_tile) view); the kernels find chunk c at c·batch·heads·n_rows·d_tile elements
    from it, and buffer i + 1 starts `chunks` of those after buffer i."""
    chunks = -(-n_reduce // chunk)
    parts = torch.empty((count, chunks, batch, heads, n_rows, d_tile), device=device, dtype=torch.float32)
    return chunks, [parts[i, 0] for i in range(count)]


def _check_head_dim(d: int) -> None:
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is larger than the supported maximum {MAX_HEAD_DIM}")


def _check_launchable(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"the Triton kernels need CUDA tensors, got a tensor on {q.device} "
            "(set TRITON_INTERPRET=1 before importing cs336_systems.flash_triton to run them on the CPU)"
        )
    _check_head_dim(q.shape[-1])


# Host plans. Everything `flash_forward_triton` and `flash_backward_triton` decide from their inputs' metadata
# (designs, Gluon or Triton, splits, TMA, the dO copy, allocation shapes, grids, constexprs, stride tuples) is
# decided once per signature (`_plan_key`) and kept; a repeat call builds the key, allocates and launches. The
# kernels take each tensor as a pointer beside the (B, H, S, D) strides its plan holds, so the calls pass their
# tensors as they are (a (B, H, S, D) view has the same pointer), except inputs of more than four dims, which
# `_as_bhsd` may have to copy.


class _PlannedLaunch:
    """One kernel launch of a host plan: a launcher with the grid, constexprs and non-tensor arguments that its plan
    fixed; a call passes its tensors (and the softmax scale, a float kernel argument in no plan's key, so that calls
    of varying scales share a plan). Launches go through the launcher until it hands back the signature's compiled
    kernel, then straight to its C launch, without the launcher's own signature: the plan's key holds all that one
    holds (the current device; each tensor's dtype and alignment, the inputs' in the key and those of our own
    allocations following from their shapes, as fresh blocks are aligned far beyond 16 bytes; the grid, constexprs
    and the other non-float arguments, which follow from the key)."""

    __slots__ = ("launcher", "grid", "head", "tail", "opts", "constexprs", "device", "compiled")

    def __init__(self, launcher, grid, head: tuple, tail: tuple | None, opts: KernelOptions, constexprs: dict,
                 device: int | None):
        self.launcher, self.grid, self.opts, self.constexprs = launcher, grid, opts, constexprs
        # the arguments after the tensors: all of them (tail None), or those before the scale and those after it
        self.head, self.tail = head, tail
        self.device = device  # the current CUDA device of the plan's key: its compiled kernels, its stream
        self.compiled: _Compiled | None = None  # one reference, set in one store: threads may share a plan

    def arguments(self, tensors: tuple, scale: float | None) -> tuple:
        return (*tensors, *self.head) if self.tail is None else (*tensors, *self.head, scale, *self.tail)

    def scratch_size(self) -> int | None:
        """Bytes of global scratch (TMA descriptors) its C launch takes; None while launches go through the
        launcher."""
        compiled = self.compiled
        return None if compiled is None or compiled.c_launch is None else compiled.c_launch.scratch_size

    def __call__(self, buffer: torch.Tensor | None, *tensors: torch.Tensor, scale: float | None = None) -> None:
        """Launch on this call's tensors; `buffer`: the call's shared scratch (`_SharedScratch`) or None."""
        args = self.arguments(tensors, scale)
        compiled = self.compiled
        if compiled is None or compiled.c_launch is None:
            self.compiled = self.launcher(self.grid, args, self.opts, **self.constexprs)
        else:
            compiled.c_launch(self.device, *args, *compiled.tail, buffer=buffer)


class _SharedScratch:
    """One global-scratch buffer per call for all the C launches of a plan, instead of one per launch. As safe as
    one per launch: the kernels of a call run one after another on the current stream (none is launched with
    programmatic dependent launch), each writing its TMA descriptors before reading them; and the buffer, freed when
    the call returns, goes back to the caching allocator, which hands it out again only to work queued after them
    on that stream (under CUDA-graph capture, from the graph's private pool, as before)."""

    __slots__ = ("launches", "size")

    def __init__(self, launches: tuple[_PlannedLaunch, ...]):
        self.launches = launches
        self.size: int | None = None  # bytes: the largest launch's, once every launch has its C launch

    def __call__(self) -> torch.Tensor | None:
        """This call's buffer; None where no launch needs one, or some still go through their launcher (which
        takes its own, as does a C launch given none)."""
        if self.size is None:
            sizes = [launch.scratch_size() for launch in self.launches]
            if None in sizes:
                return None
            self.size = max(sizes, default=0)
        return scratch(self.size, 128, None) if self.size else None


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of t's shape, dtype and device (faster to ask for than torch.empty with them)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.data_ptr() % 16


def _plan_key(tensors: tuple[torch.Tensor, ...], is_causal: bool, opts: KernelOptions) -> tuple:
    """What a host plan is decided from: each tensor's shape, strides, dtype and 16-byte misalignment (the batch is
    in no stride of a contiguous tensor, only in its shape; alignment decides TMA, the Gluon kernels and Triton's
    pointer specialization), is_causal, the options; q's device (its SM count, the Gluon kernels' sm_90 check), the
    fp32 matmul precision, whether launch hooks are installed (then every launch goes through Triton), and last the
    current CUDA device, whose compiled kernels the plan's launches call."""
    q = tensors[0]
    return (*map(_layout, tensors), is_causal, opts, q.device, _precision(q.dtype), launch_hooks_installed(),
            torch.cuda.current_device() if q.is_cuda else None)


def _off_current_device(q: torch.Tensor, key: tuple) -> bool:
    """Whether q is on a CUDA device other than the current one (the last part of its plan key): the kernels launch
    on the current device, so the call then runs again under a guard that makes q's device current."""
    return q.is_cuda and key[-1] != q.device.index


def _planned_sum(out4: torch.Tensor, chunks: int, chunk: int, d: int, d_tile: int, is_causal: bool,
                 rows_are_keys: bool, opts: KernelOptions, device: int | None) -> _PlannedLaunch:
    """The launch that writes out4 = the sum of the chunks of one partial buffer of `_split_buffers`. One output per
    launch: dK and dV in one launch would need one allocation, and the custom op's outputs must not share
    storage."""
    batch, heads, n_rows = out4.shape[:3]
    return _PlannedLaunch(_sum_launch, (batch * heads, -(-n_rows // SUM_TILE)),
                          (out4.stride(), chunks, chunk, heads, n_rows), None, opts,
                          dict(D=d, D_TILE=d_tile, Q_TILE_SIZE=SUM_TILE, is_causal=is_causal,
                               ROWS_ARE_KEYS=rows_are_keys), device)


@dataclass(frozen=True, slots=True)
class _ForwardPlan:
    """What `flash_forward_triton` decides for a signature."""

    lse_shape: tuple[int, ...]
    reshape: bool                     # inputs of more than four dims: `_as_bhsd` each call
    default_scale: float              # 1/sqrt(D)
    gluon: tuple | None               # (config, cached) where the Gluon forward runs; else
    use_tma: bool = False             # the Triton kernels:
    split: tuple | None = None        # `_split_buffers`' arguments where the keys split (a short grid),
    split_lse_shape: tuple | None = None  # and the partial L's shape
    fwd: _PlannedLaunch | None = None
    combine: _PlannedLaunch | None = None  # merges the chunks of a split
    scratch: _SharedScratch | None = None


_FORWARD_PLANS: dict[tuple, _ForwardPlan] = {}


def _plan_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, opts: KernelOptions,
                  device: int | None) -> _ForwardPlan:
    q4, k4, v4 = _as_bhsd(q), _as_bhsd(k), _as_bhsd(v)
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    d_tile = padded_dim(d)
    chunk = _split_rows(opts, batch * heads, n_q, n_k, is_causal, d, q.device)
    gluon, gluon_config = _gluon_choice(opts, opts.gluon_fwd, "fwd", batch * heads * n_q * n_k)
    gluon = gluon and not chunk and _tma_wanted(opts) and flash_gluon.fwd_supported(q4, k4, v4, gluon_config)
    lse_shape, reshape, default_scale = tuple(q.shape[:-1]), q.ndim > 4, d ** -0.5
    if gluon:
        return _ForwardPlan(lse_shape, reshape, default_scale, (gluon_config, not launch_hooks_installed()))
    o4 = _as_bhsd(_empty_like(q))  # as each call allocates O
    split, split_lse_shape, chunks, out = None, None, 1, o4
    if chunk:  # a short grid: chunks of the keys, merged by the combine kernel
        split = (chunk, n_k, batch, heads, n_q, d_tile)
        chunks, (out,) = _split_buffers(*split, q.device)
        split_lse_shape = (chunks, batch * heads, n_q)
    use_tma = _tma_wanted(opts) and _tma_ok(q4, k4, v4, out)
    fwd = _PlannedLaunch(
        _fwd_launch, TilesGrid(batch * heads, n_q, "Q_TILE_SIZE", chunks),
        (q4.stride(), k4.stride(), v4.stride(), out.stride(), heads, heads // kv_heads, n_q, n_k), (chunk,), opts,
        dict(D=d, D_TILE=d_tile, is_causal=is_causal, SKIP_MASKED_TILES=opts.skip_masked_tiles, USE_TMA=use_tma,
             PRECISION=_precision(q.dtype), SPLIT=bool(chunk)), device)
    combine = None
    if chunk:
        combine = _PlannedLaunch(_combine_launch, (batch * heads, -(-n_q // PREP_TILE), 1),
                                 (o4.stride(), chunks, heads, n_q), None, opts,
                                 dict(D=d, D_TILE=d_tile, Q_TILE_SIZE=PREP_TILE), device)
    return _ForwardPlan(lse_shape, reshape, default_scale, None, use_tma, split, split_lse_shape, fwd, combine,
                        _SharedScratch((fwd,) if combine is None else (fwd, combine)))


def flash_forward_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
    opts: KernelOptions = DEFAULT_OPTIONS, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """O (..., H, Nq, D) in q's dtype and L (..., H, Nq) fp32, for checked inputs (k, v: (..., Hkv, Nk, D))."""
    _check_launchable(q)
    key = _plan_key((q, k, v), is_causal, opts)
    if _off_current_device(q, key):
        with torch.cuda.device(q.device):
            return flash_forward_triton(q, k, v, is_causal, opts, scale)
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        plan = _FORWARD_PLANS[key] = _plan_forward(q, k, v, is_causal, opts, key[-1])
    scale = plan.default_scale if scale is None else float(scale)
    o = _empty_like(q)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32)
    if plan.reshape:
        q, k, v = _as_bhsd(q), _as_bhsd(k), _as_bhsd(v)
    if plan.gluon:
        config, cached = plan.gluon
        flash_gluon.forward(_as_bhsd(q), _as_bhsd(k), _as_bhsd(v), _as_bhsd(o), lse, is_causal, scale, config,
                            cached=cached)
        return o, lse
    if plan.use_tma:  # launches through Triton take TMA scratch from its allocator, a context variable: set per thread
        triton.set_allocator(scratch)
    out, out_lse = o, lse
    if plan.split:
        _, (out,) = _split_buffers(*plan.split, q.device)
        out_lse = q.new_empty(plan.split_lse_shape, dtype=torch.float32)
    buffer = plan.scratch()
    plan.fwd(buffer, q, k, v, out, out_lse, scale=scale)
    if plan.combine:
        plan.combine(buffer, out, out_lse, o, lse)
    return o, lse


@dataclass(frozen=True, slots=True)
class _BackwardBuffers:
    """What a backward call allocates besides dQ, dK, dV, by its plan."""

    delta_shape: tuple[int, int]  # (batch·heads, Nq)
    dq_acc_shape: tuple[int, int, int] | None  # (batch·heads, Nq, D_TILE): the atomic design's fp32 dQ accumulator
    copy_do: str | None  # "dq pass": an empty buffer that the fused dQ pass fills; "now": dO.contiguous(); None
    dq_split: tuple | None  # `_split_buffers`' arguments where the dQ pass splits
    kv_split: tuple | None  # ... and where the dK/dV pass does (two buffers: dK's, dV's)

    def __call__(self, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, do: torch.Tensor) -> tuple:
        """(delta, dq_acc, do, do_tiles, dq_out, dk_out, dv_out): delta; the dQ accumulator; dO as the passes that
        read it through pointers take it, and as the TMA-loading passes do; where the dQ pass and the dK/dV pass
        write (the outputs, or partial sums)."""
        delta = dq.new_empty(self.delta_shape, dtype=torch.float32)
        do_tiles = do
        if self.copy_do == "dq pass":
            do_tiles = _empty_like(do)
        elif self.copy_do == "now":
            do = do_tiles = do.contiguous()
        dq_out = dq
        if self.dq_split:
            _, (dq_out,) = _split_buffers(*self.dq_split, dq.device)
        dk_out, dv_out = dk, dv
        if self.kv_split:
            _, (dk_out, dv_out) = _split_buffers(*self.kv_split, dq.device, 2)
        # Outside the atomic design the dQ-accumulator argument is unused (the pre-pass without ZERO_DQ does not
        # touch it; the dK/dV kernel without DQ_ATOMIC neither), and dK's buffer stands in for it: the kv autotuner
        # zeroes that argument before timing each config and before the launch, which then writes all of dK. No
        # input, nor delta or dQ (the dQ pass has written both by then), may stand in.
        dq_acc = dk_out
        if self.dq_acc_shape is not None:
            dq_acc = dq.new_empty(self.dq_acc_shape, dtype=torch.float32)
        return delta, dq_acc, do, do_tiles, dq_out, dk_out, dv_out


@dataclass(frozen=True, slots=True)
class _BackwardPlan:
    """What `flash_backward_triton` decides for a signature: the launches in their order."""

    buffers: _BackwardBuffers
    reshape: bool                     # inputs of more than four dims: `_as_bhsd` each call
    default_scale: float              # 1/sqrt(D)
    use_tma: bool
    atomic: bool                      # the single pass (dQ accumulated in fp32)
    prep: _PlannedLaunch | None       # the pre-pass: delta (and the atomic design's zeroed dQ accumulator)
    dq: _PlannedLaunch | None         # the two-pass design's dQ pass
    dq_sum: _PlannedLaunch | None     # merges its chunks where it splits
    kv: _PlannedLaunch | None         # the Triton dK/dV pass, or
    gluon_kv: tuple | None            # (config, keywords) of the Gluon one (`flash_gluon.kv_pass`)
    kv_sums: tuple[_PlannedLaunch, ...]  # dK's and dV's, where the dK/dV pass splits
    cast: _PlannedLaunch | None       # the atomic design's dQ = its accumulator · scale, in q's dtype
    scratch: _SharedScratch


_BACKWARD_PLANS: dict[tuple, _BackwardPlan] = {}


def _plan_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                   is_causal: bool, opts: KernelOptions, device: int | None) -> _BackwardPlan:
    q4, k4, v4, o4, do4 = _as_bhsd(q), _as_bhsd(k), _as_bhsd(v), _as_bhsd(o), _as_bhsd(do)
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    inputs_tma = _tma_wanted(opts) and _tma_ok(q4, k4, v4)
    gluon_wanted, gluon_config = _gluon_choice(opts, opts.gluon_kv, "kv", batch * heads * n_q * n_k)
    # the single pass in Gluon (dQ by TMA reductions; dO made contiguous for it, so q stands in for it in
    # `supported`'s layout checks)
    gluon_single = (gluon_wanted and opts.deterministic is not True and opts.skip_masked_tiles
                    and inputs_tma and do4.dtype == q4.dtype
                    and flash_gluon.supported(q4, k4, v4, q4, gluon_config, opts.single_qrows, single_pass=True))
    atomic = opts.deterministic is False or gluon_single
    fused = opts.fused_prep and not atomic
    # dO from o.sum().backward() is an expand (all strides 0), which no TMA descriptor takes: one copy
    # (the size of O) keeps the passes on TMA instead of dropping them to block pointers. The fused dQ
    # pass reads dO through pointers and writes the copy the dK/dV pass loads.
    copy_do = inputs_tma and (not _tma_ok(do4) or gluon_single and not do4.is_contiguous())
    d_tile = padded_dim(d)
    # short grids split a pass's reduction into chunks (the two-pass design only): fp32 partial sums
    dq_chunk = 0 if atomic else _split_rows(opts, batch * heads, n_q, n_k, is_causal, d, q.device)
    # (the dK/dV pass counted per query head: a GQA program runs its group's heads one after another)
    kv_chunk = 0 if atomic else _split_rows(opts, batch * heads, n_k, n_q, is_causal, d, q.device)
    dq_chunks, kv_chunks = -(-n_k // dq_chunk) if dq_chunk else 1, -(-n_q // kv_chunk) if kv_chunk else 1
    reshape = max(t.ndim for t in (q, k, v, o, do)) > 4
    buffers = _BackwardBuffers(
        (batch * heads, n_q), (batch * heads, n_q, d_tile) if atomic else None,
        ("dq pass" if fused else "now") if copy_do else None,
        (dq_chunk, n_k, batch, heads, n_q, d_tile) if dq_chunk else None,
        (kv_chunk, n_q, batch, kv_heads, n_k, d_tile) if kv_chunk else None)
    # the rest is decided on buffers allocated as each call allocates them
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    _, _, do_read, do_tiles, dq_out, dk_out, dv_out = buffers(dq, dk, dv, do4 if reshape else do)
    dq4, dk4, dv4, do4, do_tiles, dq_out, dk_out, dv_out = map(
        _as_bhsd, (dq, dk, dv, do_read, do_tiles, dq_out, dk_out, dv_out))
    use_tma = inputs_tma and _tma_ok(do_tiles, dk_out, dv_out, *(() if atomic else (dq_out,)))
    sizes = (heads, heads // kv_heads, n_q, n_k)  # (then the scale, which each call passes)
    common = dict(D=d, D_TILE=d_tile, is_causal=is_causal, SKIP_MASKED_TILES=opts.skip_masked_tiles,
                  USE_TMA=use_tma, PRECISION=_precision(q.dtype), DP_FIRST=opts.dp_first)
    n_prep = -(-n_q // PREP_TILE)
    prep = dq_pass = dq_sum = kv = gluon_kv = cast = None
    kv_sums = ()
    if not fused:
        prep = _PlannedLaunch(_prep_launch, (batch * heads, n_prep, 1), (o4.stride(), do4.stride(), heads, n_q), None,
                              opts, dict(D=d, D_TILE=d_tile, Q_TILE_SIZE=PREP_TILE, ZERO_DQ=atomic), device)
    if not atomic:  # the dQ pass; fused, it writes delta (and the dO copy) that the dK/dV pass reads
        dq_pass = _PlannedLaunch(
            _dq_launch, TilesGrid(batch * heads, n_q, "Q_TILE_SIZE", dq_chunks),
            (q4.stride(), k4.stride(), v4.stride(), do4.stride(), dq_out.stride(), o4.stride(), do_tiles.stride(),
             *sizes), (dq_chunk,), opts,
            dict(**common, FUSED_PREP=fused, COPY_DO=copy_do and fused, SPLIT=bool(dq_chunk)), device)
        if dq_chunk:
            dq_sum = _planned_sum(dq4, dq_chunks, dq_chunk, d, d_tile, is_causal, False, opts, device)
    if gluon_single or (gluon_wanted and not atomic and not kv_chunk and opts.skip_masked_tiles and use_tma
                        and flash_gluon.supported(q4, k4, v4, do_tiles, gluon_config, opts.kv_qrows)):
        gluon_kv = (gluon_config, dict(cached=not launch_hooks_installed(),
                                       qrows=opts.single_qrows if gluon_single else opts.kv_qrows))
    else:
        kv = _PlannedLaunch(
            _kv_launch, TilesGrid(batch * kv_heads, n_k, "K_TILE_SIZE", kv_chunks),
            (q4.stride(), k4.stride(), v4.stride(), do_tiles.stride(), dk_out.stride(), dv_out.stride(), *sizes),
            (kv_chunk,), opts,
            dict(**common, DQ_ATOMIC=atomic, SPLIT=bool(kv_chunk)), device)
    if kv_chunk:
        kv_sums = tuple(_planned_sum(out4, kv_chunks, kv_chunk, d, d_tile, is_causal, True, opts, device)
                        for out4 in (dk4, dv4))
    if atomic:
        cast = _PlannedLaunch(_cast_launch, (batch * heads, n_prep, 1), (dq4.stride(), heads, n_q), (), opts,
                              dict(D=d, D_TILE=d_tile, Q_TILE_SIZE=PREP_TILE), device)
    launches = tuple(launch for launch in (prep, dq_pass, dq_sum, kv, *kv_sums, cast) if launch is not None)
    return _BackwardPlan(buffers, reshape, d ** -0.5, use_tma, atomic, prep, dq_pass, dq_sum, kv, gluon_kv, kv_sums,
                         cast, _SharedScratch(launches))


def flash_backward_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    do: torch.Tensor, is_causal: bool, opts: KernelOptions = DEFAULT_OPTIONS, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (each in its input's dtype) from the saved forward tensors and dO (any strides)."""
    key = _plan_key((q, k, v, o, lse, do), is_causal, opts)
    if _off_current_device(q, key):
        with torch.cuda.device(q.device):
            return flash_backward_triton(q, k, v, o, lse, do, is_causal, opts, scale)
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        plan = _BACKWARD_PLANS[key] = _plan_backward(q, k, v, o, do, is_causal, opts, key[-1])
    scale = plan.default_scale if scale is None else float(scale)
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    if plan.reshape:
        q, k, v, o, do = _as_bhsd(q), _as_bhsd(k), _as_bhsd(v), _as_bhsd(o), _as_bhsd(do)
    delta, dq_acc, do, do_tiles, dq_out, dk_out, dv_out = plan.buffers(dq, dk, dv, do)
    if plan.use_tma:  # launches through Triton take TMA scratch from its allocator, a context variable: set per thread
        triton.set_allocator(scratch)
    buffer = plan.scratch()
    if plan.prep:
        plan.prep(buffer, o, do, delta, dq_acc)
    if plan.dq:
        plan.dq(buffer, q, k, v, do, lse, delta, dq_out, o, do_tiles, scale=scale)
        if plan.dq_sum:
            plan.dq_sum(buffer, dq_out, dq)
    if plan.kv:
        plan.kv(buffer, q, k, v, do_tiles, lse, delta, dk_out, dv_out, dq_acc, scale=scale)
    else:
        config, keywords = plan.gluon_kv
        flash_gluon.kv_pass(_as_bhsd(q), _as_bhsd(k), _as_bhsd(v), _as_bhsd(do_tiles), lse, delta, _as_bhsd(dk),
                            _as_bhsd(dv), is_causal, scale, config, dq_acc=dq_acc if plan.atomic else None, **keywords)
    if plan.kv_sums:
        dk_sum, dv_sum = plan.kv_sums
        dk_sum(buffer, dk_out, dk)
        dv_sum(buffer, dv_out, dv)
    if plan.cast:
        plan.cast(buffer, dq_acc, dq, scale=scale)
    return dq, dk, dv


def _repeat_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    return t if group == 1 else t.repeat_interleave(group, dim=-3)


def attention_forward(q, k, v, is_causal: bool, scale: float, opts: KernelOptions = DEFAULT_OPTIONS):
    """(O, L): the Triton kernels, or on a CPU without the interpreter the tiled PyTorch forward."""
    if q.device.type == "cuda" or INTERPRET:
        return flash_forward_triton(q, k, v, is_causal, opts, scale)
    group = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    return flash_forward_tiled(q, _repeat_kv(k, group), _repeat_kv(v, group), is_causal, scale=scale)


def attention_backward(do, q, k, v, o, lse, is_causal: bool, scale: float, opts: KernelOptions = DEFAULT_OPTIONS):
    """(dQ, dK, dV): the Triton kernels, or the compiled PyTorch backward (CPU without the interpreter,
    or the ablation variant that keeps it)."""
    if opts.triton_backward and (q.device.type == "cuda" or INTERPRET):
        return flash_backward_triton(q, k, v, o, lse, do, is_causal, opts, scale)
    group = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    dq, dk, dv = flash_backward_compiled(q, _repeat_kv(k, group), _repeat_kv(v, group), o, do, lse, is_causal, scale)
    if group > 1:
        dk = dk.unflatten(-3, (k.shape[-3], group)).sum(-3)
        dv = dv.unflatten(-3, (v.shape[-3], group)).sum(-3)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# 4. Ops, autograd.Function, functional API
# ----------------------------------------------------------------------------------------------

# Two ops, `cs336::flash_attn_fwd` and `cs336::flash_attn_bwd`, are what compiled graphs call (no graph break;
# CUDA graphs capture them). They are `triton_op`s: torch.compile traces their bodies, and where a call runs
# the Triton kernels alone, unsplit (a CUDA GPU, static sizes, less than GLUON_MIN_WORK: the short calls, which
# are bound by host time), Inductor launches the flat entry kernels itself (`wrap_triton`), with no Python of
# ours in the compiled call. Every other call (the Gluon kernels, split passes, the atomic design, symbolic
# sizes, the CPU) goes to an opaque custom op (`..._launch`) running the launchers above; so does an eager call
# of the ops.


def _plain(t: torch.Tensor) -> bool:
    """Whether an op body runs eagerly on real tensors (not fake or functional ones, as when traced)."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def _tma_ok_traced(*tensors: torch.Tensor) -> bool:
    """`_tma_ok` from metadata (tensors being traced have no data): Inductor aligns what it allocates and
    copies an input whose storage is misaligned, so the storage offset stands for the pointer."""
    return all(t.storage_offset() * t.element_size() % 16 == 0 and _tma_strides_ok(t) for t in tensors)


def _inlined(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> bool:
    """Whether a traced call runs the flat entry kernels, launched by Inductor: CUDA (no interpreter), static sizes,
    the default options asking for no Gluon kernel (below GLUON_MIN_WORK), and no pass splits. Symbolic sizes
    (torch.compile(dynamic=True)) take the opaque op: tracing the autotuned kernels (their config pruning, the
    grid) specializes every size, one compiled graph per sequence length (H200, session 19)."""
    if q.device.type != "cuda" or INTERPRET:
        return False
    if any(isinstance(n, torch.SymInt) for n in (*q.shape, *k.shape)):
        return False
    q4, k4 = _as_bhsd(q), _as_bhsd(k)
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    work = batch * heads * n_q * n_k
    opts = DEFAULT_OPTIONS
    if _gluon_choice(opts, opts.gluon_fwd, "fwd", work)[0] or _gluon_choice(opts, opts.gluon_kv, "kv", work)[0]:
        return False
    return not (_split_rows(opts, batch * heads, n_q, n_k, is_causal, d, q.device)
                or _split_rows(opts, batch * heads, n_k, n_q, is_causal, d, q.device))


def _flat(kernel):
    """A flat entry kernel as an op body launches it: through `wrap_triton` (traced by Inductor; called straight
    through otherwise), or directly under the interpreter, whose kernels `wrap_triton` does not take."""
    return kernel if INTERPRET else torch.library.wrap_triton(kernel)


def _strides(*tensors: torch.Tensor) -> tuple:
    return tuple(s for t in tensors for s in t.stride())


def forward_inlined(q, k, v, is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) by the flat forward kernel, as `flash_forward_triton` computes them for an `_inlined` call."""
    q4, k4, v4 = _as_bhsd(q), _as_bhsd(k), _as_bhsd(v)
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    o = _empty_like(q)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    o4 = _as_bhsd(o)
    use_tma = _tma_wanted(DEFAULT_OPTIONS) and _tma_ok_traced(q4, k4, v4, o4)
    if use_tma:  # for launches outside Inductor's (an eager call, aot_eager); Inductor sets its own
        triton.set_allocator(scratch)
    _flat(flash_fwd_flat_autotuned)[TilesGrid(batch * heads, n_q, "Q_TILE_SIZE")](
        q4, k4, v4, o4, lse, *_strides(q4, k4, v4, o4), heads, heads // kv_heads, n_q, n_k, scale,
        D=d, D_TILE=padded_dim(d), is_causal=is_causal, SKIP_MASKED_TILES=True, USE_TMA=use_tma,
        PRECISION=_precision(q.dtype))
    return o, lse


def backward_inlined(do, q, k, v, o, lse, is_causal: bool, scale: float):
    """(dQ, dK, dV) by the two-pass design's flat kernels (the dQ pass with the pre-pass fused, then the dK/dV
    pass), as `flash_backward_triton` computes them for an `_inlined` call."""
    q4, k4, v4, o4, do4 = _as_bhsd(q), _as_bhsd(k), _as_bhsd(v), _as_bhsd(o), _as_bhsd(do)
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    inputs_tma = _tma_wanted(DEFAULT_OPTIONS) and _tma_ok_traced(q4, k4, v4)
    copy_do = inputs_tma and not _tma_ok_traced(do4)  # (o.sum()'s expanded dO: see `_plan_backward`)
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    dq4, dk4, dv4 = _as_bhsd(dq), _as_bhsd(dk), _as_bhsd(dv)
    delta = q.new_empty((batch * heads, n_q), dtype=torch.float32)
    do_tiles = _as_bhsd(_empty_like(do4)) if copy_do else do4
    use_tma = inputs_tma and _tma_ok_traced(do_tiles, dq4, dk4, dv4)
    if use_tma:
        triton.set_allocator(scratch)
    sizes = (heads, heads // kv_heads, n_q, n_k, scale)
    common = dict(D=d, D_TILE=padded_dim(d), is_causal=is_causal, SKIP_MASKED_TILES=True, USE_TMA=use_tma,
                  PRECISION=_precision(q.dtype), DP_FIRST=True)
    _flat(flash_bwd_dq_flat_autotuned)[TilesGrid(batch * heads, n_q, "Q_TILE_SIZE")](
        q4, k4, v4, do4, lse, delta, dq4, o4, do_tiles, *_strides(q4, k4, v4, do4, dq4, o4, do_tiles), *sizes,
        **common, COPY_DO=copy_do)
    _flat(flash_bwd_kv_flat_autotuned)[TilesGrid(batch * kv_heads, n_k, "K_TILE_SIZE")](
        q4, k4, v4, do_tiles, lse, delta, dk4, dv4, *_strides(q4, k4, v4, do_tiles, dk4, dv4), *sizes, **common)
    return dq, dk, dv


@torch.library.custom_op("cs336::flash_attn_fwd_launch", mutates_args=(), device_types=None)
def flash_attn_fwd_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_attn_fwd` by the launchers, opaque to torch.compile."""
    return attention_forward(q, k, v, is_causal, scale)


@flash_attn_fwd_launch.register_fake
def _(q, k, v, is_causal, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("cs336::flash_attn_bwd_launch", mutates_args=(), device_types=None)
def flash_attn_bwd_launch(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                          lse: torch.Tensor, is_causal: bool, scale: float,
                          deterministic: bool | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`flash_attn_bwd` by the launchers, opaque to torch.compile."""
    return attention_backward(do, q, k, v, o, lse, is_causal, scale, _OPTIONS[deterministic])


@flash_attn_bwd_launch.register_fake
def _(do, q, k, v, o, lse, is_causal, scale, deterministic):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


@torch.library.triton_op("cs336::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) of checked inputs: q (..., H, Nq, D), k and v (..., Hkv, Nk, D), Hkv dividing H."""
    if _plain(q):
        return attention_forward(q, k, v, is_causal, scale)
    if _inlined(q, k, is_causal):
        return forward_inlined(q, k, v, is_causal, scale)
    return flash_attn_fwd_launch(q, k, v, is_causal, scale)


@torch.library.triton_op("cs336::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, is_causal: bool, scale: float,
                   deterministic: bool | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV); `deterministic` as KernelOptions.deterministic (None: the faster design)."""
    if _plain(q):
        return attention_backward(do, q, k, v, o, lse, is_causal, scale, _OPTIONS[deterministic])
    if deterministic is not False and _inlined(q, k, is_causal):
        return backward_inlined(do, q, k, v, o, lse, is_causal, scale)
    return flash_attn_bwd_launch(do, q, k, v, o, lse, is_causal, scale, deterministic)


def _op_setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal, ctx.scale = is_causal, scale


def _op_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = flash_attn_bwd(do, q, k, v, o, lse, ctx.is_causal, ctx.scale, _deterministic(None))
    return dq, dk, dv, None, None


flash_attn_fwd.register_autograd(_op_backward, setup_context=_op_setup_context)

_launch_eagerly_forward = torch.compiler.disable(attention_forward)
_launch_eagerly_backward = torch.compiler.disable(attention_backward)


_OPTIONS = {None: DEFAULT_OPTIONS, True: DETERMINISTIC_OPTIONS, False: ATOMIC_OPTIONS}


def _deterministic(flag: object) -> bool | None:
    """The backward's `deterministic` (KernelOptions.deterministic): a bool as given; None follows
    `torch.are_deterministic_algorithms_enabled()` (True when it is on, else None: the faster design)."""
    if flag is None:
        return True if torch.are_deterministic_algorithms_enabled() else None
    return check_flag("deterministic", flag)


def _forward(ctx, Q, K, V, is_causal, scale, enable_gqa, deterministic, opts: KernelOptions):
    is_causal = check_attention_inputs(Q, K, V, is_causal, enable_gqa)
    scale = check_scale(scale, Q.shape[-1])
    deterministic = _deterministic(deterministic)
    _check_head_dim(Q.shape[-1])
    if opts is not DEFAULT_OPTIONS:  # ablation variants: the launchers run eagerly (a graph break)
        O, L = _launch_eagerly_forward(Q, K, V, is_causal, scale, opts)
    elif torch.compiler.is_compiling():
        O, L = flash_attn_fwd(Q, K, V, is_causal, scale)
    else:
        O, L = attention_forward(Q, K, V, is_causal, scale)
    ctx.save_for_backward(L, Q, K, V, O)
    ctx.is_causal, ctx.scale, ctx.deterministic, ctx.opts = is_causal, scale, deterministic, opts
    return O


def _backward(ctx, dO):
    refuse_double_backward("FlashAttention2Triton")
    L, Q, K, V, O = ctx.saved_tensors
    if ctx.opts is not DEFAULT_OPTIONS:
        dQ, dK, dV = _launch_eagerly_backward(dO, Q, K, V, O, L, ctx.is_causal, ctx.scale, ctx.opts)
    elif torch.compiler.is_compiling():
        dQ, dK, dV = flash_attn_bwd(dO, Q, K, V, O, L, ctx.is_causal, ctx.scale, ctx.deterministic)
    else:
        dQ, dK, dV = attention_backward(dO, Q, K, V, O, L, ctx.is_causal, ctx.scale, _OPTIONS[ctx.deterministic])
    return dQ, dK, dV, None, None, None, None


class FlashAttention2Triton(torch.autograd.Function):
    """FlashAttention-2: Triton forward and backward (TMA, causal tile skipping, autotuned tiles).

    `FlashAttention2Triton.apply(Q, K, V, is_causal, scale=None, enable_gqa=False, deterministic=None)`
    (autograd.Function.apply takes positional arguments only) with Q (..., H, Nq, D), K and V
    (..., Hkv, Nk, D). Saves exactly one (..., H, Nq) logsumexp beside Q, K, V and O. The backward is
    not differentiable again (double backward raises).
    """

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False, scale=None, enable_gqa=False, deterministic=None):
        return _forward(ctx, Q, K, V, is_causal, scale, enable_gqa, deterministic, DEFAULT_OPTIONS)

    @staticmethod
    def backward(ctx, dO):
        return _backward(ctx, dO)


def autograd_function(name: str, opts: KernelOptions) -> type[torch.autograd.Function]:
    """An autograd.Function like FlashAttention2Triton that runs the kernels with `opts` (eagerly)."""

    def forward(ctx, Q, K, V, is_causal=False, scale=None, enable_gqa=False, deterministic=None):
        return _forward(ctx, Q, K, V, is_causal, scale, enable_gqa, deterministic, opts)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(_backward),
        "__doc__": f"FlashAttention-2 (Triton) with {opts}",
    })


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, scale: float | None = None,
    enable_gqa: bool = False, deterministic: bool | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ · scale [causal]) v, like `F.scaled_dot_product_attention` without a mask or dropout.

    q (..., H, Nq, D), k and v (..., Hkv, Nk, D); Hkv = H unless `enable_gqa` (then Hkv divides H and
    each K/V head serves H / Hkv query heads). `scale` defaults to 1/sqrt(D). Causal masking is
    top-left aligned as in SDPA: query i sees key j iff i >= j, also when Nq != Nk. Head dims up to
    256; fp32 inputs follow `torch.get_float32_matmul_precision()` ("highest": IEEE fp32 dots, else
    TF32). `deterministic`: True runs the two-pass backward (bitwise repeatable), False the single pass
    (dQ added in fp32 by TMA reductions or atomics), None (default) follows
    `torch.are_deterministic_algorithms_enabled()`: the two-pass backward when it is on, else the faster
    of the two for the call (the single pass for large d-64 and d-128 calls on sm_90,
    `KernelOptions.deterministic`).
    """
    return FlashAttention2Triton.apply(q, k, v, is_causal, scale, enable_gqa, deterministic)


__all__ = [
    "AUTOTUNED_KERNELS", "KERNELS", "FlashAttention2Triton", "KernelOptions", "KernelSpec",
    "attention_backward", "attention_forward", "autograd_function", "flash_attention", "flash_attn_bwd",
    "flash_attn_fwd", "flash_backward_triton", "flash_forward_triton", "launch_cache_sizes",
    "launch_hooks_installed", "make_configs", "split_rows",
]
