"""Kernels in Gluon for Hopper (sm_90a): the forward, the dK/dV pass and the single-pass backwards (shipped
for large calls: the forward, the keys-on-rows single pass at d 64 and 128, the queries-on-rows dK/dV pass for
the deterministic two-pass backward).

The forward (`flash_fwd_gluon_kernel`, `forward`) is FlashAttention-3's schedule: a producer warp, two or
three consumer warpgroups of 64 query rows that take turns at the tensor cores, and in each warpgroup the
softmax of one key tile under the previous tile's P·V (the schedule and its barriers are described above
the kernel, in `flash_fwd.py`). `flash_triton` runs it by default where `fwd_supported` holds and the call is large
(`chooser.GLUON_FWD_MIN_WORK`); on the H200 it takes less kernel time than the Triton forward at d 64 and 128
(docs/design.md).

The single pass at d 64 and 128 (`flash_bwd_single_keys_gluon_kernel`, `kv_pass(dq_acc=)`, shipped: `flash_triton`
runs it where `supported(single_pass=True)` holds and the call is large) is FlashAttention-3's d-64 backward: the
keys on rows, two compute warpgroups split along the keys so that P and dS stay in registers for dV and dK, dS to
shared memory only for dQ, a loader warp and a dQ warp (its schedule is in the kernel's docstring, in
`flash_bwd_single_keys.py`); a tile of 128 keys × 128 queries at d 64, taken whole (FlashAttention-4's sm90 tile),
and FlashAttention-3's d-128 tile, 64 queries × 128 keys, at d 128. On the H200 it is faster than the
queries-on-rows single pass below at d 64 and than the two-pass backward at d 128 (docs/design.md).

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
dK/dV pass of grouped-query heads takes as many heads as fit the rows its programs stream (Q, dO, L, delta) in half
the L2, then a last group large enough not to leave its longest programs alone at the end (`head_groups`; without
grouped-query heads, a wave of lines a group with that last group, as the forward below); with tile 0 of every head
first the resident programs of a 16-head call read rows of every head, which the L2 cannot hold. The single pass
takes a wave of lines a group (`wave_groups`: as many kv-head lines as their key tiles fill the SMs once): the L2
rule gave grouped-query calls, whose lines stream several heads' rows and fp32 dQ, a last group of most lines, and
the kernel ran up to 1.5x slower. The dense forward takes a wave of lines a group too, with the two-pass rule's
last group (`fwd_head_groups`, `wave_tail_groups`): with more heads than SMs, tile 0 of every head first leaves each
resident program on a head of its own, and every query tile of a head reads its K and V from memory again; wave
groups beat the L2 rule where programs are short, and the tail keeps the longest programs from running alone at
the end (plain wave groups lost 5% at 1 x 16 x 16384 d 64 causal). A window keeps the plain order (neighbouring
tiles read the same band).

Launches after the first of a signature call the compiled kernel's C launch directly (`_launch`), their TMA
descriptors from a cache by address (`_Compiled`); a caller that plans its calls (`flash_triton`) holds a `Launch`
per signature (`forward_launch`, `kv_launch`), which builds the arguments from a template fixed at its first call.
Scope (the caller checks `supported` / `fwd_supported` and otherwise runs the Triton kernel): CUDA sm_90, bf16/fp16,
head dim 64 or 128, contiguous (B, H, S, D) tensors or (B, H, S, D) views whose rows hold the heads side by side
(`heads_inside`: (B, S, H, D) memory as a model's projections give it, or slices of a fused QKV projection, read as
(B·S, H·D) with their own row stride), sequence lengths that divide into the tiles; a sliding window (`band`) in the
forward and the keys-on-rows single pass only, on self-attention. Packed sequences (varlen) in the forward and the
keys-on-rows single pass (`packed_forward`, `packed_kv_pass`: any lengths, a window, grouped-query heads; a grid of
(heads, slots) over a table of (sequence, tile) slots made on the device, longest first; every tile checks the
sequence's end at run time). Gluon has no interpreter, so these kernels run only on the GPU (tests marked gpu).

Variants measured slower and removed (docs/design.md, "Designs tried", has each with its commit): K and V as
register operands of Sᵀ and dPᵀ; the next tile's Sᵀ issued before this tile's dSᵀ; a warp-specialized dK/dV pass,
a producer warp and two consumer warpgroups of 64 keys; the single-pass backward on the keys-on-rows kernel with
dQ by TMA bulk reductions, in two builds; the single pass on this queries-on-rows kernel with dQ by `red.global`
from registers; the keys-on-rows single pass without warp specialization, and with P rounded to bf16 for dS.

Layout (FlashAttention-4's `flash_attn/cute/`: a host interface, one kernel per file with the device code of its
own, the device code of several kernels in a module of its own, the tile order's heuristics as small functions):

  __init__               this overview, and the host interface the project uses (re-exported from the modules below)
  configs                the tile configs per kernel and head dim, the dense forward's per call (`fwd_config`);
                         `supported`, `fwd_supported`, `packed_supported`, `packed_fwd_supported`
  heuristics             the order programs start in: `head_groups`, `wave_groups`, `wave_tail_groups` (`wave_size`,
                         `tail_group`), `kv_head_groups`, `fwd_head_groups`; the persistent forward's grid
                         (`persistent_programs`)
  interface              the launches: argument templates over the call's tensors, the compiled launches per signature
                         (`Launch`, C launches, TMA descriptors by address), the launch plans and launchers `kv_pass`,
                         `kv_launch`, `forward`, `forward_launch`, `packed_kv_pass`, `packed_forward` (and their slot
                         tables), `example_launch`, `GLUON_KERNELS`
  common                 device code of several kernels: the program order (`grouped_program`, `grouped_item`), a
                         dK/dV program's key tile, query tiles, loads and epilogue, a packed sequence's bounds, masked
                         row stores, the TMA bulk reduction
  flash_bwd_kv           the dK/dV pass with the keys on rows (`flash_bwd_kv_gluon_kernel`)
  flash_bwd_kv_qrows     the dK/dV pass with the queries on rows and its single pass (`flash_bwd_kv_qrows_gluon_kernel`)
  flash_bwd_single_keys  the single pass with the keys on rows (band and packed programs, loader warp, dQ warp,
                         compute tile, kernel: `flash_bwd_single_keys_gluon_kernel`)
  flash_fwd              the forward (producer, softmax step, consumer, kernel: `flash_fwd_gluon_kernel`)
  flash_fwd_persistent   the forward of one consumer warpgroup in a persistent grid, each program looping over query
                         tiles (`flash_fwd_persistent_gluon_kernel`, `persistent_forward_launch`): not routed, an
                         A/B against the one-program-per-tile forward at short calls, whose result decides it

The names the launches read at call time (`fwd_head_groups`, `kv_head_groups`, `persistent_programs`,
`DESCRIPTORS_PER_ARGUMENT`) are not re-exported here: a copy on the package would take a patch that the launches
never see; patch `interface`.
"""

