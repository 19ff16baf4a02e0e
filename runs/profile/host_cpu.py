"""The Python share of our attention op's host time, read on a CPU (issue 9): a diagnostic, not a benchmark.

Batch 1, 16 heads, seq 1024, d 64, bf16, causal, on CPU tensors. Nothing reaches a GPU: TMA is forced on (as on
a Hopper GPU), the CUDA-only check `_check_launchable` is skipped, and `attention_forward`/`attention_backward`
call the Triton launchers as they do for CUDA tensors (CPU tensors would take the PyTorch fallback). µs per call
(median over --iters calls after --warmup) in two modes:

  launchers off   every `_Launcher` of flash_triton and `flash_gluon.forward`/`kv_pass` replaced by a no-op
                  (the reading of NOTES.md's "Issue 9, a CPU reading"): the Python around the launchers;
  C launch off    the launchers kept (their per-signature launch cache too, `torch.cuda.current_device` read as
                  0) with a `kernel_launch.CLaunch` of no scratch whose C function is a no-op as each signature's
                  compiled kernel: everything but the C launch and the TMA scratch allocation.

Each times `flash_forward_triton`, `flash_backward_triton`, and the autograd path: `FlashAttention2Triton.apply`
(inputs requiring grad) and `torch.autograd.grad` of its output. CPU allocations are cheaper than CUDA's and no
kernel is launched, so the GPU's host time is higher (`cs336-bench overhead` measures that). Run it WITHOUT
TRITON_INTERPRET (the interpreter would run the kernels; the no-ops stand in for every launch):

    .venv/bin/python runs/profile/host_cpu.py --out runs/profile/host_cpu_<commit>.txt
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time

import torch
import triton

from cs336_systems import flash_gluon
from cs336_systems import flash_triton as ft
from cs336_systems.kernel_launch import CLaunch


def per_call_us(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def noop(*args, **kwargs) -> None:
    return None


def stand_in_for_the_gpu() -> None:
    """What every mode shares: TMA on, no CUDA check, the CUDA branch of the op's dispatch, no Gluon launch."""
    ft._tma_default = lambda: True
    ft._check_launchable = noop
    ft.attention_forward = lambda q, k, v, is_causal, scale, opts=ft.DEFAULT_OPTIONS: (
        ft.flash_forward_triton(q, k, v, is_causal, opts, scale))
    ft.attention_backward = lambda do, q, k, v, o, lse, is_causal, scale, opts=ft.DEFAULT_OPTIONS: (
        ft.flash_backward_triton(q, k, v, o, lse, do, is_causal, opts, scale))
    flash_gluon.forward = flash_gluon.kv_pass = noop


def launchers_off() -> None:
    for name in ("_fwd_launch", "_kv_launch", "_dq_launch", "_prep_launch", "_cast_launch", "_combine_launch",
                 "_sum_launch"):
        setattr(ft, name, noop)


def c_launch_off() -> None:
    torch.cuda.current_device = lambda: 0
    no_launch = CLaunch(noop, (1, 1, 1), None, False, False, None, 0, lambda device_index: 0)
    ft._Launcher._compile = lambda self, grid, args, constexprs: ft._Compiled((), None, no_launch)


def measure(args: argparse.Namespace) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 16, args.seq, 64, generator=gen).to(torch.bfloat16) for _ in range(4))
    o, lse = ft.flash_forward_triton(q, k, v, True)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    og = ft.FlashAttention2Triton.apply(qg, kg, vg, True)
    calls = {
        "flash_forward_triton": lambda: ft.flash_forward_triton(q, k, v, True),
        "flash_backward_triton": lambda: ft.flash_backward_triton(q, k, v, o, lse, do, True),
        "FlashAttention2Triton.apply": lambda: ft.FlashAttention2Triton.apply(qg, kg, vg, True),
        "torch.autograd.grad": lambda: torch.autograd.grad(og, (qg, kg, vg), do, retain_graph=True),
    }
    return [f"  {name:<30} {per_call_us(fn, args.iters, args.warmup):7.1f} µs" for name, fn in calls.items()]


MODES = {"C launch off (launch caches kept)": c_launch_off, "launchers off": launchers_off}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="text file for the readings")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)  # one mode, in this process
    args = ap.parse_args()
    if ft.INTERPRET:
        raise SystemExit("run without TRITON_INTERPRET: the interpreter would run the kernels")
    if args.mode:
        stand_in_for_the_gpu()
        MODES[args.mode]()
        print("\n".join([f"{args.mode}:", *measure(args)]))
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "cs336_systems/flash_triton.py",
                            "cs336_systems/kernel_launch.py"], capture_output=True, text=True).stdout.strip()
    lines = [f"commit {commit}{' (flash_triton/kernel_launch modified)' if dirty else ''}; {platform.machine()} "
             f"Python {platform.python_version()} torch {torch.__version__} triton {triton.__version__}; "
             f"{torch.get_num_threads()} threads",
             f"shape (1, 16, {args.seq}, 64) bf16 causal, CPU tensors; µs per call = median over {args.iters} calls "
             f"after {args.warmup}; each mode in its own process"]
    for mode in MODES:  # a process each: what one mode caches must not carry into the other
        out = subprocess.run([sys.executable, __file__, "--out", args.out, "--iters", str(args.iters), "--warmup",
                              str(args.warmup), "--seq", str(args.seq), "--mode", mode],
                             capture_output=True, text=True, check=True)
        lines.append(out.stdout.rstrip())
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
