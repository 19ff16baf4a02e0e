"""report: render `<out>/<problem>/table.md` and PNG plots from each problem's metrics.jsonl.

Only the JSONL files are read. Each problem module renders its own rows (`render(rows, out)`); this module is
the shared toolkit (latest rows, pivots, markdown, plot helpers, one colour and label per implementation) and
the loop over problems. Rows sharing a measurement key keep the latest row, whatever its status; non-ok cells
print their status. A ratio of two rows from different runs is marked †. Rows of different devices (and
--smoke rows) are never mixed: each device gets its own section, and its plots a file-name suffix after the
first device's. Rows that do not match the problem's schema (`record.valid_rows`, which `--resume` applies
too) are skipped with a warning; the other rows and problems still render. The exit code is 2 when --out is
not a folder or cannot be written, 1 when a problem named in --problems has no valid rows or --out holds no
metrics.jsonl.
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from cs336_systems.bench.impls import ABLATION_PREFIX
from cs336_systems.bench.record import KEY_FIELDS, NUMBER, Row, key_of, read_rows, valid_rows

NAME = "report"
HELP = "render table.md and PNG plots from <out>/<problem>/metrics.jsonl"
SIZE_ORDER = ("smoke", "small", "medium", "large", "xl", "2.7B")
IMPL_STYLE = {  # name -> (label in tables and legends, colour): the same in every figure
    "naive": ("naive", "#7f7f7f"),
    "naive_compiled": ("naive (compiled)", "#3f3f3f"),
    "flash_pytorch": ("flash (PyTorch)", "#9467bd"),
    "flash_triton": ("ours", "#1f77b4"),
    "flash_triton_compiled": ("ours (compiled)", "#17becf"),
    "flash_triton_cudagraphs": ("ours (CUDA graphs)", "#aec7e8"),
    "flash_op": ("ours (flash_attention op)", "#08519c"),
    "sdpa": ("SDPA (PyTorch's choice)", "#ffbb78"),
    "sdpa_flash": ("SDPA flash (FA2)", "#ff7f0e"),
    "sdpa_cudnn": ("SDPA cuDNN", "#2ca02c"),
    "sdpa_efficient": ("SDPA mem-efficient", "#d62728"),
    "sdpa_math": ("SDPA math", "#8c564b"),
    "flash_triton_gluon_kv": ("ours, keys-on-rows Gluon dK/dV (two-pass)", "#bcbd22"),
}
IMPL_ORDER = tuple(IMPL_STYLE)
EXTRA_COLORS = ("#e377c2", "#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39")
FIGURE_WIDTH = 10.0  # inches: two panels per row fill a page
PANEL_HEIGHT = 3.6


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("runs"), help="output root holding <problem>/metrics.jsonl")
    p.add_argument("--problems", nargs="+", default=None,
                   help="problems to render (default: every cs336-bench problem with a metrics.jsonl; another "
                        "folder's rows, when named, get a plain table)")


def run(args: argparse.Namespace, problems: dict[str, ModuleType]) -> int:
    """Render every problem found (or named). Exit code 2 when --out is not a folder or a table or plot
    cannot be written there (the other problems still render); else 1 when a problem named in --problems
    has no valid rows (or is no problem or folder), a problem's renderer fails on its rows (the others still
    render), or --out holds no metrics.jsonl."""
    if not args.out.is_dir():
        print(f"report: --out {args.out}: {'not a folder' if args.out.exists() else 'no such folder'}",
              file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    found = [p for p in problems if (args.out / p / "metrics.jsonl").exists()]
    requested = args.problems or found
    if not requested:
        print(f"report: no <problem>/metrics.jsonl under {args.out}", file=sys.stderr)
        return 1
    missing, failed, unwritable = [], [], False
    for problem in requested:
        path = args.out / problem / "metrics.jsonl"
        module = problems.get(problem)
        if module is None and not path.parent.is_dir():
            print(f"report: no problem or folder named {problem!r} (problems: {', '.join(problems)})",
                  file=sys.stderr)
            missing.append(problem)
            continue
        rows = valid_rows(read_rows(path), module, path)
        if not rows:
            print(f"report: no valid rows in {path}", file=sys.stderr)
            if args.problems:
                missing.append(problem)
            continue
        try:
            table, plots = render_problem(problem, rows, module, args.out / problem)
        except OSError as e:
            print(f"report: cannot write under {args.out / problem}: {e}", file=sys.stderr)
            unwritable = True
            continue
        except Exception:  # one problem's rows that its renderer cannot take: the other problems still render
            print(f"report: cannot render {path}:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            failed.append(problem)
            continue
        print(f"report: {table}" + "".join(f"\n        {p}" for p in plots))
    if unwritable:
        return 2
    if missing:
        print(f"report: nothing to render for {', '.join(missing)}", file=sys.stderr)
    if failed:
        print(f"report: could not render {', '.join(failed)} (the tracebacks above)", file=sys.stderr)
    return 1 if missing or failed else 0


def render_problem(problem: str, rows: list[Row], module: ModuleType | None, folder: Path) -> tuple[Path, list[Path]]:
    """Write `folder`/table.md and the plots of one problem's valid rows; return their paths."""
    render = module.render if module is not None else render_generic
    sections, plots = [], []
    devices = group_by_device(rows)
    for i, (label, device_rows) in enumerate(devices):
        out = Output(folder, "" if i == 0 else slug("", label), smoke=label.endswith("--smoke"))
        body = render(device_rows, out)
        if len(devices) > 1:
            body = [f"## Device: {label}"] + [demote(s) for s in body]
        sections += body
        plots += out.saved
    table = folder / "table.md"
    table.write_text(header(problem, rows) + "\n\n".join(sections) + "\n")
    return table, plots


