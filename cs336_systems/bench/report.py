"""report: render `<out>/<problem>/table.md` and PNG plots from each problem's metrics.jsonl.

Only the JSONL files are read. Rows sharing a measurement key keep the latest ok row (else the
latest row, so OOM / unsupported / error cells still show). Non-ok cells print their status.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from cs336_systems.bench.record import KEY_FIELDS, key_of, read_rows

HELP = "render table.md and PNG plots from <out>/<problem>/metrics.jsonl"
PROBLEM_ORDER = ("attention", "model", "flash", "leaderboard", "autotune", "resources")
SIZE_ORDER = ("smoke", "small", "medium", "large", "xl", "2.7B")
IMPL_ORDER = (
    "naive", "naive_compiled", "flash_pytorch", "flash_triton", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient",
)
Row = dict[str, Any]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("runs"), help="output root holding <problem>/metrics.jsonl")
    p.add_argument("--problems", nargs="+", default=None, help="problems to render (default: all found)")


def run(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    found = [d.name for d in sorted(args.out.glob("*")) if (d / "metrics.jsonl").exists()]
    problems = args.problems or sorted(
        found, key=lambda p: (PROBLEM_ORDER.index(p) if p in PROBLEM_ORDER else len(PROBLEM_ORDER), p)
    )
    if not problems:
        print(f"report: no <problem>/metrics.jsonl under {args.out}", file=sys.stderr)
        return 1
    for problem in problems:
        path = args.out / problem / "metrics.jsonl"
        rows = read_rows(path)
        if not rows:
            print(f"report: {path} is missing or empty", file=sys.stderr)
            continue
        render = RENDERERS.get(problem, render_generic)
        sections, plots = render(rows, args.out / problem)
        table = args.out / problem / "table.md"
        table.write_text(header(problem, rows) + "\n\n".join(sections) + "\n")
        print(f"report: {table}" + "".join(f"\n        {p}" for p in plots))
    return 0


# ---------------------------------------------------------------------------------------------
# Row selection and formatting
# ---------------------------------------------------------------------------------------------


def latest(rows: Iterable[Row], fields: Sequence[str] = KEY_FIELDS) -> list[Row]:
    """One row per key: the last ok row if any, else the last row (file order is time order)."""
    chosen: dict[tuple, Row] = {}
    for r in rows:
        k = key_of(r, fields)
        if r.get("status") == "ok" or chosen.get(k, {}).get("status") != "ok":
            chosen[k] = r
    return list(chosen.values())


def ok(r: Row | None) -> bool:
    return r is not None and r.get("status") == "ok" and r.get("ms") is not None


def status_cell(r: Row | None) -> str | None:
    """The cell text of a non-ok row ("OOM", "unsupported", "error", ...), None for ok rows."""
    if r is None:
        return "–"
    status = str(r.get("status"))
    if status == "ok":
        return None
    if status == "oom":
        return "OOM"
    return status.split(":")[0]


def fmt_num(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "–"
    if math.isinf(x):
        return "inf"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.3f}"
    return f"{x:.3g}"


def ms_cell(r: Row | None) -> str:
    return status_cell(r) or fmt_num(r["ms"])


def mean_std_cell(r: Row | None) -> str:
    s = status_cell(r)
    if s:
        return s
    mean, std = r.get("ms_mean", r["ms"]), r.get("ms_std")
    return f"{fmt_num(mean)} ± {fmt_num(std)}" if std is not None else fmt_num(mean)


def ratio_cell(num: Row | None, den: Row | None, field: str = "ms") -> str:
    if not (ok(num) and ok(den)) or not num.get(field):
        return "–"
    return f"{den[field] / num[field]:.2f}x"


def sort_value(field: str, value: Any) -> tuple:
    order = {"model_size": SIZE_ORDER, "impl": IMPL_ORDER}.get(field)
    if order and value in order:
        return (0, order.index(value), "")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (1, value, "")
    return (2, 0, str(value))


def sort_rows(rows: Iterable[Row], fields: Sequence[str]) -> list[Row]:
    return sorted(rows, key=lambda r: tuple(sort_value(f, r.get(f)) for f in fields))


def distinct(rows: Iterable[Row], field: str) -> list[Any]:
    values = {r.get(field) for r in rows}
    return sorted(values, key=lambda v: sort_value(field, v))


def group_by(rows: Iterable[Row], fields: Sequence[str]) -> list[tuple[tuple, list[Row]]]:
    groups: dict[tuple, list[Row]] = {}
    for r in sort_rows(rows, fields):
        groups.setdefault(tuple(r.get(f) for f in fields), []).append(r)
    return list(groups.items())


def markdown(headers: Sequence[str], body: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in body]
    return "\n".join(lines)


def pivot(
    rows: list[Row],
    index: Sequence[str],
    columns: Sequence[tuple[str, Callable[[Row], bool]]],
    cell: Callable[[Row | None], str],
    extra: Sequence[tuple[str, Callable[[dict[str, Row | None]], str]]] = (),
) -> str:
    """Markdown table: one line per distinct `index` value; each column picks its row by predicate."""
    body = []
    for key, group in group_by(rows, index):
        picked = {name: next((r for r in reversed(group) if pred(r)), None) for name, pred in columns}
        body.append([*key, *(cell(picked[name]) for name, _ in columns), *(f(picked) for _, f in extra)])
    return markdown([*index, *(n for n, _ in columns), *(n for n, _ in extra)], body)


def header(problem: str, rows: list[Row]) -> str:
    def values(field: str) -> str:
        return ", ".join(sorted({str(r.get(field)) for r in rows}))

    statuses: dict[str, int] = {}
    for r in rows:
        s = str(r.get("status")).split(":")[0]
        statuses[s] = statuses.get(s, 0) + 1
    lines = [
        f"# {problem}",
        "",
        f"Generated by `cs336-bench report` from `{problem}/metrics.jsonl` ({len(rows)} rows: "
        + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
        + ").",
        "",
        f"- gpu: {values('gpu')}",
        f"- torch: {values('torch')}; triton: {values('triton')}",
        f"- commit: {values('commit')}",
        f"- runs: {len({r.get('run_id') for r in rows})} ({values('time').split(', ')[0]} ... "
        f"{values('time').split(', ')[-1]})",
    ]
    if any(r.get("timings_meaningless") for r in rows):
        lines.append("- **some rows come from CPU smoke runs: their timings are meaningless**")
    lines.append("- times in ms; cells show OOM / unsupported / error where a measurement did not complete")
    return "\n".join(lines) + "\n\n"


def subtitle(fields: Sequence[str], key: tuple) -> str:
    return ", ".join(f"{f}={v}" for f, v in zip(fields, key))


# ---------------------------------------------------------------------------------------------
# Plot helpers
# ---------------------------------------------------------------------------------------------


def new_figure(n_panels: int, width: float = 5.5, height: float = 4.2):
    import matplotlib.pyplot as plt

    cols = min(n_panels, 4)
    rows = math.ceil(n_panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    return fig, flat[:n_panels]


def save(fig, path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def line_plot(ax, rows: list[Row], x: str, series: Callable[[Row], str], y: Callable[[Row], float | None]) -> None:
    """One line per series over ok rows; the legend notes where a series hits OOM."""
    points: dict[str, list[tuple[float, float]]] = {}
    oom_from: dict[str, float] = {}
    for r in rows:
        name = series(r)
        if r.get("status") == "oom" and r.get(x) is not None:
            oom_from[name] = min(oom_from.get(name, math.inf), r[x])
            points.setdefault(name, [])
            continue
        value = y(r) if r.get("status") == "ok" else None
        if value is not None and r.get(x) is not None:
            points.setdefault(name, []).append((r[x], value))
    for name, pts in points.items():
        pts.sort()
        label = f"{name} (OOM from {oom_from[name]:g})" if name in oom_from else name
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if points:
        ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)


def log_axes(ax, xlabel: str, ylabel: str) -> None:
    """Log-log axes (base 2 in x); an axes with no data points says so instead."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if not any(len(line.get_xdata()) for line in ax.lines):
        ax.text(0.5, 0.5, "no completed measurements", ha="center", va="center", transform=ax.transAxes)
        return
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")