from cs336_systems.flash.gluon.configs import (
    CONFIGS, FWD_CONFIGS, GLUON_DTYPES, MAX_SLOTS, ONE_WARPGROUP_MAX_KEYS, QROWS_CONFIGS, SINGLE_PASS_CONFIGS,
    SINGLE_PASS_KEYS_CONFIGS, fwd_config, fwd_supported, heads_inside, one_warpgroup_fwd, packed_fwd_supported,
    packed_supported, row_stride, supported,
)
from cs336_systems.flash.gluon.flash_bwd_kv import flash_bwd_kv_gluon_kernel
from cs336_systems.flash.gluon.flash_bwd_kv_qrows import flash_bwd_kv_qrows_gluon_kernel
from cs336_systems.flash.gluon.flash_bwd_single_keys import flash_bwd_single_keys_gluon_kernel
from cs336_systems.flash.gluon.flash_fwd import flash_fwd_gluon_kernel
from cs336_systems.flash.gluon.heuristics import L2_SHARE, TAIL_WORK, head_groups, wave_groups
from cs336_systems.flash.gluon.interface import (
    GLUON_KERNELS, PACKED_TAIL, UNBOUNDED, Launch, example_launch, forward, forward_launch, kv_launch, kv_pass,
    launch_cache_size, packed_forward, packed_key_tiles, packed_kv_pass, packed_query_tiles, packed_rows,
)

__all__ = [
    "CONFIGS", "FWD_CONFIGS", "GLUON_DTYPES", "GLUON_KERNELS", "L2_SHARE", "MAX_SLOTS", "ONE_WARPGROUP_MAX_KEYS",
    "PACKED_TAIL", "QROWS_CONFIGS", "SINGLE_PASS_CONFIGS", "SINGLE_PASS_KEYS_CONFIGS", "TAIL_WORK", "UNBOUNDED",
    "Launch", "example_launch", "flash_bwd_kv_gluon_kernel", "flash_bwd_kv_qrows_gluon_kernel",
    "flash_bwd_single_keys_gluon_kernel", "flash_fwd_gluon_kernel", "forward", "forward_launch", "fwd_config",
    "fwd_supported", "head_groups", "heads_inside", "kv_launch", "kv_pass", "launch_cache_size", "one_warpgroup_fwd",
    "packed_forward", "packed_fwd_supported", "packed_key_tiles", "packed_kv_pass", "packed_query_tiles",
    "packed_rows", "packed_supported", "row_stride", "supported", "wave_groups",
]