# ---------------------------------------------------------------------------------------------
# Device separation
# ---------------------------------------------------------------------------------------------


def device_label(r: Row) -> str:
    return f"{r.get('gpu')}" + (" --smoke" if r.get("smoke") or r.get("timings_meaningless") else "")


def group_by_device(rows: list[Row]) -> list[tuple[str, list[Row]]]:
    """Rows per device label: real measurements first (most rows first), --smoke rows last."""
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(device_label(r), []).append(r)
    return sorted(groups.items(), key=lambda kv: (kv[0].endswith("--smoke"), -len(kv[1]), kv[0]))


def demote(section: str) -> str:
    return "\n".join("#" + line if line.startswith("#") else line for line in section.split("\n"))


# ---------------------------------------------------------------------------------------------
# Row selection and formatting
# ---------------------------------------------------------------------------------------------


def latest(rows: Iterable[Row], fields: Sequence[str] = KEY_FIELDS) -> list[Row]:
    """One row per key: the last one (file order is time order), whatever its status: a newer run's error or OOM is
    shown, not hidden behind an older ok row (`--resume` measures again what did not complete)."""
    return list({key_of(r, fields): r for r in rows}.values())


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


def field_cell(field: str) -> Callable[[Row | None], str]:
    """Cell showing `field` of an ok row, or the row's status."""
    return lambda r: status_cell(r) or fmt_num(r.get(field))


ms_cell = field_cell("ms")


def mean_std_cell(r: Row | None) -> str:
    s = status_cell(r)
    if s:
        return s
    mean, std = r.get("ms_mean", r["ms"]), r.get("ms_std")
    return f"{fmt_num(mean)} ± {fmt_num(std)}" if std is not None else fmt_num(mean)


CROSS_RUN = "†"  # marks a ratio of rows from two runs: the drift between runs is in it


def ratio_cell(num: Row | None, den: Row | None, field: str = "ms") -> str:
    """den / num as "1.23×" (a speedup of `num` over `den`), "–" unless both completed; "1.23×†" where the two rows
    come from different runs (`header` says what † means)."""
    if not (ok(num) and ok(den)) or not num.get(field) or den.get(field) is None:
        return "–"
    return f"{den[field] / num[field]:.2f}×" + ("" if same_run(num, den) else CROSS_RUN)


def same_run(*rows: Row) -> bool:
    return len({r.get("run_id") for r in rows}) == 1


def sort_value(field: str, value: Any) -> tuple:
    order = {"model_size": SIZE_ORDER, "impl": IMPL_ORDER}.get(field)
    if order and value in order:
        return (0, order.index(value), "")
    if isinstance(value, NUMBER) and not isinstance(value, bool):
        return (1, value, "")
    return (2, 0, str(value))


def sort_rows(rows: Iterable[Row], fields: Sequence[str]) -> list[Row]:
    return sorted(rows, key=lambda r: tuple(sort_value(f, r.get(f)) for f in fields))


def distinct(rows: Iterable[Row], field: str) -> list[Any]:
    values = {key_of(r, (field,))[0] for r in rows}
    return sorted(values, key=lambda v: sort_value(field, v))


def group_by(rows: Iterable[Row], fields: Sequence[str]) -> list[tuple[tuple, list[Row]]]:
    groups: dict[tuple, list[Row]] = {}
    for r in sort_rows(rows, fields):
        groups.setdefault(key_of(r, fields), []).append(r)
    return list(groups.items())


SHAPE_FIELDS = ("dtype", "batch", "n_heads", "seq_len", "d_head", "is_causal")


def by_shape(rows: Iterable[Row], modes: Sequence[str]) -> list[tuple[tuple, list[Row], list[str]]]:
    """The latest rows grouped by attention shape (`SHAPE_FIELDS`), with the `modes` each group has."""
    return [(key, group, [m for m in modes if any(r["mode"] == m for r in group)])
            for key, group in group_by(latest(rows), SHAPE_FIELDS)]