def slug(*parts: Any) -> str:
    return "_".join(str(p).replace(".", "p").replace("/", "-").replace(" ", "") for p in parts)


# ---------------------------------------------------------------------------------------------
# Per-problem renderers: (rows, problem dir) -> (markdown sections, plot paths)
# ---------------------------------------------------------------------------------------------


def render_attention(rows: list[Row], out: Path) -> tuple[list[str], list[Path]]:
    rows = latest(rows)
    sections, plots = [], []
    group_fields = ("dtype", "batch", "is_causal")
    impls = distinct(rows, "impl")
    for key, group in group_by(rows, group_fields):
        columns = [(f"{impl} {mode}", _is(impl=impl, mode=mode)) for impl in impls for mode in ("fwd", "bwd")]
        extra = [
            (f"mem before bwd MB ({impl})", _mem_before_bwd(impl)) for impl in impls
        ]
        if "naive" in impls and "naive_compiled" in impls:
            extra += [
                (f"compiled speedup {mode}", lambda p, m=mode: ratio_cell(p[f"naive_compiled {m}"], p[f"naive {m}"]))
                for mode in ("fwd", "bwd")
            ]
        sections.append(
            f"## Attention latency (ms, median over iterations), {subtitle(group_fields, key)}\n\n"
            + pivot(group, ("d_head", "seq_len"), columns, ms_cell, extra)
        )
        fig, axes = new_figure(3)
        for ax, mode in zip(axes, ("fwd", "bwd")):
            line_plot(ax, [r for r in group if r["mode"] == mode], "seq_len",
                      lambda r: f"{r['impl']} d={r['d_head']}", lambda r: r["ms"])
            log_axes(ax, "sequence length", "ms")
            ax.set_title(mode)
        line_plot(axes[2], [r for r in group if r["mode"] == "bwd"], "seq_len",
                  lambda r: f"{r['impl']} d={r['d_head']}", lambda r: r.get("mem_before_bwd_mb"))
        log_axes(axes[2], "sequence length", "MB allocated before backward")
        axes[2].set_title("memory before backward")
        plots.append(save(fig, out / f"{slug('attention', *key)}.png", f"attention, {subtitle(group_fields, key)}"))
    return sections, plots


