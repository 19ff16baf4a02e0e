"""Host side of the kernels: per input signature a plan (made once), and launches that skip Triton's Python.

A plan holds what a call decides from its inputs' metadata: the design (`chooser`), the tile configs
(`tuning`), splits, TMA, allocation shapes, grids, constexprs and strides. A repeat call builds the plan's key,
allocates and calls the compiled kernels' C launches directly (`c_launch.CLaunch`), which saves most of the host
time at short sequences. The kernels take each tensor as a pointer beside the (B, H, S, D) strides its plan holds,
so calls pass their tensors as they are, except inputs of more than four dims, which `as_bhsd` may have to copy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton

from cs336_systems.flash import autotune, background, chooser, gluon, triton_kernels as kernels, tuning
from cs336_systems.flash.c_launch import CLaunch, scratch
from cs336_systems.flash.chooser import DEFAULT_OPTIONS, NO_WINDOW, Backward, Forward, KernelOptions
from cs336_systems.flash.tuning import TileConfig, padded_dim
from cs336_systems.flash_pytorch import backward_for, flash_forward_tiled

INTERPRET = kernels.INTERPRET
MAX_HEAD_DIM = 256  # the largest head dim the kernels take
MAX_GRID_Y = 65535
PREP_TILE = 16 if INTERPRET else 64
SUM_TILE = 16 if INTERPRET else 32  # rows per program of the split sum (more programs: it is latency-bound)
# The CPU fallback's forward tiles: 64 queries by 512 keys (on 2 CPU cores, causal, 1 x 8 x S x 64 at S 1024 and
# 4096: half the time of 128 queries by every key at once, whose score blocks fall out of cache; smaller tiles
# pay per-call costs)
CPU_Q_TILE, CPU_K_TILE = 64, 512


def launch_hooks_installed() -> bool:
    """Whether a profiler (e.g. proton) hooks Triton's launches: then every launch goes through Triton.
    Triton 3.6 keeps the hooks in a HookChain (never None; empty when none is installed), older
    versions a callable or None."""
    hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class _Compiled:
    """What `_Launcher` keeps per argument signature: the compiled kernel's C launch (None where Triton's
    launcher does not expose it; then its runner is called) and the arguments after the call's own."""

    __slots__ = ("tail", "runner", "c_launch")

    def __init__(self, tail: tuple, runner, c_launch: CLaunch | None):
        self.tail = tail  # the constexprs and tuned meta-parameters
        self.runner, self.c_launch = runner, c_launch


class _Launcher:
    """Launches one kernel (a JIT function given its config, or an autotuner); remembers, per argument signature,
    the compiled kernel and its grid.

    The first launch of a signature goes through Triton (specialization, compilation; for an autotuner, tuning);
    later ones call the compiled kernel's C launch directly (the current stream, fresh TMA scratch). The signature
    holds everything Triton specializes on: each tensor's dtype and 16-byte alignment, every integer's value, the
    constexprs and compile options, and the device. Under the interpreter, or with launch hooks installed, every
    launch goes through Triton.
    """

    def __init__(self, kernel, name: str):
        self.kernel = kernel
        self.name = name
        self.plain = background.plain_positions(kernel)  # (`background.specialization`)
        self.tuned = isinstance(kernel, triton.runtime.Autotuner)
        self.arg_names = (kernel.fn if self.tuned else kernel).arg_names  # every parameter, in order
        fn = kernel
        while hasattr(fn, "fn"):  # the Python function under the autotuner, heuristics, JIT (or interpreter)
            fn = fn.fn
        # parameters a launch may leave out (the packed-sequence variant's, off by default)
        self.defaults = {p.name: p.default for p in inspect.signature(fn).parameters.values()
                         if p.default is not inspect.Parameter.empty}
        self.entries: dict[tuple, _Compiled] = {}
        # where the tensors and the specialized non-tensors sit among the arguments: each call site passes one
        # fixed layout, found at its first call
        self.tensor_positions: tuple[int, ...] = ()
        self.other_positions: tuple[int, ...] | None = None

    def _key(self, grid, args: tuple, constexprs: dict) -> tuple:
        if self.other_positions is None:
            self.tensor_positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            self.other_positions = tuple(i for i, a in enumerate(args) if not isinstance(a, (torch.Tensor, float)))
        tensors = [args[i] for i in self.tensor_positions]
        return (torch.cuda.current_device(), grid, *constexprs.values(), *[t.dtype for t in tensors],
                *[t.data_ptr() % 16 == 0 for t in tensors], *[args[i] for i in self.other_positions])

    def __call__(self, grid, args: tuple, **constexprs) -> _Compiled | None:
        """Launch; hand back what this signature's later launches may call directly, or None where every launch
        goes through Triton."""
        if INTERPRET or launch_hooks_installed():
            self.kernel[grid](*args, **constexprs)
            return None
        key = self._key(grid, args, constexprs)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = self._compile(grid, args, constexprs)
        elif entry.c_launch is None:
            entry.runner(*args, *entry.tail)
        else:
            entry.c_launch(key[0], *args, *entry.tail)
        return entry

    def warm(self, args: tuple, constexprs: dict) -> None:
        """Compile (and load) the kernel these arguments launch, without launching it: Triton's JIT cache then
        holds it for the first real launch. Only a kernel given its config: an autotuner must time to choose."""
        if not (self.tuned or INTERPRET):
            background.compile_ahead(self.kernel, args, constexprs)

    def _compile(self, grid, args: tuple, constexprs: dict) -> _Compiled:
        background.wait_for(self, args, constexprs)
        kernel = self.kernel[grid](*args, **constexprs)
        if hasattr(kernel, "result"):  # Triton's asynchronous compile mode hands back a future
            kernel = kernel.result()
        background.note_compiled(self, args, constexprs)
        values = {**self.defaults, **dict(zip(self.arg_names, args)), **constexprs}
        if self.tuned:
            values.update(self.kernel.best_config.kwargs)
            values.update({name: rule(values) for name, rule in autotune.EVEN_HEURISTICS.items()})
        tail = tuple(values[name] for name in self.arg_names[len(args):])
        fixed_grid = tuple(grid(values) if callable(grid) else grid)
        return _Compiled(tail, kernel[fixed_grid], CLaunch.of(kernel, fixed_grid))


_fwd_launch = _Launcher(kernels.flash_fwd_kernel, "fwd")
_kv_launch = _Launcher(kernels.flash_bwd_kv_kernel, "kv")
_dq_launch = _Launcher(kernels.flash_bwd_dq_kernel, "dq")
_fwd_tuned_launch = _Launcher(autotune.flash_fwd_autotuned, "fwd")
_kv_tuned_launch = _Launcher(autotune.flash_bwd_kv_autotuned, "kv")
_dq_tuned_launch = _Launcher(autotune.flash_bwd_dq_autotuned, "dq")
_prep_launch = _Launcher(kernels.flash_bwd_prep_kernel, "prep")
_cast_launch = _Launcher(kernels.flash_bwd_dq_cast_kernel, "cast")
_combine_launch = _Launcher(kernels.flash_fwd_combine_kernel, "combine")
_sum_launch = _Launcher(kernels.flash_split_sum_kernel, "sum")
_LAUNCHERS = (_fwd_launch, _kv_launch, _dq_launch, _fwd_tuned_launch, _kv_tuned_launch, _dq_tuned_launch,
              _prep_launch, _cast_launch, _combine_launch, _sum_launch)
