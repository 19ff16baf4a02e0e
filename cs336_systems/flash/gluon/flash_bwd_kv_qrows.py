"""The dK/dV pass with the queries on rows (`flash_bwd_kv_qrows_gluon_kernel`, shipped for the two-pass
backward) and, with DQ_ATOMIC, the single pass built on it (an ablation variant): its query tile and its kernel,
whose docstring has the schedule."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from cs336_systems.flash.gluon.common import BY_LENGTH, LOG2E, issue_tile_loads, kv_program, kv_program_end, \
    kv_program_start, kv_tiles_at, tile_row, tile_rows, tma_reduce_add


@gluon.jit
def _kv_qrows_tile(t, dk, dv, lse, delta, q_desc, do_desc, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, ready,
                   L_ptr, Delta_ptr, offs_m, offs_k, zero_s, total, n_vis, first_head, q_first, N_QUERIES, N_HEADS,
                   qk_scale, dq_desc, dq_smem, zero_dq, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                   MASKED: gl.constexpr, DQ_ATOMIC: gl.constexpr, Q_INSIDE: gl.constexpr, DO_INSIDE: gl.constexpr):
    """Query tile t of `flash_bwd_kv_qrows_gluon_kernel` (its L and delta given; the next tile's returned);
    MASKED: the tile on the diagonal; DQ_ATOMIC: also dQ = dS·K, reduced into the accumulator behind dq_desc
    through buffer t % 2 of dq_smem. Every wgmma is retired before it returns: one in flight across the
    caller's loop makes ptxas serialize every wgmma of the kernel (C7515)."""
    dtype: gl.constexpr = q_smem.dtype
    s = t % STAGES
    lse_next, delta_next = tile_rows(L_ptr, Delta_ptr, offs_m, t + 1, total, n_vis, first_head, q_first, N_QUERIES,
                                      BLOCK_M)
    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
    q_tile = q_smem.index(s)
    do_tile = do_smem.index(s)
    sc = warpgroup_mma(q_tile, k_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_tile, v_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    sc = warpgroup_mma_wait(1, deps=(sc, ))
    gl.thread_barrier()  # every warpgroup is past tile t-1: P, dS and its stage are free
    issue_tile_loads(q_desc, do_desc, q_smem, do_smem, ready, t + STAGES - 1, total, n_vis, first_head, q_first,
                      N_QUERIES, N_HEADS, BLOCK_M, STAGES, Q_INSIDE, DO_INSIDE)
    p = gl.exp2(sc * qk_scale - gl.expand_dims(lse, 1))
    if MASKED:  # query i sees key j iff i >= j
        q_start = q_first + (t % n_vis) * BLOCK_M
        keep = gl.expand_dims(q_start + offs_m, 1) >= gl.expand_dims(offs_k, 0)
        p = gl.where(keep, p, 0.0)
    p_smem.store(p.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    dv = warpgroup_mma(p_smem.permute((1, 0)), do_tile, dv, is_async=True)
    dp = warpgroup_mma_wait(1, deps=(dp, ))
    ds = p * (dp - gl.expand_dims(delta, 1))
    ds_smem.store(ds.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    if DQ_ATOMIC:  # dQ = dS·K first: its wait, store and TMA reduction run under dK's matmul
        dq = warpgroup_mma(ds_smem, k_smem, zero_dq, use_acc=False, is_async=True)
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q_tile, dk, is_async=True)
        dq = warpgroup_mma_wait(1, deps=(dq, ))
        # through buffer t % 2, once the reduction that last read it (tile t-2's) is done
        tma.store_wait(pendings=1)
        gl.thread_barrier()  # (the wait holds only in the thread that issued the reductions)
        buf = dq_smem.index(t % 2)
        buf.store(dq)
        fence_async_shared()
        tma_reduce_add(dq_desc, [tile_row(t, n_vis, first_head, q_first, N_QUERIES, BLOCK_M), 0], buf)
    else:
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q_tile, dk, is_async=True)
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    return dk, dv, lse_next, delta_next


@gluon.jit(do_not_specialize=BY_LENGTH)
def flash_bwd_kv_qrows_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, L_ptr, Delta_ptr, dq_desc,
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, HEAD_GROUP, TAIL,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
    is_causal: gl.constexpr, DQ_ATOMIC: gl.constexpr, Q_INSIDE: gl.constexpr, K_INSIDE: gl.constexpr,
    V_INSIDE: gl.constexpr, DO_INSIDE: gl.constexpr, num_warps: gl.constexpr,
):
    """`flash_bwd_kv_gluon_kernel` with the queries on rows (FlashAttention-3's backward layout).

    S = Q·Kᵀ and dP = dO·Vᵀ are (BLOCK_M queries, BLOCK_N keys), one warpgroup per 64 queries (so the
    matmuls are BLOCK_N wide and each thread holds L and delta of two rows); P and dS go to shared memory
    in Q's dtype, and dV += Pᵀ·dO, dK += dSᵀ·Q read them back transposed, one warpgroup per 64 keys (both
    operands from shared memory). Per query tile t (`_kv_qrows_tile`):
        issue  S, dP                                   wait S
        barrier (every warpgroup past tile t-1: P, dS and t-1's stage free)   TMA tile t+STAGES-1
        P = exp2(S·scale·log2 e - L) -> shared         (runs under dP's matmul)
        barrier, issue dV += Pᵀ·dO                     wait dP
        dS = P·(dP - delta) -> shared                  (runs under dV's matmul)
        barrier, issue dK += dSᵀ·Q, wait dV, dK
    BLOCK_M = BLOCK_N = 16·num_warps (a warpgroup per 64 rows of both layouts). With DQ_ATOMIC it is the
    single-pass backward: before dK it issues dQ = dS·K (dS and the resident K tile from shared memory; a
    warpgroup per 64 query rows), waits for dQ alone, stores the fp32 tile into one of two shared buffers (free
    once the reduction two tiles back has read it) and adds it to the (B·H·Nq, D) accumulator behind dq_desc
    with one TMA bulk reduction, while dK's matmul runs."""
    dtype: gl.constexpr = q_desc.dtype
    k_start, first_head = kv_program(N_HEADS, KV_GROUP, HEAD_GROUP, TAIL, BLOCK_N)
    kv_at = kv_tiles_at(first_head, k_start, N_HEADS, KV_GROUP, N_KEYS, D, K_INSIDE, V_INSIDE)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, D, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # per query
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per key
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth)

    k_smem, v_smem, q_smem, do_smem, ready, kv_bar, q_first, n_vis, total = kv_program_start(
        q_desc, k_desc, v_desc, do_desc, k_start, kv_at, first_head, N_QUERIES, N_HEADS, KV_GROUP, BLOCK_M, STAGES,
        is_causal, Q_INSIDE, DO_INSIDE)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_layout)

    qk_scale = scale * LOG2E
    offs_m = gl.arange(0, BLOCK_M, layout=row_layout)
    offs_k = k_start + gl.arange(0, BLOCK_N, layout=col_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    dk = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
    lse, delta = tile_rows(L_ptr, Delta_ptr, offs_m, 0, total, n_vis, first_head, q_first, N_QUERIES, BLOCK_M)
    # dQ = dS·K of a tile (DQ_ATOMIC): (BLOCK_M, D) fp32, added to the (B·H·Nq, D) accumulator by TMA reductions
    zero_dq = gl.zeros([BLOCK_M, D], gl.float32, acc_layout)
    if DQ_ATOMIC:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, D], dq_desc.layout)
    else:
        dq_smem = k_smem  # unused
    mbarrier.wait(kv_bar, 0)

    # per query head of the group: under causal masking its first tile is the diagonal one (BLOCK_M = BLOCK_N,
    # q_first = k_start), the only one that needs the mask
    for g in range(KV_GROUP):
        t0 = g * n_vis
        if is_causal:
            if n_vis > 0:
                dk, dv, lse, delta = _kv_qrows_tile(
                    t0, dk, dv, lse, delta, q_desc, do_desc, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, ready,
                    L_ptr, Delta_ptr, offs_m, offs_k, zero_s, total, n_vis, first_head, q_first, N_QUERIES, N_HEADS,
                    qk_scale, dq_desc, dq_smem, zero_dq, BLOCK_M, STAGES, True, DQ_ATOMIC, Q_INSIDE, DO_INSIDE)
            first = 1
        else:
            first = 0
        for j in range(first, n_vis):
            dk, dv, lse, delta = _kv_qrows_tile(
                t0 + j, dk, dv, lse, delta, q_desc, do_desc, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, ready,
                L_ptr, Delta_ptr, offs_m, offs_k, zero_s, total, n_vis, first_head, q_first, N_QUERIES, N_HEADS,
                qk_scale, dq_desc, dq_smem, zero_dq, BLOCK_M, STAGES, False, DQ_ATOMIC, Q_INSIDE, DO_INSIDE)
    if DQ_ATOMIC:  # the last reductions read dq_smem, whose space the epilogue may reuse
        tma.store_wait(pendings=0)
        gl.thread_barrier()

    k_row, k_col, v_row, v_col = kv_at
    kv_program_end(dk, dv, scale, dk_desc, dv_desc, k_row, k_col, v_row, v_col, ready, kv_bar, STAGES)