def _is(**conditions: Any) -> Callable[[Row], bool]:
    return lambda r: all(r.get(k) == v for k, v in conditions.items())


def _mem_before_bwd(impl: str) -> Callable[[dict[str, Row | None]], str]:
    def cell(picked: dict[str, Row | None]) -> str:
        r = picked.get(f"{impl} bwd") or picked.get(f"{impl} fwd")
        if r is None:
            return "–"
        return status_cell(r) or fmt_num(r.get("mem_before_bwd_mb"))

    return cell


def render_model(rows: list[Row], out: Path) -> tuple[list[str], list[Path]]:
    import numpy as np

    rows = latest(rows)
    sections, plots = [], []
    modes = [m for m in ("fwd", "bwd", "fwd_bwd", "step") if any(r["mode"] == m for r in rows)]
    variants = [(c, "compiled" if c else "eager") for c in distinct(rows, "compiled")]
    setup = ("model_size", "context_length", "impl", "dtype", "batch", "compiled", "mode")
    by_setup = group_by(rows, setup)
    warmups = distinct(rows, "warmup_steps")
    # Step-time tables and plots: per setup the most warmed-up run; fewer warm-up steps only in their own table.
    steady = [max(g, key=lambda r: r.get("warmup_steps") or 0) for _, g in by_setup]
    index = ["model_size", "context_length", "impl", "dtype", "batch"]
    if len(distinct(steady, "warmup_steps")) > 1:
        index.append("warmup_steps")
    columns = [(f"{mode} {label}", _is(mode=mode, compiled=c)) for mode in modes for c, label in variants]
    extra = []
    if len(variants) == 2:
        extra = [
            (f"compile speedup {mode}", lambda p, m=mode: ratio_cell(p[f"{m} compiled"], p[f"{m} eager"], "ms_mean"))
            for mode in modes
        ]
    if len(warmups) > 1:
        warm_rows = [r for _, g in by_setup if len(distinct(g, "warmup_steps")) > 1 for r in g]
        sections.append(
            "## Warm-up effect (ms: mean ± std over timed steps; first timed step in brackets)\n\n"
            + pivot(
                warm_rows, ["model_size", "context_length", "impl", "dtype", "compiled", "mode"],
                [(f"warmup {w}", _is(warmup_steps=w)) for w in warmups], _mean_std_first_cell,
            )
        )
    sections += [
        "## Step time (ms, mean ± std over timed steps)\n\n" + pivot(steady, index, columns, mean_std_cell, extra),
        "## Throughput (tokens/s, from the mean step time)\n\n"
        + pivot(steady, index, columns, lambda r: status_cell(r) or fmt_num(r.get("tokens_per_s"))),
        "## Peak memory (MB, max_memory_allocated over the mode's steps)\n\n"
        + pivot(steady, index, columns, lambda r: status_cell(r) or fmt_num(r.get("peak_mem_mb"))),
    ]

    for key, group in group_by(steady, ("context_length", "impl", "dtype")):
        sizes = distinct(group, "model_size")
        if len(sizes) < 2 and len(distinct(group, "compiled")) < 2:
            continue  # one bar per mode: the context-sweep plot below shows it
        fig, axes = new_figure(len(modes))
        for ax, mode in zip(axes, modes):
            width = 0.8 / max(len(variants), 1)
            for i, (c, label) in enumerate(variants):
                ys, errs = [], []
                for size in sizes:
                    r = _pick(group, model_size=size, mode=mode, compiled=c)
                    ys.append(r.get("ms_mean", r["ms"]) if ok(r) else 0.0)
                    errs.append((r.get("ms_std") or 0.0) if ok(r) else 0.0)
                ax.bar(np.arange(len(sizes)) + i * width, ys, width, yerr=errs, label=label, capsize=2)
            ax.set_xticks(np.arange(len(sizes)) + width * (len(variants) - 1) / 2, [str(s) for s in sizes])
            ax.set_ylabel("ms per step (mean ± std)")
            ax.set_title(mode)
            ax.legend(fontsize=7)
            ax.grid(True, axis="y", alpha=0.3)
        fields = ("context_length", "impl", "dtype")
        plots.append(save(fig, out / f"{slug('model', *key)}.png", f"model step time, {subtitle(fields, key)}"))

    for key, group in group_by(steady, ("model_size", "dtype")):
        swept = [m for m in modes if len(distinct([r for r in group if r["mode"] == m], "context_length")) > 1]
        if not swept:
            continue
        fig, axes = new_figure(2 * len(swept))
        for i, mode in enumerate(swept):
            sel = [r for r in group if r["mode"] == mode]
            line_plot(axes[i], sel, "context_length", _model_series, lambda r: r.get("ms_mean", r["ms"]))
            log_axes(axes[i], "context length", "ms per step")
            axes[i].set_title(f"{mode} time")
            line_plot(axes[len(swept) + i], sel, "context_length", _model_series, lambda r: r.get("peak_mem_mb"))
            log_axes(axes[len(swept) + i], "context length", "peak MB")
            axes[len(swept) + i].set_title(f"{mode} peak memory")
        fields = ("model_size", "dtype")
        plots.append(
            save(fig, out / f"{slug('model_context', *key)}.png", f"model context sweep, {subtitle(fields, key)}")
        )
    return sections, plots


