"""Where the leaderboard harness's time goes on the GPU: a diagnostic, not a benchmark.

The course harness times `o = flash(q, k, v, True); o.sum().backward()` with do_bench, which zeroes a
256 MB buffer (the L2 flush) before each call and does not synchronize between calls. For each
implementation this script runs do_bench (all samples kept; the SM clock before and after), then
do_bench's timed loop (flush, event, step, event) under torch.profiler, and prints per step the event
time, the GPU span of the step's kernels and their sum, then every kernel of the median step with its
start (µs after the flush ends), its duration and the idle gap before it. Everything goes to --out
(text); the recorded figures are the `cs336-bench leaderboard` rows.

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
    ap.add_argument("--rep-ms", type=int, default=1000)
    ap.add_argument("--impls", nargs="+", default=["flash_triton_compiled", "flash_triton", "sdpa_cudnn", "sdpa_flash"])
    args = ap.parse_args()
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}",
             f"harness step, (1, {args.heads}, {args.seq}, 64) bf16 causal, inputs (H, S, D) leaves requiring grad"]

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    q, k, v = torch.randn(3, args.heads, args.seq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cache = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    setup = impls.Setup(torch.device("cuda"), "bf16", args.seq)
    for label in args.impls:
        attn = impls.build(label, setup)

        def step():
            o = attn(q, k, v, True)
            o.sum().backward()

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        clock = torch.cuda.clock_rate()
        times = triton.testing.do_bench(step, warmup=200, rep=args.rep_ms, return_mode="all")
        clock_after = torch.cuda.clock_rate()
        flush_us = 1e3 * triton.testing.do_bench(cache.zero_, warmup=5, rep=20, return_mode="median")
        # do_bench's timed loop (flush, event, step, event), under the profiler
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for i in range(args.steps):
                cache.zero_()
                starts[i].record()
                step()
                ends[i].record()
            torch.cuda.synchronize()
        event_us = [1e3 * a.elapsed_time(b) for a, b in zip(starts, ends)]
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            prof.export_chrome_trace(tmp.name)
            events = gpu_events(tmp.name)
        steps = steps_of(events, 0.5 * flush_us)
        say(f"\n=== {label}: do_bench ({args.rep_ms} ms) median {statistics.median(times):.3f} ms, "
            f"first 10 {statistics.median(times[:10]):.3f}, last 10 {statistics.median(times[-10:]):.3f}; "
            f"SM clock {clock} -> {clock_after} MHz; flush {flush_us:.0f} µs")
        if len(steps) != args.steps:
            say(f"found {len(steps)} steps for {args.steps}; the longest GPU events:")
            for name, ts, dur in sorted(events, key=lambda e: -e[2])[:10]:
                say(f"{dur:9.1f} µs  {name[:110]}")
            continue
        spans = [s[-1][1] + s[-1][2] for s in steps]
        say("per profiled step, µs: event time / kernel span (flush end -> last kernel end) / sum of kernels")
        for ev, span, s in zip(event_us, spans, steps):
            say(f"  {ev:8.1f} / {span:8.1f} / {sum(d for _, _, d in s):8.1f}")
        median = sorted(zip(spans[1:], range(1, len(steps))))[(len(steps) - 1) // 2][1]
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
