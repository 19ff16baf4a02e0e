"""resources: registers, spills, shared memory and ptxas's wgmma warnings of our kernels, without a GPU.

Each kernel is compiled for a given CUDA target (default sm_90a, the H100/H200) exactly as a launch
would compile it: Triton's own argument specialization is applied to the arguments a launch on
contiguous (1, heads, seq, d) tensors would pass (`KernelSpec.example_launch`; unit strides become
constants, 16-divisible ints and aligned pointers get divisibility hints), with TMA descriptors where
the target has them (sm_90 and newer, as the launcher does on such a GPU; `--no-tma`: block pointers).
Every kernel of `cs336_systems.flash_triton.KERNELS` (per autotune config) and of
`cs336_systems.flash.gluon.GLUON_KERNELS` (its default config per head dim; sm_90 only) is compiled
unless `--kernels` names some. The PTX goes through Triton's ptxas with -v. One row per (kernel,
config): registers per thread, spill bytes, shared memory, the warps a CTA launches (the compiled kernel's: Triton
pads a warp-specialized kernel's worker partitions to whole warpgroups), the warps per SM the register file allows
(65,536 registers per SM), and ptxas's C75xx warnings ("Potential Performance Loss: wgmma.mma_async
instructions are serialized"), which the PTX does not show: each wgmma then waits for the one before.
Often a large slowdown (docs/design.md), not always (the forward's 128×128/4/3 config is
among the fastest at d 64 with one). And the kernel's hot loops from its SASS (Triton's nvdisasm): the
innermost loops holding matrix instructions, each with its instruction count and its local-memory loads and
stores (spills there cost every iteration; ptxas's spill bytes do not say where they are), and what one pass
issues when the branches inside it skip (a mask behind a uniform branch is in the count, not in the tiles it
skips). Nothing is timed; rows say `gpu: none`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from cs336_systems.bench import options, report
from cs336_systems.bench.options import add_sized, positive_int
from cs336_systems.bench.report import Output, Row

if TYPE_CHECKING:
    from cs336_systems.bench.record import Recorder

NAME = "resources"
HELP = "compile our kernels for a CUDA target without a GPU; record registers, spills, shared memory"
NEEDS_DEVICE = False
REGISTERS_PER_SM = 65536
REGISTER_ALLOC_UNIT = 8  # registers per thread are allocated in steps of 8
FIELDS = {"mode": str, "variant": str, "dtype": str, "n_heads": int, "seq_len": int, "d_head": int,
          "is_causal": bool, "target": str}
# (rows since the warps launched were read from the compiled kernel hold warps_per_cta too; older rows lack it)
OK_FIELDS = {"registers": int, "spill_store_bytes": int, "spill_load_bytes": int, "stack_bytes": int,
             "shared_mem_bytes": int, "warps_per_sm_by_registers": int, "wgmma": bool}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sized(p, "--d", full=[64], smoke=[16], help="head dims", type=positive_int, nargs="+")
    p.add_argument("--dtype", choices=options.DTYPE_NAMES, nargs="+", default=["bf16"], help="Q/K/V dtypes")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal masking")
    add_sized(p, "--seq", full=16384, smoke=64, help="sequence length the arguments describe", type=positive_int)
    add_sized(p, "--n-heads", full=16, smoke=2, help="heads the arguments describe", type=positive_int)
    p.add_argument("--kernels", nargs="+", default=None, metavar="KERNEL",
                   help="kernels to compile, names of cs336_systems.flash_triton.KERNELS or "
                        "cs336_systems.flash.gluon.GLUON_KERNELS (default: all that the target runs)")
    p.add_argument("--tma", action=argparse.BooleanOptionalAction, default=None,
                   help="TMA descriptors in the Triton kernels (default: on for sm_90 and newer, as launched there)")
    p.add_argument("--arch", type=int, choices=options.CUDA_ARCHES, default=90,
                   help="CUDA compute capability (90 = sm_90a)")
    add_sized(p, "--configs", full="all", smoke="first", choices=["all", "first"],
              help="every autotune config, or only the first of each kernel (quick checks)")


def check(args: argparse.Namespace) -> None:
    from cs336_systems import flash_triton

    if flash_triton.INTERPRET:
        raise ValueError("resources compiles the real kernels: run it without TRITON_INTERPRET=1 "
                         "(cs336_systems.flash_triton was imported in interpreter mode)")
    from cs336_systems.flash.gluon import GLUON_KERNELS

    options.choices_check("--kernels", args.kernels or [], [*flash_triton.KERNELS, *GLUON_KERNELS])
    options.check_kernel_head_dims("--d", args.d)
    if args.arch != 90 and set(args.kernels or []) & set(GLUON_KERNELS):
        raise ValueError(f"the Gluon kernels are written for sm_90 (Hopper); --arch {args.arch} cannot run them")


def heuristic_constexprs(autotuned, args: list, constexprs: dict) -> dict:
    """The constexprs the kernel's `@triton.heuristics` derive for a launch, as `Heuristics.run` does."""
    from triton.runtime.autotuner import Heuristics

    derived: dict = {}
    fn = autotuned.fn
    while isinstance(fn, Heuristics):
        for name, rule in fn.values.items():
            derived[name] = rule({**dict(zip(fn.arg_names, args)), **constexprs, **derived})
        fn = fn.fn
    return derived


