"""The dK/dV pass with the keys on rows (`flash_bwd_kv_gluon_kernel`, opt-in:
`KernelOptions(gluon_kv=True, kv_qrows=False)`); its wgmma schedule is in the package docstring."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_init, \
    warpgroup_mma_wait

from cs336_systems.flash.gluon.common import BY_LENGTH, LOG2E, issue_tile_loads, kv_program, kv_program_end, \
    kv_program_start, kv_tiles_at, tile_rows


@gluon.jit(do_not_specialize=BY_LENGTH)
def flash_bwd_kv_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, L_ptr, Delta_ptr,
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, HEAD_GROUP, TAIL,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
    is_causal: gl.constexpr, Q_INSIDE: gl.constexpr, K_INSIDE: gl.constexpr, V_INSIDE: gl.constexpr,
    DO_INSIDE: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (batch·kv_heads, key tiles). Q, dO: (B·H·Nq, D) views; K, V, dK, dV: (B·Hkv·Nk, D) (each, with its
    *_INSIDE flag, the (B·S, H·D) view of (B, S, H, D) memory instead, `head_tile`; dK, dV as K, V); L
    (natural log) and delta: contiguous (B·H, Nq) fp32, loaded one query tile ahead (global-load
    latency off the path from the Sᵀ wait to the exponentials)."""
    dtype: gl.constexpr = q_desc.dtype
    k_start, first_head = kv_program(N_HEADS, KV_GROUP, HEAD_GROUP, TAIL, BLOCK_N)
    kv_at = kv_tiles_at(first_head, k_start, N_HEADS, KV_GROUP, N_KEYS, D, K_INSIDE, V_INSIDE)

    # Sᵀ, dPᵀ: (BLOCK_N keys, BLOCK_M queries); dK, dV: (BLOCK_N, D). Warps along keys.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per query (a column of Sᵀ)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # per key

    k_smem, v_smem, q_smem, do_smem, ready, kv_bar, q_first, n_vis, total = kv_program_start(
        q_desc, k_desc, v_desc, do_desc, k_start, kv_at, first_head, N_QUERIES, N_HEADS, KV_GROUP, BLOCK_M, STAGES,
        is_causal, Q_INSIDE, DO_INSIDE)

    qk_scale = scale * LOG2E
    offs_m = gl.arange(0, BLOCK_M, layout=col_layout)
    offs_k = k_start + gl.arange(0, BLOCK_N, layout=row_layout)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, D], gl.float32, acc_layout))  # in flight across iterations
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, D], gl.float32, acc_layout))
    # the register operands of the last dV and dK wgmmas, kept alive until the wait that retires them
    p_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, a_layout)
    ds_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, a_layout)
    lse_next, delta_next = tile_rows(L_ptr, Delta_ptr, offs_m, 0, total, n_vis, first_head, q_first, N_QUERIES,
                                      BLOCK_M)
    mbarrier.wait(kv_bar, 0)

    for t in range(total):
        s = t % STAGES
        q_start = q_first + (t % n_vis) * BLOCK_M
        lse = lse_next
        delta = delta_next
        lse_next, delta_next = tile_rows(L_ptr, Delta_ptr, offs_m, t + 1, total, n_vis, first_head, q_first,
                                          N_QUERIES, BLOCK_M)
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        q_tile = q_smem.index(s)
        do_tile = do_smem.index(s)
        sT = warpgroup_mma(k_smem, q_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v_smem, do_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        sT, dk, dv, p_op, ds_op = warpgroup_mma_wait(1, deps=(sT, dk, dv, p_op, ds_op))
        # tile t-1's matmuls are done: its stage takes the tile STAGES-1 ahead
        issue_tile_loads(q_desc, do_desc, q_smem, do_smem, ready, t + STAGES - 1, total, n_vis, first_head,
                          q_first, N_QUERIES, N_HEADS, BLOCK_M, STAGES, Q_INSIDE, DO_INSIDE)
        pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse, 0))
        if is_causal:
            if q_start - q_first < BLOCK_N:  # a tile on the diagonal: query i sees key j iff i >= j
                keep = gl.expand_dims(q_start + offs_m, 0) >= gl.expand_dims(offs_k, 1)
                pT = gl.where(keep, pT, 0.0)
        p_op = gl.convert_layout(pT.to(dtype), a_layout)
        dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
        dpT = warpgroup_mma_wait(1, deps=(dpT, ))
        ds_op = gl.convert_layout((pT * (dpT - gl.expand_dims(delta, 0))).to(dtype), a_layout)
        dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)

    dk, dv, p_op, ds_op = warpgroup_mma_wait(0, deps=(dk, dv, p_op, ds_op))
    k_row, k_col, v_row, v_col = kv_at
    kv_program_end(dk, dv, scale, dk_desc, dv_desc, k_row, k_col, v_row, v_col, ready, kv_bar, STAGES)
