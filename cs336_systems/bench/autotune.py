"""autotune: run the Triton autotuner of our FlashAttention-2 kernels on given shapes, record it, and
write the tuning table the default path reads (`--write-table`).

The shipped op times nothing: its tiles come from `cs336_systems.flash.tuning`. Here, for each shape one
forward + backward of the autotuning variant (`KernelOptions(autotune=True)`) runs, which tunes every kernel
in `cs336_systems.flash_triton.AUTOTUNED_KERNELS` (name -> triton Autotuner) that has not seen the
shape's tuning key. Each launch is observed: when the autotuner benchmarks its configs, the new
`Autotuner.cache` entry (key -> chosen config) and `Autotuner.configs_timings` (config -> [median,
p20, p80] ms) are captured before the next tuning overwrites them. One row per (kernel, tuning key):
chosen config, its time, and the time of every config tried. Kernels that were not re-tuned
(cached key, or a single config as under the interpreter) get a row with tuned=false; keys answered
from Triton's on-disk autotuning cache (TRITON_CACHE_AUTOTUNING=1) get from_disk_cache=true. A
"(tuning call)" row per shape records the wall time of the tuning forward + backward.

`--write-table PATH` writes the chosen configs of this run as a tuning table (`tuning.TableKey` fields, the
config, its time and the run's provenance), merged over the entries of the file already at PATH; the package
ships `cs336_systems/flash/tuning_table.json`.

`--wide KERNEL ...` tunes the named kernels over a wide grid instead of their shipped configs
(each `KernelSpec.wide_tiles` x warps `WIDE_WARPS` x pipeline stages `WIDE_STAGES`), to look for configs worth
shipping; the shape's rows carry variant "wide: <kernels>". Configs that cannot launch (too much
shared memory) are timed by the autotuner as inf and kept in the record.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cs336_systems.bench import options, report
from cs336_systems.bench.options import add_sized, positive_int
from cs336_systems.bench.report import Output, Row

if TYPE_CHECKING:
    from cs336_systems.bench.record import Recorder

NAME = "autotune"
TUNING_CALL = "(tuning call)"  # `kernel` of the row timing the whole tuning forward + backward
HELP = "run the Triton autotuner on given shapes and record the chosen config and every config's time"
WIDE_WARPS = (4, 8)
WIDE_STAGES = (2, 3, 4, 5)
WIDE = "wide"  # the rows' variant when --wide is given
FIELDS = {"kernel": str, "dtype": str, "batch": int, "n_heads": int, "seq_len": int, "d_head": int,
          "is_causal": bool}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sized(p, "--seq", full=[1024, 4096, 16384], smoke=[64], help="sequence lengths", type=positive_int,
              nargs="+")
    add_sized(p, "--d", full=[16, 32, 64, 128], smoke=[16], help="head dims", type=positive_int, nargs="+")
    add_sized(p, "--dtype", full=["bf16"], smoke=["fp32"], help="dtypes", choices=options.DTYPE_NAMES, nargs="+")
    add_sized(p, "--n-heads", full=16, smoke=1, help="heads", type=positive_int)
    p.add_argument("--batch", type=positive_int, default=1, help="batch size")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal masking")
    p.add_argument("--write-table", type=Path, default=None, metavar="PATH",
                   help="write the chosen configs as a tuning table (merged over the entries already at PATH)")
    p.add_argument(
        "--wide", nargs="+", default=None, metavar="KERNEL",
        help="tune these kernels (names of cs336_systems.flash_triton.KERNELS) over a wide config grid "
             "instead of the shipped configs",
    )


def check(args: argparse.Namespace) -> None:
    from cs336_systems.flash_triton import KERNELS

    options.choices_check("--wide", args.wide or [], KERNELS)
    options.check_kernel_head_dims("--d", args.d)
    if args.write_table is not None:
        check_table_path(args.write_table, args.smoke)


def check_table_path(path: Path, smoke: bool) -> None:
    """--write-table's PATH, before any tuning: not with --smoke (its configs are the interpreter's), a file
    that is a tuning table or none yet, in a folder that exists."""
    if smoke:
        raise ValueError("--write-table: a --smoke run tunes nothing a GPU table can hold; drop one of them")
    if path.is_dir() or not path.parent.is_dir():
        raise ValueError(f"--write-table {path}: {'a folder' if path.is_dir() else 'no such folder'}")
    if path.exists():
        try:
            table = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--write-table {path}: not a readable tuning table ({e})") from e
        if not (isinstance(table, dict) and isinstance(table.get("measured"), list)
                and isinstance(table.get("entries"), list)):
            raise ValueError(f"--write-table {path}: not a tuning table (no 'measured' and 'entries' lists)")


def wide_configs(name: str) -> list:
    """The wide grid for one kernel: its `wide_tiles` x WIDE_WARPS x WIDE_STAGES.

    Under the interpreter: one config, the pinned 16 x 16 tiles with 2 stages (which the interpreter
    ignores), so that a CPU test can tell it from the shipped kernels' pinned 1-stage config.
    """
    import triton

    from cs336_systems.flash import autotune as flash_autotune

    if flash_autotune.INTERPRET:
        return [triton.Config({"Q_TILE_SIZE": 16, "K_TILE_SIZE": 16}, num_warps=1, num_stages=2)]
    grid = [(q, k, w, s) for q, k in flash_autotune.KERNELS[name].wide_tiles for w in WIDE_WARPS for s in WIDE_STAGES]
    return flash_autotune.make_configs(grid)


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
    import torch

    import cs336_systems.flash_triton as flash_triton
    from cs336_systems.bench.timing import synchronize, torch_dtype

    kernels = flash_triton.AUTOTUNED_KERNELS
    tuned_attention = flash_triton.autograd_function("FlashAutotuned", flash_triton.KernelOptions(autotune=True))
    entries: list[dict[str, Any]] = []
    device = rec.device
    wide = sorted(args.wide or [])
    shapes = [(dt, d, s) for dt in args.dtype for d in args.d for s in args.seq]
    for dtype_name, d, seq in options.progress(shapes, args, NAME):
        fields = dict(
            impl="flash_triton", mode="fwd_bwd", dtype=dtype_name, batch=args.batch, n_heads=args.n_heads,
            seq_len=seq, d_head=d, is_causal=args.causal,
        )
        if wide:
            fields["variant"] = f"{WIDE}: {' '.join(wide)}"
        if rec.is_done({**fields, "kernel": TUNING_CALL}):
            continue
        events: list[dict[str, Any]] = []

        def tune() -> dict[str, Any]:
            """One forward + backward; its wall time is the autotuning cost of this shape."""
            q, k, v = (
                torch.randn(args.batch, args.n_heads, seq, d, device=device, dtype=torch_dtype(dtype_name),
                            requires_grad=True)
                for _ in range(3)
            )
            start = time.perf_counter()
            with configs_replaced(kernels, wide), observe(kernels) as observed:
                try:
                    tuned_attention.apply(q, k, v, args.causal).sum().backward()
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
            row = rec.measure({**fields, "kernel": event["kernel"]}, lambda e=event: event_metrics(e))
            if row["status"] == "ok" and event["tuned"] and not wide:
                entries.append(table_entry(event, torch_dtype(dtype_name), d, seq, args.causal, row))
    if args.write_table is not None:
        if entries:
            write_table(args.write_table, entries, rec.meta)
        else:  # (nothing tuned in this run: shapes --resume skipped, --wide, failures; no provenance without entries)
            print(f"autotune: no tuned configs in this run; {args.write_table} left as it was", file=sys.stderr)
    return 0


def table_entry(event: dict[str, Any], dtype, d: int, seq: int, causal: bool, row: Row) -> dict[str, Any]:
    """One tuning-table entry from a tuned launch (fields of `tuning.TableKey`, the config, its time)."""
    import torch

    from cs336_systems.flash import chooser, tuning

    best = event["best_config"]
    table_name = {"flash_fwd": "fwd", "flash_bwd_kv": "kv", "flash_bwd_dq": "dq"}[event["kernel"]]
    return dict(kernel=table_name, arch=tuning.arch_name(torch.cuda.get_device_capability()),
                d=tuning.padded_dim(d), dtype=tuning.dtype_class(dtype, chooser.precision(dtype)), causal=causal,
                bucket=tuning.length_bucket(seq, seq),
                config=[best.kwargs["Q_TILE_SIZE"], best.kwargs["K_TILE_SIZE"], best.num_warps, best.num_stages],
                ms=row.get("ms"), run_id=row["run_id"],
                tried=[[c["Q_TILE_SIZE"], c["K_TILE_SIZE"], c["num_warps"], c["num_stages"], c["ms"]]
                       for c in row.get("configs", ()) if math.isfinite(c["ms"])])


def write_table(path: Path, entries: list[dict[str, Any]], meta: Row) -> None:
    """Merge `entries` over the table at `path` (same key: the new entry) and record this run's provenance."""
    key = ("kernel", "arch", "d", "dtype", "causal", "bucket")
    table = json.loads(path.read_text()) if path.exists() else {"measured": [], "entries": []}
    merged = {tuple(e[f] for f in key): e for e in table["entries"]}
    merged.update({tuple(e[f] for f in key): e for e in entries})
    provenance = {f: meta.get(f) for f in ("gpu", "torch", "triton", "commit", "run_id")}
    table["measured"] = [*table["measured"], {**provenance, "date": time.strftime("%Y-%m-%d", time.gmtime())}]
    table["entries"] = sorted(merged.values(), key=lambda e: tuple(str(e[f]) for f in key))
    partial = path.with_name(path.name + ".partial")  # written whole, then renamed: a crash leaves the old table
    partial.write_text(table_text(table))
    partial.replace(path)


