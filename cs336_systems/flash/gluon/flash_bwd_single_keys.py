"""The single-pass backward with the keys on rows (`flash_bwd_single_keys_gluon_kernel`, shipped at d 64 and 128):
a loader warp, a dQ warp and two compute warpgroups (the kernel's docstring has the schedule and its barriers), with
the device code of its own: a window's query tiles, a packed call's program and epilogue, where a query tile lies,
the three partitions, the tile, and the runs of tiles a window's or packed sequence's edges cut or not."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from cs336_systems.flash.gluon.common import BY_LENGTH, LOG2E, grouped_program, head_tile, kv_barriers_invalidated, \
    kv_program, kv_program_end, kv_tiles_at, packed_sequence, store_rows, tma_reduce_add, visible_tiles

# registers per thread of the single pass's loader and dQ warps (`_single_keys_loader`, `_single_keys_dq_writer`)
WORKER_REGS = gl.constexpr(24)


@gluon.jit
def _band_tiles(k_start, N_QUERIES, KV_GROUP, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr):
    """`visible_tiles` under a window: the query tiles holding a query i that sees a key j of the tile at k_start,
    j - right <= i <= j + left (self-attention, N_QUERIES in whole BLOCK_M)."""
    q_first = gl.maximum(k_start - WINDOW_RIGHT, 0) // BLOCK_M * BLOCK_M
    q_end = gl.minimum(k_start + BLOCK_N + WINDOW_LEFT, N_QUERIES)
    n_vis = gl.maximum(gl.cdiv(q_end - q_first, BLOCK_M), 0)
    return q_first, n_vis, KV_GROUP * n_vis


@gluon.jit
def _packed_kv_program(TILES, CU_SEQLENS_Q, CU_SEQLENS_K, N_SEQS, KV_GROUP, HEAD_GROUP, TAIL, BLOCK_N: gl.constexpr,
                       D: gl.constexpr):
    """A packed call's dK/dV program (grid (kv_heads, slots), `grouped_program`'s order): slot i runs key tile
    TILES[i, 1] of sequence TILES[i, 0], whose L and delta start at column TILES[i, 2] (a sequence index N_SEQS marks
    a spare slot, which sees no query and no key). Returns (k_start within the sequence, the tile's row and column in
    the (total_k, Hkv·D) views of K and V, the first query head of the kv head's group, the sequence's first query
    row, its first column in L and delta, its numbers of queries and of keys)."""
    kv_head, slot = grouped_program(HEAD_GROUP, TAIL)
    seq = gl.load(TILES + 3 * slot)
    k_start = gl.load(TILES + 3 * slot + 1) * BLOCK_N
    l0 = gl.load(TILES + 3 * slot + 2)
    q0, k0, n_q, n_k = packed_sequence(CU_SEQLENS_Q, CU_SEQLENS_K, seq, N_SEQS)
    return k_start, k0 + k_start, kv_head * D, kv_head * KV_GROUP, q0, l0, n_q, n_k


@gluon.jit
def _packed_kv_program_end(dk, dv, scale, dk_ptr, dv_ptr, kv_row, kv_col, n_rows, ROW_STRIDE, ready, kv_bar,
                           STAGES: gl.constexpr):
    """`kv_program_end` of a packed call: dK·scale and dV stored from registers, rows n_rows on masked (they are the
    next sequence's)."""
    kv_barriers_invalidated(ready, kv_bar, STAGES)
    store_rows(dk_ptr, dk * scale, kv_row, kv_col, n_rows, ROW_STRIDE)
    store_rows(dv_ptr, dv, kv_row, kv_col, n_rows, ROW_STRIDE)


@gluon.jit
def _query_tile(t, n_vis, first_head, q_first, q0, l0, N_QUERIES, N_HEADS, BLOCK_M: gl.constexpr, D: gl.constexpr,
                IS_VARLEN: gl.constexpr, Q_INSIDE: gl.constexpr, DO_INSIDE: gl.constexpr):
    """Where query tile t of a single-pass program (n_vis tiles per query head of the group) lies: (row, column) in
    the views of Q and of dO, row in the dQ accumulator's (·, D) view, (row, column) in the views of L and delta.
    Dense: Q and dO as `head_tile` places them (Q_INSIDE, DO_INSIDE), the accumulator (B·H·Nq, D), L and delta a
    row per query tile. Packed (IS_VARLEN, the sequence's first query at row q0): rows of the (total_q, H·D) views, a
    head's D columns; the accumulator (H, total_q, D); L and delta (H, ·) with the sequence from column l0 (a TMA box
    starts at a 16-byte-aligned address: `packed_rows`)."""
    head = first_head + t // n_vis
    local = q_first + (t % n_vis) * BLOCK_M
    acc_row = _accumulator_row(t, n_vis, first_head, q_first, q0, N_QUERIES, BLOCK_M)
    if IS_VARLEN:
        row = q0 + local
        col = head * D
        do_row = row
        do_col = col
        l_row = head
        l_col = l0 + local
    else:
        row, col = head_tile(first_head, t // n_vis, local, N_HEADS, N_QUERIES, D, Q_INSIDE)
        do_row, do_col = head_tile(first_head, t // n_vis, local, N_HEADS, N_QUERIES, D, DO_INSIDE)
        l_row = acc_row // BLOCK_M
        l_col = col * 0
    return row, col, do_row, do_col, acc_row, l_row, l_col


@gluon.jit
def _accumulator_row(t, n_vis, first_head, q_first, q0, N_QUERIES, BLOCK_M: gl.constexpr):
    """Query tile t's first row in the dQ accumulator: (B·H·Nq, D) dense, (H, total_q, D) packed, whose sequence
    starts at q0 (0 dense)."""
    return (first_head + t // n_vis) * N_QUERIES + q0 + q_first + (t % n_vis) * BLOCK_M


@gluon.jit
def _single_keys_loader(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, k_smem, v_smem, do_smem,
                        lse_smem, delta_smem, ready, empty, dq_full, kv_bar, kv_at, total, n_vis, first_head,
                        q_first, q0, l0, N_QUERIES, N_HEADS, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                        IS_VARLEN: gl.constexpr, Q_INSIDE: gl.constexpr, DO_INSIDE: gl.constexpr):
    """The loader warp of `flash_bwd_single_keys_gluon_kernel`: K and V once, then per query tile t, once its
    stage is free (`empty`: the compute warps are past tile t-STAGES), Q, dO, L and delta into stage t % STAGES
    (`ready`). It also passes the news on to the dQ warp: past tile t-STAGES, the compute warps have stored the
    dQ of tile t-STAGES-1 (`dq_full`), so that their loop arrives on one barrier per tile, not two. kv_at: (row,
    column) of the key tile in K's view, then in V's."""
    k_row, k_col, v_row, v_col = kv_at
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [k_row, k_col], kv_bar, k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [v_row, v_col], kv_bar, v_smem.index(0))
    nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes
                            + delta_desc.block_type.nbytes)
    for t in range(total):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)  # (a fresh barrier passes phase 1)
        if t >= STAGES + 1:
            mbarrier.arrive(dq_full.index((t - STAGES - 1) % 2))
        row, col, do_row, do_col, _, l_row, l_col = _query_tile(t, n_vis, first_head, q_first, q0, l0, N_QUERIES,
                                                                N_HEADS, BLOCK_M, q_desc.block_type.shape[1],
                                                                IS_VARLEN, Q_INSIDE, DO_INSIDE)
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, col], bar, q_smem.index(s))
        tma.async_copy_global_to_shared(do_desc, [do_row, do_col], bar, do_smem.index(s))
        tma.async_copy_global_to_shared(lse_desc, [l_row, l_col], bar, lse_smem.index(s))
        tma.async_copy_global_to_shared(delta_desc, [l_row, l_col], bar, delta_smem.index(s))


