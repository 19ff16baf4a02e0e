"""autotune: run the Triton autotuner of our FlashAttention-2 kernels on given shapes and record it.

For each shape one forward + backward of `flash_attention` runs, which tunes every kernel in
`cs336_systems.flash_triton.AUTOTUNED_KERNELS` (name -> triton Autotuner) that has not seen the
shape's tuning key. Each launch is observed: when the autotuner benchmarks its configs, the new
`Autotuner.cache` entry (key -> chosen config) and `Autotuner.configs_timings` (config -> [median,
p20, p80] ms) are captured before the next tuning overwrites them. One row per (kernel, tuning key):
chosen config, its time, and the time of every config tried. Kernels that were not re-tuned
(cached key, or a single config as under the interpreter) get a row with tuned=false; keys answered
from Triton's on-disk autotuning cache (TRITON_CACHE_AUTOTUNING=1) get from_disk_cache=true. A
"(tuning call)" row per shape records the wall time of the tuning forward + backward.

`--wide KERNEL ...` tunes the named kernels over a wide grid instead of their shipped configs
(`WIDE_TILES` x warps `WIDE_WARPS` x pipeline stages `WIDE_STAGES`), to look for configs worth
shipping; the shape's rows carry variant "wide: <kernels>". Configs that cannot launch (too much
shared memory) are timed by the autotuner as inf and kept in the record.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cs336_systems.bench.record import DTYPES, Recorder, dtype_from_name, progress, resolve, synchronize

NAME = "autotune"
TUNING_CALL = "(tuning call)"  # `kernel` of the row timing the whole tuning forward + backward
HELP = "run the Triton autotuner on given shapes and record the chosen config and every config's time"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths (default 1024 4096 16384)")
    p.add_argument("--d", type=int, nargs="+", default=None, help="head dims (default 16 32 64 128)")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=None, help="dtypes (default bf16)")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--n-heads", type=int, default=None, help="heads (default 16; 1 in smoke runs)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal masking")
    p.add_argument(
        "--wide", nargs="+", choices=list(WIDE_TILES), default=None, metavar="KERNEL",
        help=f"tune these kernels over a wide config grid instead of the shipped configs ({', '.join(WIDE_TILES)})",
    )


# (Q_TILE_SIZE, K_TILE_SIZE) per kernel for --wide; every pair runs with each warp count and stage count.
WIDE_TILES = {
    "flash_fwd": ((64, 32), (64, 64), (64, 128), (128, 64), (128, 128)),
    "flash_bwd_dkdv": ((32, 64), (32, 128), (64, 64), (64, 128), (128, 64), (128, 128)),
    "flash_bwd_dq": ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128)),
}
WIDE_WARPS = (4, 8)
WIDE_STAGES = (2, 3, 4, 5)
WIDE = "wide"  # the rows' variant when --wide is given


def wide_configs(name: str) -> list:
    """The wide grid for one kernel.

    Under the interpreter: one config, the pinned 16 x 16 tiles with 2 stages (which the interpreter
    ignores), so that a CPU test can tell it from the shipped kernels' pinned 1-stage config.
    """
    import triton

    from cs336_systems.flash_triton import INTERPRET, KERNELS, make_configs

    if INTERPRET:
        return [triton.Config({"Q_TILE_SIZE": 16, "K_TILE_SIZE": 16}, num_warps=1, num_stages=2)]
    grid = [(q, k, w, s) for q, k in KERNELS[name].wide_tiles for w in WIDE_WARPS for s in WIDE_STAGES]
    return make_configs(grid)


@contextmanager
def configs_replaced(kernels: dict[str, Any], names: list[str]) -> Iterator[None]:
    """Tune the named autotuners over their wide grid; their configs and tuning cache are restored after."""
    saved = {n: (kernels[n].configs, dict(kernels[n].cache)) for n in names}
    for n in names:
        kernels[n].configs = wide_configs(n)
        kernels[n].cache.clear()
    try:
        yield
    finally:
        for n, (configs, cache) in saved.items():
            kernels[n].configs = configs
            kernels[n].cache.clear()
            kernels[n].cache.update(cache)


def config_dict(config) -> dict[str, Any]:
    """A triton.Config as plain JSON: its tile kwargs plus warps / stages / ctas."""
    return {
        **config.kwargs,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "num_ctas": config.num_ctas,
    }


@contextmanager
def observe(kernels: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
    """Wrap each autotuner's `run` (instance attribute) to log what every launch tuned or reused."""
    events: list[dict[str, Any]] = []
    originals = {}
    for name, kernel in kernels.items():
        originals[name] = kernel.__dict__.get("run")

        def run(*args, _kernel=kernel, _name=name, _orig=kernel.run, **kwargs):
            keys_before = set(_kernel.cache)
            timings_before = getattr(_kernel, "configs_timings", None)
            bench_time_before = getattr(_kernel, "bench_time", None)
            result = _orig(*args, **kwargs)
            timings = getattr(_kernel, "configs_timings", None)
            bench_time = getattr(_kernel, "bench_time", None)
            new_keys = [k for k in _kernel.cache if k not in keys_before]
            tuned = bool(new_keys) and timings is not None and timings is not timings_before
            # With TRITON_CACHE_AUTOTUNING=1 a key can be answered from Triton's on-disk cache: timings
            # are set (from an earlier tuning on this machine) but nothing was benchmarked now.
            benchmarked = tuned and bench_time is not bench_time_before
            events.append(
                dict(
                    kernel=_name,
                    tuned=tuned,
                    tuning_key=list(new_keys[-1]) if new_keys else None,
                    best_config=_kernel.best_config,
                    timings=dict(timings) if tuned else None,
                    from_disk_cache=tuned and not benchmarked,
                    bench_time_s=bench_time if benchmarked else None,
                    n_configs=len(_kernel.configs),
                )
            )
            return result

        kernel.run = run
    try:
        yield events
    finally:
        for name, kernel in kernels.items():
            if originals[name] is None:
                del kernel.run
            else:
                kernel.run = originals[name]


