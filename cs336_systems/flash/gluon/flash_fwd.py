"""The Gluon forward (`flash_fwd_gluon_kernel`): FlashAttention-3's warp-specialized schedule, a producer warp and
one to three consumer warpgroups that take turns at the tensor cores (described below, above its device code), for
dense, windowed and packed calls."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from cs336_systems.flash.gluon.common import BY_LENGTH, LOG2E, grouped_program, head_tile, kv_tiles_at, \
    packed_sequence, store_rows

LN2 = gl.constexpr(0.6931471805599453)
# registers per thread of the forward's second and third consumer warpgroups (when it runs three)
REGS_3WG = gl.constexpr(160)


# ----------------------------------------------------------------------------------------------
# The forward, warp-specialized (FlashAttention-3's schedule on Hopper)
# ----------------------------------------------------------------------------------------------
#
# One program per WARPGROUPS·BLOCK_M query rows: Q is loaded once, at the program's entry, and a one-warp
# producer streams K and V tiles of BLOCK_N keys through a TMA ring; WARPGROUPS (1 to 3) consumer
# warpgroups own BLOCK_M query rows each and share every K/V tile. Per key tile j a consumer
#     issues S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1} in its turn, hands the turn to the next warpgroup,
#     waits for S_j (P_{j-1}·V_{j-1} may still run) and frees K_j, computes P_j = exp2(S_j·scale·log2 e - m_j),
#     waits for its next turn, then for P_{j-1}·V_{j-1}, frees V_{j-1} and rescales O by exp2(m_{j-1} - m_j),
# so its exponentials run under its own P·V matmul and, through the turns (ping-pong), under the other
# warpgroups' matmuls: the warpgroups issue their matmuls one after another instead of in step. (At d 64
# the matmuls of one warpgroup take about as long as its softmax, so three warpgroups are needed to keep
# the tensor cores busy; at d 128 two suffice.)
#
# Barriers (phase of use k is k & 1; a fresh barrier counts as having completed the phase before 0):
#   q_bar      entry -> consumers: Q               ready_k[s], ready_v[s]  producer -> consumers: K, V in stage s
#   empty_k[s], empty_v[s]  consumers (all) -> producer: K (after S), V (after P·V) of stage s read
#   turn[r]    consumer r - 1 (mod WARPGROUPS) -> consumer r: r may issue its matmuls
# K and V are released apart: a consumer takes its next turn before its wait for P_{j-1}·V_{j-1} (below),
# so with one barrier per stage and two stages the producer's wait for stage j-2 and the turns would
# wait on each other.


@gluon.jit
def _fwd_producer(k_desc, v_desc, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v, k_row, k_col, v_row, v_col,
                  n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    for j in range(n_tiles):
        s = j % STAGES
        phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(empty_k.index(s), phase)
        mbarrier.expect(ready_k.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, k_col], ready_k.index(s), k_smem.index(s))
        mbarrier.wait(empty_v.index(s), phase)
        mbarrier.expect(ready_v.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [v_row + j * BLOCK_N, v_col], ready_v.index(s), v_smem.index(s))


@gluon.jit
def _band_rows(offs, before, after, n_other):
    """Per row (offs) of a band, its first column lo = offs - before and its count of columns, from lo to
    min(offs + after, n_other - 1) (0 where none), as uint32: column c is in the band iff (c - lo) as uint32 < count,
    one compare a score instead of three."""
    lo = offs - before
    return lo, gl.maximum(gl.minimum(offs + after, n_other - 1) - lo + 1, 0).to(gl.uint32)


@gluon.jit
def _fwd_softmax(sc, m_i, l_i, offs_m, k_start, first, qk_scale, BLOCK_N: gl.constexpr, is_causal: gl.constexpr,
                 band, EDGES: gl.constexpr, IS_VARLEN: gl.constexpr):
    """P (fp32), the new running max (base 2), sum and the factor exp2(m_old - m_new) for one S tile; on a
    tile that crosses this warpgroup's causal diagonal, query i sees key j iff i >= j. With EDGES (a window or packed
    sequences; band: (left, right, keys), causal folded in) query i sees key j iff i - left <= j <= i + right and
    j < keys, on the tiles those edges cut; a row may see no key of its first tiles: its max stays -inf and its
    exponentials are taken against 0 (0, not NaN)."""
    if EDGES:
        left, right, n_k = band
        if ((first + sc.shape[0] - 1 - left > k_start) | (k_start + BLOCK_N - 1 - right > first)
                | (k_start + BLOCK_N > n_k)):
            offs_n = k_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, sc.type.layout))
            if IS_VARLEN:  # (the count spills in the packed d-64 loop and timed no faster there)
                i = gl.expand_dims(offs_m, 1)
                j = gl.expand_dims(offs_n, 0)
                sc = gl.where((j >= i - left) & (j <= i + right) & (j < n_k), sc, float("-inf"))
            else:
                lo, count = _band_rows(offs_m, left, right, n_k)
                seen = (gl.expand_dims(offs_n, 0) - gl.expand_dims(lo, 1)).to(gl.uint32) < gl.expand_dims(count, 1)
                sc = gl.where(seen, sc, float("-inf"))
    elif is_causal:
        if k_start + BLOCK_N > first:
            offs_n = k_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, sc.type.layout))
            sc = gl.where(gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0), sc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, axis=1) * qk_scale)
    if EDGES:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(sc * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def _fwd_store_o(o, q_tile, o_desc, row, col):
    """O from registers by TMA, through this warpgroup's Q tile (no longer read)."""
    q_tile.store(o.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row, col], q_tile)
    tma.store_wait(pendings=0)


