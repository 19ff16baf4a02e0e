"""The ops: `cs336::flash_attn_fwd` / `cs336::flash_attn_bwd` (what compiled graphs call), the autograd Function
`FlashAttention2Triton` and the functional `flash_attention`.

The two ops are `triton_op`s: torch.compile traces their bodies, and where a call runs the Triton two-pass kernels
alone, unsplit (`chooser.inlined`: a CUDA GPU, static sizes, short of the Gluon kernels' work), Inductor launches
the flat entry kernels itself (`wrap_triton`), with no Python of ours in the compiled call. Every other call (the
Gluon kernels, split passes, the single pass, symbolic sizes, the CPU) goes to an opaque custom op (`..._launch`)
running the launchers; so does an eager call of the ops, and a call with a sliding window (`window_left`,
`window_right`; -1 unbounded). No graph break either way; CUDA graphs capture both. An eager call never reaches
them: they are registered when torch._dynamo loads (`_register_traced_ops`), since registering a triton_op imports
Inductor, which made importing the op take seconds.

Packed sequences (`flash_attention_varlen`) go through one opaque custom-op pair, `cs336::flash_attn_varlen_fwd`
(with its autograd) and `cs336::flash_attn_varlen_bwd`, in eager calls and traced ones alike.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import weakref
from collections.abc import Callable

import torch
import triton

from cs336_systems.flash import chooser
from cs336_systems.flash.c_launch import scratch
from cs336_systems.flash.chooser import DEFAULT_OPTIONS, NO_WINDOW, OPTIONS, KernelOptions
from cs336_systems.flash.launch import (
    INTERPRET, TilesGrid, as_bhsd, attention_backward, attention_forward, check_head_dim, empty_like,
    tile_config, tma_strides_ok, tma_wanted, varlen_attention_backward, varlen_attention_forward,
)
from cs336_systems.flash.triton_kernels import flash_bwd_dq_flat_kernel, flash_bwd_kv_flat_kernel, \
    flash_fwd_flat_kernel
from cs336_systems.flash.tuning import even_flags, padded_dim
from cs336_systems.validation import check_attention_inputs, check_flag, check_scale, check_varlen_inputs, \
    check_varlen_offsets, check_window, refuse_double_backward


# The overload name of every cs336 op: raise it when an op's outputs change (layout, shape or dtype). torch.compile's
# on-disk caches key on a graph's op names, not on our code: a graph cached against the old outputs would fail
# Inductor's stride asserts after an upgrade. tests/test_op_edges.py holds each revision's outputs.
OP_REVISION = 1
_OVERLOAD = f"r{OP_REVISION}"


def _op_name(name: str) -> str:
    """`cs336::name.rN`, the op's qualified name at this revision."""
    return f"cs336::{name}.{_OVERLOAD}"


def _plain(t: torch.Tensor) -> bool:
    """Whether an op body runs eagerly on real tensors (not fake or functional ones, as when traced)."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def _tma_ok_traced(*tensors: torch.Tensor) -> bool:
    """TMA's conditions from metadata (tensors being traced have no data): Inductor aligns what it allocates and
    copies an input whose storage is misaligned, so the storage offset stands for the pointer."""
    return all(t.storage_offset() * t.element_size() % 16 == 0 and tma_strides_ok(t) for t in tensors)


def _inlined(q: torch.Tensor, k: torch.Tensor, is_causal: bool, backward: bool = False) -> bool:
    """Whether a traced call runs the flat entry kernels, launched by Inductor (`chooser.inlined`). Symbolic sizes
    (torch.compile(dynamic=True)) take the opaque op: the flat kernels' grid and tiles would specialize every size."""
    if q.device.type != "cuda" or INTERPRET:
        return False
    if any(isinstance(n, torch.SymInt) for n in (*q.shape, *k.shape)):
        return False
    q4, k4 = as_bhsd(q), as_bhsd(k)
    batch, heads, n_q, d = q4.shape
    index = q.device.index or 0
    call = chooser.Call(batch, heads, n_q, k4.shape[2], d, is_causal, True, chooser.sm_count(index),
                        False, False, False, False)
    return chooser.inlined(call, backward)


def _flat(kernel):
    """A flat entry kernel as an op body launches it: through `wrap_triton` (traced by Inductor; called straight
    through otherwise), or directly under the interpreter, whose kernels `wrap_triton` does not take."""
    return kernel if INTERPRET else torch.library.wrap_triton(kernel)