def event_metrics(event: dict[str, Any]) -> dict[str, Any]:
    """Row fields for one observed launch: chosen config, its time, all configs' times (sorted)."""
    best = event["best_config"]
    metrics: dict[str, Any] = dict(
        kernel=event["kernel"],
        tuned=event["tuned"],
        from_disk_cache=event["from_disk_cache"],
        tuning_key=[str(k) for k in event["tuning_key"]] if event["tuning_key"] else None,
        best_config=str(best),
        best_config_kwargs=config_dict(best),
        n_configs=event["n_configs"],
        bench_time_s=event["bench_time_s"],
    )
    if event["timings"]:
        tried = sorted(event["timings"].items(), key=lambda kv: _median(kv[1]))
        metrics["configs"] = [{"config": str(c), **config_dict(c), **_timing_fields(t)} for c, t in tried]
        metrics["n_tried"] = len(tried)
        metrics.update(_timing_fields(event["timings"][best]))
    return metrics


def _median(t) -> float:
    return t[0] if isinstance(t, (list, tuple)) else float(t)


def _timing_fields(t) -> dict[str, float]:
    if isinstance(t, (list, tuple)) and len(t) == 3:
        return {"ms": t[0], "ms_p20": t[1], "ms_p80": t[2]}
    return {"ms": _median(t)}


def run(args: argparse.Namespace, rec: Recorder) -> int:
    import cs336_systems.flash_triton as flash_triton

    kernels = getattr(flash_triton, "AUTOTUNED_KERNELS", None)
    if not kernels:
        print(
            "autotune: cs336_systems.flash_triton does not export AUTOTUNED_KERNELS "
            "(dict of kernel name -> triton Autotuner); nothing to inspect."
        )
        return 2
    device = rec.device
    seqs = resolve(args, "seq", [1024, 4096, 16384], [64])
    dims = resolve(args, "d", [16, 32, 64, 128], [16])
    dtypes = resolve(args, "dtype", ["bf16"], ["fp32"])
    n_heads = resolve(args, "n_heads", 16, 1)

    wide = sorted(args.wide or [])
    shapes = [(dt, d, s) for dt in dtypes for d in dims for s in seqs]
    for dtype_name, d, seq in progress(shapes, args, NAME):
        fields = dict(
            impl="flash_triton", mode="fwd_bwd", dtype=dtype_name, batch=args.batch, n_heads=n_heads,
            seq_len=seq, d_head=d, is_causal=args.causal,
        )
        if wide:
            fields["variant"] = f"{WIDE}: {' '.join(wide)}"
        if rec.is_done(fields):
            continue
        events: list[dict[str, Any]] = []

        def tune() -> dict[str, Any]:
            """One forward + backward; its wall time is the autotuning cost of this shape."""
            dtype = dtype_from_name(dtype_name)
            q, k, v = (
                torch.randn(args.batch, n_heads, seq, d, device=device, dtype=dtype, requires_grad=True)
                for _ in range(3)
            )
            start = time.perf_counter()
            with configs_replaced(kernels, wide), observe(kernels) as observed:
                try:
                    flash_triton.flash_attention(q, k, v, is_causal=args.causal).sum().backward()
                    synchronize(device)
                finally:
                    events.extend(observed)
            return {"tune_wall_s": time.perf_counter() - start, "n_launches": len(events)}

        if rec.measure({**fields, "kernel": TUNING_CALL}, tune)["status"] != "ok":
            continue
        seen = set()
        for event in events:
            ident = (event["kernel"], tuple(event["tuning_key"] or ()), str(event["best_config"]))
            if ident in seen:
                continue
            seen.add(ident)
            rec.measure({**fields, "kernel": event["kernel"]}, lambda e=event: event_metrics(e))
    return 0
