"""Where the host time of one short-sequence call goes (issue 9): a diagnostic, not a benchmark.

Batch 1, 16 heads, seq 1024, d 64, bf16, causal. Host µs per call (median of --iters; the queue
drained before each call, not after) of the layers of our op, from a bare Triton launch up to
torch.autograd.grad (and the custom ops compiled graphs call), the same with the GPU kept busy (a call
that waits on the GPU shows there), then cProfile of the forward and the backward, the state of our
cached launch path, and the compiled (default and reduce-overhead) calls: do_bench fwd+bwd, host time
per step, cProfile and torch.profiler tables. Everything goes to --out (text); the cs336-bench
`overhead` rows are the recorded figures.

    python3 runs/profile/host_breakdown.py --out $OUT/host_breakdown.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
import triton
import triton.testing

from cs336_systems import flash_triton as ft
from host_layers import noop_kernel, synced_us  # this directory's diagnostic (a script's directory is on sys.path)


def host_us(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    return synced_us(fn, iters)


def host_us_busy(fn, iters: int) -> float:
    """host_us with the GPU kept busy by a sleep kernel (~2 ms) queued before each call: a call that waits on the
    GPU (a synchronization, a blocking copy or free) takes about the sleep longer here than in host_us."""
    for _ in range(3):
        fn()
    return synced_us(fn, iters, 4_000_000)


def profile_text(fn, calls: int = 200, rows: int = 30, sort: str = "tottime") -> str:
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(sort).print_stats(rows)
    return s.getvalue()


def profiler_text(fn, calls: int = 50, rows: int = 25) -> str:
    """torch.profiler's CPU-side table (self time per op and runtime call) over `calls` calls."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--eager-only", action="store_true", help="skip the compiled (torch.compile) calls")
    args = ap.parse_args()
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}",
             f"shape (1, 16, {args.seq}, 64) bf16 causal; host µs = median over {args.iters} calls"]

    def say(text):
        print(text, flush=True)
        lines.append(text)

    q, k, v, do = (torch.randn(1, 16, args.seq, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    x = torch.zeros(1024, device="cuda")
    jit_launch = lambda: noop_kernel[(1,)](x, 1024, BLOCK=1024)  # noqa: E731
    compiled = noop_kernel[(1,)](x, 1024, BLOCK=1024)
    direct = lambda: compiled[(1, 1, 1)](x, 1024, 1024)  # noqa: E731  (constexprs too)
    say(f"triton noop, JITFunction launch: {host_us(jit_launch, args.iters):.1f}")
    say(f"triton noop, CompiledKernel[grid](...): {host_us(direct, args.iters):.1f}")
    say(f"torch.empty_like(q): {host_us(lambda: torch.empty_like(q), args.iters):.1f}")
    say(f"launch_enter_hook: {triton.knobs.runtime.launch_enter_hook!r}")

    o, lse = ft.flash_forward_triton(q, k, v, True)
    ft.flash_backward_triton(q, k, v, o, lse, do, True)
    say(f"flash_forward_triton: {host_us(lambda: ft.flash_forward_triton(q, k, v, True), args.iters):.1f}")
    say(f"flash_backward_triton: {host_us(lambda: ft.flash_backward_triton(q, k, v, o, lse, do, True), args.iters):.1f}")
    say(f"fast launch path, cached signatures: {ft.launch_cache_sizes()}")
    scale = 64 ** -0.5
    say(f"torch.ops.cs336.flash_attn_fwd (the op, called eagerly): "
        f"{host_us(lambda: torch.ops.cs336.flash_attn_fwd(q, k, v, True, scale), args.iters):.1f}")
    say(f"torch.ops.cs336.flash_attn_bwd: "
        f"{host_us(lambda: torch.ops.cs336.flash_attn_bwd(do, q, k, v, o, lse, True, scale, None), args.iters):.1f}")
    say(f"FlashAttention2Triton.apply, no grad: "
        f"{host_us(lambda: ft.FlashAttention2Triton.apply(q, k, v, True), args.iters):.1f}")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fwd = lambda: ft.FlashAttention2Triton.apply(qg, kg, vg, True)  # noqa: E731
    say(f"FlashAttention2Triton.apply, requires_grad: {host_us(fwd, args.iters):.1f}")
    og = fwd()
    bwd = lambda: torch.autograd.grad(og, (qg, kg, vg), do, retain_graph=True)  # noqa: E731
    say(f"torch.autograd.grad: {host_us(bwd, args.iters):.1f}")
    fwd_grad = lambda: torch.autograd.grad(fwd(), (qg, kg, vg), do)  # noqa: E731
    say(f"apply + torch.autograd.grad (no retain_graph, one training step's attention): "
        f"{host_us(fwd_grad, args.iters):.1f}")
    busy_iters = min(args.iters, 50)
    for name, fn in (("flash_forward_triton", lambda: ft.flash_forward_triton(q, k, v, True)),
                     ("flash_backward_triton", lambda: ft.flash_backward_triton(q, k, v, o, lse, do, True)),
                     ("apply, requires_grad", fwd), ("torch.autograd.grad", bwd), ("apply + autograd.grad", fwd_grad)):
        say(f"GPU busy (2 ms sleep queued first), {name}: host {host_us_busy(fn, busy_iters):.1f}")
    say(f"GPU (do_bench median µs): fwd {triton.testing.do_bench(fwd, return_mode='median') * 1e3:.1f}, "
        f"bwd {triton.testing.do_bench(bwd, return_mode='median') * 1e3:.1f}")
    say("--- cProfile forward (apply, requires_grad) x200\n" + profile_text(fwd))
    say("--- cProfile backward (autograd.grad) x200\n" + profile_text(bwd))

    def step(attn):
        o = attn(qg, kg, vg, True)
        o.sum().backward()

    eager = ft.FlashAttention2Triton.apply
    for mode in () if args.eager_only else (None, "reduce-overhead"):
        torch._dynamo.reset()
        attn = torch.compile(eager, mode=mode, dynamic=False)
        for _ in range(5):
            step(attn)
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(lambda: step(attn), return_mode="median")
        say(f"compiled mode={mode}: fwd+bwd do_bench median {ms * 1e3:.1f} µs; "
            f"host per step {host_us(lambda: step(attn), args.iters):.1f}")
        if mode is None:
            cfwd = lambda: attn(qg, kg, vg, True)  # noqa: E731
            say(f"compiled forward alone (requires_grad): host {host_us(cfwd, args.iters):.1f}")
            say("--- cProfile, compiled forward x200 (cumulative)\n"
                + profile_text(cfwd, sort="cumulative", rows=45))
            say("--- torch.profiler, compiled forward x50 (CPU self time)\n" + profiler_text(cfwd))
            say("--- torch.profiler, compiled step x50 (CPU self time)\n" + profiler_text(lambda: step(attn)))
        say(f"after compiling: fast path {ft.launch_cache_sizes()}, hooks installed {ft.launch_hooks_installed()}")
    say(f"GPU busy (2 ms sleep queued first), eager step: host {host_us_busy(lambda: step(eager), 50):.1f}")
    say("--- torch.profiler, eager step x50 (CPU self time)\n" + profiler_text(lambda: step(eager)))
    ms = triton.testing.do_bench(lambda: step(eager), return_mode="median")
    say(f"eager: fwd+bwd do_bench median {ms * 1e3:.1f} µs; host per step {host_us(lambda: step(eager), args.iters):.1f}")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