def where(**conditions: Any) -> Callable[[Row], bool]:
    return lambda r: all(r.get(k) == v for k, v in conditions.items())


def pick(rows: list[Row], **conditions: Any) -> Row | None:
    """The last row matching every condition."""
    return next((r for r in reversed(rows) if where(**conditions)(r)), None)


def markdown(headers: Sequence[str], body: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in body]
    return "\n".join(lines)


def pivot(
    rows: list[Row],
    index: Sequence[str],
    columns: Sequence[tuple[str, Callable[[Row], bool]]],
    cell: Callable[[Row | None], str] | None,
    extra: Sequence[tuple[str, Callable[[dict[str, Row | None]], str]]] = (),
) -> str:
    """Markdown table: one line per distinct `index` value; each column picks its row by predicate.

    `extra` columns compute their cell from all the picked rows; with `cell` None only they are shown.
    """
    shown = columns if cell is not None else []
    body = []
    for key, group in group_by(rows, index):
        picked = {name: next((r for r in reversed(group) if pred(r)), None) for name, pred in columns}
        body.append([*key, *(cell(picked[name]) for name, _ in shown), *(f(picked) for _, f in extra)])
    return markdown([*index, *(n for n, _ in shown), *(n for n, _ in extra)], body)


def header(problem: str, rows: list[Row]) -> str:
    def values(field: str) -> str:
        return ", ".join(sorted({str(r.get(field)) for r in rows}))

    statuses: dict[str, int] = {}
    for r in rows:
        s = str(r.get("status")).split(":")[0]
        statuses[s] = statuses.get(s, 0) + 1
    times = sorted(str(r.get("time")) for r in rows)
    lines = [
        f"# {problem}",
        "",
        f"Generated by `cs336-bench report` from `{problem}/metrics.jsonl` ({len(rows)} rows: "
        + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
        + ").",
        "",
        f"- device: {', '.join(label for label, _ in group_by_device(rows))}",
        f"- torch: {values('torch')}; triton: {values('triton')}; "
        f"fp32 matmul precision: {values('matmul_precision').replace('None', 'not recorded')}",
        f"- commit: {values('commit')}",
        f"- runs: {len({r.get('run_id') for r in rows})} ({times[0]} ... {times[-1]})",
    ]
    if any(r.get("smoke") or r.get("timings_meaningless") for r in rows):
        lines.append("- **some rows come from --smoke runs (tiny sizes, maybe the CPU): kept in their own section**")
    lines.append("- times in ms, memory in MiB; cells show OOM / unsupported / error where a measurement did "
                 "not complete")
    lines.append(f"- a ratio marked {CROSS_RUN} divides rows of two runs (the machine's drift between them is in "
                 "it); unmarked ratios compare rows of one run")
    return "\n".join(lines) + "\n\n"


def subtitle(fields: Sequence[str], key: tuple) -> str:
    return ", ".join(f"{f}={v}" for f, v in zip(fields, key))


def impl_label(name: str) -> str:
    """The display name: the registry's style table, an ablation step of ours by its step, else the name."""
    if name in IMPL_STYLE:
        return IMPL_STYLE[name][0]
    if name.startswith(ABLATION_PREFIX):
        return f"ours, ablation step {name.removeprefix(ABLATION_PREFIX)}"
    return name


def impl_color(name: str) -> str:
    if name in IMPL_STYLE:
        return IMPL_STYLE[name][1]
    return EXTRA_COLORS[sum(map(ord, name)) % len(EXTRA_COLORS)]


# ---------------------------------------------------------------------------------------------
# Plot helpers
# ---------------------------------------------------------------------------------------------


def slug(*parts: Any) -> str:
    """A file name's stem from parts (an ablation's "flash_triton:<variant>" too: no ":" in a file name)."""
    return "_".join(str(p).replace(".", "p").replace("/", "-").replace(":", "-").replace(" ", "") for p in parts)


TITLE_INCHES = 0.45


class Output:
    """Where one problem's plots for one device go: `<dir>/<name><suffix>.png`."""

    def __init__(self, directory: Path, suffix: str = "", smoke: bool = False) -> None:
        self.dir = directory
        self.suffix = suffix
        self.smoke = smoke  # the plots' titles then say that their timings mean nothing
        self.saved: list[Path] = []

    def save(self, fig, name: str, title: str) -> Path:
        import matplotlib.pyplot as plt

        fig.suptitle(f"{title} [--smoke: timings meaningless]" if self.smoke else title, fontsize=11)
        # the top TITLE_INCHES are the title's: tight_layout alone lets the first panel's title run into it
        fig.tight_layout(rect=(0, 0, 1, 1 - TITLE_INCHES / fig.get_figheight()))
        path = self.dir / f"{name}{self.suffix}.png"
        try:
            fig.savefig(path, dpi=110, bbox_inches="tight")  # (no axis label or legend cut at the edge)
        finally:  # an unwritable folder must not leave the figure open
            plt.close(fig)
        self.saved.append(path)
        return path