def _strides(*tensors: torch.Tensor) -> tuple:
    return tuple(s for t in tensors for s in t.stride())


def _flat_config(kernel: str, q: torch.Tensor, d: int, is_causal: bool, n_q: int, n_k: int, tma: bool) -> dict:
    """The tuning table's config for a flat kernel, as launch keywords (tiles, flags, warps, stages)."""
    config = tile_config(kernel, DEFAULT_OPTIONS, q, padded_dim(d), is_causal, n_q, n_k)
    return {**config.constexprs(), **even_flags(config, n_q, n_k, d, padded_dim(d), tma)}


def forward_inlined(q, k, v, is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) by the flat forward kernel, as `flash_forward_triton` computes them for an `_inlined` call."""
    q4, k4, v4 = as_bhsd(q), as_bhsd(k), as_bhsd(v)
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    o = empty_like(q)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    o4 = as_bhsd(o)
    use_tma = tma_wanted(DEFAULT_OPTIONS, q) and _tma_ok_traced(q4, k4, v4, o4)
    if use_tma:  # for launches outside Inductor's (an eager call, aot_eager); Inductor sets its own
        triton.set_allocator(scratch)
    config = _flat_config("fwd", q, d, is_causal, n_q, n_k, use_tma)
    _flat(flash_fwd_flat_kernel)[TilesGrid(batch * heads, n_q, "Q_TILE_SIZE")](
        q4, k4, v4, o4, lse, *_strides(q4, k4, v4, o4), heads, heads // kv_heads, n_q, n_k, scale,
        D=d, D_TILE=padded_dim(d), is_causal=is_causal, SKIP_MASKED_TILES=True, USE_TMA=use_tma,
        PRECISION=chooser.precision(q.dtype), **config)
    return o, lse


def backward_inlined(do, q, k, v, o, lse, is_causal: bool, scale: float):
    """(dQ, dK, dV) by the two-pass design's flat kernels (the dQ pass with the pre-pass fused, then the dK/dV
    pass), as `flash_backward_triton` computes them for an `_inlined` call."""
    q4, k4, v4, o4, do4 = as_bhsd(q), as_bhsd(k), as_bhsd(v), as_bhsd(o), as_bhsd(do)
    batch, heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    inputs_tma = tma_wanted(DEFAULT_OPTIONS, q) and _tma_ok_traced(q4, k4, v4)
    copy_do = inputs_tma and not _tma_ok_traced(do4)  # (o.sum()'s expanded dO: see `launch.plan_backward`)
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    dq4, dk4, dv4 = as_bhsd(dq), as_bhsd(dk), as_bhsd(dv)
    delta = q.new_empty((batch * heads, n_q), dtype=torch.float32)
    do_tiles = as_bhsd(empty_like(do4)) if copy_do else do4
    use_tma = inputs_tma and _tma_ok_traced(do_tiles, dq4, dk4, dv4)
    if use_tma:
        triton.set_allocator(scratch)
    sizes = (heads, heads // kv_heads, n_q, n_k, scale)
    common = dict(D=d, D_TILE=padded_dim(d), is_causal=is_causal, SKIP_MASKED_TILES=True, USE_TMA=use_tma,
                  PRECISION=chooser.precision(q.dtype), DP_FIRST=True)
    _flat(flash_bwd_dq_flat_kernel)[TilesGrid(batch * heads, n_q, "Q_TILE_SIZE")](
        q4, k4, v4, do4, lse, delta, dq4, o4, do_tiles, *_strides(q4, k4, v4, do4, dq4, o4, do_tiles), *sizes,
        **common, COPY_DO=copy_do, **_flat_config("dq", q, d, is_causal, n_q, n_k, use_tma))
    _flat(flash_bwd_kv_flat_kernel)[TilesGrid(batch * kv_heads, n_k, "K_TILE_SIZE")](
        q4, k4, v4, do_tiles, lse, delta, dk4, dv4, *_strides(q4, k4, v4, do_tiles, dk4, dv4), *sizes, **common,
        **_flat_config("kv", q, d, is_causal, n_q, n_k, use_tma))
    return dq, dk, dv


@torch.library.custom_op(_op_name("flash_attn_fwd_launch"), mutates_args=(), device_types=None)
def flash_attn_fwd_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float,
                          window_left: int = -1, window_right: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_attn_fwd` by the launchers, opaque to torch.compile."""
    return attention_forward(q, k, v, is_causal, scale, window=(window_left, window_right))