@gluon.jit
def _fwd_live_tiles(first, k_first, n_tiles, band, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    is_causal: gl.constexpr, EDGES: gl.constexpr):
    """(lo, hi): the program's key tiles lo to hi - 1 (of n_tiles from key k_first) hold every key that a
    warpgroup's BLOCK_M rows from query `first` see; at least one (rows that see no key still store O and L).
    The others are masked whole for these rows: skipping them leaves the row max, sum and O as they were. Without
    a band or causal mask: every tile."""
    lo = 0
    hi = n_tiles
    if EDGES:
        left, right, n_k = band
        lo = gl.maximum(first - left, 0) // BLOCK_N - k_first // BLOCK_N
        hi = gl.cdiv(gl.minimum(first + BLOCK_M + right, n_k), BLOCK_N) - k_first // BLOCK_N
    elif is_causal:  # from key 0
        hi = gl.cdiv(first + BLOCK_M, BLOCK_N)
    if EDGES or is_causal:
        hi = gl.maximum(gl.minimum(hi, n_tiles), 1)  # (a packed sequence without keys: its one masked tile)
        lo = gl.minimum(lo, hi - 1)
    return lo, hi


@gluon.jit
def _fwd_idle(ready_k, ready_v, empty_k, empty_v, turn, t_first, t_end, STAGES: gl.constexpr,
              WARPGROUPS: gl.constexpr, ROLE: gl.constexpr):
    """Key tiles t_first to t_end - 1 of a consumer that reads none of them (its rows see none of their keys, or
    lie past the queries): per tile it passes the turn on and frees K and V once they have arrived (so that each
    release counts towards that tile's phase), as a working consumer would."""
    for j in range(t_first, t_end):
        s = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(turn.index(ROLE), j & 1)
        mbarrier.arrive(turn.index((ROLE + 1) % WARPGROUPS))
        mbarrier.wait(ready_k.index(s), phase)
        mbarrier.arrive(empty_k.index(s))
        mbarrier.wait(ready_v.index(s), phase)
        mbarrier.arrive(empty_v.index(s))