def new_figure(n_panels: int, cols: int = 2, height: float = PANEL_HEIGHT, width: float | None = None):
    """A page-wide figure of `n_panels` axes, `cols` per row (one narrower panel when alone)."""
    import matplotlib.pyplot as plt

    cols = max(1, min(n_panels, cols))
    rows = math.ceil(n_panels / cols)
    width = width or (FIGURE_WIDTH if cols > 1 else FIGURE_WIDTH * 0.6)
    fig, axes = plt.subplots(rows, cols, figsize=(width, height * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    return fig, flat[:n_panels]


def line_plot(
    ax, rows: list[Row], x: str, series: Callable[[Row], str], y: Callable[[Row], float | None],
    color: Callable[[Row], str] | None = None, label: Callable[[str], str] = impl_label,
    linestyle: Callable[[Row], str] | None = None, legend: bool = True,
) -> None:
    """One line per series over ok rows; the legend notes where a series hits OOM."""
    points: dict[str, list[tuple[float, float]]] = {}
    colors: dict[str, str | None] = {}
    styles: dict[str, str] = {}
    oom_from: dict[str, float] = {}
    for r in rows:
        name = series(r)
        colors.setdefault(name, color(r) if color else None)
        styles.setdefault(name, linestyle(r) if linestyle else "-")
        if r.get("status") == "oom" and r.get(x) is not None:
            oom_from[name] = min(oom_from.get(name, math.inf), r[x])
            points.setdefault(name, [])
            continue
        value = y(r) if r.get("status") == "ok" else None
        if value is not None and r.get(x) is not None:
            points.setdefault(name, []).append((r[x], value))
    for name, pts in points.items():
        pts.sort()
        text = label(name) + (f" (OOM from {oom_from[name]:g})" if name in oom_from else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3.5, label=text, color=colors[name],
                ls=styles[name])
    if points and legend:
        ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)


def has_data(ax) -> bool:
    return any(len(line.get_xdata()) for line in ax.lines) or bool(ax.patches)


def log_axes(ax, xlabel: str, ylabel: str, log_y: bool = True) -> None:
    """Log-2 x axis (sizes), log y where values span decades; an empty axes says so instead."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if not has_data(ax):
        ax.text(0.5, 0.5, "no completed measurements", ha="center", va="center", transform=ax.transAxes)
        return
    ax.set_xscale("log", base=2)
    xs = sorted({float(x) for line in ax.lines for x in line.get_xdata()})
    ax.set_xticks(xs, [f"{x:g}" if x < 1024 else f"{x / 1024:g}K" for x in xs], fontsize=8)
    ax.minorticks_off()
    if log_y:
        ax.set_yscale("log")
        plain_ticks(ax.yaxis)


def plain_ticks(axis) -> None:
    """Log-axis labels as plain numbers (0.1, 1, 10, 100) rather than powers of ten."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.10g}"))
    axis.set_minor_formatter(NullFormatter())


def log_if_spread(ax, values: Iterable[float], axis: str = "y", spread: float = 20.0) -> None:
    """A log scale on `axis` when the positive values span more than `spread` times (else linear)."""
    positive = [v for v in values if v and v > 0]
    if positive and max(positive) / min(positive) > spread:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
        plain_ticks(ax.yaxis if axis == "y" else ax.xaxis)


def speedup_axis(ax, ylabel: str = "speedup", values: Iterable[float] = ()) -> None:
    """Log-2 y axis with plain ticks (0.5×, 1×, 2×) and a line at 1×, spanning the lines' y and `values`."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_yscale("log", base=2)
    ys = [y for line in ax.lines for y in line.get_ydata()] + [v for v in values if v > 0]
    low, high = math.floor(math.log2(min(ys + [1.0]))), math.ceil(math.log2(max(ys + [1.0])))
    ax.set_ylim(2.0 ** low / 1.15, 2.0 ** high * 1.15)
    ax.yaxis.set_major_locator(FixedLocator([2.0 ** e for e in range(low, high + 1)]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}×"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylabel(ylabel)


def render_generic(rows: list[Row], out: Output) -> list[str]:
    """A table of every row, for a problem directory no module renders."""
    rows = latest(rows)
    fields = [f for f in KEY_FIELDS if any(r.get(f) is not None for r in rows)]
    body = [[*(r.get(f) for f in fields), r.get("status"), fmt_num(r.get("ms"))] for r in sort_rows(rows, fields)]
    return ["## All measurements\n\n" + markdown([*fields, "status", "ms"], body)]