def _empty_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) allocated, not computed."""
    return empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@flash_attn_fwd_launch.register_fake
def _(q, k, v, is_causal, scale, window_left=-1, window_right=-1):
    return _empty_outputs(q)


@torch.library.custom_op(_op_name("flash_attn_bwd_launch"), mutates_args=(), device_types=None)
def flash_attn_bwd_launch(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                          lse: torch.Tensor, is_causal: bool, scale: float, deterministic: bool | None,
                          window_left: int = -1,
                          window_right: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`flash_attn_bwd` by the launchers, opaque to torch.compile."""
    return attention_backward(do, q, k, v, o, lse, is_causal, scale, OPTIONS[deterministic],
                              (window_left, window_right))


@flash_attn_bwd_launch.register_fake
def _(do, q, k, v, o, lse, is_causal, scale, deterministic, window_left=-1, window_right=-1):
    return tuple(empty_like(t) for t in (q, k, v))


def _flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float,
                   window_left: int = -1, window_right: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) of checked inputs: q (..., H, Nq, D), k and v (..., Hkv, Nk, D), Hkv dividing H; a checked window."""
    window = (window_left, window_right)
    if _plain(q) and not q.is_meta:  # meta tensors go to the launch op, whose fake kernel serves the meta device
        return attention_forward(q, k, v, is_causal, scale, window=window)
    if window == NO_WINDOW and _inlined(q, k, is_causal):
        return forward_inlined(q, k, v, is_causal, scale)
    return flash_attn_fwd_launch(q, k, v, is_causal, scale, window_left, window_right)


def _flash_attn_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, is_causal: bool, scale: float, deterministic: bool | None,
                   window_left: int = -1,
                   window_right: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV); `deterministic` as KernelOptions.deterministic (None: the faster design); the forward's window."""
    window = (window_left, window_right)
    if _plain(q) and not q.is_meta:
        return attention_backward(do, q, k, v, o, lse, is_causal, scale, OPTIONS[deterministic], window)
    if deterministic is not False and window == NO_WINDOW and _inlined(q, k, is_causal, backward=True):
        return backward_inlined(do, q, k, v, o, lse, is_causal, scale)
    return flash_attn_bwd_launch(do, q, k, v, o, lse, is_causal, scale, deterministic, window_left, window_right)


def _op_setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale, *window = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal, ctx.scale, ctx.window = is_causal, scale, tuple(window) or NO_WINDOW


def _op_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = flash_attn_bwd(do, q, k, v, o, lse, ctx.is_causal, ctx.scale, deterministic_flag(None), *ctx.window)
    return dq, dk, dv, None, None, None, None


def _autocast_cast(t: object, device: str, dtype: torch.dtype) -> object:
    """t as autocast casts an input of an op it runs in lower precision: a floating tensor on `device` other than
    float64 in `dtype`; anything else as it is."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.device.type == device:
        return t.to(dtype)
    return t


_AUTOCAST_DEVICES = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}  # device type: its autocast dispatch key
_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCUDA)
_autocast_library = torch.library.Library("cs336", "FRAGMENT")


def _register_autocast(name: str, cast: int) -> None:
    """Op `cs336::name` under autocast as SDPA is: its first `cast` arguments in the autocast dtype (the one in
    effect, not a fixed one as `torch.library.register_autocast` casts to), the op computed without autocast."""
    op = getattr(getattr(torch.ops.cs336, name), _OVERLOAD)
    for device, key in _AUTOCAST_DEVICES.items():
        def kernel(_keyset, *args, device=device):
            dtype = torch.get_autocast_dtype(device)
            args = (*(_autocast_cast(t, device, dtype) for t in args[:cast]), *args[cast:])
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
                return op(*args)

        _autocast_library.impl(f"{name}.{_OVERLOAD}", kernel, key, with_keyset=True)


# The launchers as the variants call them: a graph break under torch.compile once dynamo is loaded (before, nothing
# traces them)
_launch_eagerly_forward, _launch_eagerly_backward = attention_forward, attention_backward


def _register_traced_ops() -> None:
    """Register the ops torch.compile traces (`cs336::flash_attn_fwd`, `cs336::flash_attn_bwd`: triton_ops, their
    autograd and autocast rules) and wall off the variants' launchers. Registering a triton_op imports Inductor
    (3-7 s), which an eager call never needs: this runs when torch._dynamo loads (`_AfterImport`), before anything
    can be traced, or at import where it is loaded already."""
    global flash_attn_fwd, flash_attn_bwd, _launch_eagerly_forward, _launch_eagerly_backward
    if "flash_attn_fwd" in globals():
        return
    flash_attn_fwd = torch.library.triton_op(_op_name("flash_attn_fwd"), mutates_args=())(_flash_attn_fwd)
    flash_attn_bwd = torch.library.triton_op(_op_name("flash_attn_bwd"), mutates_args=())(_flash_attn_bwd)
    flash_attn_fwd.register_autograd(_op_backward, setup_context=_op_setup_context)
    _register_autocast("flash_attn_fwd", 3)  # q, k, v
    _register_autocast("flash_attn_bwd", 0)  # the forward's tensors and dO, in the dtype it ran in
    _launch_eagerly_forward = torch.compiler.disable(attention_forward)
    _launch_eagerly_backward = torch.compiler.disable(attention_backward)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `callback` right after module `name` is first executed: finds the module's spec with the other finders
    and wraps its loader's exec_module (then leaves sys.meta_path)."""

    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute, callback = spec.loader.exec_module, self.callback

        def exec_module(module):
            execute(module)
            callback()

        spec.loader.exec_module = exec_module
        return spec