def table_text(table: dict[str, Any]) -> str:
    """The table file's text: one line per provenance record and per entry."""
    def lines(items: list) -> str:
        return ",\n".join("  " + json.dumps(item) for item in items)

    return f'{{\n "measured": [\n{lines(table["measured"])}\n ],\n "entries": [\n{lines(table["entries"])}\n ]\n}}\n'



# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _cells(r: Row, fields: tuple[str, ...]) -> list[Any]:
    return ["–" if r.get(f) is None else r.get(f) for f in fields]


def _wide_label(r: Row, kernel: str) -> str:
    """' wide' where this kernel tuned over the --wide grid, ' (wide run)' where another kernel did."""
    if not r.get("variant"):
        return ""
    return " wide" if kernel in r["variant"].split() else " (wide run)"


def render(rows: list[Row], out: Output) -> list[str]:
    rows = report.latest(rows)
    shape = ("dtype", "batch", "n_heads", "seq_len", "d_head", "is_causal")
    if any(r.get("variant") for r in rows):  # --wide runs beside the shipped configs' runs
        shape = (*shape, "variant")
    calls = [r for r in rows if r["kernel"] == TUNING_CALL]
    kernels = [r for r in rows if r["kernel"] != TUNING_CALL]
    sections = [
        "## Tuning calls (one forward + backward per shape)\n\n"
        + report.markdown([*shape, "status", "wall s", "launches"], [
            [*_cells(r, shape), r["status"], report.fmt_num(r.get("tune_wall_s")), r.get("n_launches", "–")]
            for r in report.sort_rows(calls, shape)
        ]),
        "## Chosen configs\n\n"
        + report.markdown([*shape, "kernel", "tuned", "tuning key", "best config", "best ms", "configs tried",
                           "bench s"], [
            [*_cells(r, shape), r["kernel"], r.get("tuned"), " ".join(r.get("tuning_key") or []) or "–",
             r.get("best_config") if r["status"] == "ok" else r["status"], report.fmt_num(r.get("ms")),
             r.get("n_tried", "–"), report.fmt_num(r.get("bench_time_s"))]
            for r in report.sort_rows(kernels, (*shape, "kernel"))
        ]),
    ]
    detail = []
    for r in report.sort_rows(kernels, (*shape, "kernel")):
        if r.get("configs"):
            detail.append(
                f"### {r['kernel']}, {report.subtitle(shape, tuple(r.get(f) for f in shape))}\n\n"
                + report.markdown(["config", "ms", "p20", "p80", "x best"], [
                    [c["config"], report.fmt_num(c.get("ms")), report.fmt_num(c.get("ms_p20")),
                     report.fmt_num(c.get("ms_p80")),
                     f"{c['ms'] / r['ms']:.2f}" if r.get("ms") and c.get("ms") and math.isfinite(c["ms"]) else "–"]
                    for c in r["configs"]
                ])
            )
    if detail:
        sections.append("## Every config tried\n\n" + "\n\n".join(detail))
    _plot(kernels, shape, out)
    return sections


