"""Timing, memory and FLOP helpers of the benchmarks (apart from the recording in `record`).

torch and triton are imported inside the functions, so that importing this module (as the CLI does to
build its parser) stays instant.

Three ways to time a callable:
- `time_calls`: wall clock per call, the device synchronized before and after each (the handout's
  "synchronize after every call" loops; also the CPU fallback of the others);
- `bench`: `triton.testing.do_bench` (CUDA events per call, L2 flushed before each) -> median, p20, p80,
  once our kernels' background compiles have ended (`settle`); `harness_bench` is do_bench as the course's
  leaderboard harness calls it, keeping every sample;
- `host_times`: the Python call alone, the device queue drained before it and not waited for after it
  (the host overhead of launching the call's work).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

QUANTILES = (0.5, 0.2, 0.8)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, DTYPES[name])


def inputs_bytes(names: Sequence[str], dtype: str, shape: Sequence[int]) -> tuple[int, str]:
    """Bytes of one `dtype` tensor of `shape` per name, and a description ("q, k, v of 1 × 64 × 16 fp32")."""
    description = f"{', '.join(names)} of {' × '.join(map(str, shape))} {dtype}"
    return len(names) * math.prod(shape) * ITEMSIZE[dtype], description


def memory_bytes(device: torch.device) -> int:
    """What `device` can hold at most: a GPU's total memory, the host's physical RAM for the CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def allocated_memory_mib(device: torch.device) -> float | None:
    import torch

    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def interleaved_rounds(keys: Sequence[tuple], rounds: int, measure: Callable[..., dict[str, Any]],
                       device: torch.device) -> dict[tuple, list[dict[str, Any]] | BaseException]:
    """`measure(*key)` for every key in order, `rounds` times over: each round measures every key once, so that a host
    whose speed drifts (a shared machine) slows every key alike, not only the one timed during a slow spell. A
    measurement that raises is not tried again: its key keeps the exception (for `rec.measure` to record it as OOM,
    unsupported or error), else the list of its rounds' results."""
    results: dict[tuple, list[dict[str, Any]] | BaseException] = {key: [] for key in keys}
    for _ in range(rounds):
        for key in keys:
            done = results[key]
            if isinstance(done, BaseException):
                continue
            free_memory(device)
            try:
                done.append(measure(*key))
            except Exception as e:  # (kept for its row)
                results[key] = e
    free_memory(device)
    return results


def median_of_rounds(done: list[dict[str, Any]] | BaseException) -> dict[str, Any]:
    """An `interleaved_rounds` result as one row's metrics (`median_round`), or its exception raised again."""
    if isinstance(done, BaseException):
        raise done
    return median_round(done)