if "torch._dynamo" in sys.modules:
    _register_traced_ops()
else:
    sys.meta_path.insert(0, _AfterImport("torch._dynamo", _register_traced_ops))


def __getattr__(name: str):
    """flash_attn_fwd / flash_attn_bwd from outside: loading torch._dynamo registers them."""
    if name in ("flash_attn_fwd", "flash_attn_bwd"):
        import torch._dynamo  # noqa: F401

        _register_traced_ops()  # (done already by the finder; a no-op unless dynamo loaded past it)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def deterministic_flag(flag: object) -> bool | None:
    """The backward's `deterministic` (KernelOptions.deterministic): a bool as given; None follows
    `torch.are_deterministic_algorithms_enabled()` (True when it is on, else None: the faster design)."""
    if flag is None:
        return True if torch.are_deterministic_algorithms_enabled() else None
    return check_flag("deterministic", flag)


def _autocast_device(t: object) -> str | None:
    """t's device type where autocast is on for it (the CPU or CUDA, where the op runs), else None."""
    if isinstance(t, torch.Tensor) and t.device.type in _AUTOCAST_DEVICES:
        return t.device.type if torch.is_autocast_enabled(t.device.type) else None
    return None


def _checked_window(window: object) -> tuple[int, int]:
    """`check_window`'s window; the default passes unchecked, except traced (dynamo cannot take `is` between
    tuples once their ints are symbolic)."""
    return check_window(window) if torch.compiler.is_compiling() or window is not NO_WINDOW else NO_WINDOW


def _forward(ctx, Q, K, V, is_causal, scale, enable_gqa, deterministic, window, opts: KernelOptions):
    window = _checked_window(window)
    if torch._C._is_any_autocast_enabled() and (device := _autocast_device(Q)):
        # as SDPA under autocast: q, k, v in the autocast dtype, the attention itself computed without autocast
        dtype = torch.get_autocast_dtype(device)
        Q, K, V = (_autocast_cast(t, device, dtype) for t in (Q, K, V))
        with torch.autocast(device, enabled=False):
            return _forward(ctx, Q, K, V, is_causal, scale, enable_gqa, deterministic, window, opts)
    is_causal = check_attention_inputs(Q, K, V, is_causal, enable_gqa)
    scale = check_scale(scale, Q.shape[-1])
    deterministic = deterministic_flag(deterministic)
    check_head_dim(Q.shape[-1])
    if Q.is_meta or not Q.numel():  # nothing to compute: no data (meta), or no rows (batch or heads 0)
        O, L = _empty_outputs(Q)
    elif opts is not DEFAULT_OPTIONS:  # variants: the launchers run eagerly (a graph break)
        O, L = _launch_eagerly_forward(Q, K, V, is_causal, scale, opts, window)
    elif torch.compiler.is_compiling():
        O, L = flash_attn_fwd(Q, K, V, is_causal, scale, *window)
    else:
        O, L = attention_forward(Q, K, V, is_causal, scale, window=window)
    ctx.save_for_backward(L, Q, K, V, O)
    ctx.is_causal, ctx.scale, ctx.deterministic, ctx.opts = is_causal, scale, deterministic, opts
    ctx.window = window
    return O


