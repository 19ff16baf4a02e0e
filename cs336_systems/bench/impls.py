"""The one registry from an implementation name to an attention callable `attn(q, k, v, is_causal) -> o`.

Every benchmark (attention, flash, leaderboard, model, overhead) builds its callables here. Inputs are
(..., seq, d) tensors, e.g. (batch, seq, d) or (batch, heads, seq, d); SDPA gets 3-d inputs as
(1, X, seq, d). Grouped-query inputs (k and v with fewer heads than q, `Setup.grouped`) are passed on
as SDPA's `enable_gqa`; the entries that cannot take them raise `Unsupported`. Names:

  naive            the assignment-1 materialized attention (`cs336_basics.model`), mask built once
  flash_pytorch    `FlashAttention2Pytorch` (tiled PyTorch forward, compiled recomputing backward)
  flash_triton     `FlashAttention2Triton`, the shipped kernel ("ours" in tables and plots)
  flash_op         `cs336_systems.flash_attention`, the functional op around the same kernels (its
                   cost over the class is Python: argument checks, the torch.func guard)
  flash_triton:V   the ablation variant V of `cs336_systems.flash_ablation.ABLATION_VARIANTS`
  flash_triton_gluon_kv
                   the shipped kernel with the keys-on-rows Gluon dK/dV pass wherever it applies
                   (`KernelOptions(gluon_kv=True, kv_qrows=False, deterministic=True)`: the two-pass
                   backward; the shipped kernel runs the queries-on-rows one on large calls)
  sdpa             `F.scaled_dot_product_attention` with PyTorch's own choice of backend
  sdpa_flash, sdpa_cudnn, sdpa_efficient, sdpa_math
                   `F.scaled_dot_product_attention` restricted to one backend
  NAME_compiled    torch.compile(NAME) (naive, flash_triton and its variants, flash_op, the SDPA entries)
  NAME_cudagraphs  torch.compile(NAME, mode="reduce-overhead"): CUDA graphs (flash_triton, flash_op, the
                   SDPA entries: the same-run yardstick for our op under CUDA graphs)

"flash" is an alias of flash_triton in every subcommand. `registry_name` is the argparse type of the
options that take these names: an unknown one is a usage error before torch is imported, with the
closest name and a pointer to the list (`python -m cs336_systems.bench.impls` prints it).

`build(name, setup)` raises `Unsupported` (recorded as an "unsupported" row) where the combination
cannot run: an SDPA backend without a kernel for the dtype / device (or for grouped k and v), naive
and flash_pytorch on grouped k and v, or torch.compile around our kernels under the Triton interpreter.
The module imports torch only inside the builders.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cs336_systems.bench.options import check_kernel_head_dims, unknown_choice
from cs336_systems.bench.record import Unsupported

if TYPE_CHECKING:
    import torch

Attention = Callable[..., Any]  # attn(q, k, v, is_causal) -> o
ABLATION_PREFIX = "flash_triton:"
SHIPPED = "flash_triton"
ALIASES = {"flash": SHIPPED}  # our kernel's old name
LISTING = "python -m cs336_systems.bench.impls"  # prints every name
ABLATION_SOURCE = Path(__file__).resolve().parents[1] / "flash_ablation.py"
COMPILE_SUFFIXES = {"_compiled": "default", "_cudagraphs": "reduce-overhead"}
SDPA_BACKENDS = {  # impl -> (torch.nn.attention.SDPBackend member or None: no restriction, dtypes it accepts on CUDA)
    "sdpa": (None, ("bf16", "fp16", "fp32")),
    "sdpa_flash": ("FLASH_ATTENTION", ("bf16", "fp16")),
    "sdpa_cudnn": ("CUDNN_ATTENTION", ("bf16", "fp16")),
    "sdpa_efficient": ("EFFICIENT_ATTENTION", ("bf16", "fp16", "fp32")),
    "sdpa_math": ("MATH", ("bf16", "fp16", "fp32")),
}
NO_KERNEL_MESSAGES = ("No available kernel", "No viable backend")  # SDPA on CUDA / on the CPU


@dataclass(frozen=True)
class Setup:
    """What a builder may need besides the name: where it runs and the shape it is built for."""

    device: torch.device
    dtype: str  # fp32 / bf16 / fp16
    seq_len: int  # the naive mask is built once for this length
    compile_backend: str = "inductor"
    grouped: bool = False  # k and v have fewer heads than q (grouped-query attention, SDPA's enable_gqa)


@dataclass(frozen=True)
class Impl:
    name: str
    make: Callable[[Setup], Attention]
    triton: bool = False  # runs our Triton kernels (dynamo cannot trace them under the interpreter)
    compile_modes: tuple[str, ...] = ()  # the COMPILE_SUFFIXES this base name takes


def _refuse_grouped(name: str, setup: Setup) -> None:
    if setup.grouped:
        raise Unsupported(f"{name} takes no grouped-query k and v (fewer heads than q)")


def _apply(function: type, setup: Setup) -> Attention:
    """An autograd.Function's apply; for grouped k and v a call that passes enable_gqa (apply takes
    positional arguments only: scale None is the default 1/sqrt(d))."""
    if not setup.grouped:
        return function.apply
    return lambda q, k, v, is_causal: function.apply(q, k, v, is_causal, None, True)


def _naive(setup: Setup) -> Attention:
    import cs336_basics.model as basics_model

    _refuse_grouped("naive", setup)

    attention = basics_model.scaled_dot_product_attention  # looked up now: a model may swap the global later
    mask = basics_model.causal_mask(setup.seq_len, setup.seq_len, device=setup.device)

    def naive(q, k, v, is_causal):
        return attention(q, k, v, mask=mask if is_causal else None)

    return naive


def _flash_pytorch(setup: Setup) -> Attention:
    from cs336_systems.flash_pytorch import FlashAttention2Pytorch

    _refuse_grouped("flash_pytorch", setup)
    return FlashAttention2Pytorch.apply


def _flash_triton(setup: Setup) -> Attention:
    from cs336_systems.flash_triton import FlashAttention2Triton

    return _apply(FlashAttention2Triton, setup)


def _flash_op(setup: Setup) -> Attention:
    from cs336_systems.flash_triton import flash_attention

    return functools.partial(flash_attention, enable_gqa=True) if setup.grouped else flash_attention


@functools.cache
def _flash_triton_gluon_kv_class():
    from cs336_systems.flash_triton import KernelOptions, autograd_function

    # (deterministic: the two-pass backward, whose dK/dV pass this is; the single pass has its own kernels)
    return autograd_function("FlashGluonKv", KernelOptions(gluon_kv=True, kv_qrows=False, deterministic=True))


def _flash_triton_gluon_kv(setup: Setup) -> Attention:
    return _apply(_flash_triton_gluon_kv_class(), setup)


def _ablation(variant: str) -> Callable[[Setup], Attention]:
    def make(setup: Setup) -> Attention:
        from cs336_systems.flash_ablation import ABLATION_VARIANTS

        return _apply(ABLATION_VARIANTS[variant], setup)

    return make


def _sdpa(impl: str) -> Callable[[Setup], Attention]:
    backend_name, dtypes = SDPA_BACKENDS[impl]

    def make(setup: Setup) -> Attention:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if setup.device.type == "cuda" and setup.dtype not in dtypes:
            raise Unsupported(f"{impl} does not support {setup.dtype}")
        backend = getattr(SDPBackend, backend_name) if backend_name else None

        def sdpa(q, k, v, is_causal):
            squeeze = q.ndim == 3
            if squeeze:
                q, k, v = q[None], k[None], v[None]
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                try:
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=setup.grouped)
                except RuntimeError as e:
                    if any(m in str(e) for m in NO_KERNEL_MESSAGES):
                        raise Unsupported(f"{impl}: no kernel for q {tuple(q.shape)}, k and v {tuple(k.shape)} "
                                          f"{q.dtype} on {q.device}") from e
                    raise
            return o[0] if squeeze else o

        return sdpa

    return make


BASE_IMPLS = {
    impl.name: impl
    for impl in (
        Impl("naive", _naive, compile_modes=("_compiled",)),
        Impl("flash_pytorch", _flash_pytorch),
        Impl(SHIPPED, _flash_triton, triton=True, compile_modes=("_compiled", "_cudagraphs")),
        Impl("flash_op", _flash_op, triton=True, compile_modes=("_compiled", "_cudagraphs")),
        Impl("flash_triton_gluon_kv", _flash_triton_gluon_kv, triton=True),
        *(Impl(name, _sdpa(name), compile_modes=("_compiled", "_cudagraphs")) for name in SDPA_BACKENDS),
    )
}


@functools.cache
def ablation_variants() -> tuple[str, ...]:
    """The ablation variants' keys, in order (the last one is the shipped kernel), read from the dict
    literal in flash_ablation's source: names are checked before torch (which that module imports) is."""
    for node in ast.parse(ABLATION_SOURCE.read_text()).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ABLATION_VARIANTS":
            return tuple(ast.literal_eval(key) for key in node.value.keys)
    raise RuntimeError(f"no ABLATION_VARIANTS dict literal in {ABLATION_SOURCE}")


