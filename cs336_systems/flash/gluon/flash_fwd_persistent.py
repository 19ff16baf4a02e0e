"""The persistent Gluon forward (`flash_fwd_persistent_gluon_kernel`): the dense forward's one-consumer-warpgroup
schedule with a fixed grid of programs, each looping over query tiles, so that a short call's next tile (its Q and
first K and V) loads under the current tile's matmuls instead of at a new program's start."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from cs336_systems.flash.gluon.common import BY_LENGTH, grouped_item, head_tile, kv_tiles_at
from cs336_systems.flash.gluon.flash_fwd import LN2, fwd_mainloop

# ----------------------------------------------------------------------------------------------
# The persistent forward: one consumer warpgroup, a producer warp, a grid of resident programs
# ----------------------------------------------------------------------------------------------
#
# Program p takes work items p, p + G, p + 2G, ... (G programs; item w is (batch·head, query tile) in
# `grouped_item`'s order, the longest causal tiles of a head group first). Both partitions walk the same items:
#
#   producer (1 warp)   Q_i into buffer i % 2 | K, V tiles of item i through the ring | Q_{i+1} | K, V of i+1 ...
#   consumer (4 warps)  wait Q_i | S, P, O over item i's key tiles | O_i out through Q_i's buffer | wait Q_{i+1} ...
#
# The ring's stages and phases count key tiles over all of a program's items (c), so the producer streams the next
# item's Q, K and V while the consumer is still on the current one: a short tile's load latency, paid once per
# program in the one-program-per-tile grid, hides under the previous tile's matmuls.
#
# Barriers (phase of use k is k & 1; a fresh barrier counts as having completed the phase before 0):
#   q_ready[b]   producer -> consumer: Q of the item in buffer b     q_empty[b]  consumer -> producer: buffer b free
#                                                                                (O stored from it)
#   ready_k[s], ready_v[s]  producer -> consumer: K, V in stage s    empty_k[s], empty_v[s]  consumer -> producer
#   turn         the consumer's hand-off to itself per key tile: its wait keeps the wait for P·V after the
#                exponentials (as in the one-program-per-tile forward with one warpgroup)


@gluon.jit
def _item(w, BATCH_HEADS, N_Q_TILES, HEAD_GROUP, TAIL, N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, D: gl.constexpr, is_causal: gl.constexpr, Q_INSIDE: gl.constexpr,
          K_INSIDE: gl.constexpr, V_INSIDE: gl.constexpr):
    """Work item w: (batch·head, its first query, Q's (row, column), K's, V's, its key tiles)."""
    batch_head, step = grouped_item(w, BATCH_HEADS, N_Q_TILES, HEAD_GROUP, TAIL)
    if is_causal:
        q_start = (N_Q_TILES - 1 - step) * BLOCK_M
        n_tiles = gl.cdiv(gl.minimum(q_start + BLOCK_M, N_KEYS), BLOCK_N)  # top-left: up to the tile's last query
    else:
        q_start = step * BLOCK_M
        n_tiles = N_KEYS // BLOCK_N
    q_row, q_col = head_tile(batch_head, 0, q_start, N_HEADS, N_QUERIES, D, Q_INSIDE)
    k_row, k_col, v_row, v_col = kv_tiles_at(batch_head, 0, N_HEADS, KV_GROUP, N_KEYS, D, K_INSIDE, V_INSIDE)
    return batch_head, q_start, q_row, q_col, k_row, k_col, v_row, v_col, n_tiles


@gluon.jit
def _pfwd_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, ready_k, ready_v, empty_k,
                   empty_v, BATCH_HEADS, N_Q_TILES, HEAD_GROUP, TAIL, N_HEADS, KV_GROUP, N_QUERIES, N_KEYS,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                   is_causal: gl.constexpr, Q_INSIDE: gl.constexpr, K_INSIDE: gl.constexpr, V_INSIDE: gl.constexpr):
    c = 0  # key tiles streamed so far
    i = 0  # items
    for w in range(gl.program_id(0), BATCH_HEADS * N_Q_TILES, gl.num_programs(0)):
        _, _, q_row, q_col, k_row, k_col, v_row, v_col, n_tiles = _item(
            w, BATCH_HEADS, N_Q_TILES, HEAD_GROUP, TAIL, N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, BLOCK_M, BLOCK_N, D,
            is_causal, Q_INSIDE, K_INSIDE, V_INSIDE)
        b = i % 2
        mbarrier.wait(q_empty.index(b), ((i // 2) & 1) ^ 1)
        mbarrier.expect(q_ready.index(b), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_ready.index(b), q_smem.index(b))
        for j in range(n_tiles):
            t = c + j
            s = t % STAGES
            phase = ((t // STAGES) & 1) ^ 1
            mbarrier.wait(empty_k.index(s), phase)
            mbarrier.expect(ready_k.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, k_col], ready_k.index(s), k_smem.index(s))
            mbarrier.wait(empty_v.index(s), phase)
            mbarrier.expect(ready_v.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [v_row + j * BLOCK_N, v_col], ready_v.index(s), v_smem.index(s))
        c += n_tiles
        i += 1


@gluon.jit
def _pfwd_consumer(o_desc, L_ptr, q_smem, k_smem, v_smem, q_ready, q_empty, ready_k, ready_v, empty_k, empty_v, turn,
                   scale, BATCH_HEADS, N_Q_TILES, HEAD_GROUP, TAIL, N_HEADS, KV_GROUP, N_QUERIES, N_KEYS,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                   is_causal: gl.constexpr, Q_INSIDE: gl.constexpr, K_INSIDE: gl.constexpr, V_INSIDE: gl.constexpr,
                   DEFER_STORE: gl.constexpr):
    dtype: gl.constexpr = o_desc.dtype
    no_band = (0, 0, 0)  # (the mainloop's band: unused without EDGES)
    mbarrier.arrive(turn.index(0))  # the first tile's turn
    c = 0
    i = 0
    for w in range(gl.program_id(0), BATCH_HEADS * N_Q_TILES, gl.num_programs(0)):
        batch_head, first, q_row, q_col, _, _, _, _, n = _item(
            w, BATCH_HEADS, N_Q_TILES, HEAD_GROUP, TAIL, N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, BLOCK_M, BLOCK_N, D,
            is_causal, Q_INSIDE, K_INSIDE, V_INSIDE)
        b = i % 2
        q_tile = q_smem.index(b)
        mbarrier.wait(q_ready.index(b), (i // 2) & 1)
        # (DEFER_STORE: the previous item's O store, issued before this item began, frees its buffer once the first
        # S is issued)
        o, m_i, l_i, offs_m = fwd_mainloop(q_tile, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v, turn, first,
                                           0, c, c, n, scale, no_band, (q_empty.index(1 - b), i > 0), BLOCK_M,
                                           BLOCK_N, D, STAGES, is_causal, False, False, 1, 0, DEFER_STORE)
        o = o / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o.type.layout)), 1)
        gl.store(L_ptr + batch_head * N_QUERIES + offs_m, (m_i + gl.log2(l_i)) * LN2)
        # O out through Q's buffer (its matmuls done); the buffer is the producer's again once the store has read it
        q_tile.store(o.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [q_row, q_col], q_tile)
        if not DEFER_STORE:
            tma.store_wait(pendings=0)
            mbarrier.arrive(q_empty.index(b))
        c += n
        i += 1
    if DEFER_STORE:
        tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=BY_LENGTH + ("BATCH_HEADS", ))
def flash_fwd_persistent_gluon_kernel(
    q_desc, k_desc, v_desc, o_desc, L_ptr, N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, BATCH_HEADS, HEAD_GROUP, TAIL,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, is_causal: gl.constexpr,
    Q_INSIDE: gl.constexpr, K_INSIDE: gl.constexpr, V_INSIDE: gl.constexpr, DEFER_STORE: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Grid (programs,): BATCH_HEADS × (N_QUERIES / BLOCK_M) work items, item w of a program every grid's width,
    in `grouped_item`'s order (HEAD_GROUP, TAIL). Views and L as `flash_fwd_gluon_kernel`'s dense call (Nq a multiple
    of BLOCK_M, Nk of BLOCK_N; Q_INSIDE, K_INSIDE, V_INSIDE: a (B·S, H·D) view of (B, S, H, D) memory, O as Q)."""
    dtype: gl.constexpr = q_desc.dtype
    N_Q_TILES = N_QUERIES // BLOCK_M
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_v = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_v = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_k.index(i), count=1)
        mbarrier.init(ready_v.index(i), count=1)
        mbarrier.init(empty_k.index(i), count=1)
        mbarrier.init(empty_v.index(i), count=1)
    mbarrier.init(turn.index(0), count=1)

    gl.warp_specialize([
        (_pfwd_consumer, (o_desc, L_ptr, q_smem, k_smem, v_smem, q_ready, q_empty, ready_k, ready_v, empty_k, empty_v,
                          turn, scale, BATCH_HEADS, N_Q_TILES, HEAD_GROUP, TAIL, N_HEADS, KV_GROUP, N_QUERIES, N_KEYS,
                          BLOCK_M, BLOCK_N, D, STAGES, is_causal, Q_INSIDE, K_INSIDE, V_INSIDE, DEFER_STORE)),
        (_pfwd_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, ready_k, ready_v, empty_k,
                          empty_v, BATCH_HEADS, N_Q_TILES, HEAD_GROUP, TAIL, N_HEADS, KV_GROUP, N_QUERIES, N_KEYS,
                          BLOCK_M, BLOCK_N, D, STAGES, is_causal, Q_INSIDE, K_INSIDE, V_INSIDE)),
    ], [1], [24])