def _backward(ctx, dO):
    if torch._C._is_any_autocast_enabled() and (device := _autocast_device(dO)):
        with torch.autocast(device, enabled=False):  # a backward run under autocast: its fp32 math stays fp32
            return _backward(ctx, dO)
    refuse_double_backward("FlashAttention2Triton")
    L, Q, K, V, O = ctx.saved_tensors
    if Q.is_meta or not Q.numel():  # zeros: a GQA call with no query heads still has K and V
        dQ, dK, dV = (empty_like(t).zero_() for t in (Q, K, V))
    elif ctx.opts is not DEFAULT_OPTIONS:
        dQ, dK, dV = _launch_eagerly_backward(dO, Q, K, V, O, L, ctx.is_causal, ctx.scale, ctx.opts, ctx.window)
    elif torch.compiler.is_compiling():
        dQ, dK, dV = flash_attn_bwd(dO, Q, K, V, O, L, ctx.is_causal, ctx.scale, ctx.deterministic, *ctx.window)
    else:
        dQ, dK, dV = attention_backward(dO, Q, K, V, O, L, ctx.is_causal, ctx.scale, OPTIONS[ctx.deterministic],
                                        ctx.window)
    return dQ, dK, dV, None, None, None, None, None


class FlashAttention2Triton(torch.autograd.Function):
    """FlashAttention-2: Triton forward and backward (TMA, causal tile skipping, tiles from the tuning table).

    `FlashAttention2Triton.apply(Q, K, V, is_causal, scale=None, enable_gqa=False, deterministic=None,
    window=(-1, -1))` (autograd.Function.apply takes positional arguments only) with Q (..., H, Nq, D), K and V
    (..., Hkv, Nk, D). Saves exactly one (..., H, Nq) logsumexp beside Q, K, V and O. The backward is
    not differentiable again (double backward raises).
    """

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False, scale=None, enable_gqa=False, deterministic=None, window=NO_WINDOW):
        return _forward(ctx, Q, K, V, is_causal, scale, enable_gqa, deterministic, window, DEFAULT_OPTIONS)

    @staticmethod
    def backward(ctx, dO):
        return _backward(ctx, dO)


def autograd_function(name: str, opts: KernelOptions) -> type[torch.autograd.Function]:
    """An autograd.Function like FlashAttention2Triton that runs the kernels with `opts` (eagerly)."""

    def forward(ctx, Q, K, V, is_causal=False, scale=None, enable_gqa=False, deterministic=None, window=NO_WINDOW):
        return _forward(ctx, Q, K, V, is_causal, scale, enable_gqa, deterministic, window, opts)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(_backward),
        "__doc__": f"FlashAttention-2 (Triton) with {opts}",
    })


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, scale: float | None = None,
    enable_gqa: bool = False, deterministic: bool | None = None, window: tuple[int, int] = NO_WINDOW,
) -> torch.Tensor:
    """softmax(q kᵀ · scale [causal]) v, like `F.scaled_dot_product_attention` without a mask or dropout.

    q (..., H, Nq, D), k and v (..., Hkv, Nk, D); Hkv = H unless `enable_gqa` (then Hkv divides H and
    each K/V head serves H / Hkv query heads). `scale` defaults to 1/sqrt(D). Causal masking is
    top-left aligned as in SDPA: query i sees key j iff i >= j, also when Nq != Nk. Head dims up to
    256; fp32 inputs follow `torch.get_float32_matmul_precision()` ("highest": IEEE fp32 dots, else
    TF32). `deterministic`: True runs the two-pass backward (bitwise repeatable), False the single pass
    (dQ added in fp32), None (default) follows `torch.are_deterministic_algorithms_enabled()`: the two-pass
    backward when it is on, else the faster of the two for the call (`chooser.backward_design`).

    `window=(left, right)`: sliding-window (local) attention, query i sees key j iff i - left <= j <= i + right
    (-1: that side unbounded; the default (-1, -1) is plain attention), in the same top-left coordinates as the
    causal mask, which still applies with is_causal (right then acts as 0). Key tiles outside the band are
    skipped, not masked. A query whose window holds no key (Nq > Nk, or a window past the keys) gets output 0,
    logsumexp -inf and zero gradients (SDPA with such a boolean mask row gives NaN). A window that is not two ints
    >= -1 raises (TypeError, ValueError) before any work.

    Under `torch.autocast` it follows autocast as SDPA does: q, k, v (floating, not float64) are cast to the
    autocast dtype and the output is in that dtype. Outputs and gradients are contiguous, except that a q (k, v)
    that is a (B, H, S, D) view of (B, S, H, D) memory, as a model's projections give it, or a slice of a fused QKV
    projection's (B, S, ·) output, gets O and dQ (dK, dV) as (B, H, S, D) views of (B, S, H, D) memory, so that
    reshaping O back to (B, S, H·D) copies nothing (SDPA's layout). A batch or head count of 0
    gives empty outputs (and zero gradients); sequence lengths and the head dim must be at least 1 (ValueError).
    Meta tensors give outputs of the right shapes, nothing computed. torch.compile traces it (fullgraph too);
    torch.func transforms (vmap, grad, jvp, ...) raise a RuntimeError.
    """
    if torch._C._are_functorch_transforms_active():  # before autograd.Function's message, which is for its authors
        raise RuntimeError(
            "flash_attention does not support torch.func transforms (vmap, grad, jvp, jacrev, ...): for gradients "
            "use autograd (loss.backward() or torch.autograd.grad); for vmap fold the mapped dim into the leading "
            "dims, which take any number of batch dims")
    return FlashAttention2Triton.apply(q, k, v, is_causal, scale, enable_gqa, deterministic, window)