@gluon.jit
def _single_keys_dq_writer(dq_desc, x, y, dq_full, dq_empty, total, n_vis, first_head, q_first, q0, N_QUERIES,
                           BLOCK_M: gl.constexpr):
    """The dQ warp of `flash_bwd_single_keys_gluon_kernel`: per query tile u, once its dQ is in the buffer of u's
    parity (x: even, y: odd; `dq_full`), a TMA bulk reduction into the accumulator behind dq_desc; once it has read
    the buffer, the buffer goes back to the compute warps (`dq_empty`)."""
    for u in range(total):
        b = u % 2
        mbarrier.wait(dq_full.index(b), (u // 2) & 1)
        row = _accumulator_row(u, n_vis, first_head, q_first, q0, N_QUERIES, BLOCK_M)
        if b == 0:
            tma_reduce_add(dq_desc, [row, 0], x[1].index(0))
        else:
            tma_reduce_add(dq_desc, [row, 0], y[1].index(0))
        tma.store_wait(pendings=0)
        mbarrier.arrive(dq_empty.index(b))


@gluon.jit
def _single_keys_dq_free(dq_empty, u):
    """Wait until dQ buffer u % 2 is free for tile u: the dQ warp's reductions of tile u-2 have read it."""
    mbarrier.wait(dq_empty.index(u % 2), ((u // 2) & 1) ^ 1)


@gluon.jit
def _single_keys_p(sT, lse_t, offs_k, q_start, MASKED: gl.constexpr, band, EDGES: gl.constexpr):
    """Pᵀ (fp32) of a tile from its Sᵀ (scaled by scale·log2 e). With EDGES, band (k_start, left, right, n_q, n_k):
    query i sees key j iff i - left <= j <= i + right, i < n_q and j < n_k (a window, or a packed sequence's causal
    diagonal and ends); the tiles those edges cut are found at run time (a uniform branch) and masked."""
    s_layout: gl.constexpr = sT.type.layout
    pT = gl.exp2(sT - lse_t.load(s_layout) * LOG2E)
    if MASKED:  # query i sees key j iff i >= j
        offs_q = q_start + gl.arange(0, sT.shape[1], layout=gl.SliceLayout(0, s_layout))
        pT = gl.where(gl.expand_dims(offs_q, 0) >= gl.expand_dims(offs_k, 1), pT, 0.0)
    if EDGES:
        k_start, left, right, n_q, n_k = band
        if ((q_start + sT.shape[1] - 1 - left > k_start) | (k_start + sT.shape[0] - 1 - right > q_start)
                | (q_start + sT.shape[1] > n_q) | (k_start + sT.shape[0] > n_k)):
            offs_q = q_start + gl.arange(0, sT.shape[1], layout=gl.SliceLayout(0, s_layout))
            i = gl.expand_dims(offs_q, 0)
            j = gl.expand_dims(offs_k, 1)
            pT = gl.where((j >= i - left) & (j <= i + right) & (i < n_q) & (j < n_k), pT, 0.0)
    return pT


@gluon.jit
def _single_keys_ds(pT, dpT, delta_t, dtype: gl.constexpr):
    """dSᵀ = Pᵀ·(dPᵀ - delta) of a tile, and Pᵀ, in Q's dtype."""
    dsT = (pT * (dpT - delta_t.load(dpT.type.layout))).to(dtype)
    return pT.to(dtype), dsT


@gluon.jit
def _single_keys_tile(t, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, cur, prev, ready, empty,
                      dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first, qk_scale, BLOCK_M: gl.constexpr,
                      STAGES: gl.constexpr, MASKED: gl.constexpr, band, EDGES: gl.constexpr):
    """Query tile t of `flash_bwd_single_keys_gluon_kernel` (MASKED: one on the diagonal), and tile t-1's dQ (issued
    with dV and dK, not with Sᵀ and dPᵀ: that needs more registers than there are). cur: the buffers of tiles of t's
    parity, prev: those of t-1's, each (dSᵀ, dQ), a separate allocation named statically (the compiler's
    shared-memory hazard analysis takes any view of an allocation for all of it, and would add barriers). Every
    wgmma is retired before it returns (one in flight across the caller's loop serializes them all, C7515)."""
    # The buffers come as (1, ...) allocations indexed by z, always 0 but not foldable by the compiler: their wgmma
    # descriptors are then computed in the loop instead of hoisted out of it (where ~50 of them were spilled).
    z = t // 1073741824
    s = t % STAGES + z  # (likewise: in the loop of tile pairs, t % STAGES is invariant)
    q_start = q_first + (t % n_vis) * BLOCK_M
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    q_t = q_smem.index(s)
    do_t = do_smem.index(s)
    k_t = k_smem.index(z)
    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
    sT = warpgroup_mma(k_t, q_t.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v_smem.index(z), do_t.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    _single_keys_barrier(t, empty, STAGES)
    sT = warpgroup_mma_wait(1, deps=(sT, ))
    pT = _single_keys_p(sT * qk_scale, lse_smem.index(s), offs_k, q_start, MASKED, band, EDGES)
    dpT = warpgroup_mma_wait(0, deps=(dpT, ))
    pT, dsT = _single_keys_ds(pT, dpT, delta_smem.index(s), q_t.dtype)
    pT_a = gl.convert_layout(pT, a_layout)
    dsT_a = gl.convert_layout(dsT, a_layout)
    # dQ of tile t-1 first, so that its wait comes before dV's and dK's: the stores of this tile's dSᵀ and of that dQ
    # run under dV and dK, not on the tile's chain (before the issue and after the last wait)
    dq = warpgroup_mma(prev[0].index(z).permute((1, 0)), k_t, zero_dq, use_acc=False, is_async=True)
    dv = warpgroup_mma(pT_a, do_t, dv, is_async=True)
    dk = warpgroup_mma(dsT_a, q_t, dk, is_async=True)
    cur[0].index(z).store(dsT)
    dq = warpgroup_mma_wait(2, deps=(dq, ))
    if t >= 1:  # into buffer (t-1) % 2
        _single_keys_dq_free(dq_empty, t - 1)
        prev[1].index(z).store(dq)
    dk, dv, pT_a, dsT_a = warpgroup_mma_wait(0, deps=(dk, dv, pT_a, dsT_a))
    return dk, dv


@gluon.jit
def _single_keys_barrier(t, empty, STAGES: gl.constexpr):
    """The one barrier of a tile: every warpgroup is past tile t-1 (its stage goes back to the loader warp; its dSᵀ
    and tile t-2's dQ are stored and fenced)."""
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), pred=t >= 1)


@gluon.jit
def _single_keys_pairs(t_first, n_pairs, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x, y, ready,
                       empty, dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first, qk_scale, BLOCK_M: gl.constexpr,
                       STAGES: gl.constexpr, band):
    """Tiles t_first .. t_first+2·n_pairs-1, unmasked, two per iteration: those of t_first's parity take the buffers
    x, the others y."""
    for i in range(n_pairs):
        t = t_first + 2 * i
        dk, dv = _single_keys_tile(t, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x, y, ready,
                                   empty, dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first, qk_scale, BLOCK_M,
                                   STAGES, False, band, False)
        dk, dv = _single_keys_tile(t + 1, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, y, x, ready,
                                   empty, dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first, qk_scale, BLOCK_M,
                                   STAGES, False, band, False)
    return dk, dv


@gluon.jit
def _single_keys_rest(t_first, n, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x, y, ready, empty,
                      dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first, qk_scale, BLOCK_M: gl.constexpr,
                      STAGES: gl.constexpr, band):
    """Tiles t_first .. t_first+n-1, unmasked: `_single_keys_pairs`, then an odd last tile on the buffers x."""
    dk, dv = _single_keys_pairs(t_first, n // 2, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x, y,
                                ready, empty, dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first, qk_scale, BLOCK_M,
                                STAGES, band)
    if n % 2 == 1:
        dk, dv = _single_keys_tile(t_first + n - 1, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                                   x, y, ready, empty, dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first, qk_scale,
                                   BLOCK_M, STAGES, False, band, False)
    return dk, dv


@gluon.jit
def _single_keys_run(t0, n_vis, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x, y, ready, empty,
                     dq_empty, offs_k, zero_s, zero_dq, q_first, qk_scale, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, is_causal: gl.constexpr, band,
                     EDGES: gl.constexpr):
    """Tiles t0 .. t0+n_vis-1 (one query head's): tiles of t0's parity take the buffers x, the others y. Under
    causal masking the first BLOCK_N / BLOCK_M tiles (1 or 2) are on the diagonal (with two, n_vis is even:
    `supported` takes query lengths in whole BLOCK_N). With EDGES (a window, causal folded into it; packed
    sequences) the tiles the band's edges or the sequence's ends may cut run first and last, each checking whether
    they do (`_band_split`), and those between in a loop without the mask, whose registers spilled in the loop."""
    if EDGES:  # the tiles an edge or end cuts come first and last: the loop over those between holds no mask
        a, m = _band_split(q_first, n_vis, band, BLOCK_M, BLOCK_N)
        dk, dv = _single_keys_cut(t0, a, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x, y, ready,
                                  empty, dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first, qk_scale, BLOCK_M, STAGES,
                                  band)
        dk, dv = _single_keys_pairs(t0 + a, m // 2, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x,
                                    y, ready, empty, dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first, qk_scale,
                                    BLOCK_M, STAGES, band)
        dk, dv = _single_keys_cut(t0 + a + m, n_vis - a - m, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem,
                                  delta_smem, x, y, ready, empty, dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first,
                                  qk_scale, BLOCK_M, STAGES, band)
    else:
        dk, dv = _single_keys_tile(t0, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x, y, ready,
                                   empty, dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first, qk_scale, BLOCK_M,
                                   STAGES, is_causal, band, EDGES)
        if is_causal and BLOCK_N == 2 * BLOCK_M:
            dk, dv = _single_keys_tile(t0 + 1, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, y, x,
                                       ready, empty, dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first, qk_scale,
                                       BLOCK_M, STAGES, True, band, EDGES)
            dk, dv = _single_keys_rest(t0 + 2, n_vis - 2, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem,
                                       delta_smem, x, y, ready, empty, dq_empty, offs_k, zero_s, zero_dq, n_vis,
                                       q_first, qk_scale, BLOCK_M, STAGES, band)
        else:
            dk, dv = _single_keys_rest(t0 + 1, n_vis - 1, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem,
                                       delta_smem, y, x, ready, empty, dq_empty, offs_k, zero_s, zero_dq, n_vis,
                                       q_first, qk_scale, BLOCK_M, STAGES, band)
    return dk, dv


@gluon.jit
def _single_keys_cut(t_first, n, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x, y, ready, empty,
                     dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first, qk_scale, BLOCK_M: gl.constexpr,
                     STAGES: gl.constexpr, band):
    """Tiles t_first .. t_first+n-1 that the band's edges or the sequence's ends may cut, each checking whether they
    do: one a loop iteration, its buffers by its parity against t_first's (x) (two instances of the tile, not the
    three of a loop of pairs: these runs are short and their code is compile time)."""
    for i in range(n):
        if i % 2 == 0:
            dk, dv = _single_keys_tile(t_first + i, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                                       x, y, ready, empty, dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first,
                                       qk_scale, BLOCK_M, STAGES, False, band, True)
        else:
            dk, dv = _single_keys_tile(t_first + i, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                                       y, x, ready, empty, dq_empty, offs_k, zero_s, zero_dq, n_vis, q_first,
                                       qk_scale, BLOCK_M, STAGES, False, band, True)
    return dk, dv


@gluon.jit
def _band_split(q_first, n_vis, band, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(a, m) of a key tile's n_vis query tiles from q_first under the band (k_start, left, right, n_q, n_k): the
    first a (even, or all) hold the tiles the right edge cuts (the diagonal), the next m (even) are tiles no edge or
    end cuts (`_single_keys_p`'s test), the rest hold those the left edge or the queries' end cut. A key tile past
    the keys' end is cut everywhere (m = 0). Even counts keep each run on its first tile's dS/dQ buffers."""
    k_start, left, right, n_q, n_k = band
    a = gl.minimum(gl.maximum(gl.cdiv(k_start + BLOCK_N - 1 - right - q_first, BLOCK_M), 0), n_vis)
    a = gl.minimum(a + a % 2, n_vis)
    cut_from = gl.minimum(k_start + left - BLOCK_M + 2, n_q - BLOCK_M + 1)  # (the left edge's or the end's first)
    b = gl.minimum(gl.maximum(gl.cdiv(cut_from - q_first, BLOCK_M), 0), n_vis)
    m = gl.maximum(b - a, 0)
    m = gl.where(k_start + BLOCK_N <= n_k, m - m % 2, 0)
    return a, m


@gluon.jit
def _single_keys_last_dq(last, bufs, k_smem, dq_full, dq_empty, zero_dq, STAGES: gl.constexpr):
    """After the last tile (its buffers bufs): the dQ of the tiles the loader warp did not announce to the dQ warp,
    then the last tile's dQ."""
    fence_async_shared()
    gl.thread_barrier()
    for u in range(gl.maximum(last - STAGES, 0), last):
        mbarrier.arrive(dq_full.index(u % 2))
    dq = warpgroup_mma(bufs[0].index(0).permute((1, 0)), k_smem.index(0), zero_dq, use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    _single_keys_dq_free(dq_empty, last)
    bufs[1].index(0).store(dq)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(dq_full.index(last % 2))


@gluon.jit
def _single_keys_compute(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x, y, ready, empty, dq_full,
                         dq_empty, kv_bar, k_start, q_first, n_vis, total, KV_GROUP, scale, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, is_causal: gl.constexpr,
                         band, EDGES: gl.constexpr, num_warps: gl.constexpr):
    """The compute warps of `flash_bwd_single_keys_gluon_kernel`: every query tile, the dS and dQ buffers of each
    named statically (tiles of even t take the buffers x, odd ones y); returns dK (unscaled) and dV."""
    # Sᵀ, dPᵀ: (BLOCK_N keys, BLOCK_M queries), a warpgroup per 64 keys; dK, dV: (BLOCK_N, D);
    # dQ: (BLOCK_M, D), a warpgroup per 64 queries where BLOCK_M has 64 per warpgroup (d 64: m64n64 wgmmas, 4 KiB
    # of shared-memory operands per 2·64·64·16 FLOP), else a warpgroup per D / 2 columns (d 128, BLOCK_M = 64)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, D, 16])
    DQ_WARPS_M: gl.constexpr = num_warps if BLOCK_M == 16 * num_warps else num_warps // 2
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                        warps_per_cta=[DQ_WARPS_M, num_warps // DQ_WARPS_M],
                                                        instr_shape=[16, D * DQ_WARPS_M // num_warps, 16])
    qk_scale = scale * LOG2E
    offs_k = k_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    zero_dq = gl.zeros([BLOCK_M, D], gl.float32, dq_layout)
    dk = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    if n_vis > 0:
        for g in range(KV_GROUP):  # a query head of the group at a time
            t0 = g * n_vis
            if t0 % 2 == 0:
                dk, dv = _single_keys_run(t0, n_vis, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                                          x, y, ready, empty, dq_empty, offs_k, zero_s, zero_dq, q_first, qk_scale,
                                          BLOCK_M, BLOCK_N, STAGES, is_causal, band, EDGES)
            else:
                dk, dv = _single_keys_run(t0, n_vis, dk, dv, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                                          y, x, ready, empty, dq_empty, offs_k, zero_s, zero_dq, q_first, qk_scale,
                                          BLOCK_M, BLOCK_N, STAGES, is_causal, band, EDGES)
        last = total - 1
        if last % 2 == 0:
            _single_keys_last_dq(last, x, k_smem, dq_full, dq_empty, zero_dq, STAGES)
        else:
            _single_keys_last_dq(last, y, k_smem, dq_full, dq_empty, zero_dq, STAGES)
    return dk, dv


@gluon.jit(do_not_specialize=BY_LENGTH + ("WINDOW_LEFT", "WINDOW_RIGHT"))
def flash_bwd_single_keys_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_desc,
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, HEAD_GROUP, TAIL, WINDOW_LEFT, WINDOW_RIGHT,
    CU_SEQLENS_Q, CU_SEQLENS_K, TILES, N_SEQS,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
    is_causal: gl.constexpr, HAS_WINDOW: gl.constexpr, IS_VARLEN: gl.constexpr, Q_INSIDE: gl.constexpr,
    K_INSIDE: gl.constexpr, V_INSIDE: gl.constexpr, DO_INSIDE: gl.constexpr, num_warps: gl.constexpr,
):
    """The single-pass backward with the keys on rows (FlashAttention-3's d-64 layout). Grid (batch·kv_heads,
    key tiles) as `flash_bwd_kv_gluon_kernel`; L (natural log) and delta come as (B·H·Nq / BLOCK_M, BLOCK_M)
    fp32 descriptors, a row per query tile. Each of Q, K (and dK, in K's layout), V (and dV) and dO is a
    (B·H·S, D) view or, with its *_INSIDE flag, the (B·S, H·D) view of (B, S, H, D) memory, a head's D columns per
    box (`head_tile`). With IS_VARLEN, packed sequences
    (`_packed_kv_program`): grid (kv_heads, slots), a slot per key tile of a sequence (TILES), descriptors over
    the (total, heads·D) views of the packed Q, K, V, dO and over L and delta as (H, ·) rows (`packed_rows`);
    N_QUERIES, N_KEYS the totals;
    dk_desc and dv_desc the packed dK and dV themselves, stored with a mask (a TMA store of a tile past the
    sequence's end would write the next sequence's rows); every tile checks the causal diagonal, the window and the
    sequence's ends at run time as a window's tiles do, so that the rows of the neighbouring sequences that a tile
    loads contribute nothing.

    Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ are (BLOCK_N keys, BLOCK_M queries), a warpgroup per 64 keys, so Pᵀ and dSᵀ
    are in registers as the A operands of dV += Pᵀ·dO and dK += dSᵀ·Q: P never goes to shared memory. dSᵀ
    goes there for dQ = dS·K, which needs all the tile's keys (a warpgroup per 64 queries at d 64, per D / 2
    columns at d 128), so it is computed one tile later, after the next tile's barrier. Three partitions
    (FlashAttention-3's): a loader warp (`_single_keys_loader`) streams Q, dO, L and delta through a TMA ring; a
    dQ warp (`_single_keys_dq_writer`) adds each tile's fp32 dQ into the accumulator behind dq_desc by TMA bulk
    reductions; the compute warpgroups (`_single_keys_compute`, 240 registers), per query tile t
    (`_single_keys_tile`), a whole tile at once (BLOCK_M = 128 queries at d 64, FlashAttention-4's sm90 tile; 64
    at d 128, where dK and dV take 128 registers per thread and shared memory holds no larger tile):
        issue  Sᵀ, dPᵀ
        the one CTA barrier of the tile: tile t-1's stage goes back to the loader (and through it tile t-2's dQ
        to the dQ warp)
        Pᵀ = exp2(Sᵀ·scale·log2 e - L)                                       (under dPᵀ; the exponentials of one
        dSᵀ = Pᵀ·(dPᵀ - delta)                                               warpgroup under the other's matmuls)
        issue  dQ of tile t-1 = dS·K, dV += Pᵀ·dO, dK += dSᵀ·Q
        dSᵀ -> shared;  wait dQ;  dQ -> shared (once the dQ warp has read the buffer);  wait dV, dK
    (Two parts of 64 queries per d-64 tile, the second's exponentials under the first's dV and dK, were slower on
    the H200.) Under causal masking the d-128 key tile spans two query
    tiles of the diagonal. With HAS_WINDOW (window (WINDOW_LEFT, WINDOW_RIGHT) as `chooser.band` gives it, causal
    folded in; self-attention) a key tile visits only the query tiles of its band (`_band_tiles`), and each tile
    masks itself where the band's edges cut it.
    dS and dQ buffers of tiles of either parity are separate shared allocations named statically (two tiles per
    loop iteration): Triton's shared-memory hazard analysis takes any view of an allocation for all of it, and two
    writes into one allocation between barriers would cost a CTA barrier each. The steady loop runs two CTA
    barriers per tile (the one above, and one the compiler puts after the mbarrier arrive).
    Handoffs are mbarriers (phase of use k is k & 1): ready[s] / empty[s] between the loader and the compute
    warps, dq_full[b] / dq_empty[b] between them and the dQ warp. BLOCK_N = 16·num_warps = 128."""
    dtype: gl.constexpr = q_desc.dtype
    EDGES: gl.constexpr = HAS_WINDOW or IS_VARLEN
    if IS_VARLEN:  # (window and causal folded into the band; a query without keys is in no program's band)
        k_start, kv_row, kv_col, first_head, q0, l0, n_q, n_k = _packed_kv_program(
            TILES, CU_SEQLENS_Q, CU_SEQLENS_K, N_SEQS, KV_GROUP, HEAD_GROUP, TAIL, BLOCK_N, D)
        kv_at = (kv_row, kv_col, kv_row, kv_col)
        q_first, n_vis, total = _band_tiles(k_start, n_q, KV_GROUP, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N)
    else:
        k_start, first_head = kv_program(N_HEADS, KV_GROUP, HEAD_GROUP, TAIL, BLOCK_N)
        kv_at = kv_tiles_at(first_head, k_start, N_HEADS, KV_GROUP, N_KEYS, D, K_INSIDE, V_INSIDE)
        q0 = k_start * 0
        l0 = q0
        n_q = N_QUERIES
        n_k = N_KEYS
        if HAS_WINDOW:  # (self-attention: every query sees its own key, so no row's L is -inf)
            q_first, n_vis, total = _band_tiles(k_start, N_QUERIES, KV_GROUP, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M,
                                                BLOCK_N)
        else:
            q_first, n_vis, total = visible_tiles(k_start, N_QUERIES, KV_GROUP, BLOCK_M, is_causal)

    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth)
    # K, V and the dS, dQ buffers as (1, ...) allocations (`_single_keys_tile` indexes them)
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], delta_desc.layout)
    # dSᵀ and dQ of two tiles (x: even tiles, y: odd), each a separate allocation (see `_single_keys_tile`)
    ds0 = gl.allocate_shared_memory(dtype, [1, BLOCK_N, BLOCK_M], ds_layout)
    ds1 = gl.allocate_shared_memory(dtype, [1, BLOCK_N, BLOCK_M], ds_layout)
    dq0 = gl.allocate_shared_memory(gl.float32, [1, BLOCK_M, D], dq_desc.layout)
    dq1 = gl.allocate_shared_memory(gl.float32, [1, BLOCK_M, D], dq_desc.layout)
    x = (ds0, dq0)
    y = (ds1, dq1)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    mbarrier.init(kv_bar, count=1)

    dk, dv = gl.warp_specialize([
        (_single_keys_compute, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x, y, ready, empty, dq_full,
                                dq_empty, kv_bar, k_start, q_first, n_vis, total, KV_GROUP, scale, BLOCK_M, BLOCK_N,
                                D, STAGES, is_causal, (k_start, WINDOW_LEFT, WINDOW_RIGHT, n_q, n_k), EDGES,
                                num_warps)),
        (_single_keys_loader, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, k_smem, v_smem, do_smem,
                               lse_smem, delta_smem, ready, empty, dq_full, kv_bar, kv_at, total, n_vis, first_head,
                               q_first, q0, l0, N_QUERIES, N_HEADS, BLOCK_M, STAGES, IS_VARLEN, Q_INSIDE,
                               DO_INSIDE)),
        (_single_keys_dq_writer, (dq_desc, x, y, dq_full, dq_empty, total, n_vis, first_head, q_first, q0, N_QUERIES,
                                  BLOCK_M)),
    ], [1, 1], [WORKER_REGS, WORKER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(dq_full.index(i))
        mbarrier.invalidate(dq_empty.index(i))
    if IS_VARLEN:
        _packed_kv_program_end(dk, dv, scale, dk_desc, dv_desc, kv_row, kv_col, n_k - k_start,
                               (N_HEADS // KV_GROUP) * D, ready, kv_bar, STAGES)
    else:
        k_row, k_col, v_row, v_col = kv_at
        kv_program_end(dk, dv, scale, dk_desc, dv_desc, k_row, k_col, v_row, v_col, ready, kv_bar, STAGES)