def _plot(kernels: list[Row], shape: tuple[str, ...], out: Output) -> None:
    names = report.distinct(kernels, "kernel")
    fig, axes = report.new_figure(max(len(names), 1), cols=1, height=3.4, width=report.FIGURE_WIDTH)
    for ax, name in zip(axes, names):
        sel = report.sort_rows([r for r in kernels if r["kernel"] == name and r["status"] == "ok"], shape)
        labels = [f"{r['dtype']} d{r['d_head']} s{r['seq_len']}" + _wide_label(r, name) for r in sel]
        ratios = []
        for i, r in enumerate(sel):
            tried = [c["ms"] / r["ms"] for c in r.get("configs") or []
                     if c.get("ms") and math.isfinite(c["ms"]) and r.get("ms")]
            ax.scatter([i] * len(tried), tried, s=10, alpha=0.6, color="#1f77b4",
                       label="a config tried" if i == 0 else None)
            ax.scatter([i], [1.0], marker="*", s=60, color="#d62728", label="chosen" if i == 0 else None)
            ratios += tried
        ax.set_xticks(range(len(sel)), labels, rotation=60, ha="right", fontsize=7)
        report.speedup_axis(ax, "time / chosen config's", ratios)
        ax.set_title(f"{name} (lower is better)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    out.save(fig, "autotune_configs", "autotune: every config's time relative to the chosen one")