# ---------------------------------------------------------------------------------------------------------------
# Packed sequences (varlen)
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op(_op_name("flash_attn_varlen_fwd"), mutates_args=(), device_types=None)
def flash_attn_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
                          scale: float, window_left: int = -1, window_right: int = -1,
                          deterministic: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O (total_q, H, D), L (H, total_q)) of checked packed inputs (`flash_attention_varlen`); `deterministic` is the
    backward's (carried to it with the other arguments)."""
    return varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                    scale, (window_left, window_right))


@flash_attn_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, window_left=-1,
      window_right=-1, deterministic=None):
    return empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op(_op_name("flash_attn_varlen_bwd"), mutates_args=(), device_types=None)
def flash_attn_varlen_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                          lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, scale: float, window_left: int = -1,
                          window_right: int = -1,
                          deterministic: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of `flash_attn_varlen_fwd`; `deterministic` as KernelOptions.deterministic (True: the two-pass
    design, bitwise repeatable; None: the Gluon single pass where it applies)."""
    return varlen_attention_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     is_causal, scale, (window_left, window_right), OPTIONS[deterministic])


@flash_attn_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, window_left=-1,
      window_right=-1, deterministic=None):
    return tuple(empty_like(t) for t in (q, k, v))


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *rest = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.rest = tuple(rest)  # max_seqlen_q, max_seqlen_k, is_causal, scale[, window_left, window_right, deterministic]


def _varlen_backward(ctx, do, dlse):
    q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = flash_attn_varlen_bwd(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *ctx.rest)
    return dq, dk, dv, *(None,) * (2 + len(ctx.rest))


flash_attn_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def _offsets_readable(cu_seqlens: torch.Tensor) -> bool:
    """Whether the offsets' values can be read on the host here: an eager call on real tensors, not under CUDA-graph
    capture (nothing may sync there)."""
    return (not torch.compiler.is_compiling() and _plain(cu_seqlens) and not cu_seqlens.is_meta
            and not (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()))


# The offsets checked last, per tensor: (a weak reference to it, its version counter, the packed length, max_seqlen).
# The same offsets reach every layer of a model's step; read once, they cost one device sync per step, not per call.
_CHECKED_OFFSETS: dict[int, tuple] = {}
_CHECKED_MAX = 8


def _check_kept(cu_seqlens: torch.Tensor) -> bool:
    """Whether a check of these offsets is kept for later calls: CUDA offsets (a read costs a device sync) that have
    a version counter. CPU offsets cost no sync, and writes through NumPy bypass the counter; inference tensors have
    none."""
    return cu_seqlens.is_cuda and not cu_seqlens.is_inference()


def _check_offsets_once(cu_seqlens: torch.Tensor, total: int, max_seqlen: int, name: str) -> None:
    """`check_varlen_offsets`, skipped for the very tensor already checked with these sizes and unchanged since (its
    version counter: in-place writes through PyTorch bump it), where `_check_kept`."""
    if not _check_kept(cu_seqlens):
        check_varlen_offsets(cu_seqlens, total, max_seqlen, name)
        return
    seen = _CHECKED_OFFSETS.get(id(cu_seqlens))
    if seen is not None and seen[0]() is cu_seqlens and seen[1:] == (cu_seqlens._version, total, max_seqlen):
        return
    check_varlen_offsets(cu_seqlens, total, max_seqlen, name)
    if len(_CHECKED_OFFSETS) >= _CHECKED_MAX:
        _CHECKED_OFFSETS.clear()
    _CHECKED_OFFSETS[id(cu_seqlens)] = (weakref.ref(cu_seqlens), cu_seqlens._version, total, max_seqlen)


def _assert_offsets(cu_seqlens: torch.Tensor, total, max_seqlen, name: str) -> None:
    """`check_varlen_offsets`'s conditions where the host cannot read the offsets (torch.compile, CUDA-graph capture):
    asserted on the device, before the kernels that would read or write past a sequence, instead of a silent wrong
    answer (rows past max_seqlen never written)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    valid = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) & (lengths >= 0).all() & (lengths <= max_seqlen).all()
    # (the message names no size: formatting a symbolic one would specialize the graph on it)
    torch._assert_async(valid, f"{name}: offsets must start at 0, not decrease, end at the packed length, and no "
                               "sequence may be longer than max_seqlen")