def compile_config(fn, args: list, constexprs: dict, num_warps: int | None, num_stages: int | None, arch: int):
    """Compile like JITFunction.run does (same binder and specialization), for `arch`, without a device.
    A Gluon kernel (num_warps among its constexprs, no stages) goes through Gluon's AST source."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction  # Triton 3.6's location
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(constexprs)
    if num_warps is not None:
        kwargs["num_warps"] = num_warps
    if num_stages is not None:
        kwargs["num_stages"] = num_stages
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, consts, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    return triton.compile(source(fn, signature, consts, attrs), target=target, options=options.__dict__)


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
        # e.g. C7511-C7515, "wgmma.mma_async instructions are serialized due to ..."
        "ptxas_warnings": " ".join(sorted(set(re.findall(r"\((C75\d\d)\)", log)))),
    }


def _matrix_loops(sass: str) -> tuple[list[tuple[int, str]], dict[str, int], list[tuple[int, int]]]:
    """A kernel's SASS (nvdisasm -c) as its instructions (address, text), its labels' addresses, and its innermost
    loops that hold matrix instructions (HGMMA, HMMA) as (first, last) indices of the instructions, in address order.
    A loop is a predicated branch back to a label (an unpredicated one is a wait's retry path, not a loop)."""
    code, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        instruction = re.search(r"/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", line)
        if instruction:
            address = int(instruction.group(1), 16)
            labels.update((p, address) for p in pending)
            pending = []
            code.append((address, instruction.group(2)))
    loops = []
    for last, (address, text) in enumerate(code):
        back = re.match(r"@!?U?P\d+\s+BRA\s+`\((\.L_x_\d+)\)", text)
        if back and labels[back.group(1)] <= address:
            first = next(i for i, (a, _) in enumerate(code) if a >= labels[back.group(1)])
            if any(re.search(r"\bHG?MMA\b", t) for _, t in code[first:last + 1]):
                loops.append((first, last))
    inner = [(a, b) for a, b in loops if not any((a, b) != (c, d) and a <= c and d <= b for c, d in loops)]
    return code, labels, inner


def hot_loops(sass: str) -> str:
    """The innermost loops of a kernel's SASS that hold matrix instructions (`_matrix_loops`), in address order, each
    as "instructions:local loads/local stores" (e.g. "1137:4/0"); "" where there is none."""
    code, _, loops = _matrix_loops(sass)
    bodies = [[t for _, t in code[a:b + 1]] for a, b in loops]
    return " ".join(f"{len(body)}:{_count(body, 'LDL')}/{_count(body, 'STL')}" for body in bodies)


def hot_loops_issued(sass: str) -> str:
    """Per loop of `hot_loops`, the instructions one pass issues when each forward branch inside the loop is taken:
    the path that skips what a uniform branch guards (a mask on the tiles it does not cut), which the static count
    holds but those tiles do not issue. A branch out of the loop (a wait's retry path) counts as not taken."""
    code, labels, loops = _matrix_loops(sass)
    issued = []
    for a, b in loops:
        index = {code[i][0]: i for i in range(a, b + 1)}
        fewest = {a: 1}  # the fewest instructions issued from the loop's first to each reachable one
        for i in range(a, b):
            if i not in fewest:
                continue
            branch = re.match(r"(@!?U?P\d+\s+)?BRA\s+(?:U?P\d+,\s*)?`\((\.L_x_\d+)\)", code[i][1])
            target = index.get(labels[branch.group(2)]) if branch else None
            steps = [] if branch and branch.group(1) is None and target is not None else [i + 1]
            if target is not None and target > i:
                steps.append(target)
            for step in steps:
                fewest[step] = min(fewest.get(step, b - a + 2), fewest[i] + 1)
        issued.append(str(fewest.get(b, b - a + 1)))
    return " ".join(issued)


def _count(code: list[str], opcode: str) -> int:
    """How many instructions of `code` (predicated or not) are `opcode` (any of its variants)."""
    return sum(bool(re.match(rf"(@!?U?P\d+\s+)?{opcode}\b", t)) for t in code)


def sass_of(cubin: bytes) -> str:
    """The SASS of a compiled kernel's cubin, by the nvdisasm Triton ships."""
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        Path(path).write_bytes(cubin)
        return subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", path], capture_output=True, text=True,
                              check=True).stdout