def _mean_std_first_cell(r: Row | None) -> str:
    cell = mean_std_cell(r)
    if ok(r) and r.get("first_ms") is not None:
        cell += f" ({fmt_num(r['first_ms'])})"
    return cell


def _model_series(r: Row) -> str:
    return f"{r['impl']} {'compiled' if r['compiled'] else 'eager'}"


def render_flash(rows: list[Row], out: Path) -> tuple[list[str], list[Path]]:
    rows = latest(rows)
    sections, plots = [], []
    impls = distinct(rows, "impl")
    fields = ("dtype", "mode", "batch", "is_causal")
    for key, group in group_by(rows, fields):
        columns = [(impl, _is(impl=impl)) for impl in impls]
        # references with at least one completed row here (SDPA flash / cuDNN have none in fp32)
        refs = [
            ref for ref in ("naive", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
            if "flash_triton" in impls and any(r["impl"] == ref and ok(r) for r in group)
        ]
        extra = [
            (f"flash_triton speedup vs {ref}", lambda p, ref=ref: ratio_cell(p["flash_triton"], p[ref]))
            for ref in refs
        ]
        if "flash_triton" in impls:
            extra.append(("flash_triton TFLOP/s", _tflops_cell("flash_triton")))
        sections.append(
            f"## Latency (ms, do_bench median), {subtitle(fields, key)}\n\n"
            + pivot(group, ("d_head", "seq_len"), columns, ms_cell, extra)
        )
        dims = distinct(group, "d_head")
        fig, axes = new_figure(len(dims))
        for ax, d in zip(axes, dims):
            line_plot(ax, [r for r in group if r["d_head"] == d], "seq_len", lambda r: r["impl"], lambda r: r["ms"])
            log_axes(ax, "sequence length", "ms")
            ax.set_title(f"d={d}")
        plots.append(save(fig, out / f"{slug('flash_latency', *key[:2])}.png", f"latency, {subtitle(fields, key)}"))

        if refs:
            fig, axes = new_figure(len(refs))
            for ax, ref in zip(axes, refs):
                speedup_rows = []
                for d in dims:
                    for seq in distinct(group, "seq_len"):
                        ours = _pick(group, impl="flash_triton", d_head=d, seq_len=seq)
                        theirs = _pick(group, impl=ref, d_head=d, seq_len=seq)
                        if ok(ours) and ok(theirs):
                            x = theirs["ms"] / ours["ms"]
                            speedup_rows.append({"status": "ok", "d_head": d, "seq_len": seq, "x": x})
                line_plot(ax, speedup_rows, "seq_len", lambda r: f"d={r['d_head']}", lambda r: r["x"])
                log_axes(ax, "sequence length", f"speedup (ms {ref} / ms flash_triton)")
                ax.axhline(1.0, color="gray", lw=0.8)
                ax.set_title(f"flash_triton vs {ref}")
            plots.append(
                save(fig, out / f"{slug('flash_speedup', *key[:2])}.png", f"speedup, {subtitle(fields, key)}")
            )
    return sections, plots


def _tflops_cell(impl: str) -> Callable[[dict[str, Row | None]], str]:
    return lambda picked: status_cell(picked[impl]) or fmt_num(picked[impl].get("tflops"))


def _pick(rows: list[Row], **conditions: Any) -> Row | None:
    return next((r for r in reversed(rows) if all(r.get(k) == v for k, v in conditions.items())), None)


def render_leaderboard(rows: list[Row], out: Path) -> tuple[list[str], list[Path]]:
    rows = latest(rows)
    sections, plots = [], []
    fields = ("dtype", "batch", "n_heads", "seq_len", "d_head", "is_causal")
    for key, group in group_by(rows, fields):
        modes = [m for m in ("fwd_bwd", "fwd") if any(r["mode"] == m for r in group)]
        body = []
        entries = list(dict.fromkeys((r["variant"], r["impl"], r.get("compiled")) for r in group))
        for variant, impl, compiled in entries:
            first = _pick(group, variant=variant)
            line = [variant, impl, compiled, f"{fmt_num(first.get('rep_ms'))}/{fmt_num(first.get('warmup_ms'))}"]
            for mode in modes:
                r = _pick(group, variant=variant, mode=mode)
                line += [ms_cell(r), status_cell(r) or fmt_num(r.get("ms_mean")),
                         status_cell(r) or f"{fmt_num(r['ms_p20'])}–{fmt_num(r['ms_p80'])}",
                         status_cell(r) or fmt_num(r.get("tflops"))]
                for ref in ("sdpa_flash", "sdpa_cudnn"):
                    line.append(ratio_cell(_pick(group, variant=ref, mode=mode), r, "ms_mean")
                                if impl not in ("sdpa_flash", "sdpa_cudnn") else "")
            body.append(line)
        headers = ["variant", "impl", "compiled", "do_bench rep/warmup ms"]
        for mode in modes:
            headers += [f"{mode} median ms", f"{mode} mean ms (harness)", f"{mode} p20–p80", f"{mode} TFLOP/s",
                        f"{mode} ours/sdpa_flash", f"{mode} ours/sdpa_cudnn"]
        sections.append(
            f"## Leaderboard harness, {subtitle(fields, key)}\n\n"
            "ratios are ours / theirs on the harness mean (below 1 = faster than SDPA)\n\n"
            + markdown(headers, body)
        )
        fig, axes = new_figure(len(modes), width=7)
        for ax, mode in zip(axes, modes):
            sel = [r for r in group if r["mode"] == mode and ok(r)]
            labels = [r["variant"] for r in sel]
            ms = [r["ms"] for r in sel]
            err = [[r["ms"] - r.get("ms_p20", r["ms"]) for r in sel], [r.get("ms_p80", r["ms"]) - r["ms"] for r in sel]]
            colors = ["tab:gray" if r["impl"].startswith("sdpa") else "tab:blue" for r in sel]
            ax.barh(labels, ms, xerr=err, color=colors, capsize=3)
            for i, v in enumerate(ms):
                ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
            ax.set_xlabel("ms (median, p20–p80)")
            ax.set_title(mode)
            ax.invert_yaxis()
        title = f"leaderboard harness, {subtitle(fields, key)}"
        plots.append(save(fig, out / f"{slug('leaderboard', *key)}.png", title))
    return sections, plots


def _cells(r: Row, fields: Sequence[str]) -> list[Any]:
    return ["–" if r.get(f) is None else r.get(f) for f in fields]


def _wide_label(r: Row, kernel: str) -> str:
    """' wide' where this kernel tuned over the --wide grid, ' (wide run)' where another kernel did."""
    if not r.get("variant"):
        return ""
    return " wide" if kernel in r["variant"].split() else " (wide run)"


def render_autotune(rows: list[Row], out: Path) -> tuple[list[str], list[Path]]:
    from cs336_systems.bench.autotune import TUNING_CALL

    rows = latest(rows, (*KEY_FIELDS, "kernel", "tuning_key"))
    shape = ("dtype", "batch", "n_heads", "seq_len", "d_head", "is_causal")
    if any(r.get("variant") for r in rows):  # --wide runs beside the shipped configs' runs
        shape = (*shape, "variant")
    calls = [r for r in rows if r.get("kernel") == TUNING_CALL]
    kernels = [r for r in rows if r.get("kernel") != TUNING_CALL]
    sections, plots = [], []
    sections.append(
        "## Tuning calls (one forward + backward per shape)\n\n"
        + markdown([*shape, "status", "wall s", "launches"], [
            [*_cells(r, shape), r["status"], fmt_num(r.get("tune_wall_s")), r.get("n_launches", "–")]
            for r in sort_rows(calls, shape)
        ])
    )
    sections.append(
        "## Chosen configs\n\n"
        + markdown([*shape, "kernel", "tuned", "tuning key", "best config", "best ms", "configs tried", "bench s"], [
            [*_cells(r, shape), r.get("kernel"), r.get("tuned"), " ".join(r.get("tuning_key") or []) or "–",
             r.get("best_config") if r["status"] == "ok" else r["status"], fmt_num(r.get("ms")),
             r.get("n_tried", "–"), fmt_num(r.get("bench_time_s"))]
            for r in sort_rows(kernels, (*shape, "kernel"))
        ])
    )
    detail = []
    for r in sort_rows(kernels, (*shape, "kernel")):
        if r.get("configs"):
            detail.append(
                f"### {r['kernel']}, {subtitle(shape, tuple(r.get(f) for f in shape))}\n\n"
                + markdown(["config", "ms", "p20", "p80", "x best"], [
                    [c["config"], fmt_num(c.get("ms")), fmt_num(c.get("ms_p20")), fmt_num(c.get("ms_p80")),
                     f"{c['ms'] / r['ms']:.2f}" if r.get("ms") and c.get("ms") and math.isfinite(c["ms"]) else "–"]
                    for c in r["configs"]
                ])
            )
    if detail:
        sections.append("## Every config tried\n\n" + "\n\n".join(detail))

    names = distinct(kernels, "kernel")
    fig, axes = new_figure(max(len(names), 1), width=7)
    for ax, name in zip(axes, names):
        sel = sort_rows([r for r in kernels if r.get("kernel") == name and r["status"] == "ok"], shape)
        labels = [f"{r['dtype']} d{r['d_head']} s{r['seq_len']}" + _wide_label(r, name) for r in sel]
        for i, r in enumerate(sel):
            tried = [c["ms"] for c in r.get("configs") or [] if c.get("ms") and math.isfinite(c["ms"])]
            if tried and r.get("ms"):
                ax.scatter([i] * len(tried), [t / r["ms"] for t in tried], s=10, alpha=0.6, color="tab:blue")
            ax.scatter([i], [1.0], marker="*", s=60, color="tab:red")
        ax.set_xticks(range(len(sel)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("config time / chosen config time")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
    plots.append(save(fig, out / "autotune_configs.png", "autotune: every config's time relative to the chosen one"))
    return sections, plots


def render_resources(rows: list[Row], out: Path) -> tuple[list[str], list[Path]]:
    rows = latest(rows)
    sections = []
    fields = ("target", "dtype", "n_heads", "seq_len", "d_head", "is_causal")
    headers = ["kernel", "config (tiles/warps/stages)", "registers", "spill store/load B", "stack B",
               "shared mem KiB", "warps/SM (registers)", "wgmma"]
    for key, group in group_by(rows, fields):
        body = [
            [r["mode"], r["variant"], r["registers"], f"{r['spill_store_bytes']}/{r['spill_load_bytes']}",
             r["stack_bytes"], fmt_num(r["shared_mem_bytes"] / 1024), r["warps_per_sm_by_registers"], r["wgmma"]]
            if r.get("status") == "ok" else [r["mode"], r["variant"], r.get("status"), "", "", "", "", ""]
            for r in group
        ]
        sections.append(
            f"## ptxas resources, {subtitle(fields, key)}\n\n"
            "static compile, nothing timed; warps/SM counts whole CTAs that fit 65,536 registers\n\n"
            + markdown(headers, body)
        )
    return sections, []


def render_generic(rows: list[Row], out: Path) -> tuple[list[str], list[Path]]:
    rows = latest(rows)
    fields = [f for f in KEY_FIELDS if any(r.get(f) is not None for r in rows)]
    body = [[*(r.get(f) for f in fields), r.get("status"), fmt_num(r.get("ms"))] for r in sort_rows(rows, fields)]
    return ["## All measurements\n\n" + markdown([*fields, "status", "ms"], body)], []


RENDERERS: dict[str, Callable[[list[Row], Path], tuple[list[str], list[Path]]]] = {
    "attention": render_attention,
    "model": render_model,
    "flash": render_flash,
    "leaderboard": render_leaderboard,
    "autotune": render_autotune,
    "resources": render_resources,
}
