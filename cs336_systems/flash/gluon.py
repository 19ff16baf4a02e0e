"""Kernels in Gluon for Hopper (sm_90a): the forward, the dK/dV pass and the single-pass backwards (shipped
for large calls: the forward, the keys-on-rows single pass at d 64 and 128, the queries-on-rows dK/dV pass for
the deterministic two-pass backward).

The forward (`flash_fwd_gluon_kernel`, `forward`) is FlashAttention-3's schedule: a producer warp, two or
three consumer warpgroups of 64 query rows that take turns at the tensor cores, and in each warpgroup the
softmax of one key tile under the previous tile's P·V (the schedule and its barriers are described above
the kernel). `flash_triton` runs it by default where `fwd_supported` holds and the call is large
(`chooser.GLUON_FWD_MIN_WORK`); on the H200 it takes less kernel time than the Triton forward at d 64 and 128
(docs/design.md).

The single pass at d 64 and 128 (`flash_bwd_single_keys_gluon_kernel`, `kv_pass(dq_acc=)`, shipped: `flash_triton`
runs it where `supported(single_pass=True)` holds and the call is large) is FlashAttention-3's d-64 backward: the
keys on rows, two compute warpgroups split along the keys so that P and dS stay in registers for dV and dK, dS to
shared memory only for dQ, a loader warp and a dQ warp (its schedule is described above the kernel); a tile of 128
keys × 128 queries at d 64, taken whole (FlashAttention-4's sm90 tile), and FlashAttention-3's d-128 tile, 64 queries
× 128 keys, at d 128. On the H200 it is faster than the queries-on-rows single pass below at d 64 and than the
two-pass backward at d 128 (docs/design.md).

The dK/dV pass does the work of `flash_triton.flash_bwd_kv_kernel` (one program per key tile, over every
query tile and every query head of its GQA group that sees it) in one of two layouts (`kv_pass(qrows=)`):

- `flash_bwd_kv_qrows_gluon_kernel` (shipped for the two-pass backward: `flash_triton` runs it where
  `supported(qrows=True)` holds and the call is large): S = Q·Kᵀ and dP = dO·Vᵀ with the queries on rows
  (BLOCK_N-wide matmuls, two L/delta values per thread), P and dS through shared memory into dV += Pᵀ·dO
  and dK += dSᵀ·Q (both operands from shared memory), the diagonal tile's mask outside the loop; faster than
  the Triton pass on the H200 at d 64 and 128. With DQ_ATOMIC (`kv_pass(qrows=True, dq_acc=)`,
  `KernelOptions.single_qrows`) the same kernel is a single-pass backward: dQ = dS·K from the shared dS and the
  resident K tile, its fp32 tile added into an accumulator by a TMA bulk reduction per tile through a double buffer
  (128 keys per program, which halves the reduction traffic that held every 64-key single pass back); the default
  single pass before the keys-on-rows kernel, kept as an ablation variant.
- `flash_bwd_kv_gluon_kernel` (opt-in, `KernelOptions(gluon_kv=True, kv_qrows=False)`): the keys on rows,
  as the Triton pass, with the wgmma schedule written out instead of left to Triton's pipeliner, which
  waits for every non-accumulating wgmma as soon as it is issued:

    per query tile t (stage s of a TMA ring of Q and dO tiles):
        issue  Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ                      (both async)
        wait   until only dPᵀ is in flight  -> Sᵀ ready; dV, dK of tile t-1 done, stage of t-1 free
        TMA    the tile t+STAGES-1 into the stage t-1 used
        Pᵀ = exp2(Sᵀ·scale·log2 e - L)                        (runs under dPᵀ's matmul)
        issue  dV += Pᵀ·dO                                     (Pᵀ from registers)
        wait   until only dV is in flight   -> dPᵀ ready
        dSᵀ = Pᵀ·(dPᵀ - delta)                                 (runs under dV's matmul)
        issue  dK += dSᵀ·Q                                     (dSᵀ from registers)

  One warpgroup per program; the accumulators dK, dV stay in registers, K and V in shared memory. On the
  H200 it ties the Triton pass at d 64 and gains a little at d 128, long sequences.

The dK/dV passes start their programs a few heads at a time (`grouped_program`, `kv_head_groups`). The two-pass
dK/dV pass takes as many heads as fit the rows its programs stream (Q, dO, L, delta) in half the L2, then a last
group large enough not to leave its longest programs alone at the end (`head_groups`); with tile 0 of every head
first the resident programs of a 16-head call read rows of every head, which the L2 cannot hold. The single pass
takes a wave of lines a group (`wave_groups`: as many kv-head lines as their key tiles fill the SMs once): the L2
rule gave grouped-query calls, whose lines stream several heads' rows and fp32 dQ, a last group of most lines, and
the kernel ran up to 1.5x slower. The dense forward does the same with the K and V rows its programs stream
(`fwd_head_groups`): with more heads than SMs, tile 0 of every head first leaves each resident program on a head
of its own, and every query tile of a head reads its K and V from memory again. A window keeps the plain order
(neighbouring tiles read the same band).

Launches after the first of a signature call the compiled kernel's C launch directly (`_launch`), their TMA
descriptors from a cache by address (`_Compiled`); a caller that plans its calls (`flash_triton`) holds a `Launch`
per signature (`forward_launch`, `kv_launch`), which builds the arguments from a template fixed at its first call.
Scope (the caller checks `supported` / `fwd_supported` and otherwise runs the Triton kernel): CUDA
sm_90, bf16/fp16, head dim 64 or 128, contiguous (B, H, S, D) tensors, sequence lengths that divide
into the tiles; a sliding window (`band`) in the forward and the keys-on-rows single pass only, on
self-attention. Packed sequences (varlen) in the forward and the keys-on-rows single pass (`packed_forward`,
`packed_kv_pass`: any lengths, a window, grouped-query heads; a grid of (heads, slots) over a table of (sequence,
tile) slots made on the device, longest first; every tile checks the sequence's end at run time). Gluon has no
interpreter, so these kernels run only on the GPU (tests marked gpu).

Variants measured slower and removed (docs/design.md, "Designs tried", has each with its commit): K and V as
register operands of Sᵀ and dPᵀ; the next tile's Sᵀ issued before this tile's dSᵀ; a warp-specialized dK/dV pass,
a producer warp and two consumer warpgroups of 64 keys; the single-pass backward on the keys-on-rows kernel with
dQ by TMA bulk reductions, in two builds; the single pass on this queries-on-rows kernel with dQ by `red.global`
from registers; the keys-on-rows single pass without warp specialization, and with P rounded to bf16 for dS.

Layout, top-down: the dK/dV passes (helpers, kernels: keys on rows, then queries on rows), the single pass with
the keys on rows (loader warp, dQ warp, compute tile, kernel), the forward (producer, softmax step, consumer,
kernel), then the configs, `supported` / `fwd_supported` and the host launchers `kv_pass`, `packed_kv_pass`,
`packed_forward` and `forward`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_init, warpgroup_mma_wait
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cs336_systems.flash import background
from cs336_systems.flash.c_launch import CLaunch

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
# registers per thread of the forward's second and third consumer warpgroups (when it runs three)
REGS_3WG = gl.constexpr(160)
# registers per thread of the single pass's loader and dQ warps (`_single_keys_loader`, `_single_keys_dq_writer`)
WORKER_REGS = gl.constexpr(24)


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
    """First row of query tile t (n_vis tiles per query head of the group) in the (B·H·Nq, D) views of
    Q and dO, which is also its offset in the contiguous (B·H, Nq) L and delta."""
    return (first_head + t // n_vis) * N_QUERIES + q_first + (t % n_vis) * BLOCK_M


@gluon.jit
def issue_tile_loads(q_desc, do_desc, q_smem, do_smem, ready, t, total, n_vis, first_head, q_first, N_QUERIES,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """TMA of query tile t (of `total`) into stage t % STAGES; nothing past the last tile."""
    s = t % STAGES
    row = tile_row(t, n_vis, first_head, q_first, N_QUERIES, BLOCK_M)
    pred = t < total
    bar = ready.index(s)
    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [row, 0], bar, q_smem.index(s), pred=pred)
    tma.async_copy_global_to_shared(do_desc, [row, 0], bar, do_smem.index(s), pred=pred)


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
    tiles = gl.num_programs(1)
    lin = gl.program_id(0) + gl.program_id(1) * heads
    if lin < (heads - TAIL) * tiles:
        first = lin // (HEAD_GROUP * tiles) * HEAD_GROUP
        size = HEAD_GROUP
    else:
        first = heads - TAIL
        size = TAIL
    r = lin - first * tiles
    return first + r % size, r // size


@gluon.jit
def kv_program(N_HEADS, KV_GROUP, N_KEYS, HEAD_GROUP, TAIL, BLOCK_N: gl.constexpr):
    """A dK/dV program's key tile (grid (batch·kv_heads, key tiles), `grouped_program`'s order): (k_start, its
    first row in the (B·Hkv·Nk, D) views of K, V, dK, dV, the (batch·H) index of its group's first query
    head)."""
    batch_kv_head, key_tile = grouped_program(HEAD_GROUP, TAIL)
    k_start = key_tile * BLOCK_N
    n_kv_heads = N_HEADS // KV_GROUP
    batch = batch_kv_head // n_kv_heads
    kv_head = batch_kv_head % n_kv_heads
    return k_start, batch_kv_head * N_KEYS + k_start, batch * N_HEADS + kv_head * KV_GROUP


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
def _band_tiles(k_start, N_QUERIES, KV_GROUP, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr):
    """`visible_tiles` under a window: the query tiles holding a query i that sees a key j of the tile at k_start,
    j - right <= i <= j + left (self-attention, N_QUERIES in whole BLOCK_M)."""
    q_first = gl.maximum(k_start - WINDOW_RIGHT, 0) // BLOCK_M * BLOCK_M
    q_end = gl.minimum(k_start + BLOCK_N + WINDOW_LEFT, N_QUERIES)
    n_vis = gl.maximum(gl.cdiv(q_end - q_first, BLOCK_M), 0)
    return q_first, n_vis, KV_GROUP * n_vis


@gluon.jit
def kv_program_start(q_desc, k_desc, v_desc, do_desc, k_start, kv_row, first_head, N_QUERIES, KV_GROUP,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr, is_causal: gl.constexpr):
    """Shared memory for K, V and a ring of STAGES (Q, dO) tiles with its barriers; K, V and the first
    STAGES-1 query tiles on their way. Returns those and `visible_tiles`."""
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
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [kv_row, 0], kv_bar, v_smem)
    for i in gl.static_range(STAGES - 1):
        issue_tile_loads(q_desc, do_desc, q_smem, do_smem, ready, i, total, n_vis, first_head, q_first,
                          N_QUERIES, BLOCK_M, STAGES)
    return k_smem, v_smem, q_smem, do_smem, ready, kv_bar, q_first, n_vis, total


@gluon.jit
def kv_barriers_invalidated(ready, kv_bar, STAGES: gl.constexpr):
    """The end of a dK/dV program's barriers (`kv_program_start`'s)."""
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(kv_bar)


@gluon.jit
def kv_program_end(dk, dv, scale, dk_desc, dv_desc, kv_row, ready, kv_bar, STAGES: gl.constexpr):
    """Barriers invalidated; dK·scale and dV stored (through shared memory, by TMA)."""
    dtype: gl.constexpr = dk_desc.dtype
    kv_barriers_invalidated(ready, kv_bar, STAGES)
    out_smem = gl.allocate_shared_memory(dtype, [2] + dk_desc.block_type.shape, dk_desc.layout)
    out_smem.index(0).store((dk * scale).to(dtype))
    out_smem.index(1).store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [kv_row, 0], out_smem.index(0))
    tma.async_copy_shared_to_global(dv_desc, [kv_row, 0], out_smem.index(1))
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


@gluon.jit(do_not_specialize=BY_LENGTH)
def flash_bwd_kv_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, L_ptr, Delta_ptr,
    N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, HEAD_GROUP, TAIL,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
    is_causal: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (batch·kv_heads, key tiles). Q, dO: (B·H·Nq, D) views; K, V, dK, dV: (B·Hkv·Nk, D); L
    (natural log) and delta: contiguous (B·H, Nq) fp32, loaded one query tile ahead (global-load
    latency off the path from the Sᵀ wait to the exponentials)."""
    dtype: gl.constexpr = q_desc.dtype
    k_start, kv_row, first_head = kv_program(N_HEADS, KV_GROUP, N_KEYS, HEAD_GROUP, TAIL, BLOCK_N)

    # Sᵀ, dPᵀ: (BLOCK_N keys, BLOCK_M queries); dK, dV: (BLOCK_N, D). Warps along keys.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per query (a column of Sᵀ)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # per key

    k_smem, v_smem, q_smem, do_smem, ready, kv_bar, q_first, n_vis, total = kv_program_start(
        q_desc, k_desc, v_desc, do_desc, k_start, kv_row, first_head, N_QUERIES, KV_GROUP, BLOCK_M, STAGES, is_causal)

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
                          q_first, N_QUERIES, BLOCK_M, STAGES)
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
    kv_program_end(dk, dv, scale, dk_desc, dv_desc, kv_row, ready, kv_bar, STAGES)