def median_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's metrics from its rounds: the round of the median `ms` (the lower middle one of an even count), with
    every round's ms (`ms_rounds`), the median host time where measured, and the largest peak memory."""
    ordered = sorted(results, key=lambda r: r["ms"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["ms_rounds"] = [r["ms"] for r in results]
    if "host_us" in row:
        row["host_us"] = statistics.median(r["host_us"] for r in results)
    peaks = [r["peak_mem_mb"] for r in results if r.get("peak_mem_mb") is not None]
    row["peak_mem_mb"] = max(peaks) if peaks else None
    return row


def summarize_ms(times_ms: list[float]) -> dict[str, float]:
    """Median (the headline `ms`), 20th/80th percentiles, mean and sample std of per-call times."""
    q = statistics.quantiles(times_ms, n=10, method="inclusive") if len(times_ms) > 1 else [times_ms[0]] * 9
    return {
        "ms": statistics.median(times_ms),
        "ms_p20": q[1],
        "ms_p80": q[7],
        "ms_mean": statistics.fmean(times_ms),
        "ms_std": statistics.stdev(times_ms) if len(times_ms) > 1 else 0.0,
        "n_timed": len(times_ms),
    }


def time_calls(
    fn: Callable[[], Any],
    device: torch.device,
    iters: int,
    warmup: int,
    before: Callable[[], Any] | None = None,
    settled: bool = False,
) -> dict[str, float]:
    """Time `iters` calls of `fn` with a wall clock, synchronizing the device after each call.

    `before` runs untimed ahead of every call (e.g. to drop accumulated grads or redo a forward). `settled`: after
    the warm-up, wait for the background compiles our kernels' first calls start and reset the device's peak-memory
    counter, so that the peak the caller reads is that of the timed calls, not of the first calls' compiles.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
        synchronize(device)
    if settled:
        wait_for_our_compiles()
        reset_peak_memory(device)
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return {**summarize_ms(times), "first_ms": times[0]}  # first_ms: shows what warm-up absorbs


def host_times(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int) -> dict[str, float]:
    """Microseconds the Python call `fn()` takes to return, with the device's queue empty when it starts.

    The device is synchronized before each call (untimed) and not after it, so the time is what the host
    spends issuing the call's work, not the work itself, and no queue back-pressure is included. A call
    that synchronizes internally (e.g. `.item()`) shows its device time here: that is host time too.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        synchronize(device)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    synchronize(device)
    stats = summarize_ms(times)
    return {"host_us": stats["ms"], "host_us_p20": stats["ms_p20"], "host_us_p80": stats["ms_p80"]}


def wait_for_our_compiles() -> None:
    """The end of the background compiles our kernels' first calls start (the other length class, the other dO
    layout); nothing where our kernels were never imported."""
    launch = sys.modules.get("cs336_systems.flash.launch")
    if launch is not None:
        launch.wait_for_background_compiles()


def settle(fn: Callable[[], Any]) -> None:
    """One call of fn, then the end of our background compiles: timed while they run, a short call's host time
    includes their threads' GIL."""
    fn()
    wait_for_our_compiles()


def bench(
    fn: Callable[[], Any],
    device: torch.device,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    grad_to_none: list[torch.Tensor] | None = None,
) -> dict[str, float]:
    """`triton.testing.do_bench` (median and [0.2, 0.8] quantiles) on CUDA; one synchronized call on the CPU."""
    if device.type != "cuda":

        def drop_grads() -> None:
            for t in grad_to_none or ():
                t.grad = None

        return time_calls(fn, device, iters=1, warmup=1, before=drop_grads)
    import triton.testing

    settle(fn)
    ms, p20, p80 = triton.testing.do_bench(
        fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, quantiles=list(QUANTILES)
    )
    return {"ms": ms, "ms_p20": p20, "ms_p80": p80}


def harness_bench(fn: Callable[[], Any], device: torch.device, warmup_ms: float, rep_ms: float) -> dict[str, float]:
    """do_bench(fn, rep, warmup) as the course's harness calls it (no grad_to_none), keeping every sample."""
    if device.type != "cuda":
        return time_calls(fn, device, iters=1, warmup=1)
    import triton.testing

    return summarize_ms(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"))


def one_call_peak_mib(fn: Callable[[], Any], device: torch.device, grads_of: list[torch.Tensor]) -> float | None:
    """Peak memory allocated (MiB) while one call of `fn` runs, the gradients of `grads_of` freed
    first: what is live before the call (its inputs) plus what it allocates. None off CUDA.
    Resets the device's peak counter: inside `Recorder.measure`, read the whole measurement's peak first."""
    if device.type != "cuda":
        return None
    for t in grads_of:
        t.grad = None
    synchronize(device)
    reset_peak_memory(device)
    fn()
    synchronize(device)
    return peak_memory_mib(device)


def kernel_times_us(fn: Callable[[], Any], calls: int = 10) -> dict[str, float]:
    """CUDA time per kernel name (µs, mean over `calls` calls of `fn`), from torch.profiler; run `fn` once
    before (compiling, autotuning) so that only the timed calls are profiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.count}


def attention_flops(mode: str, batch: int, n_heads: int, seq_len: int, d_head: int, is_causal: bool) -> float:
    """FLOPs of one attention call: fwd = 4*B*H*S^2*D (halved when causal), bwd = 2.5x, fwd_bwd = 3.5x."""
    fwd = 4.0 * batch * n_heads * seq_len**2 * d_head * (0.5 if is_causal else 1.0)
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