def warps_per_sm(registers: int, num_warps: int) -> int:
    """Resident warps per SM that the register file allows (whole CTAs)."""
    per_thread = -(-registers // REGISTER_ALLOC_UNIT) * REGISTER_ALLOC_UNIT
    ctas = REGISTERS_PER_SM // (per_thread * 32 * num_warps)
    return ctas * num_warps


def run(args: argparse.Namespace, rec: Recorder) -> int:
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    from cs336_systems.bench.timing import torch_dtype
    from cs336_systems.flash.gluon import GLUON_KERNELS
    from cs336_systems.flash_triton import KERNELS

    tma = args.arch >= 90 if args.tma is None else args.tma
    target = sm_arch_from_capability(args.arch)
    names = args.kernels or [*KERNELS, *(GLUON_KERNELS if args.arch == 90 else ())]
    for dtype_name in args.dtype:
        for d in args.d:
            for name in names:
                base = dict(impl="flash_triton", kernel=name, mode=name, dtype=dtype_name, batch=1,
                            n_heads=args.n_heads, seq_len=args.seq, d_head=d, is_causal=args.causal, target=target)
                if name in GLUON_KERNELS:
                    _gluon_row(rec, base, name, torch_dtype(dtype_name), args)
                    continue
                spec = KERNELS[name]
                for config in spec.configs[:1] if args.configs == "first" else spec.configs:
                    tiles = (config.kwargs["Q_TILE_SIZE"], config.kwargs["K_TILE_SIZE"])
                    fields = dict(
                        base, variant=f"Q{tiles[0]}xK{tiles[1]}/w{config.num_warps}/s{config.num_stages}",
                        q_tile=tiles[0], k_tile=tiles[1], num_warps=config.num_warps,
                        num_stages=config.num_stages, use_tma=tma,
                    )
                    if rec.is_done(fields):
                        continue
                    launch, constexprs = spec.example_launch(torch_dtype(dtype_name), args.n_heads, args.seq, d,
                                                             args.causal)
                    constexprs = {**constexprs, **config.kwargs, "USE_TMA": tma}
                    constexprs.update(heuristic_constexprs(spec.autotuned, launch, constexprs))
                    _compile_row(rec, fields, spec.jit, launch, constexprs, config.num_warps, config.num_stages,
                                 args.arch)
    return 0


def _gluon_row(rec: Recorder, base: Row, name: str, dtype, args: argparse.Namespace) -> None:
    """The row of a Gluon kernel at its default config for this head dim (or its status if it has none)."""
    from cs336_systems.flash import gluon as flash_gluon

    head_dims = sorted(flash_gluon.GLUON_KERNELS[name])
    if base["d_head"] not in head_dims or dtype not in flash_gluon.GLUON_DTYPES:
        dtypes = ", ".join(str(t).removeprefix("torch.") for t in flash_gluon.GLUON_DTYPES)
        rec.skip({**base, "variant": "default", "use_tma": True},
                 f"unsupported: {name} runs head dims {head_dims} in {dtypes}")
        return
    kernel, launch, constexprs, warps, config = flash_gluon.example_launch(name, dtype, args.n_heads, args.seq,
                                                                           base["d_head"], args.causal)
    block_m, block_n, cfg_warps, stages = config
    fields = dict(base, variant=f"Q{block_m}xK{block_n}/w{cfg_warps}/s{stages}", q_tile=block_m, k_tile=block_n,
                  num_warps=warps, num_stages=stages, use_tma=True)
    if not rec.is_done(fields):
        _compile_row(rec, fields, kernel, list(launch), constexprs, None, None, args.arch)


def _compile_row(rec: Recorder, fields: Row, fn, launch: list, constexprs: dict, num_warps: int | None,
                 num_stages: int | None, arch: int) -> None:
    """Compile one kernel configuration and record ptxas's report (or why it did not compile)."""
    from triton.compiler.errors import CompilationError

    try:
        compiled = compile_config(fn, launch, constexprs, num_warps, num_stages, arch)
        usage = ptxas_usage(compiled.asm["ptx"], arch)
        sass = sass_of(compiled.asm["cubin"])
    except (CompilationError, subprocess.CalledProcessError, RuntimeError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        rec.skip(fields, f"error: {type(e).__name__}: {detail[-300:]}")
        return
    rec.write({
        **rec.base_row(fields), **usage,
        "shared_mem_bytes": compiled.metadata.shared,
        "warps_per_cta": compiled.metadata.num_warps,
        "warps_per_sm_by_registers": warps_per_sm(usage["registers"], compiled.metadata.num_warps),
        "wgmma": "wgmma" in compiled.asm["ptx"],
        "hot_loops": hot_loops(sass),
        "hot_loops_issued": hot_loops_issued(sass),
        "status": "ok",
    })


def render(rows: list[Row], out: Output) -> list[str]:
    rows = report.latest(rows)
    sections = []
    fields = ("target", "dtype", "n_heads", "seq_len", "d_head", "is_causal")
    headers = ["kernel", "config (tiles/warps/stages)", "TMA", "registers", "spill store/load B", "stack B",
               "shared mem KiB", "warps/CTA", "warps/SM (registers)", "wgmma", "ptxas: wgmma serialized",
               "hot loops (instr:LDL/STL)", "hot loops, issued a pass"]

    def tma(r: Row) -> str:  # rows before the TMA option compiled the block-pointer path
        return {True: "yes", False: "no"}.get(r.get("use_tma"), "no (not recorded)")

    for key, group in report.group_by(rows, fields):
        body = [
            [r["mode"], r["variant"], tma(r), r["registers"], f"{r['spill_store_bytes']}/{r['spill_load_bytes']}",
             r["stack_bytes"], report.fmt_num(r["shared_mem_bytes"] / 1024),
             r.get("warps_per_cta", "not recorded"), r["warps_per_sm_by_registers"],
             r["wgmma"], r.get("ptxas_warnings") or ("no" if "ptxas_warnings" in r else "not recorded"),
             r.get("hot_loops", "not recorded") or "none", r.get("hot_loops_issued", "not recorded") or "none"]
            if r["status"] == "ok" else [r["mode"], r["variant"], tma(r), r["status"], *[""] * (len(headers) - 4)]
            for r in group
        ]
        sections.append(
            f"## ptxas resources, {report.subtitle(fields, key)}\n\n"
            "static compile, nothing timed; warps/CTA: what the compiled kernel launches (rows without it counted a "
            "warp-specialized kernel's partitions unpadded, so their warps/SM is off there); warps/SM counts whole "
            "CTAs that fit 65,536 registers; a C75xx code "
            "in the serialized column means ptxas serializes the kernel's wgmmas (a potential, often large, loss); "
            "hot loops: the innermost loops holding matrix instructions, their instructions and local-memory "
            "loads/stores (spills paid every iteration); issued a pass: what one pass issues when the branches "
            "inside it skip (a mask's code on the tiles it does not cut)\n\n"
            + report.markdown(headers, body)
        )
    return sections