@gluon.jit
def _kv_qrows_tile(t, dk, dv, lse, delta, q_desc, do_desc, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, ready,
                   L_ptr, Delta_ptr, offs_m, offs_k, zero_s, total, n_vis, first_head, q_first, N_QUERIES, qk_scale,
                   dq_desc, dq_smem, zero_dq,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr, DQ_ATOMIC: gl.constexpr):
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
                      N_QUERIES, BLOCK_M, STAGES)
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
    is_causal: gl.constexpr, DQ_ATOMIC: gl.constexpr, num_warps: gl.constexpr,
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
    k_start, kv_row, first_head = kv_program(N_HEADS, KV_GROUP, N_KEYS, HEAD_GROUP, TAIL, BLOCK_N)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, D, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # per query
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per key
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth)

    k_smem, v_smem, q_smem, do_smem, ready, kv_bar, q_first, n_vis, total = kv_program_start(
        q_desc, k_desc, v_desc, do_desc, k_start, kv_row, first_head, N_QUERIES, KV_GROUP, BLOCK_M, STAGES, is_causal)
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
                    L_ptr, Delta_ptr, offs_m, offs_k, zero_s, total, n_vis, first_head, q_first, N_QUERIES, qk_scale,
                    dq_desc, dq_smem, zero_dq, BLOCK_M, STAGES, True, DQ_ATOMIC)
            first = 1
        else:
            first = 0
        for j in range(first, n_vis):
            dk, dv, lse, delta = _kv_qrows_tile(
                t0 + j, dk, dv, lse, delta, q_desc, do_desc, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, ready,
                L_ptr, Delta_ptr, offs_m, offs_k, zero_s, total, n_vis, first_head, q_first, N_QUERIES, qk_scale,
                dq_desc, dq_smem, zero_dq, BLOCK_M, STAGES, False, DQ_ATOMIC)
    if DQ_ATOMIC:  # the last reductions read dq_smem, whose space the epilogue may reuse
        tma.store_wait(pendings=0)
        gl.thread_barrier()

    kv_program_end(dk, dv, scale, dk_desc, dv_desc, kv_row, ready, kv_bar, STAGES)


@gluon.jit
def _query_tile(t, n_vis, first_head, q_first, q0, l0, N_QUERIES, BLOCK_M: gl.constexpr, D: gl.constexpr,
                IS_VARLEN: gl.constexpr):
    """Where query tile t of a single-pass program (n_vis tiles per query head of the group) lies: (row, column) in
    the views of Q and dO, row in the dQ accumulator's (·, D) view, (row, column) in the views of L and delta. Dense:
    rows of the (B·H·Nq, D) views (L and delta a row per query tile). Packed (IS_VARLEN, the sequence's first query
    at row q0): rows of the (total_q, H·D) views, a head's D columns; the accumulator (H, total_q, D); L and delta
    (H, ·) with the sequence from column l0 (a TMA box starts at a 16-byte-aligned address: `packed_rows`)."""
    head = first_head + t // n_vis
    local = q_first + (t % n_vis) * BLOCK_M
    if IS_VARLEN:
        row = q0 + local
        col = head * D
        acc_row = head * N_QUERIES + row
        l_row = head
        l_col = l0 + local
    else:
        row = head * N_QUERIES + local
        col = row * 0
        acc_row = row
        l_row = row // BLOCK_M
        l_col = col
    return row, col, acc_row, l_row, l_col


