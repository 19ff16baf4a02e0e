"""The host side of the Gluon kernels: a launch's arguments as a template over the call's tensors (`_Tma`, `_Arg`,
`_SCALE`); the launches per signature (`_launch`, `Launch`: after the first, the kernel's C launch, its TMA
descriptors cached by address, `_Compiled`); the launch plans and launchers of the dK/dV passes (`kv_pass`,
`kv_launch`), the forward (`forward`, `forward_launch`) and packed calls (`packed_kv_pass`, `packed_forward`, over
slot tables made on the device); `example_launch` and `GLUON_KERNELS`, for compiles without a GPU."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cs336_systems.flash import background
from cs336_systems.flash.c_launch import CLaunch
from cs336_systems.flash.gluon.configs import CONFIGS, FWD_CONFIGS, GL_DTYPES, ONE_WARPGROUP_FWD_CONFIGS, \
    ONE_WARPGROUP_MAXNREG, QROWS_CONFIGS, SINGLE_PASS_CONFIGS, SINGLE_PASS_KEYS_CONFIGS, fwd_config, heads_inside, \
    kv_configs, row_stride
from cs336_systems.flash.gluon.flash_bwd_kv import flash_bwd_kv_gluon_kernel
from cs336_systems.flash.gluon.flash_bwd_kv_qrows import flash_bwd_kv_qrows_gluon_kernel
from cs336_systems.flash.gluon.flash_bwd_single_keys import flash_bwd_single_keys_gluon_kernel
from cs336_systems.flash.gluon.flash_fwd import flash_fwd_gluon_kernel
from cs336_systems.flash.gluon.flash_fwd_persistent import flash_fwd_persistent_gluon_kernel
from cs336_systems.flash.gluon.heuristics import fwd_head_groups, kv_head_groups, persistent_programs


@functools.cache
def _smem_layout(rows: int, d: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([rows, d], GL_DTYPES.get(dtype, gl.float32))  # fp32: dQ's


@functools.cache
def _row_layout() -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # (built once: ~3.5 µs each)


class _Tma:
    """An argument template's TMA descriptor: call tensor `index` as the 2-D view `shape` (rows of contiguous values)
    in boxes of `block`, laid out in shared memory as `layout`. `rows`: an fp32 L or delta, copied where its base is
    not 16-byte aligned (TMA's condition): that copy's descriptor serves one launch only. `row_stride`: a
    `heads_inside` (B, H, S, D) tensor, read where it lies as (B·S, H·D) with rows this far apart (the plan's key
    holds it: a cached descriptor encodes it)."""

    __slots__ = ("index", "shape", "block", "layout", "rows", "row_stride")

    def __init__(self, index: int, shape: tuple[int, int], block: tuple[int, int], layout, rows: bool = False,
                 row_stride: int | None = None):
        self.index, self.shape, self.block, self.layout, self.rows = index, shape, block, layout, rows
        self.row_stride = row_stride

    def descriptor(self, t: torch.Tensor) -> TensorDescriptor:
        if self.row_stride is not None:
            return TensorDescriptor(t, list(self.shape), [self.row_stride, 1], list(self.block), self.layout)
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
COMPILE_OPTIONS = frozenset({"maxnreg"})  # launch keywords among a plan's constexprs that only the compiler reads


def _tiles(tensors: tuple, index: int, rows: int) -> _Tma:
    """Call tensor `index` (·, D) as its (rows, D) view, tiles of `rows` rows; a `heads_inside` (B, H, S, D) tensor
    as its (B·S, H·D) view, a head's D columns per box."""
    t = tensors[index]
    d = t.shape[-1]
    stride = row_stride(t)
    if stride is not None:
        batch, heads, seq, _ = t.shape
        return _Tma(index, (batch * seq, heads * d), (rows, d), _smem_layout(rows, d, t.dtype), row_stride=stride)
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
    """(kernel, positional arguments, constexprs, warps its partitions ask for, config) of a launch of kernel
    `name` (a key of GLUON_KERNELS) with its default config on contiguous (1, heads, seq, d) tensors, built as
    `forward` and `kv_pass` build theirs (a `_window_gluon` kernel with a window of seq / 8 keys left of each
    query, and as many right of it where not causal); the tensors are CPU placeholders, so that the kernel can be
    compiled without a GPU (`cs336-bench resources`). A warp-specialized kernel launches more warps than its
    partitions ask for (Triton pads the worker partitions to whole warpgroups): the compiled kernel's
    `metadata.num_warps` says how many."""
    x = torch.empty(1, heads, seq, d, dtype=dtype)
    lse = torch.empty(heads, seq, dtype=torch.float32)
    band = (seq // 8, 0 if causal else seq // 8) if name.endswith("_window_gluon") else None  # (an eighth each side)
    if name in ("flash_fwd_gluon", "flash_fwd_window_gluon"):
        config = FWD_CONFIGS[d]
        tensors = (x, x, x, x, lse)
        _, _, template, constexprs, _ = _fwd_launch_plan(tensors, causal, config, band)
        args = _arguments(template, tensors, d ** -0.5)
        return flash_fwd_gluon_kernel, args, constexprs, 4 * constexprs["WARPGROUPS"] + 1, config  # + the producer
    if name == "flash_fwd_persistent_gluon":
        config = ONE_WARPGROUP_FWD_CONFIGS[d]
        tensors = (x, x, x, x, lse)
        _, _, template, constexprs, _ = _pfwd_launch_plan(tensors, causal, config)
        args = _arguments(template, tensors, d ** -0.5)
        return flash_fwd_persistent_gluon_kernel, args, constexprs, 5, config  # one consumer warpgroup + the producer
    if name == "flash_fwd_packed_gluon":  # (two sequences of seq / 2 tokens)
        config = FWD_CONFIGS[d]
        packed = torch.empty(seq, heads, d, dtype=dtype)
        cu_seqlens = torch.tensor([0, seq // 2, seq], dtype=torch.int32)
        _, _, template, constexprs, _, tensors = _packed_fwd_launch_plan(packed, packed, packed, packed, lse,
                                                                         cu_seqlens, cu_seqlens, causal, None)
        args = _arguments(template, tensors, d ** -0.5)
        return flash_fwd_gluon_kernel, args, constexprs, 4 * constexprs["WARPGROUPS"] + 1, config
    if name in ("flash_bwd_kv_gluon", "flash_bwd_kv_qrows_gluon", "flash_bwd_single_pass_gluon",
                "flash_bwd_single_pass_keys_gluon", "flash_bwd_single_pass_keys_window_gluon"):
        qrows = name in ("flash_bwd_kv_qrows_gluon", "flash_bwd_single_pass_gluon")
        dq_acc = torch.empty(heads, seq, d) if name.startswith("flash_bwd_single_pass") else None
        config = GLUON_KERNELS[name][d]
        tensors = (x, x, x, x, lse, lse, x, x, dq_acc)
        kernel, _, template, constexprs, _ = _kv_launch_plan(tensors, causal, config, qrows, band=band)
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


# each Gluon kernel's configs by head dim (the head dims it runs); a kernel's windowed and packed launches compile
# other code (HAS_WINDOW, IS_VARLEN) and are named apart
GLUON_KERNELS = {"flash_fwd_gluon": FWD_CONFIGS, "flash_fwd_window_gluon": FWD_CONFIGS,
                 "flash_fwd_packed_gluon": FWD_CONFIGS, "flash_fwd_persistent_gluon": ONE_WARPGROUP_FWD_CONFIGS,
                 "flash_bwd_kv_gluon": CONFIGS, "flash_bwd_kv_qrows_gluon": QROWS_CONFIGS,
                 "flash_bwd_single_pass_gluon": SINGLE_PASS_CONFIGS,
                 "flash_bwd_single_pass_keys_gluon": SINGLE_PASS_KEYS_CONFIGS,
                 "flash_bwd_single_pass_keys_window_gluon": SINGLE_PASS_KEYS_CONFIGS,
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
        # (the C launch takes the constexprs too, in the kernel's order; compile options are no arguments)
        self.tail = tuple(value for name, value in constexprs.items() if name not in COMPILE_OPTIONS)
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
    ahead = _Ahead(kernel)
    background.wait_for(ahead, args, constexprs)  # (compiled ahead: found in the JIT's cache)
    run = kernel[grid](*args, **constexprs)
    background.note_compiled(ahead, args, constexprs)
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
    q4, k4, v4, do4, lse, delta, dk4, dv4, dq_acc = tensors
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    single = dq_acc is not None
    # (each reads Q, K, V and dO where they lie, and stores dK, dV as K, V lie)
    if heads_inside(dk4) != heads_inside(k4) or heads_inside(dv4) != heads_inside(v4):
        raise ValueError("the Gluon dK/dV passes store dK and dV where K and V lie: dk4, dv4 must have their layouts")
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
    template = tuple(_tiles(tensors, i, rows)  # Q, K, V, dO, dK, dV
                     for i, rows in zip((0, 1, 2, 3, 6, 7), (block_m, block_n, block_n, block_m, block_n, block_n)))
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
    constexprs.update({f"{n}_INSIDE": heads_inside(t) for n, t in zip(("Q", "K", "V", "DO"), (q4, k4, v4, do4))})
    constexprs["num_warps"] = warps
    group, tail = kv_head_groups(q4, k4, is_causal, block_m, block_n, single) if groups is None else groups
    template += (heads, heads // kv_heads, n_q, n_k, _SCALE, group, tail)
    if single and not qrows:  # (then the packed call's offsets and slots: L stands in, unread)
        template += (*(band or (0, 0)), _Arg(4), _Arg(4), _Arg(4), 0)
    # (the grid: the cached C launch is fixed to it, and no argument above carries the batch)
    key = ("kv_qrows" if qrows else "kv", q4.device.index, grid, q4.dtype, d, block_m, block_n, warps, stages,
           is_causal, heads, heads // kv_heads, n_q, n_k, lse.data_ptr() % 16 == 0, delta.data_ptr() % 16 == 0,
           dq_acc is not None, group, tail, band, *(row_stride(t) for t in (q4, k4, v4, do4, dk4, dv4)))
    kernel = (flash_bwd_kv_qrows_gluon_kernel if qrows else
              flash_bwd_single_keys_gluon_kernel if single else flash_bwd_kv_gluon_kernel)
    return kernel, grid, template, constexprs, key


def kv_pass(q4, k4, v4, do4, lse, delta, dk4, dv4, is_causal: bool, scale: float, config=None,
            cached: bool = True, qrows: bool = False, dq_acc=None, groups: tuple[int, int] | None = None,
            band: tuple[int, int] | None = None) -> None:
    """dK·scale, dV into dk4, dv4 (in k4's and v4's layouts) for tensors `supported` accepted with the same config
    and `qrows` (and `single_pass` with dq_acc); lse, delta: contiguous (B·H, Nq) fp32. cached=False (e.g. with
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
                      HAS_WINDOW=band is not None, IS_VARLEN=True, Q_INSIDE=False, K_INSIDE=False, V_INSIDE=False,
                      DO_INSIDE=False, num_warps=warps)
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
    block_m, block_n, warps, stages = FWD_CONFIGS[d]  # (the slots `packed_fwd_supported` counted)
    groups = _fwd_warpgroups(warps)
    left, right = band if band is not None else (UNBOUNDED, 0 if is_causal else UNBOUNDED)
    tiles = packed_query_tiles(cu_seqlens_q, cu_seqlens_k, total_q, groups * block_m, is_causal)
    tensors = (q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, tiles)
    grid = (heads, tiles.shape[0], 1)
    template = (_packed_tiles(tensors, 0, block_m), _packed_tiles(tensors, 1, block_n),
                _packed_tiles(tensors, 2, block_n), _packed_tiles(tensors, 3, block_m), _Arg(4), heads,
                heads // kv_heads, total_q, total_k, _SCALE, left, right, _Arg(3), _Arg(5), _Arg(6), _Arg(7), batch,
                heads, heads)  # (head groups: unread)
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=d, STAGES=stages, WARPGROUPS=groups, is_causal=is_causal,
                      HAS_WINDOW=band is not None, IS_VARLEN=True, Q_INSIDE=False, K_INSIDE=False, V_INSIDE=False,
                      num_warps=4, **_fwd_options(groups))
    key = ("fwd_packed", q.device.index, grid, q.dtype, d, is_causal, heads, heads // kv_heads, total_q, total_k,
           band, lse.data_ptr() % 16 == 0, cu_seqlens_q.data_ptr() % 16 == 0,
           cu_seqlens_k.data_ptr() % 16 == 0)  # (as `_packed_launch_plan`'s)
    return flash_fwd_gluon_kernel, grid, template, constexprs, key, tensors


def packed_forward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, is_causal: bool, scale: float,
                   band: tuple[int, int] | None = None, cached: bool = True) -> None:
    """The forward over packed sequences, for tensors `packed_fwd_supported` accepted: O into o (packed like q), L
    (natural log) into lse, fp32 (H, total_q); band: a window's (`chooser.band` at the longest sequences), None for
    none. Its config is FWD_CONFIGS' (one consumer warpgroup's 64-row slots lost to the 192-row ones:
    docs/design.md)."""
    *planned, tensors = _packed_fwd_launch_plan(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, is_causal, band)
    _launch(*planned, tensors, scale, cached)


def _fwd_warpgroups(warps: int) -> int:
    """The forward's consumer warpgroups for a config's warps."""
    if warps not in (4, 8, 12):
        raise ValueError(f"the Gluon forward runs 1 to 3 consumer warpgroups (4, 8 or 12 warps), got {warps} warps")
    return warps // 4


def _fwd_options(groups: int) -> dict:
    """The forward's compile options: one warpgroup's register ceiling (`ONE_WARPGROUP_MAXNREG`)."""
    return {"maxnreg": ONE_WARPGROUP_MAXNREG} if groups == 1 else {}


def _fwd_arguments(tensors: tuple, block_m: int, block_n: int) -> tuple:
    """The dense forwards' first arguments on the call tensors (q4, k4, v4, o4, lse): Q, K, V and O in their tiles, L,
    heads, the GQA group, Nq, Nk, the scale. O must lie as Q does (the kernels store it at Q's coordinates)."""
    q4, k4 = tensors[0], tensors[1]
    if heads_inside(tensors[3]) != heads_inside(q4):
        raise ValueError("the Gluon forward stores O where Q lies: o4 must have q4's layout")
    heads, n_q, kv_heads, n_k = q4.shape[1], q4.shape[2], k4.shape[1], k4.shape[2]
    rows = (block_m, block_n, block_n, block_m)  # Q, K, V, O
    return (*(_tiles(tensors, i, r) for i, r in enumerate(rows)), _Arg(4), heads, heads // kv_heads, n_q, n_k,
            _SCALE)


def _fwd_launch_plan(tensors: tuple, is_causal: bool, config, band: tuple[int, int] | None = None):
    """(kernel, grid, argument template, constexprs, cache key) of a forward launch on the call tensors (q4, k4, v4,
    o4, lse) (band: a window's, `chooser.band`)."""
    q4, k4, v4, o4, lse = tensors
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    block_m, block_n, warps, stages = config or fwd_config(d, n_k, band is not None)
    groups = _fwd_warpgroups(warps)
    if band is not None and n_q != n_k:
        raise ValueError(f"the Gluon forward takes a window on self-attention only (Nq = Nk), got Nq {n_q}, "
                         f"Nk {n_k}")
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=d, STAGES=stages, WARPGROUPS=groups, is_causal=is_causal,
                      HAS_WINDOW=band is not None, IS_VARLEN=False, Q_INSIDE=heads_inside(q4),
                      K_INSIDE=heads_inside(k4), V_INSIDE=heads_inside(v4), num_warps=4, **_fwd_options(groups))
    grid = (batch * heads, -(-n_q // (groups * block_m)), 1)
    if band is None:
        group, tail = fwd_head_groups(q4, k4, is_causal, groups * block_m, block_n)
    else:  # (a window's programs read the band that their neighbours read: the plain order)
        group = tail = batch * heads
    template = (*_fwd_arguments(tensors, block_m, block_n), *(band or (0, 0)),
                _Arg(3), _Arg(4), _Arg(4), _Arg(4), 0, group, tail)  # (_Arg(3) .. 0: a packed call's five)
    key = ("fwd", q4.device.index, grid, q4.dtype, d, block_m, block_n, warps, stages, is_causal, heads,
           heads // kv_heads, n_q, n_k, lse.data_ptr() % 16 == 0, band, group, tail,
           *(row_stride(t) for t in (q4, k4, v4, o4)))  # (the grid: `_kv_launch_plan`)
    return flash_fwd_gluon_kernel, grid, template, constexprs, key


def _pfwd_launch_plan(tensors: tuple, is_causal: bool, config, defer_store: bool = False):
    """`_fwd_launch_plan` for the persistent forward (`flash_fwd_persistent_gluon_kernel`, one consumer warpgroup:
    config (BLOCK_M, BLOCK_N, 4, STAGES)): a grid of `persistent_programs`."""
    q4, k4, v4, o4, lse = tensors
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    block_m, block_n, warps, stages = config
    if warps != 4:
        raise ValueError(f"the persistent Gluon forward runs one consumer warpgroup (4 warps), got {warps} warps")
    head = _fwd_arguments(tensors, block_m, block_n)
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=d, STAGES=stages, is_causal=is_causal,
                      Q_INSIDE=heads_inside(q4), K_INSIDE=heads_inside(k4), V_INSIDE=heads_inside(v4),
                      DEFER_STORE=defer_store, num_warps=4, **_fwd_options(1))
    grid = (persistent_programs(batch * heads * (n_q // block_m), q4.device.index if q4.is_cuda else None), 1, 1)
    group, tail = fwd_head_groups(q4, k4, is_causal, block_m, block_n)
    template = (*head, batch * heads, group, tail)
    # (batch: the grid no longer holds it, and the template's batch·heads argument is fixed per key)
    key = ("pfwd", defer_store, q4.device.index, grid, q4.dtype, d, block_m, block_n, stages, is_causal, batch,
           heads, heads // kv_heads, n_q, n_k, lse.data_ptr() % 16 == 0, group, tail,
           *(row_stride(t) for t in (q4, k4, v4, o4)))
    return flash_fwd_persistent_gluon_kernel, grid, template, constexprs, key


def persistent_forward_launch(is_causal: bool, config, cached: bool = True, defer_store: bool = False) -> Launch:
    """The persistent forward's launches at one call signature (as `forward_launch`'s)."""
    return Launch(lambda tensors: _pfwd_launch_plan(tensors, is_causal, config, defer_store), cached)


def forward(q4, k4, v4, o4, lse, is_causal: bool, scale: float, config=None, cached: bool = True,
            band: tuple[int, int] | None = None) -> None:
    """O into o4 (q's shape and layout) and L (natural log) into lse (contiguous (B·H, Nq) fp32) for
    tensors `fwd_supported` accepted with the same config (None: `fwd_config`'s for the call). band: a sliding
    window's (`chooser.band`; Nq = Nk). (A caller that plans its calls holds a `forward_launch` instead, which plans
    the launch once.)"""
    tensors = (q4, k4, v4, o4, lse)
    _launch(*_fwd_launch_plan(tensors, is_causal, config, band), tensors, scale, cached)


def forward_launch(is_causal: bool, config=None, cached: bool = True, band: tuple[int, int] | None = None) -> Launch:
    """`forward`'s launches at one call signature: called with the tensors (q4, k4, v4, o4, lse) and the scale."""
    return Launch(lambda tensors: _fwd_launch_plan(tensors, is_causal, config, band), cached)
