"""FlashAttention-2 device code in Triton: tile helpers, the inner loops and the kernels (no host code).

One program per (batch·head, tile):
  `flash_fwd_kernel`          O and the logsumexp L;
  `flash_bwd_prep_kernel`     delta = rowsum(dO·O) and the zeroed fp32 dQ accumulator (the single pass);
  `flash_bwd_kv_kernel`       per key tile: dK, dV over every query tile (and every query head of a GQA
                              group) that sees it; with DQ_ATOMIC also dQ, added in fp32 by atomics;
  `flash_bwd_dq_kernel`       the two-pass design's dQ pass, run first: dQ per query tile, delta (and a
                              contiguous copy of an expanded dO) for the dK/dV pass;
  `flash_bwd_dq_cast_kernel`  the single pass's fp32 dQ -> dQ·scale in the input dtype;
  `flash_fwd_combine_kernel`, `flash_split_sum_kernel`
                              merge the chunks of a pass split along its reduction (short grids);
  `flash_*_flat_kernel`       entry points Inductor launches itself (strides as separate integers).

The inner loops run first over the tiles that need no mask, then over the tiles on the causal
diagonal (and a ragged last tile) with MASKED=True. With HAS_WINDOW (a sliding window: query i sees keys
[i - WINDOW_LEFT, i + WINDOW_RIGHT], causal folded into WINDOW_RIGHT by the host) they run over the tiles that
intersect the band only: masked where its edges cut a tile, unmasked inside it; a row that sees no key gets
O = 0 and L = -inf. Causal grids run the longest tiles first.
With IS_VARLEN (packed sequences, the forward and the two-pass backward's passes) a program's batch index is a
sequence of a packed batch: its rows, [cu_seqlens[b], cu_seqlens[b + 1]) of the (total, heads, D) inputs, and
its length come from the cu_seqlens arrays (`_varlen_sequence`); tiles past its length return at once.
Scores are kept in base 2 (`qk_scale = scale·log2 e`, exp2) and converted back for L, which is in
natural log as the handout defines it. Causally hidden scores are excluded exactly (-inf before the
softmax, 0 after). Head dims that are not a power of two are padded inside the kernel (zero-filled
loads), never copied. Grouped-query attention indexes the K/V head in the kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRET = triton.knobs.runtime.interpret  # TRITON_INTERPRET as Triton itself reads it (1/true/on/yes)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
EMPTY_ROW_MAX = tl.constexpr(-1e30)  # running max of a row that has seen no key yet (finite: exp2 of it minus -inf is 0)

if INTERPRET:
    from cs336_systems.flash import interpreter_fixes

    interpreter_fixes.apply()

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
    """Pointers to rows offs_n, columns offs_d of one (batch, head) of a (B, H, N, D) tensor. Row offsets in int64:
    a (B, S, H, D) view's rows are H·D apart, and (N - 1)·H·D passes 2^31 in one (batch, head) of a long call."""
    return (ptr + batch * strides[0] + head * strides[1]
            + offs_n[:, None].to(tl.int64) * strides[2] + offs_d[None, :] * strides[3])


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
    acc, m_i, l_i, q, k_src, v_src, offs_q, start, stop, N_KEYS, qk_scale, WINDOW_LEFT, WINDOW_RIGHT,
    K_TILE_SIZE: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr,
    CHECK_K: tl.constexpr, CHECK_D: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
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
            if HAS_WINDOW:
                keep = keep & _in_band(offs_q[:, None], offs_k[None, :], WINDOW_LEFT, WINDOW_RIGHT)
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if HAS_WINDOW:  # a band's first tile may show a row nothing, and its later scores may lie far below 0
                m_new = tl.where(m_new == float("-inf"), EMPTY_ROW_MAX, m_new)
            else:
                m_new = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row with nothing visible yet
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
    dk, dv, k, v, q_src, do_src, dq_dst, L_ptr, Delta_ptr, offs_k, start, stop, N_QUERIES, N_KEYS, qk_scale,
    WINDOW_LEFT, WINDOW_RIGHT,
    Q_TILE_SIZE: tl.constexpr, D_TILE: tl.constexpr, MASKED: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    CHECK_Q: tl.constexpr, CHECK_D: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    DP_FIRST: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """dK, dV of one key tile over query tiles [start, stop), in transposed form (keys on rows).

    Query rows past N_QUERIES load as zeros (q, dO, L, delta), so they add nothing to dK, dV.
    With DQ_ATOMIC, dQ += dS·K of each tile pair is added to the fp32 accumulator `dq_dst`
    (a TMA descriptor, or a pointer to the (N_QUERIES, D) rows with row stride D). MASKED tiles are cut by the
    causal diagonal, or with HAS_WINDOW by the band (keys past N_KEYS masked too: a row that sees no key has
    L = -inf, which would make their P infinite).
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
            if HAS_WINDOW:
                keep = _in_band(offs_q[None, :], offs_k[:, None], WINDOW_LEFT, WINDOW_RIGHT)
                pT = tl.where(keep & (offs_k[:, None] < N_KEYS), pT, 0.0)
            else:
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
    dq, q, do, lse, delta, k_src, v_src, offs_q, start, stop, N_KEYS, qk_scale, WINDOW_LEFT, WINDOW_RIGHT,
    K_TILE_SIZE: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr,
    CHECK_K: tl.constexpr, CHECK_D: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    DP_FIRST: tl.constexpr, HAS_WINDOW: tl.constexpr,
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
            if HAS_WINDOW:
                keep = keep & _in_band(offs_q[:, None], offs_k[None, :], WINDOW_LEFT, WINDOW_RIGHT)
            p = tl.where(keep, p, 0.0)
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _in_band(offs_q, offs_k, WINDOW_LEFT, WINDOW_RIGHT):
    """Whether query offs_q sees key offs_k under the window (broadcast shapes)."""
    return (offs_k >= offs_q - WINDOW_LEFT) & (offs_k <= offs_q + WINDOW_RIGHT)


@triton.jit
def _band_ranges(row_start, N_ROWS, N_COLS, BEFORE, AFTER, ROW_TILE: tl.constexpr, COL_TILE: tl.constexpr,
                 WHOLE_COLS: tl.constexpr):
    """Column ranges for the row tile at row_start when row r sees columns [r - BEFORE, r + AFTER]:
    (start, full_start, full_stop, stop), where [start, full_start) and [full_stop, stop) are the tiles the band's
    edges cut (masked) and [full_start, full_stop) the tiles inside it for every real row; column tiles outside
    [start, stop) hold nothing any row sees and are never visited. WHOLE_COLS: a full tile must not be ragged
    (the forward and dQ pass mask keys past N_COLS; the dK/dV pass reads queries past N_ROWS as zeros)."""
    last = tl.minimum(row_start + ROW_TILE, N_ROWS) - 1
    stop = tl.minimum(last + AFTER + 1, N_COLS)
    first = tl.maximum(row_start - BEFORE, 0)
    start = tl.where(first < stop, (first // COL_TILE) * COL_TILE, stop)  # (a tile of padding alone: none)
    full_start = tl.minimum(tl.cdiv(tl.maximum(last - BEFORE, 0), COL_TILE) * COL_TILE, stop)
    full_stop = ((row_start + AFTER + 1) // COL_TILE) * COL_TILE
    if WHOLE_COLS:
        full_stop = tl.minimum(full_stop, (N_COLS // COL_TILE) * COL_TILE)
    full_stop = tl.maximum(tl.minimum(full_stop, stop), full_start)
    return start, full_start, full_stop, stop


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
def _varlen_sequence(CU_SEQLENS_Q, CU_SEQLENS_K, seq):
    """Sequence `seq` of a packed batch: (its first query row, its queries, its first key row, its keys)."""
    q_first = tl.load(CU_SEQLENS_Q + seq)
    k_first = tl.load(CU_SEQLENS_K + seq)
    n_q = tl.load(CU_SEQLENS_Q + seq + 1) - q_first
    n_k = tl.load(CU_SEQLENS_K + seq + 1) - k_first
    return q_first.to(tl.int64), n_q, k_first.to(tl.int64), n_k


@triton.jit
def _lse_row(batch_head, head, n_rows, total_rows, first_row, IS_VARLEN: tl.constexpr):
    """Where a program's rows start in L (and delta): (batch·heads, n_rows) contiguous, or with IS_VARLEN
    (heads, total_rows) with the sequence's rows from first_row."""
    if IS_VARLEN:
        return head * total_rows + first_row
    else:
        return batch_head.to(tl.int64) * n_rows


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


