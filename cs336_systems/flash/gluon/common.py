"""Device code shared by the Gluon kernels: the order their programs start in (`grouped_program`); a dK/dV
program's key tile, the query tiles that see it, their loads, L and delta, and its epilogue (the dK/dV passes and
the keys-on-rows single pass); a packed sequence's bounds and masked row stores (the forward and the single pass);
the TMA bulk reduction that adds dQ into its accumulator (the single passes)."""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.language._core import builtin

LOG2E = gl.constexpr(1.4426950408889634)


# integer arguments that vary with the lengths and are not specialized: one compile serves every length
BY_LENGTH = ("HEAD_GROUP", "TAIL")


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[desc at coord] += shared `src` as one asynchronous TMA bulk reduction (cp.reduce.async.bulk),
    completed like a TMA store (`tma.store_wait`). Gluon 3.6 builds the op (its builder's
    `create_async_tma_reduce`, which Triton's own descriptor `atomic_add` lowers to) but exports no wrapper."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def tile_row(t, n_vis, first_head, q_first, N_QUERIES, BLOCK_M: gl.constexpr):
    """First row of query tile t (n_vis tiles per query head of the group) in a dense (B·H·Nq, ·) view: its offset
    in the contiguous (B·H, Nq) L and delta, its row in the (B·H·Nq, D) dQ accumulator."""
    return (first_head + t // n_vis) * N_QUERIES + q_first + (t % n_vis) * BLOCK_M


@gluon.jit
def head_tile(first, g, local, N_HEADS, N_ROWS, D: gl.constexpr, INSIDE: gl.constexpr):
    """(row, column) of row `local` of head first + g (batch·H indices of one batch, H = N_HEADS, N_ROWS rows a
    head) in a dense (B·H·N_ROWS, D) view, or with INSIDE in the (B·N_ROWS, H·D) view of (B, N_ROWS, H, D) memory.
    The divisions are by `first` alone, which a program keeps: out of the loops. (Compile-time flags, not runtime
    strides: runtime values passed to the single pass's loader warp cost its compute warps' loop spills.)"""
    if INSIDE:
        row = first // N_HEADS * N_ROWS + local
        col = (first % N_HEADS + g) * D
    else:
        row = (first + g) * N_ROWS + local
        col = local * 0
    return row, col


@gluon.jit
def kv_tiles_at(first_head, k_start, N_HEADS, KV_GROUP, N_KEYS, D: gl.constexpr, K_INSIDE: gl.constexpr,
                V_INSIDE: gl.constexpr):
    """(row, column) of key tile k_start of query head first_head's kv head in K's view, then in V's (`head_tile`);
    a dK/dV program's dK and dV lie as K and V do. Query heads of one kv head's group are adjacent, so
    first_head // KV_GROUP is its batch·Hkv index."""
    k_row, k_col = head_tile(first_head // KV_GROUP, 0, k_start, N_HEADS // KV_GROUP, N_KEYS, D, K_INSIDE)
    v_row, v_col = head_tile(first_head // KV_GROUP, 0, k_start, N_HEADS // KV_GROUP, N_KEYS, D, V_INSIDE)
    return k_row, k_col, v_row, v_col


@gluon.jit
def issue_tile_loads(q_desc, do_desc, q_smem, do_smem, ready, t, total, n_vis, first_head, q_first, N_QUERIES,
                      N_HEADS, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, Q_INSIDE: gl.constexpr,
                      DO_INSIDE: gl.constexpr):
    """TMA of query tile t (of `total`) into stage t % STAGES, Q and dO each where `head_tile` places it; nothing
    past the last tile."""
    s = t % STAGES
    g = t // n_vis  # (the query head of the group)
    local = q_first + (t % n_vis) * BLOCK_M
    D: gl.constexpr = q_desc.block_type.shape[1]
    q_row, q_col = head_tile(first_head, g, local, N_HEADS, N_QUERIES, D, Q_INSIDE)
    do_row, do_col = head_tile(first_head, g, local, N_HEADS, N_QUERIES, D, DO_INSIDE)
    pred = t < total
    bar = ready.index(s)
    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], bar, q_smem.index(s), pred=pred)
    tma.async_copy_global_to_shared(do_desc, [do_row, do_col], bar, do_smem.index(s), pred=pred)


@gluon.jit
def tile_rows(L_ptr, Delta_ptr, offs_m, t, total, n_vis, first_head, q_first, N_QUERIES, BLOCK_M: gl.constexpr):
    """L (in base 2) and delta of query tile t; zeros past the last tile."""
    row = tile_row(t, n_vis, first_head, q_first, N_QUERIES, BLOCK_M)
    valid = (offs_m * 0 + t) < total
    lse = gl.load(L_ptr + row + offs_m, mask=valid, other=0.0)
    delta = gl.load(Delta_ptr + row + offs_m, mask=valid, other=0.0)
    return lse * LOG2E, delta


@gluon.jit
def grouped_program(HEAD_GROUP, TAIL):
    """(head, tile) of this program in a grid (heads, tiles) that runs a few heads at a time: programs start in the
    order of their linear id (axis 0 fastest), which here takes every tile of HEAD_GROUP heads, tile by tile (tile
    0 of each head of the group, then tile 1, ...), before the next group, and the last TAIL heads as one group
    (HEAD_GROUP divides heads - TAIL). So the resident programs read the rows of a few heads, which the L2 holds,
    instead of all heads'; a large enough last group keeps its longest programs from running alone at the end.
    With HEAD_GROUP = TAIL = heads: tile 0 of every head first."""
    heads = gl.num_programs(0)
    return grouped_item(gl.program_id(0) + gl.program_id(1) * heads, heads, gl.num_programs(1), HEAD_GROUP, TAIL)


@gluon.jit
def grouped_item(lin, heads, tiles, HEAD_GROUP, TAIL):
    """(head, tile) of work item `lin` of heads × tiles in `grouped_program`'s order (a persistent program's items
    take the order the programs of a grid start in)."""
    if lin < (heads - TAIL) * tiles:
        first = lin // (HEAD_GROUP * tiles) * HEAD_GROUP
        size = HEAD_GROUP
    else:
        first = heads - TAIL
        size = TAIL
    r = lin - first * tiles
    return first + r % size, r // size


@gluon.jit
def kv_program(N_HEADS, KV_GROUP, HEAD_GROUP, TAIL, BLOCK_N: gl.constexpr):
    """A dK/dV program's key tile (grid (batch·kv_heads, key tiles), `grouped_program`'s order): (k_start, the
    (batch·H) index of its group's first query head); `kv_tiles_at` places the tile in K, V, dK, dV."""
    batch_kv_head, key_tile = grouped_program(HEAD_GROUP, TAIL)
    n_kv_heads = N_HEADS // KV_GROUP
    batch = batch_kv_head // n_kv_heads
    kv_head = batch_kv_head % n_kv_heads
    return key_tile * BLOCK_N, batch * N_HEADS + kv_head * KV_GROUP


@gluon.jit
def visible_tiles(k_start, N_QUERIES, KV_GROUP, BLOCK_M: gl.constexpr, is_causal: gl.constexpr):
    """(q_first, n_vis, total): the query tiles that see the key tile at k_start (causal, top-left: queries from
    k_start on), per query head and over the GQA group."""
    if is_causal:
        q_first = k_start
    else:
        q_first = k_start * 0
    n_vis = gl.maximum(N_QUERIES - q_first, 0) // BLOCK_M
    return q_first, n_vis, KV_GROUP * n_vis


@gluon.jit
def kv_program_start(q_desc, k_desc, v_desc, do_desc, k_start, kv_at, first_head, N_QUERIES, N_HEADS, KV_GROUP,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr, is_causal: gl.constexpr, Q_INSIDE: gl.constexpr,
                      DO_INSIDE: gl.constexpr):
    """Shared memory for K, V and a ring of STAGES (Q, dO) tiles with its barriers; K, V (at kv_at,
    `kv_tiles_at`) and the first STAGES-1 query tiles on their way. Returns those and `visible_tiles`."""
    dtype: gl.constexpr = q_desc.dtype
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], do_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(kv_bar, count=1)
    q_first, n_vis, total = visible_tiles(k_start, N_QUERIES, KV_GROUP, BLOCK_M, is_causal)
    k_row, k_col, v_row, v_col = kv_at
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [k_row, k_col], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [v_row, v_col], kv_bar, v_smem)
    for i in gl.static_range(STAGES - 1):
        issue_tile_loads(q_desc, do_desc, q_smem, do_smem, ready, i, total, n_vis, first_head, q_first,
                          N_QUERIES, N_HEADS, BLOCK_M, STAGES, Q_INSIDE, DO_INSIDE)
    return k_smem, v_smem, q_smem, do_smem, ready, kv_bar, q_first, n_vis, total