@gluon.jit
def _single_keys_loader(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, k_smem, v_smem, do_smem,
                        lse_smem, delta_smem, ready, empty, dq_full, kv_bar, kv_row, kv_col, total, n_vis,
                        first_head, q_first, q0, l0, N_QUERIES, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                        IS_VARLEN: gl.constexpr):
    """The loader warp of `flash_bwd_single_keys_gluon_kernel`: K and V once, then per query tile t, once its
    stage is free (`empty`: the compute warps are past tile t-STAGES), Q, dO, L and delta into stage t % STAGES
    (`ready`). It also passes the news on to the dQ warp: past tile t-STAGES, the compute warps have stored the
    dQ of tile t-STAGES-1 (`dq_full`), so that their loop arrives on one barrier per tile, not two."""
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row, kv_col], kv_bar, k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [kv_row, kv_col], kv_bar, v_smem.index(0))
    nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes
                            + delta_desc.block_type.nbytes)
    for t in range(total):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)  # (a fresh barrier passes phase 1)
        if t >= STAGES + 1:
            mbarrier.arrive(dq_full.index((t - STAGES - 1) % 2))
        row, col, _, l_row, l_col = _query_tile(t, n_vis, first_head, q_first, q0, l0, N_QUERIES, BLOCK_M,
                                                q_desc.block_type.shape[1], IS_VARLEN)
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, col], bar, q_smem.index(s))
        tma.async_copy_global_to_shared(do_desc, [row, col], bar, do_smem.index(s))
        tma.async_copy_global_to_shared(lse_desc, [l_row, l_col], bar, lse_smem.index(s))
        tma.async_copy_global_to_shared(delta_desc, [l_row, l_col], bar, delta_smem.index(s))


@gluon.jit
def _single_keys_dq_writer(dq_desc, x, y, dq_full, dq_empty, total, n_vis, first_head, q_first, q0, N_QUERIES,
                           BLOCK_M: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The dQ warp of `flash_bwd_single_keys_gluon_kernel`: per query tile u, once its dQ is in the buffer of u's
    parity (x: even, y: odd; `dq_full`), a TMA bulk reduction into the accumulator behind dq_desc; once it has read
    the buffer, the buffer goes back to the compute warps (`dq_empty`)."""
    for u in range(total):
        b = u % 2
        mbarrier.wait(dq_full.index(b), (u // 2) & 1)
        _, _, row, _, _ = _query_tile(u, n_vis, first_head, q_first, q0, q0, N_QUERIES, BLOCK_M,
                                      dq_desc.block_type.shape[1], IS_VARLEN)
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
    is_causal: gl.constexpr, HAS_WINDOW: gl.constexpr, IS_VARLEN: gl.constexpr, num_warps: gl.constexpr,
):
    """The single-pass backward with the keys on rows (FlashAttention-3's d-64 layout). Grid (batch·kv_heads,
    key tiles) as `flash_bwd_kv_gluon_kernel`; L (natural log) and delta come as (B·H·Nq / BLOCK_M, BLOCK_M)
    fp32 descriptors, a row per query tile. With IS_VARLEN, packed sequences (`_packed_kv_program`): grid
    (kv_heads, slots), a slot per key tile of a sequence (TILES), descriptors over the (total, heads·D) views of
    the packed Q, K, V, dO and over L and delta as (H, ·) rows (`packed_rows`); N_QUERIES, N_KEYS the totals;
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
        q_first, n_vis, total = _band_tiles(k_start, n_q, KV_GROUP, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N)
    else:
        k_start, kv_row, first_head = kv_program(N_HEADS, KV_GROUP, N_KEYS, HEAD_GROUP, TAIL, BLOCK_N)
        kv_col = k_start * 0
        q0 = kv_col
        l0 = kv_col
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
                               lse_smem, delta_smem, ready, empty, dq_full, kv_bar, kv_row, kv_col, total, n_vis,
                               first_head, q_first, q0, l0, N_QUERIES, BLOCK_M, STAGES, IS_VARLEN)),
        (_single_keys_dq_writer, (dq_desc, x, y, dq_full, dq_empty, total, n_vis, first_head, q_first, q0, N_QUERIES,
                                  BLOCK_M, IS_VARLEN)),
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
        kv_program_end(dk, dv, scale, dk_desc, dv_desc, kv_row, ready, kv_bar, STAGES)


# ----------------------------------------------------------------------------------------------
# The forward, warp-specialized (FlashAttention-3's schedule on Hopper)
# ----------------------------------------------------------------------------------------------
#
# One program per WARPGROUPS·BLOCK_M query rows: a one-warp producer loads Q once and streams K and V
# tiles of BLOCK_N keys through a TMA ring; WARPGROUPS (2 or 3) consumer warpgroups own BLOCK_M query rows
# each and share every K/V tile. Per key tile j a consumer
#     issues S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1} in its turn, hands the turn to the next warpgroup,
#     waits for S_j (P_{j-1}·V_{j-1} may still run) and frees K_j, computes P_j = exp2(S_j·scale·log2 e - m_j),
#     waits for its next turn, then for P_{j-1}·V_{j-1}, frees V_{j-1} and rescales O by exp2(m_{j-1} - m_j),
# so its exponentials run under its own P·V matmul and, through the turns (ping-pong), under the other
# warpgroups' matmuls: the warpgroups issue their matmuls one after another instead of in step. (At d 64
# the matmuls of one warpgroup take about as long as its softmax, so three warpgroups are needed to keep
# the tensor cores busy; at d 128 two suffice.)
#
# Barriers (phase of use k is k & 1; a fresh barrier counts as having completed the phase before 0):
#   q_bar      producer -> consumers: Q            ready_k[s], ready_v[s]  producer -> consumers: K, V in stage s
#   empty_k[s], empty_v[s]  consumers (all) -> producer: K (after S), V (after P·V) of stage s read
#   turn[r]    consumer r - 1 (mod WARPGROUPS) -> consumer r: r may issue its matmuls
# K and V are released apart: a consumer takes its next turn before its wait for P_{j-1}·V_{j-1} (below),
# so with one barrier per stage and two stages the producer's wait for stage j-2 and the turns would
# wait on each other.


@gluon.jit
def _fwd_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready_k, ready_v, empty_k, empty_v, q_row,
                  q_col, kv_row, kv_col, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  WARPGROUPS: gl.constexpr):
    mbarrier.expect(q_bar, WARPGROUPS * q_desc.block_type.nbytes)
    for r in gl.static_range(WARPGROUPS):
        tma.async_copy_global_to_shared(q_desc, [q_row + r * BLOCK_M, q_col], q_bar, q_smem.index(r))
    for j in range(n_tiles):
        s = j % STAGES
        phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(empty_k.index(s), phase)
        mbarrier.expect(ready_k.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, kv_col], ready_k.index(s), k_smem.index(s))
        mbarrier.wait(empty_v.index(s), phase)
        mbarrier.expect(ready_v.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, kv_col], ready_v.index(s), v_smem.index(s))


@gluon.jit
def _fwd_softmax(sc, m_i, l_i, offs_m, k_start, first, qk_scale, BLOCK_N: gl.constexpr, is_causal: gl.constexpr,
                 band, EDGES: gl.constexpr):
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
            i = gl.expand_dims(offs_m, 1)
            j = gl.expand_dims(offs_n, 0)
            sc = gl.where((j >= i - left) & (j <= i + right) & (j < n_k), sc, float("-inf"))
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
    dtype: gl.constexpr = o_desc.dtype
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
    sc = warpgroup_mma_wait(0, deps=(sc, ))
    mbarrier.arrive(empty_k.index(s0))
    p, m_i, l_i, alpha = _fwd_softmax(sc, m_i, l_i, offs_m, k_first + t0 * BLOCK_N, first, qk_scale, BLOCK_N,
                                      is_causal, band, EDGES)
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
        p, m_i, l_i, alpha = _fwd_softmax(sc, m_i, l_i, offs_m, k_first + t * BLOCK_N, first, qk_scale, BLOCK_N,
                                          is_causal, band, EDGES)
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

    if IS_VARLEN:  # a row whose sequence holds no key it sees: O = 0, L = -inf
        seen = l_i > 0
        m_i = gl.where(seen, m_i, float("-inf"))
        l_i = gl.where(seen, l_i, 1.0)
    o = o / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
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


