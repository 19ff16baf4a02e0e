"""Host time of the course harness's eager step at a short sequence (issue 9): a diagnostic, not a benchmark.

`o = attn(q, k, v, True); o.sum().backward()` on (1, 16, --seq, 64) bf16 leaves, per implementation of the
`impls` registry (default: ours, `flash_triton`, and SDPA's flash backend), with the autograd engine's device thread
(the default) and without it (`torch.autograd.set_multithreading_enabled(False)`, the backward on the
calling thread, so that cProfile sees it): µs per step back to back, then the forward (with the sum) and
the backward() each timed on its own after a synchronize; last, cProfile of the first implementation
on the calling thread.
Everything goes to --out (text); the cs336-bench `overhead` rows are the recorded figures.

    python3 runs/profile/host_step.py --out $OUT/host_step.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import triton

from cs336_systems.bench import impls


def label(name: str) -> str:
    return "ours" if name == impls.SHIPPED else name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--impls", nargs="+", default=[impls.SHIPPED, "sdpa_flash"], type=impls.registry_name)
    args = ap.parse_args()
    impls.check_head_dims(args.impls, [64])
    q, k, v = (torch.randn(1, 16, args.seq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def step(fn):
        o = fn(q, k, v, True)
        o.sum().backward()

    def back_to_back_us(fn):
        for _ in range(20):
            step(fn)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(fn)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / args.steps * 1e6

    def parts_us(fn):
        fwd, bwd = [], []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            s = fn(q, k, v, True).sum()
            t1 = time.perf_counter()
            s.backward()
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
        return statistics.median(fwd) * 1e6, statistics.median(bwd) * 1e6

    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}",
             f"harness step, (1, 16, {args.seq}, 64) bf16 causal, leaves requiring grad; {args.steps} steps"]
    setup = impls.Setup(torch.device("cuda"), "bf16", args.seq)
    attns = {name: impls.build(name, setup) for name in args.impls}
    for name, fn in attns.items():
        for threaded in (True, False):
            torch.autograd.set_multithreading_enabled(threaded)
            fwd, bwd = parts_us(fn)
            lines.append(f"{label(name):<10} device thread {threaded!s:<5}: {back_to_back_us(fn):6.1f} µs per step "
                         f"back to back; forward+sum {fwd:6.1f} µs, backward() {bwd:6.1f} µs "
                         "(each after a synchronize)")
            print(lines[-1], flush=True)
    torch.autograd.set_multithreading_enabled(False)
    profile = cProfile.Profile()
    profile.enable()
    first = attns[args.impls[0]]
    for _ in range(args.steps):
        step(first)
    profile.disable()
    torch.cuda.synchronize()
    for order, count in (("tottime", 45), ("cumulative", 70)):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(count)
        title = f"--- cProfile of {label(args.impls[0])}, backward on the calling thread, by {order}"
        lines += [title, text.getvalue()]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