@triton.jit
def flash_fwd_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, L_ptr,
    stride_q, stride_k, stride_v, stride_o,  # (batch, head, seq, d) strides of each tensor
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, CHUNK, WINDOW_LEFT, WINDOW_RIGHT,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT: tl.constexpr, CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr, CHECK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr = False, CU_SEQLENS_Q=None, CU_SEQLENS_K=None,
):
    """Grid (batch·heads, query tiles[, key chunks]). L is contiguous (batch·heads, N_QUERIES), natural log.

    With SPLIT, program (·, ·, c) sees only keys [c·CHUNK, (c+1)·CHUNK) and writes its normalized O
    (fp32) and L into chunk c of (chunks, batch·heads, N_QUERIES, D_TILE) and (chunks, batch·heads,
    N_QUERIES) buffers (L = -inf and O = 0 where it sees no key); `flash_fwd_combine_kernel` merges them.

    With IS_VARLEN (not with SPLIT) batch b is sequence b of packed inputs: the strides' batch entries are 0, N_QUERIES
    and N_KEYS are the total rows, L is (heads, total queries), and a sequence without keys gets O = 0, L = -inf.
    """
    O_ptr += _chunk_offset(N_QUERIES, D_TILE, SPLIT)
    L_ptr += _chunk_offset(N_QUERIES, 1, SPLIT)
    batch_head, batch, head, kv_head, q_start = _query_program(N_HEADS, KV_GROUP, Q_TILE_SIZE,
                                                               is_causal and SKIP_MASKED_TILES)
    q_first, total_q = 0, 0
    if IS_VARLEN:
        tl.static_assert(not SPLIT, "packed sequences are not split")
        total_q = N_QUERIES
        q_first, N_QUERIES, k_first, N_KEYS = _varlen_sequence(CU_SEQLENS_Q, CU_SEQLENS_K, batch)
        if q_start >= N_QUERIES:
            return
        Q_ptr += q_first * stride_q[2]
        O_ptr += q_first * stride_o[2]
        K_ptr += k_first * stride_k[2]
        V_ptr += k_first * stride_v[2]
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    q, k_src, v_src = _query_tile_sources(Q_ptr, K_ptr, V_ptr, stride_q, stride_k, stride_v, batch, head, kv_head,
                                          q_start, N_QUERIES, N_KEYS, D, D_TILE, Q_TILE_SIZE, K_TILE_SIZE, CHECK_Q,
                                          CHECK_D, USE_TMA)
    o_dst = _tile_src(O_ptr, stride_o, batch, head, N_QUERIES, D, Q_TILE_SIZE, D_TILE, USE_TMA)
    m_i = tl.full((Q_TILE_SIZE,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((Q_TILE_SIZE,), dtype=tl.float32)
    acc = tl.zeros((Q_TILE_SIZE, D_TILE), dtype=tl.float32)
    qk_scale = scale * LOG2E

    if HAS_WINDOW:
        band_start, full_start, full_stop, stop = _band_ranges(q_start, N_QUERIES, N_KEYS, WINDOW_LEFT,
                                                               WINDOW_RIGHT, Q_TILE_SIZE, K_TILE_SIZE, True)
        start, end = _in_chunk(band_start, full_start, CHUNK, SPLIT)
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_src, v_src, offs_q, start, end, N_KEYS, qk_scale,
                                   WINDOW_LEFT, WINDOW_RIGHT, K_TILE_SIZE, True, is_causal, CHECK_K, CHECK_D,
                                   USE_TMA, PRECISION, True)
        start, end = _in_chunk(full_start, full_stop, CHUNK, SPLIT)
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_src, v_src, offs_q, start, end, N_KEYS, qk_scale,
                                   WINDOW_LEFT, WINDOW_RIGHT, K_TILE_SIZE, False, is_causal, CHECK_K, CHECK_D,
                                   USE_TMA, PRECISION, True)
    else:
        full_stop, stop = _key_ranges(q_start, N_KEYS, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES)
        start, end = _in_chunk(0, full_stop, CHUNK, SPLIT)
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_src, v_src, offs_q, start, end, N_KEYS, qk_scale,
                                   WINDOW_LEFT, WINDOW_RIGHT, K_TILE_SIZE, False, is_causal, CHECK_K, CHECK_D,
                                   USE_TMA, PRECISION, False)
    start, end = _in_chunk(full_stop, stop, CHUNK, SPLIT)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_src, v_src, offs_q, start, end, N_KEYS, qk_scale,
                               WINDOW_LEFT, WINDOW_RIGHT, K_TILE_SIZE, True, is_causal, CHECK_K, CHECK_D, USE_TMA,
                               PRECISION, HAS_WINDOW)

    if HAS_WINDOW or IS_VARLEN:  # a row whose window (or sequence) holds no key: L = -inf (and O = 0 below)
        m_i = tl.where(l_i > 0, m_i, float("-inf"))
    if SPLIT or HAS_WINDOW or IS_VARLEN:  # a chunk past the causal diagonal sees no key: O = 0, L = -inf from m_i
        l_i = tl.where(l_i > 0, l_i, 1.0)
    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2
    _store_tile(o_dst, q_start, acc, CHECK_Q, CHECK_D, USE_TMA)
    l_ptrs = L_ptr + _lse_row(batch_head, head, N_QUERIES, total_q, q_first, IS_VARLEN) + offs_q
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
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, CHUNK, WINDOW_LEFT, WINDOW_RIGHT,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    DQ_ATOMIC: tl.constexpr, DP_FIRST: tl.constexpr, SPLIT: tl.constexpr,
    CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr, CHECK_D: tl.constexpr, HAS_WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr = False, CU_SEQLENS_Q=None, CU_SEQLENS_K=None,
):
    """Grid (batch·kv_heads, key tiles[, query chunks]); key tile 0 (the longest under causal masking) first.

    L (natural log) and delta are contiguous (batch·heads, N_QUERIES). dQacc is fp32
    (batch·heads, N_QUERIES, D_TILE), used only with DQ_ATOMIC. With SPLIT, program (·, ·, c) sees only
    queries [c·CHUNK, (c+1)·CHUNK) and writes its dK, dV into chunk c of fp32 (chunks, batch·kv_heads,
    N_KEYS, D_TILE) buffers, summed by `flash_split_sum_kernel`. With IS_VARLEN (packed sequences, as in
    `flash_fwd_kernel`; neither DQ_ATOMIC nor SPLIT) L and delta are (heads, total queries).
    """
    dK_ptr += _chunk_offset(N_KEYS, D_TILE, SPLIT)
    dV_ptr += _chunk_offset(N_KEYS, D_TILE, SPLIT)
    batch_kv_head = tl.program_id(0)
    n_kv_heads = N_HEADS // KV_GROUP
    batch = (batch_kv_head // n_kv_heads).to(tl.int64)
    kv_head = (batch_kv_head % n_kv_heads).to(tl.int64)
    k_start = tl.program_id(1) * K_TILE_SIZE
    q_first, total_q = 0, 0
    if IS_VARLEN:
        tl.static_assert(not (SPLIT or DQ_ATOMIC), "packed sequences run the unsplit two-pass backward")
        total_q = N_QUERIES
        q_first, N_QUERIES, k_first, N_KEYS = _varlen_sequence(CU_SEQLENS_Q, CU_SEQLENS_K, batch)
        if k_start >= N_KEYS:
            return
        Q_ptr += q_first * stride_q[2]
        dO_ptr += q_first * stride_do[2]
        K_ptr += k_first * stride_k[2]
        V_ptr += k_first * stride_v[2]
        dK_ptr += k_first * stride_dk[2]
        dV_ptr += k_first * stride_dv[2]

    k_src, v_src = _kv_sources(K_ptr, V_ptr, batch, kv_head, stride_k, stride_v, N_KEYS,
                               D, K_TILE_SIZE, D_TILE, USE_TMA)
    k = _load_tile(k_src, k_start, CHECK_K, CHECK_D, USE_TMA)
    v = _load_tile(v_src, k_start, CHECK_K, CHECK_D, USE_TMA)
    offs_k = k_start + tl.arange(0, K_TILE_SIZE)
    dk = tl.zeros((K_TILE_SIZE, D_TILE), dtype=tl.float32)
    dv = tl.zeros((K_TILE_SIZE, D_TILE), dtype=tl.float32)
    qk_scale = scale * LOG2E
    if HAS_WINDOW:  # key j is seen by queries [j - WINDOW_RIGHT, j + WINDOW_LEFT]
        start, full_start, full_stop, stop = _band_ranges(k_start, N_KEYS, N_QUERIES, WINDOW_RIGHT, WINDOW_LEFT,
                                                          K_TILE_SIZE, Q_TILE_SIZE, False)
    else:  # the tiles the diagonal cuts, then the whole ones
        start, full_start = _query_ranges(k_start, N_QUERIES, Q_TILE_SIZE, K_TILE_SIZE, is_causal,
                                          SKIP_MASKED_TILES)
        full_stop = N_QUERIES

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
        row = _lse_row(batch_head, head, N_QUERIES, total_q, q_first, IS_VARLEN)
        row_L = L_ptr + row
        row_delta = Delta_ptr + row
        lo, hi = _in_chunk(start, full_start, CHUNK, SPLIT)
        dk, dv = _bwd_kv_tiles(dk, dv, k, v, q_src, do_src, dq_dst, row_L, row_delta, offs_k,
                               lo, hi, N_QUERIES, N_KEYS, qk_scale, WINDOW_LEFT, WINDOW_RIGHT, Q_TILE_SIZE, D_TILE,
                               True, DQ_ATOMIC, CHECK_Q, CHECK_D, USE_TMA, PRECISION, DP_FIRST, HAS_WINDOW)
        lo, hi = _in_chunk(full_start, full_stop, CHUNK, SPLIT)
        dk, dv = _bwd_kv_tiles(dk, dv, k, v, q_src, do_src, dq_dst, row_L, row_delta, offs_k,
                               lo, hi, N_QUERIES, N_KEYS, qk_scale, WINDOW_LEFT, WINDOW_RIGHT, Q_TILE_SIZE, D_TILE,
                               False, DQ_ATOMIC, CHECK_Q, CHECK_D, USE_TMA, PRECISION, DP_FIRST, HAS_WINDOW)
        if HAS_WINDOW:
            lo, hi = _in_chunk(full_stop, stop, CHUNK, SPLIT)
            dk, dv = _bwd_kv_tiles(dk, dv, k, v, q_src, do_src, dq_dst, row_L, row_delta, offs_k,
                                   lo, hi, N_QUERIES, N_KEYS, qk_scale, WINDOW_LEFT, WINDOW_RIGHT, Q_TILE_SIZE,
                                   D_TILE, True, DQ_ATOMIC, CHECK_Q, CHECK_D, USE_TMA, PRECISION, DP_FIRST, True)

    dk_dst = _tile_src(dK_ptr, stride_dk, batch, kv_head, N_KEYS, D, K_TILE_SIZE, D_TILE, USE_TMA)
    dv_dst = _tile_src(dV_ptr, stride_dv, batch, kv_head, N_KEYS, D, K_TILE_SIZE, D_TILE, USE_TMA)
    _store_tile(dk_dst, k_start, dk * scale, CHECK_K, CHECK_D, USE_TMA)
    _store_tile(dv_dst, k_start, dv, CHECK_K, CHECK_D, USE_TMA)


@triton.jit
def flash_bwd_dq_kernel(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_ptr, O_ptr, dOcopy_ptr,
    stride_q, stride_k, stride_v, stride_do, stride_dq, stride_o, stride_docopy,  # (batch, head, seq, d)
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, CHUNK, WINDOW_LEFT, WINDOW_RIGHT,
    D: tl.constexpr, D_TILE: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    DP_FIRST: tl.constexpr, FUSED_PREP: tl.constexpr, COPY_DO: tl.constexpr, SPLIT: tl.constexpr,
    CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr, CHECK_D: tl.constexpr, HAS_WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr = False, CU_SEQLENS_Q=None, CU_SEQLENS_K=None,
):
    """Grid (batch·heads, query tiles), longest first: dQ from every key tile a query tile sees.

    With FUSED_PREP the pass runs before the dK/dV pass and does the pre-pass's work for its query
    tile: dO (any strides, stride 0 included) and O through pointer loads, delta = rowsum(dO·O) stored
    for the dK/dV pass, and with COPY_DO the dO tile stored into the contiguous dOcopy for its TMA loads.
    With SPLIT, program (·, ·, c) sees only keys [c·CHUNK, (c+1)·CHUNK) and writes its dQ into chunk c of
    an fp32 (chunks, batch·heads, N_QUERIES, D_TILE) buffer, summed by `flash_split_sum_kernel`; chunk 0
    stores delta and the dO copy. With IS_VARLEN (packed sequences, as in `flash_fwd_kernel`; FUSED_PREP, neither
    COPY_DO nor SPLIT) L and delta are (heads, total queries).
    """
    dQ_ptr += _chunk_offset(N_QUERIES, D_TILE, SPLIT)
    batch_head, batch, head, kv_head, q_start = _query_program(N_HEADS, KV_GROUP, Q_TILE_SIZE,
                                                               is_causal and SKIP_MASKED_TILES)
    q_first, total_q = 0, 0
    if IS_VARLEN:
        tl.static_assert(FUSED_PREP and not (COPY_DO or SPLIT), "packed sequences run the unsplit fused dQ pass")
        total_q = N_QUERIES
        q_first, N_QUERIES, k_first, N_KEYS = _varlen_sequence(CU_SEQLENS_Q, CU_SEQLENS_K, batch)
        if q_start >= N_QUERIES:
            return
        Q_ptr += q_first * stride_q[2]
        dO_ptr += q_first * stride_do[2]
        O_ptr += q_first * stride_o[2]
        dQ_ptr += q_first * stride_dq[2]
        K_ptr += k_first * stride_k[2]
        V_ptr += k_first * stride_v[2]
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    q, k_src, v_src = _query_tile_sources(Q_ptr, K_ptr, V_ptr, stride_q, stride_k, stride_v, batch, head, kv_head,
                                          q_start, N_QUERIES, N_KEYS, D, D_TILE, Q_TILE_SIZE, K_TILE_SIZE, CHECK_Q,
                                          CHECK_D, USE_TMA)
    dq_dst = _tile_src(dQ_ptr, stride_dq, batch, head, N_QUERIES, D, Q_TILE_SIZE, D_TILE, USE_TMA)
    row = _lse_row(batch_head, head, N_QUERIES, total_q, q_first, IS_VARLEN)
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

    if HAS_WINDOW:
        band_start, full_start, full_stop, stop = _band_ranges(q_start, N_QUERIES, N_KEYS, WINDOW_LEFT,
                                                               WINDOW_RIGHT, Q_TILE_SIZE, K_TILE_SIZE, True)
        start, end = _in_chunk(band_start, full_start, CHUNK, SPLIT)
        dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, offs_q, start, end, N_KEYS, qk_scale, WINDOW_LEFT,
                           WINDOW_RIGHT, K_TILE_SIZE, True, is_causal, CHECK_K, CHECK_D, USE_TMA, PRECISION, DP_FIRST,
                           True)
        start, end = _in_chunk(full_start, full_stop, CHUNK, SPLIT)
    else:
        full_stop, stop = _key_ranges(q_start, N_KEYS, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES)
        start, end = _in_chunk(0, full_stop, CHUNK, SPLIT)
    dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, offs_q, start, end, N_KEYS, qk_scale, WINDOW_LEFT,
                       WINDOW_RIGHT, K_TILE_SIZE, False, is_causal, CHECK_K, CHECK_D, USE_TMA, PRECISION, DP_FIRST,
                       HAS_WINDOW)
    start, end = _in_chunk(full_stop, stop, CHUNK, SPLIT)
    dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, offs_q, start, end, N_KEYS, qk_scale, WINDOW_LEFT,
                       WINDOW_RIGHT, K_TILE_SIZE, True, is_causal, CHECK_K, CHECK_D, USE_TMA, PRECISION, DP_FIRST,
                       HAS_WINDOW)
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
                     0, 0, D, D_TILE, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES, USE_TMA, PRECISION,
                     False, CHECK_Q, CHECK_K, CHECK_D, False)


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
                        N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, 0, 0, 0,
                        D, D_TILE, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES, USE_TMA, PRECISION,
                        DP_FIRST, True, COPY_DO, False, CHECK_Q, CHECK_K, CHECK_D, False)


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
                        N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, 0, 0, 0,
                        D, D_TILE, Q_TILE_SIZE, K_TILE_SIZE, is_causal, SKIP_MASKED_TILES, USE_TMA, PRECISION,
                        False, DP_FIRST, False, CHECK_Q, CHECK_K, CHECK_D, False)


