"""Where the leaderboard harness's time goes on the GPU: a diagnostic, not a benchmark.

The course harness times `o = flash(q, k, v, True); o.sum().backward()` with do_bench, which zeroes a
256 MB buffer (the L2 flush) before each call and does not synchronize between calls. This script runs
that loop (flush, step) under torch.profiler for each implementation and prints, for the median step,
every GPU kernel with its start (µs after the flush ends), its duration and the idle gap before it;
then each step's span against the sum of its kernels. Everything goes to --out (text); the recorded
figures are the `cs336-bench leaderboard` rows.

    python3 runs/profile/harness_timeline.py --out $OUT/harness_timeline.txt
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
import triton
import triton.testing

from cs336_systems import flash_triton as ft
from cs336_systems.bench import impls

FLUSH_BYTES = 256 * 2**20


def gpu_events(trace_path: str) -> list[tuple[str, float, float]]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kinds = ("kernel", "gpu_memset", "gpu_memcpy")
    found = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events if e.get("cat") in kinds and "dur" in e]
    return sorted(found, key=lambda e: e[1])


def steps_of(events, flush_min_us: float) -> list[list[tuple[str, float, float]]]:
    """Split the GPU timeline at the flush kernels (the long fills of the 256 MB buffer)."""
    steps, current, flush_end = [], None, None
    for name, ts, dur in events:
        if ("fill" in name.lower() or "memset" in name.lower()) and dur >= flush_min_us:
            if current:
                steps.append(current)
            current, flush_end = [], ts + dur
            continue
        if current is not None:
            current.append((name, ts - flush_end, dur))
    if current:
        steps.append(current)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}",
             f"harness step, (1, {args.heads}, {args.seq}, 64) bf16 causal, inputs (H, S, D) leaves requiring grad"]

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    q, k, v = torch.randn(3, args.heads, args.seq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cache = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    setup = impls.Setup(torch.device("cuda"), "bf16", args.seq)
    for label in ("flash_triton_compiled", "flash_triton", "sdpa_cudnn", "sdpa_flash"):
        attn = impls.build(label, setup)

        def step():
            o = attn(q, k, v, True)
            o.sum().backward()

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(step, warmup=200, rep=1000, return_mode="median")
        cache.zero_()
        torch.cuda.synchronize()
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        cache.zero_()
        t0.record()
        cache.zero_()
        t1.record()
        torch.cuda.synchronize()
        flush_us = t0.elapsed_time(t1) * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                cache.zero_()
                step()
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            prof.export_chrome_trace(tmp.name)
            events = gpu_events(tmp.name)
        steps = steps_of(events, 0.5 * flush_us)[1:]  # the first may wait on the host
        if not steps:
            say(f"\n=== {label}: no steps found in {len(events)} GPU events; the longest:")
            for name, ts, dur in sorted(events, key=lambda e: -e[2])[:10]:
                say(f"{dur:9.1f} µs  {name[:110]}")
            continue
        spans = [s[-1][1] + s[-1][2] for s in steps]
        median = sorted(zip(spans, range(len(steps))))[len(steps) // 2][1]
        say(f"\n=== {label}: do_bench median {ms:.3f} ms; flush {flush_us:.0f} µs; {len(steps)} profiled steps")
        say(f"step span (flush end -> last kernel end) median {statistics.median(spans):.1f} µs, "
            f"sum of kernels {statistics.median(sum(d for _, _, d in s) for s in steps):.1f} µs")
        say(f"{'start µs':>10} {'dur µs':>9} {'gap µs':>8}  kernel (median step)")
        end = 0.0
        for name, start, dur in steps[median]:
            say(f"{start:10.1f} {dur:9.1f} {start - end:8.1f}  {name[:110]}")
            end = max(end, start + dur)
    say(f"\nlaunch caches: {ft.launch_cache_sizes()}")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