@gluon.jit
def _fwd_consumer(o_desc, O_ptr, q_smem, k_smem, v_smem, q_bar, ready_k, ready_v, empty_k, empty_v, turn, L_ptr,
                  q_row, q_col, l_row, q_start, k_first, n_tiles, n_q, row_stride, scale, band,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                  is_causal: gl.constexpr, EDGES: gl.constexpr, IS_VARLEN: gl.constexpr, WARPGROUPS: gl.constexpr,
                  ROLE: gl.constexpr):
    """Consumer ROLE (of WARPGROUPS): query rows q_start + ROLE·BLOCK_M onwards (none stored from n_q on), over
    n_tiles key tiles from key k_first."""
    first = q_start + ROLE * BLOCK_M  # this warpgroup's first query
    mbarrier.wait(q_bar, 0)
    if ROLE == WARPGROUPS - 1:
        mbarrier.arrive(turn.index(0))  # warpgroup 0 issues first
    if first >= n_q:  # every row past the queries (the last tile's padding): no matmuls, only the hand-offs
        _fwd_idle(ready_k, ready_v, empty_k, empty_v, turn, 0, n_tiles, STAGES, WARPGROUPS, ROLE)
    else:  # the tiles its own rows' band meets (the program's serve all its warpgroups); only hand-offs on the rest
        lo, hi = _fwd_live_tiles(first, k_first, n_tiles, band, BLOCK_M, BLOCK_N, is_causal, EDGES)
        _fwd_idle(ready_k, ready_v, empty_k, empty_v, turn, 0, lo, STAGES, WARPGROUPS, ROLE)
        _fwd_rows(o_desc, O_ptr, q_smem.index(ROLE), k_smem, v_smem, ready_k, ready_v, empty_k, empty_v, turn, L_ptr,
                  q_row, q_col, l_row, first, k_first, lo, hi - lo, n_q, row_stride, scale, band, BLOCK_M, BLOCK_N,
                  D, STAGES, is_causal, EDGES, IS_VARLEN, WARPGROUPS, ROLE)
        _fwd_idle(ready_k, ready_v, empty_k, empty_v, turn, hi, n_tiles, STAGES, WARPGROUPS, ROLE)


@gluon.jit
def _fwd_rows(o_desc, O_ptr, q_tile, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v, turn, L_ptr, q_row, q_col,
              l_row, first, k_first, t0, n, n_q, row_stride, scale, band, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, is_causal: gl.constexpr,
              EDGES: gl.constexpr, IS_VARLEN: gl.constexpr, WARPGROUPS: gl.constexpr, ROLE: gl.constexpr):
    """Consumer ROLE's rows from query `first` (some of them before n_q): S, P and O over the program's key tiles t0
    to t0 + n - 1 (tile t from key k_first + t·BLOCK_N, in stage t % STAGES), then O and L stored."""
    o, m_i, l_i, offs_m = fwd_mainloop(q_tile, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v, turn, first,
                                       k_first, t0, 0, n, scale, band, None, BLOCK_M, BLOCK_N, D, STAGES, is_causal,
                                       EDGES, IS_VARLEN, WARPGROUPS, ROLE, False)
    if IS_VARLEN:  # a row whose sequence holds no key it sees: O = 0, L = -inf
        seen = l_i > 0
        m_i = gl.where(seen, m_i, float("-inf"))
        l_i = gl.where(seen, l_i, 1.0)
    o = o / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o.type.layout)), 1)
    row = q_row + ROLE * BLOCK_M
    if IS_VARLEN:
        gl.store(L_ptr + l_row + offs_m, (m_i + gl.log2(l_i)) * LN2, mask=offs_m < n_q)
        if first + BLOCK_M <= n_q:
            _fwd_store_o(o, q_tile, o_desc, row, q_col)
        else:  # the sequence's last rows: from registers (the rows after them are the next sequence's)
            store_rows(O_ptr, o, row, q_col, n_q - first, row_stride)
    else:
        gl.store(L_ptr + l_row + offs_m, (m_i + gl.log2(l_i)) * LN2)
        _fwd_store_o(o, q_tile, o_desc, row, q_col)