def base_impls() -> dict[str, Impl]:
    """Every base implementation, the ablation variants (imported now) included."""
    variants = {
        f"{ABLATION_PREFIX}{v}": Impl(f"{ABLATION_PREFIX}{v}", _ablation(v), triton=True, compile_modes=("_compiled",))
        for v in ablation_variants()
    }
    return {**BASE_IMPLS, **variants}


def names() -> list[str]:
    """Every name `build` accepts."""
    return [
        name + suffix for name, impl in base_impls().items() for suffix in ("", *impl.compile_modes)
    ]


def parse(name: str) -> tuple[Impl, str | None]:
    """(base implementation, torch.compile mode or None) of a registry name; ValueError if unknown."""
    bases = base_impls()
    if name in bases:
        return bases[name], None
    for suffix, mode in COMPILE_SUFFIXES.items():
        base = bases.get(name.removesuffix(suffix))
        if name.endswith(suffix) and base is not None and suffix in base.compile_modes:
            return base, mode
    raise ValueError(unknown_name(name))


def unknown_name(name: str) -> str:
    return f"{unknown_choice('implementation', name, [*names(), *ALIASES])} (every name: {LISTING})"


def registry_name(text: str) -> str:
    """argparse type of an implementation option: the registry name (aliases resolved), or a usage error."""
    name = ALIASES.get(text, text)
    if name not in names():
        raise argparse.ArgumentTypeError(unknown_name(text))
    return name


def build(name: str, setup: Setup) -> Attention:
    """The callable `attn(q, k, v, is_causal) -> o` registered as `name`, built for `setup`."""
    import torch

    impl, mode = parse(name)
    attn = impl.make(setup)
    if mode is None:
        return attn
    if impl.triton and setup.device.type != "cuda":
        raise Unsupported("dynamo cannot trace Triton-interpreter kernels (CPU)")
    if mode == "reduce-overhead" and setup.device.type != "cuda":
        raise Unsupported("CUDA graphs need a CUDA device")
    torch._dynamo.reset()  # a fresh compile per setup: no recompilation limits, no stale guards
    return torch.compile(
        attn, backend=setup.compile_backend, mode=None if mode == "default" else mode, dynamic=False
    )


def check_head_dims(requested: list[str], head_dims: list[int]) -> None:
    """ValueError for a head dim our kernels refuse, when one of the `requested` names runs them."""
    if any(uses_triton(name) for name in requested):
        check_kernel_head_dims("--d", head_dims)


def uses_triton(name: str) -> bool:
    """Whether `name` runs our Triton kernels (so cannot be torch.compile'd under the interpreter)."""
    return parse(name)[0].triton


if __name__ == "__main__":
    print("\n".join(names()))
