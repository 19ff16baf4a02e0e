"""Which design runs a call: pure functions from a call's metadata to the forward's and the backward's design.

Routing (sm_90 = Hopper; work = batch·heads·Nq·Nk, visible work = half of it when causal; "short grid" =
`split_rows` > 0):

  forward                                           | design
  --------------------------------------------------|------------------------------
  CPU without the Triton interpreter                | PYTORCH (tiled PyTorch forward, per sequence if packed)
  packed sequences, the Gluon forward takes the
  call (any work)                                   | GLUON (over a table of (sequence, query tile) slots)
  packed sequences otherwise                        | TRITON (unsplit)
  work >= GLUON_FWD_MIN_WORK (under a window: the
  band's, self-attention), sm_90, 16-bit, d 64/128,
  a layout Gluon takes                              | GLUON (one consumer warpgroup up to 1024 keys unwindowed)
  a sliding window (`band` not None) otherwise      | TRITON (unsplit)
  short grid (few heads × long sequences)           | TRITON_SPLIT (keys split, then merged)
  otherwise                                         | TRITON

  backward                                          | design
  --------------------------------------------------|------------------------------
  CPU without the Triton interpreter                | PYTORCH (recomputing PyTorch backward, per sequence if packed)
  packed sequences, deterministic not True, the
  Gluon single pass takes the call (any work)       | GLUON_SINGLE (over a table of (sequence, key tile) slots)
  packed sequences otherwise                        | TRITON_TWO_PASS, unsplit, both passes in Triton
  deterministic not True, visible work >=
  gluon_bwd_min_work(d, causal), Gluon single pass
  takes the call (under a window: the band's work,
  self-attention)                                   | GLUON_SINGLE (dQ by TMA reductions)
  a sliding window, deterministic False otherwise   | TRITON_SINGLE
  a sliding window otherwise                        | TRITON_TWO_PASS, unsplit, both passes in Triton
  deterministic False otherwise                     | TRITON_SINGLE (dQ by fp32 atomics)
  otherwise: the two-pass design (bitwise repeatable), its dK/dV pass in Gluon from gluon_kv_min_work where taken
  (`BackwardChoice.gluon_kv`), either pass split along its reduction on short grids (`dq_chunk`, `kv_chunk`).

Under torch.compile a forward (a backward) that runs Triton unsplit (the two-pass design), with no Gluon kernel, on
CUDA with static sizes and no window runs the flat entry kernels launched by Inductor itself (`inlined`). A windowed
call never splits: its reduction is bounded by the band, not by the sequence. Packed sequences (`varlen`: q, k, v
(total, heads, D) with cu_seqlens) run in the Gluon forward and single pass where they take them (`Call.gluon_fwd`,
`Call.gluon_single`: sm_90, 16-bit, d 64/128, contiguous), at any work (a packed call's work is not known on the
host), over tables of (sequence, tile) slots, longest first; elsewhere the Triton kernels' IS_VARLEN variant, a
program per (sequence·head, tile) of a grid sized by the longest sequence, through TMA descriptors made per sequence
where the layout allows (`Call.tma`: their bounds are the sequence's, so tiles past its end load zeros and store
nothing), else block pointers. The window's tile skipping applies within each sequence.

`KernelOptions` describes a variant of the kernel for the ablation and the benchmarks; the public op takes only
`deterministic`. The tile configs come from `tuning` (no timing on the default path).
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

import torch

from cs336_systems.flash.tuning import FIXED_CONFIG, TileConfig

# The forward runs in Gluon from GLUON_FWD_MIN_WORK batch·heads·Nq·Nk, the single-pass backward from
# GLUON_BWD_MIN_WORK of visible work (causal: half) by head dim and causality, the two-pass design's dK/dV pass from
# GLUON_KV_MIN_WORK. A Gluon launch (host-side TMA descriptors) costs more host time than a Triton kernel's cached C
# launch, and short calls are host-bound, so they keep Triton. Measured on the H200 (runs/ab: the Gluon forward as fast
# or faster from 2^27 at d 64 and 128; the Gluon single pass against the Triton two-pass, interleaved rounds, at
# 32 × 512 and 16 × 1024: faster from 2^28 visible at d 64 and from 2^27 at d 128, slower below, where its extra host
# time shows). In the band below the single pass's, the two-pass design with its dK/dV pass in Gluon (no fp32 dQ
# accumulator to clear, fill and cast) beat the Triton two-pass at every point measured and the single pass at most
# (H100, settled calls, runs/ab/backward_designs_6414799.jsonl); a band lower, the Triton two-pass won at most points.
# Causal d 64 is the exception: there the single pass beat both at every point measured down to 2^25.6 visible, on
# the grid's points (32 × 512 0.90×, 16 × 1024 0.96×) and in the LM's train step (0.993–0.998× at contexts 256 and
# 1024; H100, runs/ab/single_pass_causal_threshold_a5d4242.jsonl); not causal at 2^27 it lost (1.04×), at d 128
# causal 2^26 too (1.10×; runs/ab/grid_short_points_gluon_everywhere_7b86a1d.jsonl). A window keeps the
# non-causal thresholds (its band was measured apart).
GLUON_FWD_MIN_WORK = 1 << 27
GLUON_BWD_MIN_WORK = {(64, False): 1 << 28, (64, True): 1 << 25,  # (Gluon head dim, dense causal)
                      (128, False): 1 << 27, (128, True): 1 << 27}
GLUON_KV_MIN_WORK = {64: 1 << 27, 128: 1 << 26}
NO_WINDOW = (-1, -1)  # `flash_attention`'s default window: every key (the causal mask aside)
SPLIT_UNIT = 128  # chunks of a split pass are multiples of every tile size
MIN_SPLIT_STEPS = 128  # SPLIT_UNIT steps a reduction needs before it is split (`split_rows`)


@dataclass(frozen=True)
class KernelOptions:
    """A variant of the kernel; the defaults are the shipped kernel."""

    # True: the two-pass backward (bitwise repeatable). False: the single pass, dQ added in fp32 by atomics or TMA
    # reductions. None: the single pass where its Gluon kernel applies, else the two-pass design.
    deterministic: bool | None = None
    # Tiles: None the tuning table; True Triton's autotuner over `autotune.CONFIGS` (measurement only);
    # False `configs` entries ("fwd", "kv", "dq" -> (q tile, k tile, warps, stages)), else FIXED_CONFIG.
    autotune: bool | None = None
    configs: tuple[tuple[str, tuple[int, int, int, int]], ...] = ()
    # The ablation's steps (each False/None reverts one measured step of the shipped kernel):
    triton_backward: bool = True     # False: the recomputing PyTorch backward
    skip_masked_tiles: bool = True   # False: causal visits every tile and masks it
    tma: bool | None = None          # TMA tensor descriptors (None: where the GPU and strides allow)
    dp_first: bool = True            # backward passes issue dP's matmul before P's exponentials
    fused_prep: bool = True          # two-pass: the dQ pass computes delta (and copies an expanded dO)
    gluon_fwd: bool | None = None    # the Gluon forward: None on large calls, True wherever it applies, False never
    gluon_kv: bool | None = None     # the Gluon dK/dV pass (and single pass), likewise
    kv_qrows: bool = True            # the two-pass Gluon dK/dV pass with the queries on rows
    single_qrows: bool = False       # the Gluon single pass with the queries on rows (the keys-on-rows one ships)
    split_rows: int | None = None    # rows per chunk of a split pass: None by `split_rows`, 0 never

    def __post_init__(self):
        if self.split_rows is not None and (
                isinstance(self.split_rows, bool) or not isinstance(self.split_rows, int)
                or self.split_rows < 0 or self.split_rows % SPLIT_UNIT):
            raise ValueError(f"split_rows must be None, 0 or a positive multiple of {SPLIT_UNIT}, "
                             f"got {self.split_rows!r}")

    def fixed_config(self, kernel: str) -> TileConfig | None:
        """The config a fixed-tile variant (autotune=False) runs for `kernel`; None otherwise."""
        if self.autotune is not False:
            return None
        given = dict(self.configs).get(kernel)
        return FIXED_CONFIG if given is None else TileConfig(*given)


DEFAULT_OPTIONS = KernelOptions()
DETERMINISTIC_OPTIONS = KernelOptions(deterministic=True)
ATOMIC_OPTIONS = KernelOptions(deterministic=False)
OPTIONS = {None: DEFAULT_OPTIONS, True: DETERMINISTIC_OPTIONS, False: ATOMIC_OPTIONS}


class Forward(enum.Enum):
    PYTORCH = "pytorch"
    TRITON = "triton"
    TRITON_SPLIT = "triton_split"
    GLUON = "gluon"


class Backward(enum.Enum):
    PYTORCH = "pytorch"
    TRITON_TWO_PASS = "triton_two_pass"
    TRITON_SINGLE = "triton_single"
    GLUON_SINGLE = "gluon_single"


@dataclass(frozen=True)
class Call:
    """What the chooser reads of a call: sizes, device facts and layout facts (computed by the launcher)."""

    batch: int
    heads: int
    n_q: int
    n_k: int
    d: int
    causal: bool
    kernels: bool        # the Triton kernels can run (CUDA, or the interpreter)
    sms: int             # the GPU's SM count (0: the interpreter, which never splits by itself)
    tma: bool            # TMA descriptors for the inputs (Hopper, aligned strides; KernelOptions.tma)
    gluon_fwd: bool      # the Gluon forward takes this call's layout (sm_90, 16-bit, d 64/128, ...)
    gluon_single: bool   # the Gluon single pass takes it
    gluon_kv: bool       # the Gluon two-pass dK/dV pass takes it
    varlen: bool = False  # packed sequences (cu_seqlens): unsplit; in Gluon by slot tables, else Triton IS_VARLEN
    window_keys: int = 0  # under a sliding window the most keys a query sees (`band_keys`), else 0

    @property
    def window(self) -> bool:
        """A sliding window (`band` not None): unsplit; in Gluon only self-attention's forward and single pass."""
        return self.window_keys > 0

    @property
    def work(self) -> int:
        return self.batch * self.heads * self.n_q * self.n_k

    @property
    def visible_work(self) -> int:
        """The work of the score tiles a causal call visits (about half), or a windowed call (its band's)."""
        if self.window_keys:
            return self.batch * self.heads * self.n_q * self.window_keys
        return self.work // 2 if self.causal else self.work