@gluon.jit
def kv_barriers_invalidated(ready, kv_bar, STAGES: gl.constexpr):
    """The end of a dK/dV program's barriers (`kv_program_start`'s)."""
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(kv_bar)


@gluon.jit
def kv_program_end(dk, dv, scale, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col, ready, kv_bar,
                   STAGES: gl.constexpr):
    """Barriers invalidated; dK·scale and dV stored (through shared memory, by TMA) at (row, column) of their
    views."""
    dtype: gl.constexpr = dk_desc.dtype
    kv_barriers_invalidated(ready, kv_bar, STAGES)
    out_smem = gl.allocate_shared_memory(dtype, [2] + dk_desc.block_type.shape, dk_desc.layout)
    out_smem.index(0).store((dk * scale).to(dtype))
    out_smem.index(1).store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [dk_row, dk_col], out_smem.index(0))
    tma.async_copy_shared_to_global(dv_desc, [dv_row, dv_col], out_smem.index(1))
    tma.store_wait(pendings=0)


@gluon.jit
def packed_sequence(CU_SEQLENS_Q, CU_SEQLENS_K, seq, N_SEQS):
    """Sequence `seq` of a packed call (N_SEQS: none, a spare slot's): (its first query row, first key row, numbers of
    queries and of keys; 0 and 0 for none)."""
    live = (seq < N_SEQS).to(gl.int32)
    seq = gl.minimum(seq, N_SEQS - 1)
    q0 = gl.load(CU_SEQLENS_Q + seq)
    k0 = gl.load(CU_SEQLENS_K + seq)
    return q0, k0, live * (gl.load(CU_SEQLENS_Q + seq + 1) - q0), live * (gl.load(CU_SEQLENS_K + seq + 1) - k0)


@gluon.jit
def store_rows(ptr, x, row, col, n_rows, ROW_STRIDE):
    """A register tile x stored from element (row, col) of a row-major matrix of ROW_STRIDE columns, its rows from
    n_rows on masked (in a packed tensor, the next sequence's)."""
    layout: gl.constexpr = x.type.layout
    rows = gl.arange(0, x.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, layout))
    first = row.to(gl.int64) * ROW_STRIDE + col  # (then 32-bit offsets within the tile)
    offs = gl.expand_dims(rows * ROW_STRIDE, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(rows < n_rows, 1) & gl.expand_dims(cols < x.shape[1], 0)
    gl.store(ptr + first + offs, x.to(ptr.dtype.element_ty), mask=mask)