@gluon.jit
def fwd_mainloop(q_tile, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v, turn, first, k_first, t0, ring_first, n,
                 scale, band, released, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                 STAGES: gl.constexpr, is_causal: gl.constexpr, EDGES: gl.constexpr, IS_VARLEN: gl.constexpr,
                 WARPGROUPS: gl.constexpr, ROLE: gl.constexpr, RELEASE: gl.constexpr):
    """A consumer warpgroup's S, P and O for BLOCK_M query rows from `first` over n key tiles from ring slot t0 (the
    ring's stages and phases count slots: slot t in stage t % STAGES), slot t holding the keys from
    k_first + (t - ring_first)·BLOCK_N. Returns O (fp32, not yet divided by the row sums), the row max (base 2), the
    row sums and the rows' query indices. With RELEASE, `released` (a barrier, and whether to arrive on it) is
    arrived on once the first S is issued and the TMA stores in flight have read their shared memory (a persistent
    program frees its previous tile's Q buffer, through which that tile's O went out)."""
    dtype: gl.constexpr = q_tile.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    offs_m = first + gl.arange(0, BLOCK_M, layout=row_s)
    qk_scale = scale * LOG2E
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    o = gl.zeros([BLOCK_M, D], gl.float32, o_layout)

    # its first live key tile: S only (there is no P·V before it)
    s0 = t0 % STAGES
    mbarrier.wait(turn.index(ROLE), t0 & 1)
    mbarrier.wait(ready_k.index(s0), (t0 // STAGES) & 1)
    sc = warpgroup_mma(q_tile, k_smem.index(s0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index((ROLE + 1) % WARPGROUPS))
    if RELEASE:
        bar, live = released
        if live:
            tma.store_wait(pendings=0)
            mbarrier.arrive(bar)
    sc = warpgroup_mma_wait(0, deps=(sc, ))
    mbarrier.arrive(empty_k.index(s0))
    p, m_i, l_i, alpha = _fwd_softmax(sc, m_i, l_i, offs_m, k_first + (t0 - ring_first) * BLOCK_N, first, qk_scale,
                                      BLOCK_N, is_causal, band, EDGES, IS_VARLEN)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    mbarrier.wait(turn.index(ROLE), (t0 + 1) & 1, pred=n > 1)
    for j in range(1, n):
        t = t0 + j
        s = t % STAGES
        sp = (t - 1) % STAGES
        mbarrier.wait(ready_k.index(s), (t // STAGES) & 1)
        sc = warpgroup_mma(q_tile, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(ready_v.index(sp), ((t - 1) // STAGES) & 1)
        o = warpgroup_mma(p_op, v_smem.index(sp), o, is_async=True)
        mbarrier.arrive(turn.index((ROLE + 1) % WARPGROUPS))
        sc = warpgroup_mma_wait(1, deps=(sc, ))
        mbarrier.arrive(empty_k.index(s))  # K_t read
        p, m_i, l_i, alpha = _fwd_softmax(sc, m_i, l_i, offs_m, k_first + (t - ring_first) * BLOCK_N, first,
                                          qk_scale, BLOCK_N, is_causal, band, EDGES, IS_VARLEN)
        # the turn for the next tile's matmuls, taken before the wait for P_{t-1}·V_{t-1}: a wait for every
        # matmul with nothing in between ptxas would move ahead of the exponentials above, and a barrier
        # wait (a branch) keeps it here
        mbarrier.wait(turn.index(ROLE), (t + 1) & 1, pred=j + 1 < n)
        o, p_op = warpgroup_mma_wait(0, deps=(o, p_op))
        mbarrier.arrive(empty_v.index(sp))  # V_{t-1} read
        o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    tl = t0 + n - 1
    sl = tl % STAGES
    mbarrier.wait(ready_v.index(sl), (tl // STAGES) & 1)
    o = warpgroup_mma(p_op, v_smem.index(sl), o, is_async=True)
    o, p_op = warpgroup_mma_wait(0, deps=(o, p_op))
    mbarrier.arrive(empty_v.index(sl))
    return o, m_i, l_i, offs_m


@gluon.jit(do_not_specialize=BY_LENGTH + ("WINDOW_LEFT", "WINDOW_RIGHT", "N_SEQS"))
def flash_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, o_desc, L_ptr, N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, WINDOW_LEFT, WINDOW_RIGHT,
    O_ptr, CU_SEQLENS_Q, CU_SEQLENS_K, TILES, N_SEQS, HEAD_GROUP, TAIL,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
    WARPGROUPS: gl.constexpr, is_causal: gl.constexpr, HAS_WINDOW: gl.constexpr, IS_VARLEN: gl.constexpr,
    Q_INSIDE: gl.constexpr, K_INSIDE: gl.constexpr, V_INSIDE: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (batch·heads, query tiles of WARPGROUPS·BLOCK_M, 1 to 3 consumer warpgroups) in `grouped_program`'s
    order (HEAD_GROUP, TAIL; a window's, the plain order), the longest causal tiles of a group first. Q, O: (B·H·Nq,
    D) views in BLOCK_M-row blocks (Nq a multiple of BLOCK_M); K, V: (B·Hkv·Nk, D) in BLOCK_N-row blocks; with
    Q_INSIDE (O then lies as Q), K_INSIDE, V_INSIDE that tensor is instead a (B·S, H·D) view of (B, S, H, D) memory,
    a head's D columns per box (`head_tile`); L: contiguous (B·H, Nq) fp32, natural log. With HAS_WINDOW (the window
    as `chooser.band` gives it, causal folded in; self-attention, so that every query sees its own key) a program
    streams only the key tiles its rows' bands meet.

    With IS_VARLEN (packed sequences): grid (heads, slots); slot i runs query tile TILES[i, 1] of sequence TILES[i, 0]
    (N_SEQS: a spare slot, which stores nothing); Q, O: (total_q, H·D) views, K, V: (total_k, Hkv·D), a head's D
    columns per box; O_ptr: O; L: (H, total_q); N_QUERIES, N_KEYS the totals; the band (the window's, or unbounded
    sides) bounds the keys as a window's does, each tile checks the band and the sequence's end at run time, and a
    sequence's last rows are stored with a mask (the rows after them are the next sequence's)."""
    ROWS: gl.constexpr = WARPGROUPS * BLOCK_M
    if IS_VARLEN:
        head = gl.program_id(0)
        slot = gl.program_id(1)
        q_start = gl.load(TILES + 2 * slot + 1) * ROWS
        q0, k0, n_q, n_k = packed_sequence(CU_SEQLENS_Q, CU_SEQLENS_K, gl.load(TILES + 2 * slot), N_SEQS)
        q_row = q0 + q_start
        q_col = head * D
        kv_row = k0
        kv_col = head // KV_GROUP * D
        v_row = kv_row
        v_col = kv_col
        l_row = head * N_QUERIES + q0
        j0 = gl.maximum(q_start - WINDOW_LEFT, 0) // BLOCK_N
        # (at least one tile: a program without keys still takes its turns, every score masked)
        n_tiles = gl.maximum(gl.cdiv(gl.minimum(q_start + ROWS + WINDOW_RIGHT, n_k), BLOCK_N) - j0, 1)
    else:
        if HAS_WINDOW:  # (the plain order, `_fwd_launch_plan`: fewer registers, no spills in the windowed loop)
            batch_head, step = gl.program_id(0), gl.program_id(1)
        else:
            batch_head, step = grouped_program(HEAD_GROUP, TAIL)
        if is_causal:
            tile = gl.num_programs(1) - 1 - step
        else:
            tile = step
        q_start = tile * ROWS
        l_row = batch_head * N_QUERIES
        q_row, q_col = head_tile(batch_head, 0, q_start, N_HEADS, N_QUERIES, D, Q_INSIDE)
        kv_row, kv_col, v_row, v_col = kv_tiles_at(batch_head, 0, N_HEADS, KV_GROUP, N_KEYS, D, K_INSIDE, V_INSIDE)
        n_q = N_QUERIES
        n_k = N_KEYS
        if HAS_WINDOW:  # the keys from the first row's left edge to the last row's right edge
            j0 = gl.maximum(q_start - WINDOW_LEFT, 0) // BLOCK_N
            n_tiles = gl.cdiv(gl.minimum(q_start + ROWS + WINDOW_RIGHT, N_KEYS), BLOCK_N) - j0
        elif is_causal:  # top-left: the keys up to the tile's last query
            j0 = 0
            n_tiles = gl.cdiv(gl.minimum(q_start + ROWS, N_KEYS), BLOCK_N)
        else:
            j0 = 0
            n_tiles = N_KEYS // BLOCK_N
    EDGES: gl.constexpr = HAS_WINDOW or IS_VARLEN
    band = (WINDOW_LEFT, WINDOW_RIGHT, n_k)
    k_first = j0 * BLOCK_N
    dtype: gl.constexpr = q_desc.dtype

    q_smem = gl.allocate_shared_memory(dtype, [WARPGROUPS, BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_v = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_v = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [WARPGROUPS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    # Q's loads here, at entry: the partitions (the producer's too) start later
    mbarrier.expect(q_bar, WARPGROUPS * q_desc.block_type.nbytes)
    for r in gl.static_range(WARPGROUPS):
        tma.async_copy_global_to_shared(q_desc, [q_row + r * BLOCK_M, q_col], q_bar, q_smem.index(r))
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_k.index(i), count=1)
        mbarrier.init(ready_v.index(i), count=1)
        mbarrier.init(empty_k.index(i), count=WARPGROUPS)
        mbarrier.init(empty_v.index(i), count=WARPGROUPS)
    for i in gl.static_range(WARPGROUPS):
        mbarrier.init(turn.index(i), count=1)

    if WARPGROUPS == 1:
        gl.warp_specialize([
            (_fwd_consumer, (o_desc, O_ptr, q_smem, k_smem, v_smem, q_bar, ready_k, ready_v, empty_k, empty_v, turn,
                             L_ptr, q_row, q_col, l_row, q_start, k_first, n_tiles, n_q, N_HEADS * D, scale, band,
                             BLOCK_M, BLOCK_N, D, STAGES, is_causal, EDGES, IS_VARLEN, WARPGROUPS, 0)),
            (_fwd_producer, (k_desc, v_desc, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v, kv_row + k_first,
                             kv_col, v_row + k_first, v_col, n_tiles, BLOCK_N, STAGES)),
        ], [1], [24])
    elif WARPGROUPS == 2:
        gl.warp_specialize([
            (_fwd_consumer, (o_desc, O_ptr, q_smem, k_smem, v_smem, q_bar, ready_k, ready_v, empty_k, empty_v, turn,
                             L_ptr, q_row, q_col, l_row, q_start, k_first, n_tiles, n_q, N_HEADS * D, scale, band,
                             BLOCK_M, BLOCK_N, D, STAGES, is_causal, EDGES, IS_VARLEN, WARPGROUPS, 0)),
            (_fwd_consumer, (o_desc, O_ptr, q_smem, k_smem, v_smem, q_bar, ready_k, ready_v, empty_k, empty_v, turn,
                             L_ptr, q_row, q_col, l_row, q_start, k_first, n_tiles, n_q, N_HEADS * D, scale, band,
                             BLOCK_M, BLOCK_N, D, STAGES, is_causal, EDGES, IS_VARLEN, WARPGROUPS, 1)),
            (_fwd_producer, (k_desc, v_desc, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v, kv_row + k_first,
                             kv_col, v_row + k_first, v_col, n_tiles, BLOCK_N, STAGES)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_fwd_consumer, (o_desc, O_ptr, q_smem, k_smem, v_smem, q_bar, ready_k, ready_v, empty_k, empty_v, turn,
                             L_ptr, q_row, q_col, l_row, q_start, k_first, n_tiles, n_q, N_HEADS * D, scale, band,
                             BLOCK_M, BLOCK_N, D, STAGES, is_causal, EDGES, IS_VARLEN, WARPGROUPS, 0)),
            (_fwd_consumer, (o_desc, O_ptr, q_smem, k_smem, v_smem, q_bar, ready_k, ready_v, empty_k, empty_v, turn,
                             L_ptr, q_row, q_col, l_row, q_start, k_first, n_tiles, n_q, N_HEADS * D, scale, band,
                             BLOCK_M, BLOCK_N, D, STAGES, is_causal, EDGES, IS_VARLEN, WARPGROUPS, 1)),
            (_fwd_consumer, (o_desc, O_ptr, q_smem, k_smem, v_smem, q_bar, ready_k, ready_v, empty_k, empty_v, turn,
                             L_ptr, q_row, q_col, l_row, q_start, k_first, n_tiles, n_q, N_HEADS * D, scale, band,
                             BLOCK_M, BLOCK_N, D, STAGES, is_causal, EDGES, IS_VARLEN, WARPGROUPS, 2)),
            (_fwd_producer, (k_desc, v_desc, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v, kv_row + k_first,
                             kv_col, v_row + k_first, v_col, n_tiles, BLOCK_N, STAGES)),
        ], [4, 4, 1], [REGS_3WG, REGS_3WG, 24])