@dataclass(frozen=True)
class BackwardChoice:
    design: Backward
    gluon_kv: bool = False  # the two-pass design's dK/dV pass in Gluon
    dq_chunk: int = 0       # rows per chunk where the dQ pass splits (0: unsplit)
    kv_chunk: int = 0       # ... and the dK/dV pass

    @property
    def atomic(self) -> bool:
        return self.design in (Backward.TRITON_SINGLE, Backward.GLUON_SINGLE)


def split_rows(programs: int, n_rows: int, n_reduce: int, causal: bool, sms: int, per_sm: int = 2) -> int:
    """Rows per chunk of a pass's reduction (0: no split) for `programs` (batch·heads) × tiles of n_rows
    rows, each reducing over up to n_reduce rows, on a GPU with `sms` SMs running `per_sm` programs each
    (two at head dim <= 64, one above, by registers and shared memory).

    In 128-row steps: the longest program runs `steps` of them and the whole pass W (about half of
    rows × steps under causal masking). The resident programs share W evenly at W / (per_sm·sms) steps each;
    chunks of that many steps (at least 4, so that merging stays cheap) split the reduction where at
    least two fit in the longest program, and only where that program is long (MIN_SPLIT_STEPS: shorter
    calls are bound by host time, which the merge launches add to). So short grids of long sequences split
    (one head at 16384-32768 tokens); a grid of many waves (16 heads × 16384) never does.
    """
    steps = -(-n_reduce // SPLIT_UNIT)
    if steps < MIN_SPLIT_STEPS:
        return 0
    work = programs * -(-n_rows // SPLIT_UNIT) * steps
    if causal:
        work //= 2
    pieces = steps // max(4, -(-work // (per_sm * sms)))
    return -(-steps // pieces) * SPLIT_UNIT if pieces >= 2 else 0


def _split(opts: KernelOptions, call: Call, n_rows: int, n_reduce: int) -> int:
    if call.window or call.varlen:
        return 0
    if opts.split_rows is not None:
        return opts.split_rows
    if not call.sms:  # the interpreter: only where a test asks for it
        return 0
    return split_rows(call.batch * call.heads, n_rows, n_reduce, call.causal, call.sms, 2 if call.d <= 64 else 1)


def _gluon_wanted(flag: bool | None, call: Call, min_work: int, work: int) -> bool:
    """Whether a Gluon kernel that takes the call runs it (the launcher's facts say which take it: under a window
    the forward and the single pass, on self-attention; for packed sequences the same two). A packed call's work
    is not known on the host (its lengths are on the device): any work, unless the flag says False."""
    if call.varlen:
        return flag is not False
    return work >= min_work if flag is None else flag


def gluon_bwd_min_work(d: int, causal: bool) -> int:
    """The visible work from which a backward of head dim d (causal: a dense causal call; a window's band counts as
    not causal) runs the Gluon single pass (`GLUON_BWD_MIN_WORK`)."""
    return GLUON_BWD_MIN_WORK[64 if d <= 64 else 128, causal]


def gluon_kv_min_work(d: int) -> int:
    """The visible work from which the two-pass backward of head dim d runs its dK/dV pass in Gluon
    (`GLUON_KV_MIN_WORK`)."""
    return GLUON_KV_MIN_WORK[64 if d <= 64 else 128]


def _single_min_work(call: Call) -> int:
    """`gluon_bwd_min_work` of a call: a window keeps the non-causal threshold."""
    return gluon_bwd_min_work(call.d, call.causal and not call.window)


def gluon_lengths(batch_heads: int, d: int, causal: bool) -> tuple[int, ...]:
    """The shortest lengths, in whole 256-row tiles, at which a self-attention call of batch·heads runs the Gluon
    forward with each Gluon backward the default routing meets by their work (the two-pass design's dK/dV pass where
    it starts below the single pass, then the single pass; one length where both start together): where a signature
    compiles its Gluon kernels ahead of its longer calls (`launch.prewarm`)."""
    def length(visible: int) -> int:
        work = max(GLUON_FWD_MIN_WORK, visible * (2 if causal else 1))
        n = math.isqrt(-(-work // max(batch_heads, 1)) - 1) + 1  # (the ceiling of the square root)
        return -(-n // 256) * 256

    single = gluon_bwd_min_work(d, causal)
    return tuple(sorted({length(min(gluon_kv_min_work(d), single)), length(single)}))


def forward_design(call: Call, opts: KernelOptions = DEFAULT_OPTIONS) -> tuple[Forward, int]:
    """(design, rows per key chunk where the forward splits)."""
    if not call.kernels:
        return Forward.PYTORCH, 0
    if call.varlen:
        wanted = _gluon_wanted(opts.gluon_fwd, call, GLUON_FWD_MIN_WORK, call.work)
        return (Forward.GLUON if wanted and call.tma and call.gluon_fwd else Forward.TRITON), 0
    chunk = _split(opts, call, call.n_q, call.n_k)
    work = call.visible_work if call.window else call.work  # (a window's: its band's)
    if _gluon_wanted(opts.gluon_fwd, call, GLUON_FWD_MIN_WORK, work) and not chunk and call.tma and call.gluon_fwd:
        return Forward.GLUON, 0
    return (Forward.TRITON_SPLIT, chunk) if chunk else (Forward.TRITON, 0)


def backward_design(call: Call, opts: KernelOptions = DEFAULT_OPTIONS) -> BackwardChoice:
    if not call.kernels or not opts.triton_backward:
        return BackwardChoice(Backward.PYTORCH)
    if call.varlen:  # (the Triton IS_VARLEN passes have no atomic dQ: the two-pass design, bitwise repeatable)
        wanted = _gluon_wanted(opts.gluon_kv, call, _single_min_work(call), call.visible_work)
        if opts.deterministic is not True and wanted and call.tma and call.gluon_single:
            return BackwardChoice(Backward.GLUON_SINGLE)
        return BackwardChoice(Backward.TRITON_TWO_PASS)
    def gluon_from(min_work: int) -> bool:  # a Gluon backward wanted by its threshold, the options and the layout
        return (_gluon_wanted(opts.gluon_kv, call, min_work, call.visible_work)
                and opts.skip_masked_tiles and call.tma)

    if opts.deterministic is not True and gluon_from(_single_min_work(call)) and call.gluon_single:
        return BackwardChoice(Backward.GLUON_SINGLE)
    if opts.deterministic is False:
        return BackwardChoice(Backward.TRITON_SINGLE)
    dq_chunk = _split(opts, call, call.n_q, call.n_k)
    # (the dK/dV pass counted per query head: a GQA program runs its group's heads one after another)
    kv_chunk = _split(opts, call, call.n_k, call.n_q)
    gluon_kv = (gluon_from(gluon_kv_min_work(call.d)) and not kv_chunk and call.gluon_kv
                and not call.window)  # (it has no window)
    return BackwardChoice(Backward.TRITON_TWO_PASS, gluon_kv, dq_chunk, kv_chunk)


def inlined(call: Call, backward: bool = False) -> bool:
    """Whether a traced forward (`backward`: backward) with the default options runs the flat Triton kernels
    launched by Inductor: on a GPU, short of the Gluon kernels' work, no pass split."""
    short = (call.visible_work < min(gluon_kv_min_work(call.d), _single_min_work(call)) if backward
             else call.work < GLUON_FWD_MIN_WORK)
    return (call.kernels and call.sms > 0 and short and not call.window and not call.varlen
            and not _split(DEFAULT_OPTIONS, call, call.n_q, call.n_k)
            and not _split(DEFAULT_OPTIONS, call, call.n_k, call.n_q))


def band(window: tuple[int, int], is_causal: bool, n_q: int, n_k: int) -> tuple[int, int] | None:
    """A window (left, right) (-1: unbounded) as the kernels take it: bounds (left, right) with query i seeing keys
    [i - left, i + right], causal folded in (right 0) and unbounded sides as the lengths; None where the window
    hides nothing that `is_causal` alone does not, so that the call runs the unwindowed kernels. For packed sequences
    n_q and n_k are the longest sequence's lengths (a window that hides nothing there hides nothing anywhere)."""
    left, right = window
    hides_left = 0 <= left < n_q - 1   # the last query misses key 0
    hides_right = 0 <= right < n_k - 1  # the first query misses the last key
    if not hides_left and (is_causal or not hides_right):
        return None
    return (left if hides_left else n_q, 0 if is_causal else right if hides_right else n_k)


def band_keys(band: tuple[int, int] | None, n_k: int) -> int:
    """`Call.window_keys` of a call with this `band`: left + right + 1 keys, at most n_k and at least 1; 0 without
    a window."""
    return 0 if band is None else max(1, min(n_k, band[0] + band[1] + 1))


def precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: fp32 follows torch.get_float32_matmul_precision()."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    """The GPU's compute capability, asked once per device at the first launch (never at import)."""
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tma_default(device_index: int | None) -> bool:
    """TMA where the GPU has it (Hopper and newer); never under the interpreter (device_index None)."""
    return device_index is not None and capability(device_index)[0] >= 9