_TILED = {"fwd": (_fwd_launch, _fwd_tuned_launch), "kv": (_kv_launch, _kv_tuned_launch),
          "dq": (_dq_launch, _dq_tuned_launch)}


def launch_cache_sizes() -> dict[str, int]:
    """Compiled kernels the fast launch path holds, per launcher (argument signatures seen)."""
    sizes: dict[str, int] = {}
    for launcher in _LAUNCHERS:
        sizes[launcher.name] = sizes.get(launcher.name, 0) + len(launcher.entries)
    return sizes


@dataclass(frozen=True)
class TilesGrid:
    """Grid (first, tiles of n, chunks) for a config's meta-parameters; hashable, so that the launch
    cache keys on it (first is batch·heads, which no kernel argument carries)."""

    first: int
    n: int
    tile_name: str
    chunks: int = 1

    def __call__(self, meta: dict) -> tuple[int, int, int]:
        tiles = -(-self.n // meta[self.tile_name])
        if tiles > MAX_GRID_Y:
            raise ValueError(f"sequence length {self.n} needs {tiles} tiles, more than the launch grid allows")
        return (self.first, tiles, self.chunks)


def device_index(q: torch.Tensor) -> int | None:
    """q's CUDA device index; None under the interpreter (no GPU facts to ask for)."""
    return None if INTERPRET or not q.is_cuda else (q.device.index or 0)


def tile_config(kernel: str, opts: KernelOptions, q: torch.Tensor, d_tile: int, causal: bool, n_q: int,
                n_k: int) -> TileConfig | None:
    """The config `kernel` runs (None: the autotuner chooses, KernelOptions.autotune=True)."""
    if opts.autotune:
        return None
    fixed = opts.fixed_config(kernel)
    if fixed is not None:
        return tuning.INTERPRETER_CONFIG if INTERPRET else fixed
    index = device_index(q)
    arch = None if index is None else tuning.arch_name(chooser.capability(index))
    return tuning.tile_config(kernel, arch=arch, d_tile=d_tile, dtype=q.dtype, precision=chooser.precision(q.dtype),
                              causal=causal, n_q=n_q, n_k=n_k)


def tiled_launch(kernel: str, config: TileConfig | None, n_q: int, n_k: int, d: int, d_tile: int,
                 tma: bool) -> tuple:
    """(launcher, the constexprs the config sets) of a tiled kernel."""
    configured, tuned = _TILED[kernel]
    if config is None:
        return tuned, {}
    return configured, {**config.constexprs(), **tuning.even_flags(config, n_q, n_k, d, d_tile, tma)}


def split_buffers(chunk: int, n_reduce: int, batch: int, heads: int, n_rows: int, d_tile: int, device,
                  count: int = 1) -> tuple[int, list[torch.Tensor]]:
    """(chunks, `count` fp32 partial buffers of a split pass, one allocation, each as chunk 0's (batch,
    heads, n_rows, d_tile) view); the kernels find chunk c at c·batch·heads·n_rows·d_tile elements
    from it, and buffer i + 1 starts `chunks` of those after buffer i."""
    chunks = -(-n_reduce // chunk)
    parts = torch.empty((count, chunks, batch, heads, n_rows, d_tile), device=device, dtype=torch.float32)
    return chunks, [parts[i, 0] for i in range(count)]


def check_head_dim(d: int) -> None:
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is larger than the supported maximum {MAX_HEAD_DIM}")


def as_bhsd(t: torch.Tensor) -> torch.Tensor:
    """View (..., H, S, D) as (B, H, S, D) without copying when the leading dims allow it."""
    if t.ndim == 2:
        return t[None, None]
    if t.ndim == 3:
        return t[None]
    if t.ndim == 4:
        return t
    return t.reshape(-1, *t.shape[-3:])  # copies only if the leading dims cannot be merged


def tma_strides_ok(t: torch.Tensor) -> bool:
    """A contiguous last dim and 16-byte multiples elsewhere, none of them 0: an expanded tensor's stride-0 rows (k
    or v broadcast over positions, the dO of a sum over them) go through pointers, not a descriptor, whose encoding
    does not promise to take them."""
    *outer, last = t.stride()
    per16 = 16 // t.element_size()
    return last == 1 and all(s > 0 and s % per16 == 0 for s in outer)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and strides, and a contiguous last dim."""
    return all(t.data_ptr() % 16 == 0 and tma_strides_ok(t) for t in tensors)


def tma_wanted(opts: KernelOptions, q: torch.Tensor) -> bool:
    return chooser.tma_default(device_index(q)) if opts.tma is None else opts.tma


def _gluon_config(opts: KernelOptions, flag: bool | None, kernel: str):
    """The config a Gluon kernel asked for explicitly (`flag` True) by a fixed-tile variant gets; else None
    (its own default)."""
    return dict(opts.configs).get(kernel) if flag and opts.autotune is False else None


def call_facts(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool, opts: KernelOptions,
               do4: torch.Tensor | None = None, band: tuple[int, int] | None = None) -> chooser.Call:
    """The chooser's view of a call on (B, H, S, D) tensors (with do4: of its backward; band: its window)."""
    batch, heads, n_q, d = q4.shape
    index = device_index(q4)
    runs = q4.is_cuda or INTERPRET
    tma = runs and tma_wanted(opts, q4) and tma_ok(q4, k4, v4)
    gluon_fwd = gluon_single = gluon_kv = False
    if tma:
        windowed = band is not None  # (the Gluon kernels take a window on self-attention only)
        gluon_fwd = (gluon.fwd_supported(q4, k4, v4, _gluon_config(opts, opts.gluon_fwd, "fwd"))
                     and not (windowed and n_q != k4.shape[2]))
        if do4 is not None and do4.dtype == q4.dtype:
            config = _gluon_config(opts, opts.gluon_kv, "kv")
            # the single pass reads dO contiguous or `heads_inside` (copied otherwise), so q stands in for it; under a
            # window only the keys-on-rows one (the chooser keeps the two-pass dK/dV pass out of windowed calls)
            gluon_single = (gluon.supported(q4, k4, v4, q4, config, opts.single_qrows, single_pass=True)
                            and not (windowed and (n_q != k4.shape[2] or opts.single_qrows)))
            do_read = q4 if (not tma_ok(do4) or do4.is_contiguous()) else do4  # dO as the two-pass passes load it
            gluon_kv = gluon.supported(q4, k4, v4, do_read, config, opts.kv_qrows)
    return chooser.Call(batch, heads, n_q, k4.shape[2], d, causal, runs,
                        0 if index is None else chooser.sm_count(index), tma, gluon_fwd, gluon_single, gluon_kv,
                        window_keys=chooser.band_keys(band, k4.shape[2]))


class _PlannedLaunch:
    """One kernel launch of a plan: a launcher with the grid, constexprs and non-tensor arguments that its plan
    fixed; a call passes its tensors (and the softmax scale, a float kernel argument in no plan's key, so that calls
    of varying scales share a plan). Launches go through the launcher until it hands back the signature's compiled
    kernel, then straight to its C launch: the plan's key holds all that the launcher's signature holds."""

    __slots__ = ("launcher", "grid", "head", "tail", "constexprs", "device", "compiled")

    def __init__(self, launcher, grid, head: tuple, tail: tuple | None, constexprs: dict, device: int | None):
        self.launcher, self.grid, self.constexprs = launcher, grid, constexprs
        # the arguments after the tensors: all of them (tail None), or those before the scale and those after it
        self.head, self.tail = head, tail
        self.device = device  # the current CUDA device of the plan's key: its compiled kernels, its stream
        self.compiled: _Compiled | None = None  # one reference, set in one store: threads may share a plan

    def arguments(self, tensors: tuple, scale: float | None) -> tuple:
        return (*tensors, *self.head) if self.tail is None else (*tensors, *self.head, scale, *self.tail)

    def scratch_size(self) -> int | None:
        """Bytes of global scratch (TMA descriptors) its C launch takes; None while launches go through Triton."""
        compiled = self.compiled
        return None if compiled is None or compiled.c_launch is None else compiled.c_launch.scratch_size

    def __call__(self, buffer: torch.Tensor | None, *tensors: torch.Tensor, scale: float | None = None) -> None:
        """Launch on this call's tensors; `buffer`: the call's shared scratch (`_SharedScratch`) or None, or a list
        that collects the launch instead (`prewarm`)."""
        args = self.arguments(tensors, scale)
        if buffer.__class__ is list:
            buffer.append((self.launcher, args, self.constexprs))
            return
        compiled = self.compiled
        if compiled is None or compiled.c_launch is None:
            self.compiled = self.launcher(self.grid, args, **self.constexprs)
        else:
            compiled.c_launch(self.device, *args, *compiled.tail, buffer=buffer)


class _SharedScratch:
    """One global-scratch buffer per call for all the C launches of a plan. As safe as one per launch: the kernels
    of a call run one after another on the current stream, each writing its TMA descriptors before reading them;
    the buffer, freed when the call returns, goes back to the caching allocator, which hands it out again only to
    work queued after them on that stream (under CUDA-graph capture, from the graph's private pool)."""

    __slots__ = ("launches", "size")

    def __init__(self, launches: tuple[_PlannedLaunch, ...]):
        self.launches = launches
        self.size: int | None = None  # bytes: the largest launch's, once every launch has its C launch

    def __call__(self) -> torch.Tensor | None:
        if self.size is None:
            sizes = [launch.scratch_size() for launch in self.launches]
            if None in sizes:
                return None
            self.size = max(sizes, default=0)
        return scratch(self.size, 128, None) if self.size else None


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor of t's shape, dtype and device for O or a gradient: a (B, H, S, D) view of (B, S, H, D)
    memory where t has its heads inside its rows (`gluon.heads_inside`: a model's projection output, or a fused QKV
    projection's slice), so that the model's reshape back to (B, S, H·D) copies nothing; contiguous otherwise."""
    if gluon.heads_inside(t):
        return torch.empty_like(t.transpose(1, 2), memory_format=torch.contiguous_format).transpose(1, 2)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def in_layout_of(like: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t (like's shape) in the layout `empty_like(like)` gives: t itself where it has it, else a copy."""
    out = empty_like(like)
    return t if t.stride() == out.stride() else out.copy_(t)


def call_band(q: torch.Tensor, k: torch.Tensor, is_causal: bool, window: tuple[int, int]) -> tuple[int, int] | None:
    """The call's `chooser.band` (None at once for no window: the default path does no more work)."""
    return None if window == NO_WINDOW else chooser.band(window, is_causal, q.shape[-2], k.shape[-2])


def _window_args(band: tuple[int, int] | None) -> tuple[tuple[int, int], dict]:
    """The kernels' (WINDOW_LEFT, WINDOW_RIGHT) arguments (unused zeros without a window) and HAS_WINDOW."""
    return (band or (0, 0)), dict(HAS_WINDOW=band is not None)


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.data_ptr() % 16


def plan_key(tensors: tuple[torch.Tensor, ...], is_causal: bool, opts: KernelOptions,
             band: tuple[int, int] | None = None) -> tuple:
    """What a plan is decided from: each tensor's shape, strides, dtype and 16-byte misalignment, is_causal, the
    window's band, the options; q's device, the fp32 matmul precision, whether launch hooks are installed, and last
    the current CUDA device, whose compiled kernels the plan's launches call."""
    q = tensors[0]
    return (*map(_layout, tensors), is_causal, band, opts, q.device, chooser.precision(q.dtype),
            launch_hooks_installed(), torch.cuda.current_device() if q.is_cuda else None)


def _off_current_device(q: torch.Tensor, key: tuple) -> bool:
    """Whether q is on a CUDA device other than the current one (the last part of its plan key)."""
    return q.is_cuda and key[-1] != q.device.index


def _planned_sum(out4: torch.Tensor, chunks: int, chunk: int, d: int, d_tile: int, is_causal: bool,
                 rows_are_keys: bool, device: int | None) -> _PlannedLaunch:
    """The launch that writes out4 = the sum of the chunks of one partial buffer of `split_buffers` (one output per
    launch: the custom op's outputs must not share storage)."""
    batch, heads, n_rows = out4.shape[:3]
    return _PlannedLaunch(_sum_launch, (batch * heads, -(-n_rows // SUM_TILE)),
                          (out4.stride(), chunks, chunk, heads, n_rows), None,
                          dict(D=d, D_TILE=d_tile, Q_TILE_SIZE=SUM_TILE, is_causal=is_causal,
                               ROWS_ARE_KEYS=rows_are_keys), device)


# ---------------------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    """What `flash_forward_triton` decides for a signature."""

    design: Forward
    lse_shape: tuple[int, ...]
    reshape: bool                     # inputs of more than four dims: `as_bhsd` each call
    default_scale: float              # 1/sqrt(D)
    gluon: gluon.Launch | None = None  # the Gluon forward's (`gluon.forward_launch`)
    use_tma: bool = False
    split: tuple | None = None        # `split_buffers`' arguments where the keys split (a short grid),
    split_lse_shape: tuple | None = None  # and the partial L's shape
    fwd: _PlannedLaunch | None = None
    combine: _PlannedLaunch | None = None  # merges the chunks of a split
    scratch: _SharedScratch | None = None


_FORWARD_PLANS: dict[tuple, ForwardPlan] = {}


def plan_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, opts: KernelOptions,
                 device: int | None, band: tuple[int, int] | None = None) -> ForwardPlan:
    q4, k4, v4 = as_bhsd(q), as_bhsd(k), as_bhsd(v)
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    d_tile = padded_dim(d)
    design, chunk = chooser.forward_design(call_facts(q4, k4, v4, is_causal, opts, band=band), opts)
    lse_shape, reshape, default_scale = tuple(q.shape[:-1]), q.ndim > 4, d ** -0.5
    if design is Forward.GLUON:
        config = _gluon_config(opts, opts.gluon_fwd, "fwd")
        return ForwardPlan(design, lse_shape, reshape, default_scale,
                           gluon.forward_launch(is_causal, config, not launch_hooks_installed(), band=band))
    o4 = as_bhsd(empty_like(q))  # as each call allocates O
    split, split_lse_shape, chunks, out = None, None, 1, o4
    if chunk:  # a short grid: chunks of the keys, merged by the combine kernel
        split = (chunk, n_k, batch, heads, n_q, d_tile)
        chunks, (out,) = split_buffers(*split, q.device)
        split_lse_shape = (chunks, batch * heads, n_q)
    use_tma = tma_wanted(opts, q) and tma_ok(q4, k4, v4, out)
    launcher, config = tiled_launch("fwd", tile_config("fwd", opts, q, d_tile, is_causal, n_q, n_k), n_q, n_k, d,
                                    d_tile, use_tma)
    window, has_window = _window_args(band)
    fwd = _PlannedLaunch(
        launcher, TilesGrid(batch * heads, n_q, "Q_TILE_SIZE", chunks),
        (q4.stride(), k4.stride(), v4.stride(), out.stride(), heads, heads // kv_heads, n_q, n_k), (chunk, *window),
        dict(D=d, D_TILE=d_tile, is_causal=is_causal, SKIP_MASKED_TILES=opts.skip_masked_tiles, USE_TMA=use_tma,
             PRECISION=chooser.precision(q.dtype), SPLIT=bool(chunk), **config, **has_window), device)
    combine = None
    if chunk:
        combine = _PlannedLaunch(_combine_launch, (batch * heads, -(-n_q // PREP_TILE), 1),
                                 (o4.stride(), chunks, heads, n_q), None,
                                 dict(D=d, D_TILE=d_tile, Q_TILE_SIZE=PREP_TILE), device)
    return ForwardPlan(design, lse_shape, reshape, default_scale, None, use_tma, split, split_lse_shape, fwd, combine,
                       _SharedScratch((fwd,) if combine is None else (fwd, combine)))


def _check_launchable(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"the Triton kernels need CUDA tensors, got a tensor on {q.device} "
            "(set TRITON_INTERPRET=1 before importing cs336_systems to run them on the CPU)")
    check_head_dim(q.shape[-1])


def flash_forward_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
    opts: KernelOptions = DEFAULT_OPTIONS, scale: float | None = None, warm: list | None = None,
    window: tuple[int, int] = NO_WINDOW,
) -> tuple[torch.Tensor, torch.Tensor]:
    """O (..., H, Nq, D) in q's dtype and L (..., H, Nq) fp32, for checked inputs (k, v: (..., Hkv, Nk, D)). warm: a
    list that collects the Triton launches the call would make, launching none (`prewarm`). window: a checked
    (left, right) sliding window (`chooser.band`)."""
    _check_launchable(q)
    band = call_band(q, k, is_causal, window)
    key = plan_key((q, k, v), is_causal, opts, band)
    if _off_current_device(q, key):
        with torch.cuda.device(q.device):
            return flash_forward_triton(q, k, v, is_causal, opts, scale, warm, window)
    plan = _FORWARD_PLANS.get(key)
    first = warm is None and plan is None
    if warm is not None:
        plan = plan_forward(q, k, v, is_causal, opts, key[-1], band)
    elif first:
        prewarm(q, k, v, is_causal, opts, key, window)
        plan = plan_forward(q, k, v, is_causal, opts, key[-1], band)
        instead = _compiled_instead(plan, plan.gluon is not None and opts.gluon_fwd is None, q,
                                    lambda p, collect: _run_forward(p, q, k, v, is_causal, scale, collect),
                                    lambda: plan_forward(q, k, v, is_causal, _triton_only(opts), key[-1], band))
        if instead is None:
            _FORWARD_PLANS[key] = plan
        else:  # (not kept: the next call plans again)
            plan = instead
    o, lse = _run_forward(plan, q, k, v, is_causal, scale, warm)
    if first and not _wants_grad(q, k, v):
        _start_ahead(key)  # (a call with gradients to come starts them after its backward)
    return o, lse


def _run_forward(plan: ForwardPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                 scale: float | None, warm: list | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The launches of `flash_forward_triton`, by its plan."""
    scale = plan.default_scale if scale is None else float(scale)
    o = empty_like(q)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    if plan.reshape:
        q, k, v = as_bhsd(q), as_bhsd(k), as_bhsd(v)
    if plan.gluon:
        tensors = (as_bhsd(q), as_bhsd(k), as_bhsd(v), as_bhsd(o), lse)
        if warm is not None:
            warm.append(plan.gluon.ahead(tensors, scale))
        else:
            plan.gluon(tensors, scale)
        return o, lse
    if plan.use_tma:  # launches through Triton take TMA scratch from its allocator, a context variable: set per thread
        triton.set_allocator(scratch)
    out, out_lse = o, lse
    if plan.split:
        _, (out,) = split_buffers(*plan.split, q.device)
        out_lse = q.new_empty(plan.split_lse_shape, dtype=torch.float32)
    buffer = plan.scratch() if warm is None else warm
    plan.fwd(buffer, q, k, v, out, out_lse, scale=scale)
    if plan.combine:
        plan.combine(buffer, out, out_lse, o, lse)
    return o, lse


# ---------------------------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _BackwardBuffers:
    """What a backward call allocates besides dQ, dK, dV, by its plan."""

    delta_shape: tuple[int, int]  # (batch·heads, Nq)
    dq_acc_shape: tuple[int, int, int] | None  # (batch·heads, Nq, D_TILE): the single pass's fp32 dQ accumulator
    copy_do: str | None  # "dq pass": an empty buffer that the fused dQ pass fills; "now": dO.contiguous(); None
    dq_split: tuple | None  # `split_buffers`' arguments where the dQ pass splits
    kv_split: tuple | None  # ... and where the dK/dV pass does (two buffers: dK's, dV's)

    def __call__(self, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, do: torch.Tensor) -> tuple:
        """(delta, dq_acc, do, do_tiles, dq_out, dk_out, dv_out): delta; the dQ accumulator; dO as the passes that
        read it through pointers take it, and as the TMA-loading passes do; where the dQ pass and the dK/dV pass
        write (the outputs, or partial sums)."""
        delta = torch.empty(self.delta_shape, dtype=torch.float32, device=dq.device)
        do_tiles = do
        if self.copy_do == "dq pass":
            do_tiles = empty_like(do)
        elif self.copy_do == "now":
            do = do_tiles = do.contiguous()
        dq_out = dq
        if self.dq_split:
            _, (dq_out,) = split_buffers(*self.dq_split, dq.device)
        dk_out, dv_out = dk, dv
        if self.kv_split:
            _, (dk_out, dv_out) = split_buffers(*self.kv_split, dq.device, 2)
        # Outside the single pass the dQ-accumulator argument is unused, and dK's buffer stands in for it (the kv
        # autotuner zeroes that argument before timing each config and before the launch, which then writes all
        # of dK). No input, nor delta or dQ, may stand in.
        dq_acc = dk_out
        if self.dq_acc_shape is not None:
            dq_acc = dq.new_empty(self.dq_acc_shape, dtype=torch.float32)
        return delta, dq_acc, do, do_tiles, dq_out, dk_out, dv_out


@dataclass(frozen=True, slots=True)
class BackwardPlan:
    """What `flash_backward_triton` decides for a signature: the launches in their order."""

    choice: chooser.BackwardChoice
    buffers: _BackwardBuffers
    reshape: bool                     # inputs of more than four dims: `as_bhsd` each call
    default_scale: float              # 1/sqrt(D)
    use_tma: bool
    prep: _PlannedLaunch | None       # the pre-pass: delta (and the single pass's zeroed dQ accumulator)
    dq: _PlannedLaunch | None         # the two-pass design's dQ pass
    dq_sum: _PlannedLaunch | None     # merges its chunks where it splits
    kv: _PlannedLaunch | None         # the Triton dK/dV pass, or
    gluon_kv: gluon.Launch | None     # the Gluon one's (`gluon.kv_launch`)
    kv_sums: tuple[_PlannedLaunch, ...]  # dK's and dV's, where the dK/dV pass splits
    cast: _PlannedLaunch | None       # the single pass's dQ = its accumulator · scale, in q's dtype
    scratch: _SharedScratch


_BACKWARD_PLANS: dict[tuple, BackwardPlan] = {}


def plan_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                  is_causal: bool, opts: KernelOptions, device: int | None,
                  band: tuple[int, int] | None = None) -> BackwardPlan:
    q4, k4, v4, o4, do4 = as_bhsd(q), as_bhsd(k), as_bhsd(v), as_bhsd(o), as_bhsd(do)
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    call = call_facts(q4, k4, v4, is_causal, opts, do4, band)
    choice = chooser.backward_design(call, opts)
    atomic, gluon_single = choice.atomic, choice.design is Backward.GLUON_SINGLE
    fused = opts.fused_prep and not atomic
    # dO from o.sum().backward() is an expand (all strides 0), which no TMA descriptor takes: one copy
    # (the size of O) keeps the passes on TMA instead of dropping them to block pointers. The fused dQ
    # pass reads dO through pointers and writes the copy the dK/dV pass loads.
    copy_do = call.tma and (not tma_ok(do4) or gluon_single and not (do4.is_contiguous() or gluon.heads_inside(do4)))
    d_tile = padded_dim(d)
    dq_chunk, kv_chunk = choice.dq_chunk, choice.kv_chunk
    dq_chunks, kv_chunks = -(-n_k // dq_chunk) if dq_chunk else 1, -(-n_q // kv_chunk) if kv_chunk else 1
    reshape = max(t.ndim for t in (q, k, v, o, do)) > 4
    buffers = _BackwardBuffers(
        (batch * heads, n_q), (batch * heads, n_q, d_tile) if atomic else None,
        ("dq pass" if fused else "now") if copy_do else None,
        (dq_chunk, n_k, batch, heads, n_q, d_tile) if dq_chunk else None,
        (kv_chunk, n_q, batch, kv_heads, n_k, d_tile) if kv_chunk else None)
    # the rest is decided on buffers allocated as each call allocates them
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    _, _, do_read, do_tiles, dq_out, dk_out, dv_out = buffers(dq, dk, dv, do4 if reshape else do)
    dq4, dk4, dv4, do4, do_tiles, dq_out, dk_out, dv_out = map(
        as_bhsd, (dq, dk, dv, do_read, do_tiles, dq_out, dk_out, dv_out))
    use_tma = call.tma and tma_ok(do_tiles, dk_out, dv_out, *(() if atomic else (dq_out,)))
    sizes = (heads, heads // kv_heads, n_q, n_k)  # (then the scale, which each call passes)
    window, has_window = _window_args(band)
    common = dict(D=d, D_TILE=d_tile, is_causal=is_causal, SKIP_MASKED_TILES=opts.skip_masked_tiles,
                  USE_TMA=use_tma, PRECISION=chooser.precision(q.dtype), DP_FIRST=opts.dp_first, **has_window)
    n_prep = -(-n_q // PREP_TILE)
    prep = dq_pass = dq_sum = kv = gluon_kv = cast = None
    kv_sums = ()
    if not fused:
        prep = _PlannedLaunch(_prep_launch, (batch * heads, n_prep, 1), (o4.stride(), do4.stride(), heads, n_q), None,
                              dict(D=d, D_TILE=d_tile, Q_TILE_SIZE=PREP_TILE, ZERO_DQ=atomic), device)
    if not atomic:  # the dQ pass; fused, it writes delta (and the dO copy) that the dK/dV pass reads
        launcher, config = tiled_launch("dq", tile_config("dq", opts, q, d_tile, is_causal, n_q, n_k), n_q, n_k, d,
                                        d_tile, use_tma)
        dq_pass = _PlannedLaunch(
            launcher, TilesGrid(batch * heads, n_q, "Q_TILE_SIZE", dq_chunks),
            (q4.stride(), k4.stride(), v4.stride(), do4.stride(), dq_out.stride(), o4.stride(), do_tiles.stride(),
             *sizes), (dq_chunk, *window),
            dict(**common, FUSED_PREP=fused, COPY_DO=copy_do and fused, SPLIT=bool(dq_chunk), **config), device)
        if dq_chunk:
            dq_sum = _planned_sum(dq4, dq_chunks, dq_chunk, d, d_tile, is_causal, False, device)
    if gluon_single or (choice.gluon_kv and use_tma):
        config = _gluon_config(opts, opts.gluon_kv, "kv")
        gluon_kv = gluon.kv_launch(is_causal, config, not launch_hooks_installed(),
                                   qrows=opts.single_qrows if gluon_single else opts.kv_qrows, band=band)
    else:
        launcher, config = tiled_launch("kv", tile_config("kv", opts, q, d_tile, is_causal, n_q, n_k), n_q, n_k, d,
                                        d_tile, use_tma)
        kv = _PlannedLaunch(
            launcher, TilesGrid(batch * kv_heads, n_k, "K_TILE_SIZE", kv_chunks),
            (q4.stride(), k4.stride(), v4.stride(), do_tiles.stride(), dk_out.stride(), dv_out.stride(), *sizes),
            (kv_chunk, *window), dict(**common, DQ_ATOMIC=atomic, SPLIT=bool(kv_chunk), **config), device)
    if kv_chunk:
        kv_sums = tuple(_planned_sum(out4, kv_chunks, kv_chunk, d, d_tile, is_causal, True, device)
                        for out4 in (dk4, dv4))
    if atomic:
        cast = _PlannedLaunch(_cast_launch, (batch * heads, n_prep, 1), (dq4.stride(), heads, n_q), (),
                              dict(D=d, D_TILE=d_tile, Q_TILE_SIZE=PREP_TILE), device)
    launches = tuple(launch for launch in (prep, dq_pass, dq_sum, kv, *kv_sums, cast) if launch is not None)
    return BackwardPlan(choice, buffers, reshape, d ** -0.5, use_tma, prep, dq_pass, dq_sum, kv, gluon_kv, kv_sums,
                        cast, _SharedScratch(launches))


def flash_backward_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    do: torch.Tensor, is_causal: bool, opts: KernelOptions = DEFAULT_OPTIONS, scale: float | None = None,
    warm: list | None = None, window: tuple[int, int] = NO_WINDOW,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (each in its input's dtype) from the saved forward tensors and dO (any strides). warm: a list that
    collects the Triton launches the call would make, launching none (`prewarm`). window: the forward's."""
    band = call_band(q, k, is_causal, window)
    key = plan_key((q, k, v, o, lse, do), is_causal, opts, band)
    if _off_current_device(q, key):
        with torch.cuda.device(q.device):
            return flash_backward_triton(q, k, v, o, lse, do, is_causal, opts, scale, warm, window)
    plan = _BACKWARD_PLANS.get(key)
    if warm is not None:  # (a plan of its own, not kept: the collecting call launches nothing)
        plan = plan_backward(q, k, v, o, do, is_causal, opts, key[-1], band)
    elif plan is None:
        forward_key = plan_key((q, k, v), is_causal, opts, band)
        plan = plan_backward(q, k, v, o, do, is_causal, opts, key[-1], band)
        instead = _compiled_instead(plan, plan.gluon_kv is not None and opts.gluon_kv is None, q,
                                    lambda p, collect: _run_backward(p, q, k, v, o, lse, do, is_causal, scale, collect),
                                    lambda: plan_backward(q, k, v, o, do, is_causal, _triton_only(opts), key[-1], band))
        if instead is None:
            _BACKWARD_PLANS[key] = plan
        else:  # (not kept: the next call plans again)
            plan = instead
        grads = _run_backward(plan, q, k, v, o, lse, do, is_causal, scale, warm)
        _start_ahead(forward_key)  # after the first call's launches, which they would slow (GIL)
        return grads
    return _run_backward(plan, q, k, v, o, lse, do, is_causal, scale, warm)


def _run_backward(plan: BackwardPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, do: torch.Tensor, is_causal: bool, scale: float | None,
                  warm: list | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launches of `flash_backward_triton`, by its plan."""
    scale = plan.default_scale if scale is None else float(scale)
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    if plan.reshape:
        q, k, v, o, do = as_bhsd(q), as_bhsd(k), as_bhsd(v), as_bhsd(o), as_bhsd(do)
    delta, dq_acc, do, do_tiles, dq_out, dk_out, dv_out = plan.buffers(dq, dk, dv, do)
    if plan.use_tma:  # launches through Triton take TMA scratch from its allocator, a context variable: set per thread
        triton.set_allocator(scratch)
    buffer = plan.scratch() if warm is None else warm
    if plan.prep:
        plan.prep(buffer, o, do, delta, dq_acc)
    if plan.dq:
        plan.dq(buffer, q, k, v, do, lse, delta, dq_out, o, do_tiles, scale=scale)
        if plan.dq_sum:
            plan.dq_sum(buffer, dq_out, dq)
    if plan.kv:
        plan.kv(buffer, q, k, v, do_tiles, lse, delta, dk_out, dv_out, dq_acc, scale=scale)
    else:
        acc = dq_acc if plan.choice.atomic else None
        tensors = (as_bhsd(q), as_bhsd(k), as_bhsd(v), as_bhsd(do_tiles), lse, delta, as_bhsd(dk), as_bhsd(dv), acc)
        if warm is not None:
            warm.append(plan.gluon_kv.ahead(tensors, scale))
        else:
            plan.gluon_kv(tensors, scale)
    if plan.kv_sums:
        dk_sum, dv_sum = plan.kv_sums
        dk_sum(buffer, dk_out, dk)
        dv_sum(buffer, dv_out, dv)
    if plan.cast:
        plan.cast(buffer, dq_acc, dq, scale=scale)
    return dq, dk, dv


def _triton_only(opts: KernelOptions) -> KernelOptions:
    """opts without the Gluon kernels."""
    return replace(opts, gluon_fwd=False, gluon_kv=False)


def _compiled_instead(plan, gluon: bool, q: torch.Tensor, collect: Callable[[object, list], object],
                      alternative: Callable[[], object]):
    """The plan to run instead of `plan` at a call on q, where `gluon`: the default routing gave it a Gluon kernel
    (one the options ask for runs). Where a kernel of `plan` is still compiling in the background (`prewarm` sent a
    longer length's) and every kernel of the `alternative` plan (the Triton kernels) is compiled, the alternative,
    whose launches wait for nothing; else None. collect(plan, launches) gathers a plan's launches for these tensors,
    launching none (it allocates the call's buffers: only calls up to PREWARM_MAX_BYTES look, as only those
    prewarm)."""
    if (not gluon or INTERPRET or launch_hooks_installed() or q.numel() * q.element_size() > PREWARM_MAX_BYTES
            or not background.busy()):
        return None
    own: list = []
    collect(plan, own)
    if not background.compiling(own):
        return None
    other = alternative()
    theirs: list = []
    collect(other, theirs)
    return other if background.compiled(theirs) else None


_PREWARMED: set[tuple] = set()  # forward signatures whose kernels were sent to the background
_AHEAD: dict[tuple, Callable[[], None]] = {}  # per forward signature: submits the compiles for its later calls
# q's bytes up to which a call prewarms: its collected launches hold about ten buffers of q's size until they
# compile (larger calls take long enough that their compile matters less, and memory may be tight)
PREWARM_MAX_BYTES = 64 << 20


def _wants_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a backward will follow this forward."""
    return q.requires_grad or k.requires_grad or v.requires_grad


def _sibling_length(n: int) -> int:
    """A length of the other class Triton specializes integers into (multiple of 16 or not), in n's length bucket
    (the same tiles)."""
    return n - 1 if n % 16 == 0 else -(-n // 16) * 16


def _collect(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, opts: KernelOptions,
             backward: bool, window: tuple[int, int] = NO_WINDOW) -> tuple[list, list]:
    """The launches (Triton's and Gluon's) a call on tensors of these layouts makes: its forward's, and with
    `backward` its backward's for dO as autograd hands it most often (contiguous) and as o.sum() hands it (an
    expand)."""
    forward: list = []
    o, lse = flash_forward_triton(q, k, v, is_causal, opts, warm=forward, window=window)
    launches: list = []
    if backward:  # (o.sum()'s dO expands a 0-dim tensor: every stride 0, which Triton specializes unlike 1)
        for do in (o, q.new_zeros(()).expand(q.shape)):
            flash_backward_triton(q, k, v, o, lse, do, is_causal, opts, warm=launches, window=window)
    return forward, launches


def _maker(t: torch.Tensor, n: int, batch_factor: int = 1) -> Callable[[], torch.Tensor]:
    """A maker of empty tensors of t's dtype, device and layout (`empty_like`'s) with n positions along the sequence
    (and batch_factor times t's first dim); it holds nothing of t."""
    shape, dtype, device = (t.shape[0] * batch_factor, *t.shape[1:-2], n, t.shape[-1]), t.dtype, t.device
    if gluon.heads_inside(t):
        return lambda: torch.empty(shape[0], n, shape[1], shape[3], dtype=dtype, device=device).transpose(1, 2)
    return lambda: torch.empty(shape, dtype=dtype, device=device)


def _larger_batch(batch_heads: int, n_q: int, n_k: int) -> int:
    """The factor on a call's batch (no window) from which a call of its lengths runs the Gluon forward's
    one-warpgroup config (`gluon.one_warpgroup_fwd`), which no longer length compiles ahead; 1 where the call runs it
    itself or no batch does (longer keys)."""
    if not gluon.one_warpgroup_fwd(n_k, windowed=False):
        return 1
    return max(1, -(-chooser.GLUON_FWD_MIN_WORK // max(batch_heads * n_q * n_k, 1)))


def prewarm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, opts: KernelOptions,
            key: tuple, window: tuple[int, int] = NO_WINDOW) -> None:
    """At the first forward of a signature, compile in background threads (`background`) what later calls will need,
    while the forward compiles its own kernel:
      - with gradients to come, its backward's kernels (for dO contiguous and as o.sum() expands it): each launch of
        the first backward waits for its kernel's compile and finds it in the JIT's cache;
      - once the first call has run (`_start_ahead`), the kernels of lengths of the other integer class (multiples
        of 16, or not): Triton specializes kernels on it (kernels that do not specialize ran slower steps on the
        H200), so a new length of the other class finds its kernels compiled (or in flight);
      - after those, where the signature can run Gluon kernels (sm_90, 16-bit, a layout they take), every kernel its
        batch and heads run at each of `chooser.gluon_lengths`: a longer call finds them compiled; and at its own
        length, what a batch large enough for the Gluon forward runs (`_larger_batch`: that forward's config over
        short keys is one no longer length runs).
    A call whose Gluon kernel is still compiling in the background runs the Triton kernels instead where they are all
    compiled (`_compiled_instead`); any other launch whose kernel is still compiling waits for it. A dO of another
    layout compiles at its first launch, as does every call whose q exceeds PREWARM_MAX_BYTES (and the Gluon kernels
    where the placeholders at a Gluon length would)."""
    if INTERPRET or not q.is_cuda or launch_hooks_installed() or key in _PREWARMED:
        return
    if q.numel() * q.element_size() > PREWARM_MAX_BYTES:  # the collected launches hold buffers of the call's size
        return
    grads = _wants_grad(q, k, v)
    _, own = _collect(q, k, v, is_causal, opts, grads, window)  # (the forward compiles now, in this thread)
    _PREWARMED.add(key)
    background.submit(own, q.device)
    makers = [[_maker(t, _sibling_length(t.shape[-2])) for t in (q, k, v)]]
    if q.dtype in gluon.GLUON_DTYPES and window == NO_WINDOW:
        batch_heads = q.numel() // (q.shape[-2] * q.shape[-1])
        for n in chooser.gluon_lengths(batch_heads, q.shape[-1], is_causal):
            if q.numel() // q.shape[-2] * n * q.element_size() <= PREWARM_MAX_BYTES:
                makers.append([_maker(t, n) for t in (q, k, v)])  # (k, v at n too: a self-attention call)
        factor = _larger_batch(batch_heads, q.shape[-2], k.shape[-2])
        if factor > 1 and q.numel() * factor * q.element_size() <= PREWARM_MAX_BYTES:
            makers.append([_maker(t, t.shape[-2], factor) for t in (q, k, v)])
    device = q.device  # (not q itself: nothing of the call is held until these start)

    def ahead() -> None:
        sibling_forward, sibling = _collect(*(make() for make in makers[0]), is_causal, opts, grads, window)
        siblings = background.submit(sibling_forward + sibling, device)
        # (after the siblings: a new length of the same size is the likelier next call)
        for longer_makers in makers[1:]:
            longer = sum(_collect(*(make() for make in longer_makers), is_causal, opts, grads, window), [])
            if any(not isinstance(launcher, _Launcher) for launcher, _, _ in longer):  # (else no Gluon kernel runs)
                background.submit(longer, device, after=siblings)

    _AHEAD[key] = ahead


def wait_for_background_compiles() -> None:
    """Block until every background compile started so far has ended (benchmarks that time settled calls)."""
    background.wait_all()


def _start_ahead(key: tuple) -> None:
    """Start the background compiles for a signature's later calls (`prewarm`), once its first call has run (its
    forward without gradients, else its first backward): started earlier, they take the GIL from that call's own
    compiles and launches."""
    start = _AHEAD.pop(key, None)
    if start is not None:
        start()


# ---------------------------------------------------------------------------------------------------------------
# The design chosen per call: the kernels, or PyTorch on a CPU without the interpreter
# ---------------------------------------------------------------------------------------------------------------


def _repeat_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    return t if group == 1 else t.repeat_interleave(group, dim=-3)


def _group(q: torch.Tensor, k: torch.Tensor) -> int:
    return q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1


def attention_forward(q, k, v, is_causal: bool, scale: float, opts: KernelOptions = DEFAULT_OPTIONS,
                      window: tuple[int, int] = NO_WINDOW):
    """(O, L): the Triton kernels, or on a CPU without the interpreter the tiled PyTorch forward."""
    if q.device.type == "cuda" or INTERPRET:
        return flash_forward_triton(q, k, v, is_causal, opts, scale, window=window)
    group = _group(q, k)
    o, lse = flash_forward_tiled(q, _repeat_kv(k, group), _repeat_kv(v, group), is_causal, CPU_Q_TILE, CPU_K_TILE,
                                 scale=scale, band=call_band(q, k, is_causal, window))
    return in_layout_of(q, o), lse


def attention_backward(do, q, k, v, o, lse, is_causal: bool, scale: float, opts: KernelOptions = DEFAULT_OPTIONS,
                       window: tuple[int, int] = NO_WINDOW):
    """(dQ, dK, dV): the Triton kernels, or the recomputing PyTorch backward (a CPU without the interpreter, or
    the ablation variant that keeps it). A GQA group's dK and dV are summed in fp32, then rounded once."""
    if opts.triton_backward and (q.device.type == "cuda" or INTERPRET):
        return flash_backward_triton(q, k, v, o, lse, do, is_causal, opts, scale, window=window)
    group = _group(q, k)
    dq, dk, dv = backward_for(q.device)(q, _repeat_kv(k, group), _repeat_kv(v, group), o, do, lse, is_causal, scale,
                                        grad_dtype=torch.float32 if group > 1 else None,
                                        band=call_band(q, k, is_causal, window))
    if group > 1:
        dk = dk.unflatten(-3, (k.shape[-3], group)).sum(-3).to(k.dtype)
        dv = dv.unflatten(-3, (v.shape[-3], group)).sum(-3).to(v.dtype)
    return in_layout_of(q, dq), in_layout_of(k, dk), in_layout_of(v, dv)


# ---------------------------------------------------------------------------------------------------------------
# Packed sequences (varlen): q (total_q, H, D), k and v (total_k, Hkv, D), sequence b at rows cu_seqlens[b]:[b + 1]
# ---------------------------------------------------------------------------------------------------------------


def _packed_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """A packed (total, heads, D) tensor's strides as the kernels' (batch, head, seq, d) strides: batch 0 (the IS_VARLEN
    kernels offset each sequence's rows themselves)."""
    return (0, t.stride(1), t.stride(0), t.stride(2))


def varlen_band(window: tuple[int, int], is_causal: bool, max_seqlen_q: int,
                max_seqlen_k: int) -> tuple[int, int] | None:
    """A packed call's `chooser.band`, bounded by its longest sequences."""
    return None if window == NO_WINDOW else chooser.band(window, is_causal, max(max_seqlen_q, 1), max(max_seqlen_k, 1))


def varlen_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                is_causal: bool, band: tuple[int, int] | None, *others: torch.Tensor,
                do: torch.Tensor | None = None) -> chooser.Call:
    """The chooser's view of a packed call (lengths: the longest sequences'); TMA where every tensor the call's kernels
    tile (q, k, v and `others`) allows it; for a forward (`others`: O) whether the Gluon forward takes it, for a
    backward (`do`, contiguous as it will be passed) whether the Gluon single pass does."""
    index = device_index(q)
    runs = q.is_cuda or INTERPRET
    tma = runs and tma_wanted(DEFAULT_OPTIONS, q) and tma_ok(q, k, v, *others)
    fwd = do is None and tma and gluon.packed_fwd_supported(q, k, v, *others, batch)
    single = do is not None and tma and gluon.packed_supported(q, k, v, do, batch)
    return chooser.Call(batch, q.shape[1], max_seqlen_q, max_seqlen_k, q.shape[2], is_causal, runs,
                        0 if index is None else chooser.sm_count(index), tma, fwd, single, False, varlen=True,
                        window_keys=chooser.band_keys(band, max_seqlen_k))


def _varlen_launch(kernel, name: str, call: chooser.Call, q: torch.Tensor, grid_rows: int, grid_heads: int,
                   args: tuple, band: tuple[int, int] | None, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                   **constexprs) -> None:
    """Launch an IS_VARLEN kernel through Triton (a grid of (sequences·grid_heads, tiles of grid_rows)), its tiles
    from the tuning table at the longest sequences' lengths, every bounds check on (the lengths vary)."""
    if call.tma:  # (descriptors made on the device take scratch from Triton's allocator: per thread)
        triton.set_allocator(scratch)
    d = q.shape[2]
    d_tile = padded_dim(d)
    config = tile_config(name, DEFAULT_OPTIONS, q, d_tile, call.causal, max(call.n_q, 1), max(call.n_k, 1))
    meta = config.constexprs()
    window, has_window = _window_args(band)
    grid = TilesGrid(call.batch * grid_heads, grid_rows, "Q_TILE_SIZE" if name != "kv" else "K_TILE_SIZE")(meta)
    kernel[grid](*args, *window, D=d, D_TILE=d_tile, is_causal=call.causal, SKIP_MASKED_TILES=True,
                 USE_TMA=call.tma, PRECISION=chooser.precision(q.dtype), CHECK_Q=True, CHECK_K=True,
                 CHECK_D=d != d_tile, **has_window, IS_VARLEN=True, CU_SEQLENS_Q=cu_seqlens_q,
                 CU_SEQLENS_K=cu_seqlens_k, **meta, **constexprs)


def varlen_forward_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
                           scale: float, window: tuple[int, int] = NO_WINDOW,
                           opts: KernelOptions = DEFAULT_OPTIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """O (total_q, H, D) and L (H, total_q) fp32 of checked packed inputs: the Gluon forward over a table of
    (sequence, query tile) slots where the chooser routes it, else the Triton forward kernel's IS_VARLEN variant."""
    _check_launchable(q)
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):
            return varlen_forward_kernels(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                          scale, window, opts)
    total_q, heads, _ = q.shape
    o = empty_like(q)
    lse = q.new_empty((heads, total_q), dtype=torch.float32)
    batch = cu_seqlens_q.shape[0] - 1
    if not (batch and total_q):
        return o, lse
    band = varlen_band(window, is_causal, max_seqlen_q, max_seqlen_k)
    call = varlen_call(q, k, v, batch, max_seqlen_q, max_seqlen_k, is_causal, band, o)
    design = chooser.forward_design(call, opts)
    if design == (Forward.GLUON, 0):
        gluon.packed_forward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, is_causal, scale, band,
                             cached=not launch_hooks_installed())
        return o, lse
    assert design == (Forward.TRITON, 0)
    _varlen_launch(kernels.flash_fwd_kernel, "fwd", call, q, max_seqlen_q, heads,
                   (q, k, v, o, lse, *map(_packed_strides, (q, k, v, o)), heads, heads // k.shape[1], total_q,
                    k.shape[0], scale, 0), band, cu_seqlens_q, cu_seqlens_k, SPLIT=False)
    return o, lse


def varlen_backward_kernels(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                            lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                            max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, scale: float,
                            window: tuple[int, int] = NO_WINDOW, opts: KernelOptions = DEFAULT_OPTIONS
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of a packed call, dO of any strides: the Gluon single pass where the chooser routes it (dQ by TMA
    reductions into an fp32 accumulator), else the two-pass design's IS_VARLEN passes (the dQ pass with the pre-pass
    fused, then the dK/dV pass; bitwise repeatable)."""
    _check_launchable(q)
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):
            return varlen_backward_kernels(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, is_causal, scale, window, opts)
    total_q, heads, d = q.shape
    total_k, kv_heads, _ = k.shape
    batch = cu_seqlens_q.shape[0] - 1
    if not (batch and total_q and total_k):  # no query, or no key: every gradient is 0
        return tuple(torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    band = varlen_band(window, is_causal, max_seqlen_q, max_seqlen_k)
    # (a dO that is not contiguous is copied below where the Gluon pass runs: dq stands in for the copy)
    call = varlen_call(q, k, v, batch, max_seqlen_q, max_seqlen_k, is_causal, band, o, dq, dk, dv,
                       do=do if do.is_contiguous() else dq)
    choice = chooser.backward_design(call, opts)
    gluon_single = choice.design is Backward.GLUON_SINGLE
    if call.tma and not tma_ok(do) or gluon_single and not do.is_contiguous():
        # (o.sum()'s dO, an expand, or a misaligned one: one copy keeps the passes on TMA)
        do = torch.empty_like(do, memory_format=torch.contiguous_format).copy_(do)
    delta = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    if gluon_single:
        dq_acc = torch.empty((heads, total_q, d), dtype=torch.float32, device=q.device)
        rows = (heads, -(-total_q // PREP_TILE))
        kernels.flash_bwd_prep_kernel[rows](o, do, delta, dq_acc, _packed_strides(o), _packed_strides(do), heads,
                                            total_q, D=d, D_TILE=d, Q_TILE_SIZE=PREP_TILE, ZERO_DQ=True)
        gluon.packed_kv_pass(q, k, v, do, lse, delta, dk, dv, dq_acc, cu_seqlens_q, cu_seqlens_k, is_causal, scale,
                             band, cached=not launch_hooks_installed())
        kernels.flash_bwd_dq_cast_kernel[rows](dq_acc, dq, _packed_strides(dq), heads, total_q, scale, D=d, D_TILE=d,
                                               Q_TILE_SIZE=PREP_TILE)
        return dq, dk, dv
    assert choice == chooser.BackwardChoice(Backward.TRITON_TWO_PASS)
    sizes = (heads, heads // kv_heads, total_q, total_k, scale, 0)
    _varlen_launch(kernels.flash_bwd_dq_kernel, "dq", call, q, max_seqlen_q, heads,
                   (q, k, v, do, lse, delta, dq, o, do, *map(_packed_strides, (q, k, v, do, dq, o, do)), *sizes),
                   band, cu_seqlens_q, cu_seqlens_k, DP_FIRST=True, FUSED_PREP=True, COPY_DO=False, SPLIT=False)
    _varlen_launch(kernels.flash_bwd_kv_kernel, "kv", call, q, max_seqlen_k, kv_heads,
                   (q, k, v, do, lse, delta, dk, dv, dk, *map(_packed_strides, (q, k, v, do, dk, dv)), *sizes),
                   band, cu_seqlens_q, cu_seqlens_k, DP_FIRST=True, DQ_ATOMIC=False, SPLIT=False)
    return dq, dk, dv


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """(first query, stop, first key, stop) of each sequence (reads the offsets on the host)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return list(zip(cq[:-1], cq[1:], ck[:-1], ck[1:]))


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                             is_causal: bool, scale: float, window: tuple[int, int] = NO_WINDOW):
    """(O, L) of a packed call: the IS_VARLEN kernels, or on a CPU without the interpreter the tiled PyTorch forward
    sequence by sequence (a sequence without keys: O = 0, L = -inf)."""
    if q.device.type == "cuda" or INTERPRET:
        return varlen_forward_kernels(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                      scale, window)
    o = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 > q0 and k1 > k0:  # (as (H, S, D) views)
            o_b, lse_b = attention_forward(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1),
                                           v[k0:k1].transpose(0, 1), is_causal, scale, window=window)
            o[q0:q1] = o_b.transpose(0, 1)
            lse[:, q0:q1] = lse_b
    return o, lse


def varlen_attention_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                              max_seqlen_k: int, is_causal: bool, scale: float, window: tuple[int, int] = NO_WINDOW,
                              opts: KernelOptions = DEFAULT_OPTIONS):
    """(dQ, dK, dV) of a packed call: the kernels (`varlen_backward_kernels`), or the recomputing PyTorch backward
    sequence by sequence."""
    if q.device.type == "cuda" or INTERPRET:
        return varlen_backward_kernels(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       is_causal, scale, window, opts)
    dq, dk, dv = (torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 > q0 and k1 > k0:
            grads = attention_backward(*(t[q0:q1].transpose(0, 1) for t in (do, q)),
                                       *(t[k0:k1].transpose(0, 1) for t in (k, v)), o[q0:q1].transpose(0, 1),
                                       lse[:, q0:q1], is_causal, scale, window=window)
            for out, (first, stop), grad in zip((dq, dk, dv), ((q0, q1), (k0, k1), (k0, k1)), grads):
                out[first:stop] = grad.transpose(0, 1)
    return dq, dk, dv
