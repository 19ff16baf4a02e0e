"""resources: registers, spills and shared memory of our Triton kernels, per autotune config, without a GPU.

Each kernel is compiled for a given CUDA target (default sm_90a, the H100/H200) exactly as a launch
would compile it: Triton's own argument specialization is applied to the arguments a launch on
contiguous (batch, heads, seq, d) tensors would pass (unit strides become constants, 16-divisible
ints and aligned pointers get divisibility hints). The PTX goes through Triton's ptxas with -v. One
row per (kernel, config): registers per thread, spill bytes, shared memory, and the warps per SM
the register file allows (65,536 registers per SM). Nothing is timed; rows say `gpu: none`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from cs336_systems.bench.record import DTYPES, Recorder

NAME = "resources"
HELP = "compile our kernels for a CUDA target without a GPU; record registers, spills, shared memory"
KERNELS = ("fwd", "dkdv", "dq")
REGISTERS_PER_SM = 65536
REGISTER_ALLOC_UNIT = 8  # registers per thread are allocated in steps of 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d", type=int, nargs="+", default=[64], help="head dims")
    p.add_argument("--dtype", choices=list(DTYPES), nargs="+", default=["bf16"], help="Q/K/V dtypes")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal masking")
    p.add_argument("--seq", type=int, default=16384, help="sequence length the arguments describe")
    p.add_argument("--n-heads", type=int, default=16, help="heads the arguments describe")
    p.add_argument("--kernels", choices=KERNELS, nargs="+", default=list(KERNELS), help="kernels to compile")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90 = sm_90a)")
    p.add_argument("--configs", choices=["all", "first"], default="all",
                   help="every autotune config, or only the first of each kernel (quick checks)")
    p.add_argument("--out", type=Path, default=Path("runs"), help="output root")
    p.add_argument("--resume", action="store_true", help="skip (kernel, config) rows already recorded")


def stride_value(name: str, heads: int, seq: int, d: int) -> int:
    """The stride a contiguous launch passes for a kernel argument named stride_<tensor><axis>."""
    tensor_axis = name.removeprefix("stride_")
    axis = tensor_axis[-1]
    if tensor_axis.startswith("l"):  # L (and delta, which shares its strides): (batch, heads, seq)
        return {"b": heads * seq, "h": seq}.get(axis, 1)
    return {"b": heads * seq * d, "h": seq * d, "d": 1}.get(axis, d)


def launch_arguments(fn, dtype: torch.dtype, heads: int, seq: int, d: int) -> list:
    """Positional arguments (up to the constexprs) of a launch on contiguous tensors, by parameter name."""
    from triton.runtime.jit import MockTensor

    args = []
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            break
        if name.endswith("_ptr"):
            args.append(MockTensor(torch.float32 if name in ("L_ptr", "Delta_ptr") else dtype))
        elif name.startswith("stride_"):
            args.append(stride_value(name, heads, seq, d))
        elif name == "N_HEADS":
            args.append(heads)
        elif name in ("N_QUERIES", "N_KEYS"):
            args.append(seq)
        elif name == "scale":
            args.append(d ** -0.5)
        else:
            raise ValueError(f"resources: no rule for argument {name!r} of {fn.__name__}")
    return args


def compile_config(fn, args: list, constexprs: dict, num_warps: int, num_stages: int, arch: int):
    """Compile like JITFunction.run does (same binder and specialization), for `arch`, without a device."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(constexprs, num_warps=num_warps, num_stages=num_stages)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, consts, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, consts, attrs), target=target, options=options.__dict__)


def ptxas_usage(ptx: str, arch: int) -> dict[str, int]:
    """Registers, spill and stack bytes reported by Triton's ptxas for this PTX."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        Path(src).write_text(ptx)
        log = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}", src,
             "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr

    def grab(pattern: str) -> int:
        m = re.search(pattern, log)
        if m is None:
            raise RuntimeError(f"resources: ptxas output has no match for {pattern!r}:\n{log}")
        return int(m.group(1))

    return {
        "registers": grab(r"Used (\d+) registers"),
        "spill_store_bytes": grab(r"(\d+) bytes spill stores"),
        "spill_load_bytes": grab(r"(\d+) bytes spill loads"),
        "stack_bytes": grab(r"(\d+) bytes stack frame"),
    }


def warps_per_sm(registers: int, num_warps: int) -> int:
    """Resident warps per SM that the register file allows (whole CTAs)."""
    per_thread = -(-registers // REGISTER_ALLOC_UNIT) * REGISTER_ALLOC_UNIT
    ctas = REGISTERS_PER_SM // (per_thread * 32 * num_warps)
    return ctas * num_warps


def run(args: argparse.Namespace, rec: Recorder) -> int:
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    from triton.compiler.errors import CompilationError

    from cs336_systems import flash_triton as ft

    if ft.INTERPRET:
        raise SystemExit(
            "cs336-bench resources compiles the real kernels: run it without TRITON_INTERPRET=1 "
            "(cs336_systems.flash_triton was imported in interpreter mode)"
        )
    kernels = {
        "fwd": (ft.flash_fwd_kernel, ft.KERNELS["flash_fwd"].configs),
        "dkdv": (ft.flash_bwd_dkdv_kernel, ft.KERNELS["flash_bwd_dkdv"].configs),
        "dq": (ft.flash_bwd_dq_kernel, ft.KERNELS["flash_bwd_dq"].configs),
    }
    rec.meta["gpu"] = "none"
    for dtype_name in args.dtype:
        for d in args.d:
            for kernel in args.kernels:
                fn, configs = kernels[kernel]
                for config in configs[:1] if args.configs == "first" else configs:
                    tiles = (config.kwargs["Q_TILE_SIZE"], config.kwargs["K_TILE_SIZE"])
                    fields = dict(
                        problem=NAME, impl="flash_triton", mode=kernel, dtype=dtype_name, batch=1,
                        n_heads=args.n_heads, seq_len=args.seq, d_head=d, is_causal=args.causal,
                        variant=f"Q{tiles[0]}xK{tiles[1]}/w{config.num_warps}/s{config.num_stages}",
                        q_tile=tiles[0], k_tile=tiles[1], num_warps=config.num_warps,
                        num_stages=config.num_stages, target=sm_arch_from_capability(args.arch),
                    )
                    if rec.is_done(fields):
                        continue
                    constexprs = dict(
                        D=d, D_TILE=ft.padded_dim(d), is_causal=args.causal,
                        SKIP_MASKED_TILES=True, **config.kwargs,
                    )
                    launch = launch_arguments(fn, DTYPES[dtype_name], args.n_heads, args.seq, d)
                    try:
                        compiled = compile_config(
                            fn, launch, constexprs, config.num_warps, config.num_stages, args.arch)
                        usage = ptxas_usage(compiled.asm["ptx"], args.arch)
                    except (CompilationError, subprocess.CalledProcessError, RuntimeError) as e:
                        detail = getattr(e, "stderr", None) or str(e)
                        rec.write({**fields, **rec.meta, "status": f"error: {type(e).__name__}: {detail[-300:]}"})
                        continue
                    rec.write({
                        **fields, **rec.meta, **usage,
                        "shared_mem_bytes": compiled.metadata.shared,
                        "warps_per_sm_by_registers": warps_per_sm(usage["registers"], config.num_warps),
                        "wgmma": "wgmma" in compiled.asm["ptx"],
                        "status": "ok",
                    })
    return 0