@gluon.jit(do_not_specialize=BY_LENGTH + ("WINDOW_LEFT", "WINDOW_RIGHT", "N_SEQS"))
def flash_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, o_desc, L_ptr, N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale, WINDOW_LEFT, WINDOW_RIGHT,
    O_ptr, CU_SEQLENS_Q, CU_SEQLENS_K, TILES, N_SEQS, HEAD_GROUP, TAIL,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
    WARPGROUPS: gl.constexpr, is_causal: gl.constexpr, HAS_WINDOW: gl.constexpr, IS_VARLEN: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Grid (batch·heads, query tiles of WARPGROUPS·BLOCK_M, 2 or 3 consumer warpgroups) in `grouped_program`'s
    order (HEAD_GROUP, TAIL; a window's, the plain order), the longest causal tiles of a group first. Q, O: (B·H·Nq,
    D) views in BLOCK_M-row blocks (Nq a multiple of BLOCK_M); K, V: (B·Hkv·Nk, D) in BLOCK_N-row blocks; L:
    contiguous (B·H, Nq) fp32, natural log. With HAS_WINDOW (the window as `chooser.band` gives it, causal folded in;
    self-attention, so that every query sees its own key) a program streams only the key tiles its rows' bands
    meet.

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
        batch = batch_head // N_HEADS
        head = batch_head % N_HEADS
        kv_row = (batch * (N_HEADS // KV_GROUP) + head // KV_GROUP) * N_KEYS
        l_row = batch_head * N_QUERIES
        q_row = l_row + q_start
        q_col = 0
        kv_col = 0
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
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_k.index(i), count=1)
        mbarrier.init(ready_v.index(i), count=1)
        mbarrier.init(empty_k.index(i), count=WARPGROUPS)
        mbarrier.init(empty_v.index(i), count=WARPGROUPS)
    for i in gl.static_range(WARPGROUPS):
        mbarrier.init(turn.index(i), count=1)

    if WARPGROUPS == 2:
        gl.warp_specialize([
            (_fwd_consumer, (o_desc, O_ptr, q_smem, k_smem, v_smem, q_bar, ready_k, ready_v, empty_k, empty_v, turn,
                             L_ptr, q_row, q_col, l_row, q_start, k_first, n_tiles, n_q, N_HEADS * D, scale, band,
                             BLOCK_M, BLOCK_N, D, STAGES, is_causal, EDGES, IS_VARLEN, WARPGROUPS, 0)),
            (_fwd_consumer, (o_desc, O_ptr, q_smem, k_smem, v_smem, q_bar, ready_k, ready_v, empty_k, empty_v, turn,
                             L_ptr, q_row, q_col, l_row, q_start, k_first, n_tiles, n_q, N_HEADS * D, scale, band,
                             BLOCK_M, BLOCK_N, D, STAGES, is_causal, EDGES, IS_VARLEN, WARPGROUPS, 1)),
            (_fwd_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready_k, ready_v, empty_k,
                             empty_v, q_row, q_col, kv_row + k_first, kv_col, n_tiles, BLOCK_M, BLOCK_N, STAGES,
                             WARPGROUPS)),
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
            (_fwd_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready_k, ready_v, empty_k,
                             empty_v, q_row, q_col, kv_row + k_first, kv_col, n_tiles, BLOCK_M, BLOCK_N, STAGES,
                             WARPGROUPS)),
        ], [4, 4, 1], [REGS_3WG, REGS_3WG, 24])


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
# 8 or 12), STAGES)
FWD_CONFIGS = {64: (64, 128, 12, 3), 128: (64, 128, 8, 2)}  # the H200 sweep's best (plans gluon_fwd, gluon_fwd128)

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
GLUON_DTYPES = tuple(GL_DTYPES)  # the input dtypes the Gluon kernels take


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


# The share of the L2 that the rows a group of heads streams may fill (`grouped_program`, `head_groups`)
L2_SHARE = 0.5
# The last group's work per SM, in its longest programs (`head_groups`)
TAIL_WORK = 1.5