def flash_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, is_causal: bool = False, scale: float | None = None,
    window: tuple[int, int] = NO_WINDOW, deterministic: bool | None = None,
) -> torch.Tensor:
    """Attention over packed sequences (flash-attn's varlen layout): q (total_q, H, D), k and v (total_k, Hkv, D), Hkv
    dividing H (grouped-query heads); cu_seqlens_q, cu_seqlens_k int32 (batch + 1,) on q's device, starting at 0,
    non-decreasing, ending at total_q (total_k): sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1] of q (of k, v),
    and its queries see only its keys. max_seqlen_q, max_seqlen_k: at least the longest sequence's lengths (they
    size the grid; larger is allowed). Returns O (total_q, H, D) in q's dtype, contiguous.

    Within each sequence `is_causal`, `scale` and `window` mean what they mean for `flash_attention`: causal top-left
    aligned (query i sees key j iff i >= j, also when its lengths differ), window (left, right) with query i seeing
    key j iff i - left <= j <= i + right (-1 unbounded), key tiles outside the band skipped. A query that sees no key
    (a sequence with no keys, or a window past them) gets output 0 and zero gradients. Sequences of length 0 and 1
    are allowed. fp32, bf16, fp16; head dims up to 256.

    `deterministic` as for `flash_attention`: True runs the two-pass backward (bitwise repeatable), False or None
    (default; None follows `torch.are_deterministic_algorithms_enabled()`) the Gluon single pass where it applies
    (sm_90, bf16/fp16, d 64/128, contiguous inputs: dQ added in fp32 by TMA reductions), else the two-pass one.

    Checks raise TypeError or ValueError before any work; in an eager call that includes the offsets' values
    (0 first, non-decreasing, the total last, no sequence longer than max_seqlen), which reads them on the host: one
    device sync for CUDA offsets, once per offsets tensor (calls that pass the same, unmodified tensor again, as a
    model's layers do, skip the read). Under torch.compile and CUDA-graph capture the values are asserted on the
    device (`torch._assert_async`: a RuntimeError on the CPU, a device-side assert on CUDA) before the kernels run.
    torch.compile(fullgraph=True) takes the call whole (opaque custom ops `cs336::flash_attn_varlen_fwd`/`_bwd`).
    """
    is_causal = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal)
    window = _checked_window(window)
    scale = check_scale(scale, q.shape[-1])
    deterministic = deterministic_flag(deterministic)
    check_head_dim(q.shape[-1])
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    if _offsets_readable(cu_seqlens_q):
        _check_offsets_once(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
        _check_offsets_once(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    else:
        _assert_offsets(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
        _assert_offsets(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    max_seqlen_q, max_seqlen_k = (n if isinstance(n, torch.SymInt) else int(n) for n in (max_seqlen_q, max_seqlen_k))
    o, _ = flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                                 *window, deterministic)
    return o