def head_groups(heads: int, bytes_per_head: int, work_per_head: int, longest: int,
                device_index: int | None) -> tuple[int, int]:
    """(HEAD_GROUP, TAIL) of `grouped_program` for a grid of `heads` along axis 0 whose programs stream
    `bytes_per_head` each and take `work_per_head` steps per head, `longest` in the longest program: groups of as
    many heads as fit in L2_SHARE of the L2 (at least one), and a last group large enough for TAIL_WORK longest
    programs of work per SM. One group of all heads without a device (a CPU compile: both are run-time
    arguments)."""
    if device_index is None:
        return heads, heads
    props = torch.cuda.get_device_properties(device_index)
    group = max(1, min(heads, int(L2_SHARE * props.L2_cache_size) // max(bytes_per_head, 1)))
    least = -(-int(TAIL_WORK * longest * props.multi_processor_count) // max(work_per_head, 1))
    tail = next((t for t in range(max(group, least), heads) if (heads - t) % group == 0), heads)
    return group, tail


def wave_groups(lines: int, tiles: int, device_index: int | None) -> tuple[int, int]:
    """(HEAD_GROUP, TAIL) of `grouped_program` for a grid of `lines` along axis 0 and `tiles` programs a line that
    starts a wave at a time: groups of as many lines as their programs fill the SMs once (at least one), the
    remainder in the last group. The single pass's order: the L2 rule (`head_groups`) gave a grouped-query call
    small groups and a last group of most of its lines, which ran the kernel up to 1.5x slower on an H100
    (runs/ab/single_pass_wave_groups_f032026.jsonl). One group of all lines without a device (a CPU compile)."""
    if device_index is None:
        return lines, lines
    group = max(1, min(lines, torch.cuda.get_device_properties(device_index).multi_processor_count // max(tiles, 1)))
    return group, group + lines % group if lines > group else lines


def kv_head_groups(q4: torch.Tensor, k4: torch.Tensor, is_causal: bool, block_m: int, block_n: int,
                   single_pass: bool) -> tuple[int, int]:
    """(HEAD_GROUP, TAIL) of a dK/dV pass (grid axis 0: batch·kv heads; a program per BLOCK_N keys): a two-pass
    dK/dV pass's `head_groups` over the Q, dO, L and delta rows of its kv head's query heads that its programs
    stream, a BLOCK_M-query tile per step; a single pass's `wave_groups`."""
    batch, heads, n_q, d = q4.shape
    return _kv_head_groups(batch, heads, k4.shape[1], n_q, k4.shape[2], d, q4.element_size(), is_causal, block_m,
                           block_n, single_pass, q4.device.index)


def fwd_head_groups(q4: torch.Tensor, k4: torch.Tensor, is_causal: bool, rows: int, block_n: int) -> tuple[int, int]:
    """`head_groups` of a dense forward (grid axis 0: batch·heads; a program per `rows` queries), whose programs
    stream their kv head's K and V (query heads of one kv head are neighbours on axis 0, so a query head's share is
    its kv head's rows over the group size), a BLOCK_N-key tile per step. Past as many heads as SMs the plain
    order's resident programs each read another head's K and V, which the L2 cannot hold for the head's next query
    tile."""
    batch, heads, n_q, d = q4.shape
    return _fwd_head_groups(batch, heads, k4.shape[1], n_q, k4.shape[2], d, q4.element_size(), is_causal, rows,
                            block_n, q4.device.index)


@functools.cache
def _fwd_head_groups(batch: int, heads: int, kv_heads: int, n_q: int, n_k: int, d: int, item: int, is_causal: bool,
                     rows: int, block_n: int, device_index: int | None) -> tuple[int, int]:
    steps = [-(-min(i + rows, n_k) // block_n) if is_causal else n_k // block_n for i in range(0, n_q, rows)]
    return head_groups(batch * heads, -(-2 * n_k * d * item // (heads // kv_heads)), sum(steps), max(steps),
                       device_index)


@functools.cache
def _kv_head_groups(batch: int, heads: int, kv_heads: int, n_q: int, n_k: int, d: int, item: int, is_causal: bool,
                    block_m: int, block_n: int, single_pass: bool, device_index: int | None) -> tuple[int, int]:
    if single_pass:
        return wave_groups(batch * kv_heads, -(-n_k // block_n), device_index)
    per_query = (heads // kv_heads) * (2 * d * item + 8)
    steps = [(heads // kv_heads) * (max(n_q - j, 0) if is_causal else n_q) // block_m
             for j in range(0, n_k, block_n)]
    return head_groups(batch * kv_heads, n_q * per_query, sum(steps), max(steps), device_index)


def _takes(tensors, d: int, configs: dict) -> bool:
    """sm_90, 16-bit, a head dim with a config, contiguous, one dtype, 16-byte aligned."""
    q4 = tensors[0]
    if d not in configs or q4.dtype not in GL_DTYPES or not q4.is_cuda:
        return False
    if not all(t.is_contiguous() and t.dtype == q4.dtype and t.data_ptr() % 16 == 0 for t in tensors):
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
    contiguous, whole tiles (for the keys-on-rows single pass, queries in whole BLOCK_N as well: a causal key
    tile then sees an even number of BLOCK_M query tiles, as its loop takes them)."""
    d = q4.shape[-1]
    configs = kv_configs(qrows, single_pass)
    block_m, block_n, _, _ = config or configs.get(d, (1, 1, 0, 0))
    if q4.shape[2] % block_m or k4.shape[2] % block_n or (single_pass and not qrows and q4.shape[2] % block_n):
        return False
    return _takes((q4, k4, v4, do4), d, configs)


def fwd_supported(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, config=None) -> bool:
    """Whether `forward` takes these (B, H, S, D) tensors: sm_90, 16-bit, d 64/128, contiguous, query
    lengths in whole BLOCK_M tiles and key lengths in whole BLOCK_N tiles."""
    d = q4.shape[-1]
    block_m, block_n, _, _ = config or FWD_CONFIGS.get(d, (1, 1, 0, 0))
    if q4.shape[2] % block_m or k4.shape[2] % block_n:
        return False
    return _takes((q4, k4, v4), d, FWD_CONFIGS)


@functools.cache
def _smem_layout(rows: int, d: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([rows, d], GL_DTYPES.get(dtype, gl.float32))  # fp32: dQ's


@functools.cache
def _row_layout() -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # (built once: ~3.5 µs each)


class _Tma:
    """An argument template's TMA descriptor: call tensor `index` as the 2-D view `shape` (rows of contiguous values)
    in boxes of `block`, laid out in shared memory as `layout`. `rows`: an fp32 L or delta, copied where its base is
    not 16-byte aligned (TMA's condition): that copy's descriptor serves one launch only."""

    __slots__ = ("index", "shape", "block", "layout", "rows")

    def __init__(self, index: int, shape: tuple[int, int], block: tuple[int, int], layout, rows: bool = False):
        self.index, self.shape, self.block, self.layout, self.rows = index, shape, block, layout, rows

    def descriptor(self, t: torch.Tensor) -> TensorDescriptor:
        if self.rows and t.data_ptr() % 16:
            t = t.clone()
        flat = t.view(self.shape)
        return TensorDescriptor(flat, list(self.shape), list(flat.stride()), list(self.block), self.layout)


class _Arg:
    """An argument template's plain tensor argument: call tensor `index` itself."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


_SCALE = object()  # the argument template's place for the call's softmax scale (a float no plan fixes)


def _tiles(tensors: tuple, index: int, rows: int) -> _Tma:
    """Call tensor `index` (·, D) as its (rows, D) view, tiles of `rows` rows."""
    t = tensors[index]
    d = t.shape[-1]
    return _Tma(index, (t.numel() // d, d), (rows, d), _smem_layout(rows, d, t.dtype))


def _row_tiles(tensors: tuple, index: int, cols: int) -> _Tma:
    """A contiguous fp32 (B·H, Nq) call tensor (L, delta) as rows of `cols` values, one row per query tile."""
    t = tensors[index]
    return _Tma(index, (t.numel() // cols, cols), (1, cols), _row_layout(), rows=True)


def _row_boxes(tensors: tuple, index: int, cols: int) -> _Tma:
    """An fp32 2-D call tensor (a packed call's L or delta, as `packed_rows` lays them out) in boxes of one row ×
    `cols` values."""
    rows = tensors[index]
    return _Tma(index, tuple(rows.shape), (1, cols), _row_layout())


def _packed_tiles(tensors: tuple, index: int, rows: int) -> _Tma:
    """A packed (total, heads, D) call tensor as its (total, heads·D) view, tiles of `rows` rows and one head's
    columns."""
    t = tensors[index]
    total, heads, d = t.shape
    return _Tma(index, (total, heads * d), (rows, d), _smem_layout(rows, d, t.dtype))


def _arguments(template: tuple, tensors: tuple, scale: float) -> tuple:
    """A launch's positional arguments: the template filled with the call's tensors (and their descriptors) and
    scale."""
    return tuple(a.descriptor(tensors[a.index]) if a.__class__ is _Tma else tensors[a.index] if a.__class__ is _Arg
                 else scale if a is _SCALE else a for a in template)


def example_launch(name: str, dtype: torch.dtype, heads: int, seq: int, d: int, causal: bool):
    """(kernel, positional arguments, constexprs, warps per CTA, config) of a launch of kernel `name` (a key
    of GLUON_KERNELS) with its default config on contiguous (1, heads, seq, d) tensors, built as `forward` and
    `kv_pass` build theirs; the tensors are CPU placeholders, so that the kernel can be compiled without a
    GPU (`cs336-bench resources`)."""
    x = torch.empty(1, heads, seq, d, dtype=dtype)
    lse = torch.empty(heads, seq, dtype=torch.float32)
    if name == "flash_fwd_gluon":
        config = FWD_CONFIGS[d]
        tensors = (x, x, x, x, lse)
        _, _, template, constexprs, _ = _fwd_launch_plan(tensors, causal, config)
        args = _arguments(template, tensors, d ** -0.5)
        return flash_fwd_gluon_kernel, args, constexprs, 4 * constexprs["WARPGROUPS"] + 1, config  # + the producer
    if name == "flash_fwd_packed_gluon":  # (two sequences of seq / 2 tokens)
        config = FWD_CONFIGS[d]
        packed = torch.empty(seq, heads, d, dtype=dtype)
        cu_seqlens = torch.tensor([0, seq // 2, seq], dtype=torch.int32)
        _, _, template, constexprs, _, tensors = _packed_fwd_launch_plan(packed, packed, packed, packed, lse,
                                                                         cu_seqlens, cu_seqlens, causal, None)
        args = _arguments(template, tensors, d ** -0.5)
        return flash_fwd_gluon_kernel, args, constexprs, 4 * constexprs["WARPGROUPS"] + 1, config
    if name in ("flash_bwd_kv_gluon", "flash_bwd_kv_qrows_gluon", "flash_bwd_single_pass_gluon",
                "flash_bwd_single_pass_keys_gluon"):
        qrows = name in ("flash_bwd_kv_qrows_gluon", "flash_bwd_single_pass_gluon")
        dq_acc = torch.empty(heads, seq, d) if name.startswith("flash_bwd_single_pass") else None
        config = GLUON_KERNELS[name][d]
        tensors = (x, x, x, x, lse, lse, x, x, dq_acc)
        kernel, _, template, constexprs, _ = _kv_launch_plan(tensors, causal, config, qrows)
        args = _arguments(template, tensors, d ** -0.5)
        workers = 2 if kernel is flash_bwd_single_keys_gluon_kernel else 0  # its loader and dQ warps
        return kernel, args, constexprs, constexprs["num_warps"] + workers, config
    if name == "flash_bwd_single_pass_keys_packed_gluon":  # (two sequences of seq / 2 tokens)
        config = SINGLE_PASS_KEYS_CONFIGS[d]
        packed = torch.empty(seq, heads, d, dtype=dtype)
        cu_seqlens = torch.tensor([0, seq // 2, seq], dtype=torch.int32)
        _, _, template, constexprs, _, tensors = _packed_launch_plan(
            packed, packed, packed, packed, lse, lse, packed, packed, torch.empty(heads, seq, d), cu_seqlens,
            cu_seqlens, causal, None)
        args = _arguments(template, tensors, d ** -0.5)
        return flash_bwd_single_keys_gluon_kernel, args, constexprs, constexprs["num_warps"] + 2, config
    raise ValueError(f"no Gluon kernel {name!r}; known: {', '.join(GLUON_KERNELS)}")


# each Gluon kernel's configs by head dim (the head dims it runs)
GLUON_KERNELS = {"flash_fwd_gluon": FWD_CONFIGS, "flash_fwd_packed_gluon": FWD_CONFIGS,
                 "flash_bwd_kv_gluon": CONFIGS, "flash_bwd_kv_qrows_gluon": QROWS_CONFIGS,
                 "flash_bwd_single_pass_gluon": SINGLE_PASS_CONFIGS,
                 "flash_bwd_single_pass_keys_gluon": SINGLE_PASS_KEYS_CONFIGS,
                 "flash_bwd_single_pass_keys_packed_gluon": SINGLE_PASS_KEYS_CONFIGS}


# Compiled kernels per launch signature (kernel, device, grid, dtype, head dim, config, causal, the integer arguments,
# the alignment of the pointer arguments). The signature must hold everything the compiled code bakes in: a kernel
# compiled for another head dim, called with these descriptors, reads tiles of the wrong size.
_COMPILED: dict[tuple, _Compiled] = {}
# TMA descriptors a compiled launch caches per argument (one per address) before that argument's cache starts over
DESCRIPTORS_PER_ARGUMENT = 64


def launch_cache_size() -> int:
    return len(_COMPILED)


class _Compiled:
    """A compiled Gluon kernel's launches after its first at one signature: the argument template filled with a
    call's tensors and scale, then the kernel's C launch (`c_launch.CLaunch`), skipping the JIT's argument binder
    and Triton's per-launch Python. Where Triton's launcher comes apart (`CLaunch.of(raw=True)`), each TMA descriptor
    comes from a cache by its tensor's address: the signature fixes the rest of what it encodes (shape, strides,
    box), a training loop's caching allocator hands its steps the same addresses again, and the descriptor is a
    value (128 bytes the launch copies) that holds no memory. Elsewhere Triton's wrapper builds them at every launch
    (or, without a C launch, the compiled kernel's runner does)."""

    __slots__ = ("run", "grid", "template", "tail", "device", "c_launch", "steps", "expand")

    def __init__(self, run, grid: tuple, template: tuple, constexprs: dict, device: int):
        self.run, self.grid, self.template, self.device = run, grid, template, device
        self.tail = tuple(constexprs.values())  # (the C launch takes the constexprs too, in the kernel's order)
        metas = getattr(run.metadata, "tensordesc_meta", None)
        tmas = [a for a in template if a.__class__ is _Tma]
        raw = None
        if metas and len(metas) == len(tmas) and None not in metas:
            raw = CLaunch.of(run, grid, raw=True)
        self.c_launch = raw or CLaunch.of(run, grid)
        self.steps = None  # (kind, item, cache) per argument, where descriptors are cached
        if raw is not None:
            from triton.backends.nvidia.driver import make_tensordesc_arg  # (a CUDA module: loaded on a CUDA call)

            self.expand = make_tensordesc_arg
            metas = iter(metas)
            self.steps = tuple(
                (3, (a, next(metas)), {}) if a.__class__ is _Tma
                else (1, a.index, None) if a.__class__ is _Arg else (2, None, None) if a is _SCALE else (0, a, None)
                for a in template)

    def __call__(self, tensors: tuple, scale: float) -> None:
        if self.steps is None:
            args = _arguments(self.template, tensors, scale)
            if self.c_launch is None:
                self.run[self.grid](*args, *self.tail)
            else:
                self.c_launch(self.device, *args, *self.tail)
            return
        args, made = [], []
        for kind, item, cache in self.steps:
            if kind == 0:
                args.append(item)
            elif kind == 1:
                args.append(tensors[item])
            elif kind == 2:
                args.append(scale)
            else:
                tma, meta = item
                t = tensors[tma.index]
                address = t.data_ptr()
                expanded = cache.get(address)
                if expanded is None:
                    descriptor = tma.descriptor(t)
                    expanded = self.expand(descriptor, meta)  # [TMA descriptor, *shape, *strides], as Triton's wrapper
                    if tma.rows and address % 16:
                        made.append(descriptor)  # (a copy's: it lives until the launch, and is not cached)
                    else:
                        if len(cache) >= DESCRIPTORS_PER_ARGUMENT:
                            cache.clear()
                        cache[address] = expanded
                args.extend(expanded)
        self.c_launch(self.device, *args, *self.tail)


class _Ahead:
    """A Gluon kernel as `background` compiles it ahead of its first launch."""

    __slots__ = ("kernel", "name", "plain")

    def __init__(self, kernel):
        self.kernel, self.name, self.plain = kernel, kernel.fn.__name__, background.plain_positions(kernel)

    def warm(self, args: tuple, constexprs: dict) -> None:
        background.compile_ahead(self.kernel, args, constexprs)


def _launch(kernel, grid: tuple, template: tuple, constexprs: dict, key: tuple, tensors: tuple, scale: float,
            cached: bool) -> _Compiled | None:
    """Launch through the JIT the first time a signature is seen (or every time if not cached), then through its
    `_Compiled`; returns that (None uncached)."""
    compiled = _COMPILED.get(key) if cached else None
    if compiled is not None:
        compiled(tensors, scale)
        return compiled
    args = _arguments(template, tensors, scale)
    background.wait_for(_Ahead(kernel), args, constexprs)  # (compiled ahead: found in the JIT's cache)
    run = kernel[grid](*args, **constexprs)
    if not cached:
        return None
    compiled = _COMPILED[key] = _Compiled(run, grid, template, constexprs, key[1])
    return compiled


class Launch:
    """One Gluon kernel's launches at one call signature, which the caller's plan fixes (each tensor's shape, strides,
    dtype and alignment; the device; the options): planned once, from the first call's tensors (`plan(tensors)`:
    kernel, grid, argument template, constexprs, cache key), then each call is `_launch`'s, and from the second on
    its `_Compiled` alone. cached=False (launch hooks installed, which only Triton's own launch path calls) launches
    through the JIT every time."""

    __slots__ = ("plan", "cached", "planned", "compiled")

    def __init__(self, plan: Callable[[tuple], tuple], cached: bool):
        self.plan, self.cached = plan, cached
        self.planned: tuple | None = None
        self.compiled: _Compiled | None = None  # (each set in one store: threads may share a plan)

    def __call__(self, tensors: tuple, scale: float) -> None:
        compiled = self.compiled
        if compiled is not None:
            compiled(tensors, scale)
            return
        planned = self.planned
        if planned is None:
            planned = self.planned = self.plan(tensors)
        self.compiled = _launch(*planned, tensors, scale, self.cached)

    def ahead(self, tensors: tuple, scale: float) -> tuple:
        """What a call on these tensors would launch, as `background.submit` compiles it: (launcher, arguments,
        constexprs); plans nothing to keep (the tensors are placeholders of a length not yet called)."""
        kernel, _, template, constexprs, _ = self.plan(tensors)
        return _Ahead(kernel), _arguments(template, tensors, scale), constexprs


def _kv_launch_plan(tensors: tuple, is_causal: bool, config, qrows: bool = False,
                    groups: tuple[int, int] | None = None, band: tuple[int, int] | None = None):
    """(kernel, grid, argument template, constexprs, cache key) of a dK/dV-pass launch on the call tensors (q4, k4,
    v4, do4, lse, delta, dk4, dv4, dq_acc) (with dq_acc, not None: the single pass); groups: `grouped_program`'s
    (HEAD_GROUP, TAIL) (default `kv_head_groups`'); band: a window's (`chooser.band`), which only the keys-on-rows
    single pass takes, on self-attention."""
    q4, k4, _, _, lse, delta, _, _, dq_acc = tensors
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    single = dq_acc is not None
    if band is not None and (qrows or not single or n_q != n_k):
        raise ValueError(f"a window runs only in the keys-on-rows single pass, on self-attention (Nq = Nk), got "
                         f"qrows={qrows}, single pass {single}, Nq {n_q}, Nk {n_k}")
    block_m, block_n, warps, stages = config or kv_configs(qrows, single)[d]
    if qrows and not block_m == block_n == 16 * warps:
        raise ValueError(f"the queries-on-rows dK/dV pass and its single pass take BLOCK_M = BLOCK_N = "
                         f"16·num_warps (a warpgroup per 64 rows), got {config}")
    if single and not qrows and not (block_n == 16 * warps == 128 and block_m in (64, 128) and stages == 2):
        # (its dQ handoff counts on two stages: with more, the loader warp's last announcements come after the
        # compute warps' wait for them, and the kernel hangs)
        raise ValueError(f"the keys-on-rows single pass takes BLOCK_N = 16·num_warps = 128 (two warpgroups of 64 "
                         f"keys), BLOCK_M = 64 or 128 and 2 stages, got {config}")
    # (in the kernels' order: the cached launch passes the values positionally)
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=d, STAGES=stages, is_causal=is_causal)
    if single and not qrows:
        constexprs.update(HAS_WINDOW=band is not None, IS_VARLEN=False)
    grid = (batch * kv_heads, n_k // block_n, 1)
    template = (_tiles(tensors, 0, block_m), _tiles(tensors, 1, block_n), _tiles(tensors, 2, block_n),
                _tiles(tensors, 3, block_m), _tiles(tensors, 6, block_n), _tiles(tensors, 7, block_n))
    if single and not qrows:  # L and delta through the loader warp's TMA, a row per query tile
        template += (_row_tiles(tensors, 4, block_m), _row_tiles(tensors, 5, block_m))
    else:
        template += (_Arg(4), _Arg(5))
    # the fp32 dQ accumulator of the single passes (reduced a query tile at a time); the two-pass queries-on-rows
    # kernel takes dK's descriptor as an untouched stand-in
    if qrows or single:
        template += (template[4] if dq_acc is None else _tiles(tensors, 8, block_m), )
    if qrows:
        constexprs["DQ_ATOMIC"] = single
    constexprs["num_warps"] = warps
    group, tail = kv_head_groups(q4, k4, is_causal, block_m, block_n, single) if groups is None else groups
    template += (heads, heads // kv_heads, n_q, n_k, _SCALE, group, tail)
    if single and not qrows:  # (then the packed call's offsets and slots: L stands in, unread)
        template += (*(band or (0, 0)), _Arg(4), _Arg(4), _Arg(4), 0)
    # (the grid: the cached C launch is fixed to it, and no argument above carries the batch)
    key = ("kv_qrows" if qrows else "kv", q4.device.index, grid, q4.dtype, d, block_m, block_n, warps, stages,
           is_causal, heads, heads // kv_heads, n_q, n_k, lse.data_ptr() % 16 == 0, delta.data_ptr() % 16 == 0,
           dq_acc is not None, group, tail, band)
    kernel = (flash_bwd_kv_qrows_gluon_kernel if qrows else
              flash_bwd_single_keys_gluon_kernel if single else flash_bwd_kv_gluon_kernel)
    return kernel, grid, template, constexprs, key


def kv_pass(q4, k4, v4, do4, lse, delta, dk4, dv4, is_causal: bool, scale: float, config=None,
            cached: bool = True, qrows: bool = False, dq_acc=None, groups: tuple[int, int] | None = None,
            band: tuple[int, int] | None = None) -> None:
    """dK·scale, dV into dk4, dv4 (contiguous) for tensors `supported` accepted with the same config and
    `qrows` (and `single_pass` with dq_acc); lse, delta: contiguous (B·H, Nq) fp32. cached=False (e.g. with
    launch hooks installed, which only Triton's own launch path calls) launches through the JIT every time.
    qrows: the kernel with the queries on rows (`flash_bwd_kv_qrows_gluon_kernel`). dq_acc: a single pass, which
    also adds dQ = dS·K (unscaled) of every tile into this zeroed, contiguous fp32 (B·H, Nq, D) accumulator by
    TMA bulk reductions (`flash_bwd_single_keys_gluon_kernel`, or with qrows the queries-on-rows kernel with
    DQ_ATOMIC). groups: the heads run at once (`grouped_program`'s (HEAD_GROUP, TAIL); default
    `kv_head_groups`'). band: a sliding window's (`chooser.band`; the keys-on-rows single pass, Nq = Nk).
    (A caller that plans its calls holds a `kv_launch` instead, which plans the launch once.)"""
    tensors = (q4, k4, v4, do4, lse, delta, dk4, dv4, dq_acc)
    _launch(*_kv_launch_plan(tensors, is_causal, config, qrows, groups, band), tensors, scale, cached)


def kv_launch(is_causal: bool, config=None, cached: bool = True, qrows: bool = False,
              band: tuple[int, int] | None = None) -> Launch:
    """`kv_pass`'s launches at one call signature: called with the tensors (q4, k4, v4, do4, lse, delta, dk4, dv4,
    dq_acc or None) and the scale."""
    return Launch(lambda tensors: _kv_launch_plan(tensors, is_causal, config, qrows, band=band), cached)


# A packed single pass runs one kv head at a time (`grouped_program`), its slots longest first, and the last
# 1/PACKED_TAIL of the kv heads as one group: on the H200 (runs/ab/packed_head_groups_*.jsonl, 16 kv heads, 65536
# tokens) 18.7 ms fwd+bwd at d 128 against 21.0 with every head at once (whose Q and dO rows overflow the L2)
PACKED_TAIL = 4
# a side of a packed call's band that bounds nothing (beyond every sequence; kept small enough that the kernel's
# band arithmetic stays in int32)
UNBOUNDED = 1 << 30


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


def packed_rows(cu_seqlens_q: torch.Tensor, total_q: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """L and delta of a packed call as the single pass's TMA reads them: each sequence's queries from a column that
    starts a 16-byte-aligned box (a multiple of 4 fp32; a box at any other column is an illegal instruction).
    Returns (each sequence's first column, each packed row's column, the columns), made on the device without a
    sync (the columns: an upper bound)."""
    batch = cu_seqlens_q.shape[0] - 1
    offsets = cu_seqlens_q.long()
    widths = (offsets[1:] - offsets[:-1] + 3) // 4 * 4
    starts = widths.cumsum(0) - widths
    rows = torch.arange(total_q, device=cu_seqlens_q.device)
    seq = torch.searchsorted(offsets[1:], rows, right=True)
    return starts, starts[seq] + rows - offsets[seq], (total_q + 3 * batch + 3) // 4 * 4


# a packed grid's slots run along grid axis 1 (at most 65535 programs)
MAX_SLOTS = 65535


def _slots(cu_seqlens: torch.Tensor, total: int, block: int) -> tuple[torch.Tensor, ...]:
    """The tiles of `block` rows of every packed sequence, made on the device without a sync: cdiv(total, block) +
    batch slots (at least the tiles there are). Returns per slot (its sequence, batch past the last tile: spare; the
    tile within it; whether it is live; the sequence clamped to the last)."""
    batch = cu_seqlens.shape[0] - 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    tiles = (lengths + block - 1) // block
    ends = tiles.cumsum(0)
    slot = torch.arange(-(-total // block) + batch, device=cu_seqlens.device)
    seq = torch.searchsorted(ends, slot, right=True)
    live = seq < batch
    first = seq.clamp(max=batch - 1)
    return seq, torch.where(live, slot - (ends - tiles)[first], 0), live, first


def _longest_first(columns: tuple[torch.Tensor, ...], live: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """The slots' columns as (slots, columns) int32 rows, by `work` descending (stable), the spare slots last: so that
    the long programs do not run alone at the end."""
    order = torch.argsort(torch.where(live, work, -1), descending=True, stable=True)
    return torch.stack(columns, 1)[order].to(torch.int32)


def packed_key_tiles(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_k: int, block_n: int,
                     is_causal: bool, starts: torch.Tensor) -> torch.Tensor:
    """The slots of a packed single pass (`_slots` of the keys), (slots, 3) int32 rows (sequence, key tile, the
    sequence's first column in L and delta: `starts`, `packed_rows`'), longest first by the queries a tile's program
    visits (causal: those from its first key on)."""
    seq, tile, live, first = _slots(cu_seqlens_k, total_k, block_n)
    n_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()[first]
    work = (n_q - tile * block_n).clamp(min=0) if is_causal else n_q
    return _longest_first((seq, tile, torch.where(live, starts[first], 0)), live, work)


def packed_query_tiles(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, rows: int,
                       is_causal: bool) -> torch.Tensor:
    """The slots of a packed forward (`_slots` of the queries, tiles of `rows`), (slots, 2) int32 rows (sequence, query
    tile), longest first by the keys a tile's program visits (causal: those up to its last query)."""
    seq, tile, live, first = _slots(cu_seqlens_q, total_q, rows)
    n_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()[first]
    work = torch.minimum(n_k, (tile + 1) * rows) if is_causal else n_k
    return _longest_first((seq, tile), live, work)


def _packed_launch_plan(q, k, v, do, lse, delta, dk, dv, dq_acc, cu_seqlens_q, cu_seqlens_k, is_causal: bool,
                        band: tuple[int, int] | None):
    """(kernel, grid, argument template, constexprs, cache key, call tensors) of a `packed_kv_pass` launch: the
    call tensors add the slots and the L and delta rows, made on the device."""
    total_q, heads, d = q.shape
    total_k, kv_heads, _ = k.shape
    batch = cu_seqlens_q.shape[0] - 1
    block_m, block_n, warps, stages = SINGLE_PASS_KEYS_CONFIGS[d]
    left, right = band if band is not None else (UNBOUNDED, 0 if is_causal else UNBOUNDED)
    starts, columns, width = packed_rows(cu_seqlens_q, total_q)
    tiles = packed_key_tiles(cu_seqlens_q, cu_seqlens_k, total_k, block_n, is_causal, starts)
    # (zeros between the sequences: a masked row's delta multiplies a zero P, so it must be finite)
    rows = [t.new_zeros(heads, width).index_copy_(1, columns, t) for t in (lse, delta)]
    tensors = (q, k, v, do, dk, dv, *rows, dq_acc, cu_seqlens_q, cu_seqlens_k, tiles)
    grid = (kv_heads, tiles.shape[0], 1)
    template = (_packed_tiles(tensors, 0, block_m), _packed_tiles(tensors, 1, block_n),
                _packed_tiles(tensors, 2, block_n), _packed_tiles(tensors, 3, block_m), _Arg(4), _Arg(5),
                _row_boxes(tensors, 6, block_m), _row_boxes(tensors, 7, block_m), _tiles(tensors, 8, block_m),
                heads, heads // kv_heads, total_q, total_k, _SCALE, 1, max(1, kv_heads // PACKED_TAIL), left, right,
                _Arg(9), _Arg(10), _Arg(11), batch)
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=d, STAGES=stages, is_causal=is_causal,
                      HAS_WINDOW=band is not None, IS_VARLEN=True, num_warps=warps)
    # (the integers the JIT specializes: the sizes whole; the offsets' alignment; and the band, which the cached
    # launch's template holds)
    key = ("kv_packed", q.device.index, grid, q.dtype, d, is_causal, heads, heads // kv_heads, total_q, total_k,
           batch, band, cu_seqlens_q.data_ptr() % 16 == 0, cu_seqlens_k.data_ptr() % 16 == 0)
    return flash_bwd_single_keys_gluon_kernel, grid, template, constexprs, key, tensors


def packed_kv_pass(q, k, v, do, lse, delta, dk, dv, dq_acc, cu_seqlens_q, cu_seqlens_k, is_causal: bool,
                   scale: float, band: tuple[int, int] | None = None, cached: bool = True) -> None:
    """The keys-on-rows single pass over packed sequences, for tensors `packed_supported` accepted: dK·scale, dV into
    dk, dv (packed like k), dQ = dS·K (unscaled) added into the zeroed fp32 (H, total_q, D) dq_acc; lse, delta: fp32
    (H, total_q); band: a window's (`chooser.band` at the longest sequences), None for none."""
    *planned, tensors = _packed_launch_plan(q, k, v, do, lse, delta, dk, dv, dq_acc, cu_seqlens_q, cu_seqlens_k,
                                            is_causal, band)
    _launch(*planned, tensors, scale, cached)


def _packed_fwd_launch_plan(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, is_causal: bool,
                            band: tuple[int, int] | None):
    """(kernel, grid, argument template, constexprs, cache key, call tensors) of a `packed_forward` launch: the call
    tensors add the slots, made on the device."""
    total_q, heads, d = q.shape
    total_k, kv_heads, _ = k.shape
    batch = cu_seqlens_q.shape[0] - 1
    block_m, block_n, warps, stages = FWD_CONFIGS[d]
    groups = warps // 4
    left, right = band if band is not None else (UNBOUNDED, 0 if is_causal else UNBOUNDED)
    tiles = packed_query_tiles(cu_seqlens_q, cu_seqlens_k, total_q, groups * block_m, is_causal)
    tensors = (q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, tiles)
    grid = (heads, tiles.shape[0], 1)
    template = (_packed_tiles(tensors, 0, block_m), _packed_tiles(tensors, 1, block_n),
                _packed_tiles(tensors, 2, block_n), _packed_tiles(tensors, 3, block_m), _Arg(4), heads,
                heads // kv_heads, total_q, total_k, _SCALE, left, right, _Arg(3), _Arg(5), _Arg(6), _Arg(7), batch,
                heads, heads)  # (head groups: unread)
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=d, STAGES=stages, WARPGROUPS=groups, is_causal=is_causal,
                      HAS_WINDOW=band is not None, IS_VARLEN=True, num_warps=4)
    key = ("fwd_packed", q.device.index, grid, q.dtype, d, is_causal, heads, heads // kv_heads, total_q, total_k,
           band, lse.data_ptr() % 16 == 0, cu_seqlens_q.data_ptr() % 16 == 0,
           cu_seqlens_k.data_ptr() % 16 == 0)  # (as `_packed_launch_plan`'s)
    return flash_fwd_gluon_kernel, grid, template, constexprs, key, tensors


def packed_forward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, is_causal: bool, scale: float,
                   band: tuple[int, int] | None = None, cached: bool = True) -> None:
    """The forward over packed sequences, for tensors `packed_fwd_supported` accepted: O into o (packed like q), L
    (natural log) into lse, fp32 (H, total_q); band: a window's (`chooser.band` at the longest sequences), None for
    none."""
    *planned, tensors = _packed_fwd_launch_plan(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, is_causal, band)
    _launch(*planned, tensors, scale, cached)


def _fwd_launch_plan(tensors: tuple, is_causal: bool, config, band: tuple[int, int] | None = None):
    """(kernel, grid, argument template, constexprs, cache key) of a forward launch on the call tensors (q4, k4, v4,
    o4, lse) (band: a window's, `chooser.band`)."""
    q4, k4, _, _, lse = tensors
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    block_m, block_n, warps, stages = config or FWD_CONFIGS[d]
    groups = warps // 4
    if warps not in (8, 12):
        raise ValueError(f"the Gluon forward runs 2 or 3 consumer warpgroups (8 or 12 warps), got {warps} warps")
    if band is not None and n_q != n_k:
        raise ValueError(f"the Gluon forward takes a window on self-attention only (Nq = Nk), got Nq {n_q}, "
                         f"Nk {n_k}")
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=d, STAGES=stages, WARPGROUPS=groups, is_causal=is_causal,
                      HAS_WINDOW=band is not None, IS_VARLEN=False, num_warps=4)
    grid = (batch * heads, -(-n_q // (groups * block_m)), 1)
    if band is None:
        group, tail = fwd_head_groups(q4, k4, is_causal, groups * block_m, block_n)
    else:  # (a window's programs read the band that their neighbours read: the plain order)
        group = tail = batch * heads
    template = (_tiles(tensors, 0, block_m), _tiles(tensors, 1, block_n), _tiles(tensors, 2, block_n),
                _tiles(tensors, 3, block_m), _Arg(4), heads, heads // kv_heads, n_q, n_k, _SCALE, *(band or (0, 0)),
                _Arg(3), _Arg(4), _Arg(4), _Arg(4), 0, group, tail)  # (_Arg(3) .. 0: a packed call's five)
    key = ("fwd", q4.device.index, grid, q4.dtype, d, block_m, block_n, warps, stages, is_causal, heads,
           heads // kv_heads, n_q, n_k, lse.data_ptr() % 16 == 0, band, group, tail)  # (the grid: `_kv_launch_plan`)
    return flash_fwd_gluon_kernel, grid, template, constexprs, key


def forward(q4, k4, v4, o4, lse, is_causal: bool, scale: float, config=None, cached: bool = True,
            band: tuple[int, int] | None = None) -> None:
    """O into o4 (contiguous, q's shape) and L (natural log) into lse (contiguous (B·H, Nq) fp32) for
    tensors `fwd_supported` accepted with the same config. band: a sliding window's (`chooser.band`; Nq = Nk).
    (A caller that plans its calls holds a `forward_launch` instead, which plans the launch once.)"""
    tensors = (q4, k4, v4, o4, lse)
    _launch(*_fwd_launch_plan(tensors, is_causal, config, band), tensors, scale, cached)


def forward_launch(is_causal: bool, config=None, cached: bool = True, band: tuple[int, int] | None = None) -> Launch:
    """`forward`'s launches at one call signature: called with the tensors (q4, k4, v4, o4, lse) and the scale."""
    return Launch(lambda tensors: _fwd_launch_plan(tensors, is_causal, config, band), cached)
