"""grid: the training grid, ours against SDPA flash and cuDNN measured in the same process, point by point.

Points (`GRID`): (batch, seq) in (32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)
(16,384 tokens each) x 16 query heads x (d 64 bf16, d 64 fp16, d 128 bf16) x causal and not, plus
grouped-query attention 16:4 (4 k/v heads) at (8, 2048) in each of those six settings: 42 points.
q (B, H, S, D), k and v (B, Hkv, S, D), contiguous, requires_grad. Timed with triton.testing.do_bench
(median, p20, p80) per mode, in --rounds interleaved rounds per point (each round times every implementation and
mode once; a row keeps the round of its median ms and lists every round's in `ms_rounds`: on a shared host whose
speed drifts, the short points' ratios otherwise depend on which implementation a slow spell hit):
  fwd      o = attn(q, k, v)
  fwd_bwd  attn(q, k, v).backward(dO), eager, the gradients set to None first (no accumulation)
TFLOP/s from 4·B·H·S²·D forward FLOPs (halved when causal; fwd_bwd 3.5x the forward).
At each point the references (SDPA cuDNN, then SDPA flash) run first, then the other implementations
(`--impls`, registry names, ablation variants such as flash_triton:gluon_fwd included). Every row has
`x_cudnn` and `x_flash`: its ms / that reference's ms at the same point and mode in this run (below 1:
faster), None unless the reference completed before it (where cuDNN refuses a point, the target is SDPA
flash: the table says so). With --resume a point whose rows are not all done is measured again whole,
so that a ratio never mixes runs.
Section "host": the host-bound step, 1 x 16 x 1024 x 64 bf16 causal fwd_bwd, of the class (flash_triton),
the functional op (flash_op, `cs336_systems.flash_attention`) and the references; its rows add `host_us`
(the Python call alone, `timing.host_times`, as in `overhead`). `--smoke`: a tiny fp32 grid (2 heads, 1
k/v head when grouped, d 16) and host point that run on the CPU through the Triton interpreter.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cs336_systems.bench import impls, options, report, verify
from cs336_systems.bench.options import add_sized, nonnegative_int, positive_int
from cs336_systems.bench.report import Output, Row
from cs336_systems.bench.timing import inputs_bytes, interleaved_rounds, median_of_rounds

if TYPE_CHECKING:
    import torch

    from cs336_systems.bench.record import Recorder

NAME = "grid"
HELP = "the training grid: ours vs SDPA flash vs cuDNN, fwd and fwd_bwd, ratios from the same run; host-bound step"
MODES = ("fwd", "fwd_bwd")
SECTIONS = ("grid", "host")
CUDNN, FLASH = "sdpa_cudnn", "sdpa_flash"
REFERENCES = {CUDNN: "x_cudnn", FLASH: "x_flash"}  # impl -> its ratio field; measured first, in this order
DEFAULT_IMPLS = [impls.SHIPPED, FLASH, CUDNN]
HOST_IMPLS = (CUDNN, FLASH, impls.SHIPPED, "flash_op")
HOST_TARGET = 1.25  # host-bound step: at most this times SDPA flash's
OP_EXTRA_US = 10.0  # host-bound step: the functional op at most this many µs over the class
FIELDS = {"section": str, "mode": str, "dtype": str, "batch": int, "n_heads": int, "n_kv_heads": int,
          "seq_len": int, "d_head": int, "is_causal": bool}
OK_FIELDS = {"ms": (int, float)}


@dataclass(frozen=True)
class Point:
    batch: int
    seq_len: int
    d_head: int
    dtype: str
    is_causal: bool
    n_heads: int
    n_kv_heads: int


def grid(batch_seq: tuple[tuple[int, int], ...], heads: int, grouped: tuple[int, int, int],
         settings: tuple[tuple[int, str], ...]) -> tuple[Point, ...]:
    """Every (batch, seq) with `heads` heads, plus `grouped` (batch, seq, k/v heads), per (d, dtype) setting,
    causal and not."""
    shapes = [*((b, s, heads) for b, s in batch_seq), grouped]
    return tuple(Point(b, s, d, dtype, causal, heads, kv)
                 for d, dtype in settings for causal in (True, False) for b, s, kv in shapes)


GRID = grid(((32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)), heads=16, grouped=(8, 2048, 4),
            settings=((64, "bf16"), (64, "fp16"), (128, "bf16")))
SMOKE_GRID = grid(((2, 32), (1, 64)), heads=2, grouped=(2, 32, 1), settings=((16, "fp32"),))
HOST_POINT = Point(1, 1024, 64, "bf16", True, 16, 16)
SMOKE_HOST_POINT = Point(1, 32, 16, "fp32", True, 2, 2)
FILTERS = (  # (option dest, flag, the value of a point it selects on)
    ("batch_seq", "--batch-seq", lambda p: f"{p.batch}x{p.seq_len}"),
    ("d", "--d", lambda p: p.d_head),
    ("dtype", "--dtype", lambda p: p.dtype),
    ("causal", "--causal", lambda p: p.is_causal),
    ("gqa", "--gqa", lambda p: p.n_kv_heads < p.n_heads),
)


def batch_seq(text: str) -> str:
    """argparse type of --batch-seq: "BxS", both positive integers."""
    batch, x, seq = text.partition("x")
    if not x:
        raise argparse.ArgumentTypeError(f"expected BATCHxSEQ (e.g. 8x2048), got {text!r}")
    return f"{positive_int(batch)}x{positive_int(seq)}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="the training grid, and the host-bound step (1 x 16 x 1024 x 64 bf16 causal fwd_bwd)")
    p.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS, metavar="IMPL", type=impls.registry_name,
                   help="grid implementations, names of the impls registry (e.g. flash_triton:gluon_fwd); "
                        f"{CUDNN} and {FLASH} are the references of the ratios: a list without them gives rows "
                        "without ratios")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="grid passes to time")
    p.add_argument("--batch-seq", nargs="+", type=batch_seq, default=None, metavar="BxS",
                   help="only these (batch, seq) points of the grid, e.g. 8x2048 (default: all)")
    p.add_argument("--d", nargs="+", type=positive_int, default=None, help="only these head dims (default: all)")
    p.add_argument("--dtype", nargs="+", choices=options.DTYPE_NAMES, default=None,
                   help="only these dtypes (default: all)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="only the causal points, or (--no-causal) only the others (default: both)")
    p.add_argument("--gqa", action=argparse.BooleanOptionalAction, default=None,
                   help="only the grouped-query points, or (--no-gqa) none of them (default: both)")
    add_sized(p, "--rounds", full=3, smoke=1, type=positive_int,
              help="interleaved rounds per point: each times every implementation and mode once; a row keeps the "
                   "round of its median ms")
    add_sized(p, "--iters", full=200, smoke=3, help="host-bound step: calls timed for host_us", type=positive_int)
    add_sized(p, "--warmup", full=20, smoke=1, help="host-bound step: untimed calls before host_us",
              type=nonnegative_int)
    options.add_do_bench_args(p)
    options.add_compile_backend_arg(p)


def selected(args: argparse.Namespace) -> tuple[Point, ...]:
    """The points of the (smoke) grid that every filter option given lets through."""
    def wanted(dest: str) -> list:
        value = getattr(args, dest)
        return value if isinstance(value, list) else [value]

    return tuple(p for p in (SMOKE_GRID if args.smoke else GRID)
                 if all(getattr(args, dest) is None or value(p) in wanted(dest) for dest, _, value in FILTERS))


def check(args: argparse.Namespace) -> None:
    points = SMOKE_GRID if args.smoke else GRID
    for dest, flag, value in FILTERS:
        if isinstance(getattr(args, dest), list):
            options.choices_check(flag, map(str, getattr(args, dest)), dict.fromkeys(str(value(p)) for p in points))
    if "grid" in args.sections and not selected(args):
        raise ValueError("the filters (--batch-seq, --d, --dtype, --causal, --gqa) select no point of the grid")


def largest_inputs(args: argparse.Namespace, device: torch.device) -> tuple[int, str]:
    points = [*(selected(args) if "grid" in args.sections else ()),
              *([host_point(args)] if "host" in args.sections else [])]
    return max((inputs_bytes(("q", "k", "v", "dO"), p.dtype, (p.batch, p.n_heads, p.seq_len, p.d_head))
                for p in points), key=lambda sized: sized[0])


def host_point(args: argparse.Namespace) -> Point:
    return SMOKE_HOST_POINT if args.smoke else HOST_POINT


def run(args: argparse.Namespace, rec: Recorder) -> int:
    backend = options.compile_backend(args, rec.device.type == "cuda")
    work = [("grid", point, args.impls, args.modes) for point in selected(args) if "grid" in args.sections]
    if "host" in args.sections:
        work.append(("host", host_point(args), HOST_IMPLS, ["fwd_bwd"]))
    rows = []
    for section, point, names, modes in options.progress(work, args, NAME):
        rows += measure_point(section, point, names, modes, args, rec, backend)
    print("\n".join(["", *target_lines(rows)]))
    return 0


def measure_point(section: str, point: Point, names: list[str], modes: list[str], args: argparse.Namespace,
                  rec: Recorder, backend: str) -> list[Row]:
    """Every implementation at one point, the references first, in `args.rounds` interleaved rounds (each round
    times every implementation and mode once); nothing when all its rows are done."""
    import torch

    from cs336_systems.bench.timing import attention_flops, bench, host_times, peak_memory_mib, torch_dtype

    device = rec.device
    shape = dict(section=section, dtype=point.dtype, batch=point.batch, n_heads=point.n_heads,
                 n_kv_heads=point.n_kv_heads, seq_len=point.seq_len, d_head=point.d_head, is_causal=point.is_causal,
                 warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, rounds=args.rounds)
    if section == "host":
        shape.update(iters=args.iters, warmup_iters=args.warmup)

    def fields(name: str, mode: str) -> Row:
        compiled = impls.parse(name)[1] is not None
        return {**shape, "impl": name, "mode": mode, **({"compile_backend": backend} if compiled else {})}

    if all(rec.is_done(fields(name, mode)) for name in names for mode in modes):
        return []
    # (a name given twice is measured once: twice would double its rounds in one row)
    order = list(dict.fromkeys([*(ref for ref in REFERENCES if ref in names),
                                *(name for name in names if name not in REFERENCES)]))
    setup = impls.Setup(device, point.dtype, point.seq_len, backend, grouped=point.n_kv_heads < point.n_heads)
    built: dict[str, object] = {}
    checked: dict[str, dict[str, float]] = {}

    def measure(name: str, mode: str) -> Row:
        if name not in built:  # built inside the first measurement: Unsupported becomes its row
            built[name] = impls.build(name, setup)
        attn = built[name]
        q = torch.randn(point.batch, point.n_heads, point.seq_len, point.d_head, device=device,
                        dtype=torch_dtype(point.dtype), requires_grad=True)
        k, v = (torch.randn(point.batch, point.n_kv_heads, point.seq_len, point.d_head, device=device,
                            dtype=q.dtype, requires_grad=True) for _ in range(2))
        if name not in checked:  # before anything is timed; a wrong result is an error row
            checked[name] = verify.check(attn, q, k, v, point.is_causal, point.dtype, backward=modes != ["fwd"])
        if mode == "fwd":
            call = lambda: attn(q, k, v, point.is_causal)  # noqa: E731
        else:
            dout = torch.randn_like(q)

            def call():
                q.grad = k.grad = v.grad = None
                attn(q, k, v, point.is_causal).backward(dout)

        result = bench(call, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
        if section == "host":
            result.update(host_times(call, device, iters=args.iters, warmup=args.warmup))
        return {**result, "peak_mem_mb": peak_memory_mib(device), **checked[name]}

    rounds = interleaved_rounds([(name, mode) for name in order for mode in modes], args.rounds, measure, device)

    rows: list[Row] = []

    def aggregate(name: str, mode: str) -> Row:
        result = median_of_rounds(rounds[name, mode])
        refs = {REFERENCES[r["impl"]]: r["ms"] for r in rows if r["mode"] == mode and report.ok(r)
                and r["impl"] in REFERENCES}
        return {**result, **{field: result["ms"] / refs[field] if field in refs else None
                             for field in REFERENCES.values()}}

    for name in order:
        for mode in modes:
            flops = attention_flops(mode, point.batch, point.n_heads, point.seq_len, point.d_head, point.is_causal)
            rows.append(rec.measure(fields(name, mode), lambda: aggregate(name, mode), flops=flops))
    return rows


# ---------------------------------------------------------------------------------------------
# Targets and rendering
# ---------------------------------------------------------------------------------------------


def target_ratio(r: Row | None) -> tuple[float, str] | None:
    """(ms / cuDNN's ms, "cuDNN"), or where cuDNN did not complete (ms / SDPA flash's, "SDPA flash"); None
    when neither reference completed before `r` in its run."""
    if not report.ok(r):
        return None
    if r.get("x_cudnn") is not None:
        return r["x_cudnn"], "cuDNN"
    if r.get("x_flash") is not None:
        return r["x_flash"], "SDPA flash"
    return None


def ratio_cell(r: Row | None) -> str:
    ratio = target_ratio(r)
    if ratio is None:
        return report.status_cell(r) or "–"
    return f"{ratio[0]:.2f}" + ("" if ratio[1] == "cuDNN" else " (vs SDPA flash)")


def point_label(r: Row) -> str:
    grouped = f", GQA {r['n_heads']}:{r['n_kv_heads']}" if r["n_kv_heads"] < r["n_heads"] else ""
    return f"{r['batch']} × {r['seq_len']}{grouped}"


def setting_label(r: Row) -> str:
    return f"d {r['d_head']} {r['dtype']} {'causal' if r['is_causal'] else 'not causal'}"


def candidates(rows: list[Row]) -> list[str]:
    return [name for name in report.distinct(rows, "impl") if name not in REFERENCES]


def worst(rows: list[Row], name: str, mode: str) -> tuple[float, str, Row] | None:
    """The largest ratio of `name` in `mode` over `rows`, with its reference and row."""
    ratios = [(*target_ratio(r), r) for r in rows if r["impl"] == name and r["mode"] == mode and target_ratio(r)]
    return max(ratios, key=lambda x: x[0], default=None)


def op_over_class_us(host: list[Row]) -> float | None:
    """flash_op's ms - flash_triton's ms (µs per step) in the latest run that measured both ok."""
    ops = [r for r in host if r["impl"] == "flash_op" and report.ok(r)]
    for op in reversed(ops):
        cls = report.pick(host, impl=impls.SHIPPED, run_id=op["run_id"])
        if report.ok(cls):
            return (op["ms"] - cls["ms"]) * 1e3
    return None


def target_lines(rows: list[Row]) -> list[str]:
    """The issue's targets, each with its worst ratio over `rows` (and how many points it covers)."""
    lines = []
    on_grid = [r for r in rows if r["section"] == "grid"]
    for name in candidates(on_grid):
        for mode, what in (("fwd_bwd", "forward+backward"), ("fwd", "forward")):
            found = worst(on_grid, name, mode)
            measured = [r for r in on_grid if r["impl"] == name and r["mode"] == mode]
            if found is None:
                continue
            ratio, against, r = found
            covered = sum(target_ratio(x) is not None for x in measured)
            lines.append(f"- {report.impl_label(name)}, {what} ≤ cuDNN: worst {ratio:.3f} vs {against} "
                         f"({'met' if ratio <= 1 else 'missed'}) at {point_label(r)}, {setting_label(r)}; "
                         f"{covered} of {len(measured)} points with a ratio")
    host = [r for r in rows if r["section"] == "host"]
    for name in (impls.SHIPPED, "flash_op"):
        r = report.pick(host, impl=name)
        if report.ok(r) and r.get("x_flash") is not None:
            met = "met" if r["x_flash"] <= HOST_TARGET else "missed"
            lines.append(f"- host-bound step, {report.impl_label(name)} ≤ {HOST_TARGET}× SDPA flash: "
                         f"{r['x_flash']:.3f} ({met})")
    extra = op_over_class_us(host)
    if extra is not None:
        lines.append(f"- host-bound step, functional op ≤ class + {OP_EXTRA_US:g} µs: op - class = {extra:+.1f} µs "
                     f"({'met' if extra <= OP_EXTRA_US else 'missed'})")
    if on_grid and not any(r["impl"] in REFERENCES for r in on_grid):
        lines.append(f"- no reference on the grid (--impls without {CUDNN} and {FLASH}): no ratios, no targets")
    return ["targets (ratios: ms / the reference's ms in the same run; timings off the GPU mean nothing):", *lines]


def render(rows: list[Row], out: Output) -> list[str]:
    rows = report.latest(rows)
    on_grid = [r for r in rows if r["section"] == "grid"]
    host = [r for r in rows if r["section"] == "host"]
    sections = ["## Targets (worst ratio per target)\n\n" + "\n".join(target_lines(rows)[1:])]
    refs = [ref for ref in (FLASH, CUDNN) if any(r["impl"] == ref for r in on_grid)]
    ours = candidates(on_grid)
    fields = ("d_head", "dtype", "is_causal")
    for key, group in report.group_by(on_grid, fields):
        modes = [m for m in MODES if any(r["mode"] == m for r in group)]
        body = []
        points = report.group_by(group, ("n_kv_heads", "seq_len", "batch"))
        for _, line in sorted(points, key=lambda kv: (kv[0][0] < kv[1][0]["n_heads"], kv[0][1])):  # MHA, then GQA
            cells = [point_label(line[0])]
            for mode in modes:
                cells += [report.ms_cell(report.pick(line, impl=i, mode=mode)) for i in (*ours, *refs)]
                cells += [ratio_cell(report.pick(line, impl=i, mode=mode)) for i in ours]
            body.append(cells)
        headers = ["B × S"]
        for mode in modes:
            what = {"fwd_bwd": "fwd+bwd"}.get(mode, mode)
            headers += [f"{what} {report.impl_label(i)} ms" for i in (*ours, *refs)]
            headers += [f"{what} {report.impl_label(i)} / cuDNN" for i in ours]
        worst_line = "; ".join(
            f"{report.impl_label(i)} {({'fwd_bwd': 'fwd+bwd'}.get(m, m))} {w[0]:.3f} at {point_label(w[2])}"
            + ("" if w[1] == "cuDNN" else " (vs SDPA flash)")
            for i in ours for m in modes if (w := worst(group, i, m)) is not None)
        sections.append(
            f"## Training grid, {setting_label(group[0])}, {group[0]['n_heads']} heads\n\n"
            "do_bench medians; ratios: ours ms / cuDNN ms at the same point in the same run (≤ 1: target met), "
            "vs SDPA flash where cuDNN refused the point\n\n"
            + report.markdown(headers, body) + f"\n\nworst: {worst_line or '–'}"
        )
    if host:
        body = [[report.impl_label(r["impl"]), report.ms_cell(r), report.field_cell("host_us")(r),
                 report.field_cell("x_flash")(r), report.field_cell("x_cudnn")(r)]
                for r in report.sort_rows(host, ("impl",))]
        extra = op_over_class_us(host)
        h = host[0]
        sections.append(
            f"## Host-bound step, {h['batch']} × {h['n_heads']} × {h['seq_len']} × {h['d_head']}, {setting_label(h)}, "
            "fwd+bwd\n\n"
            "ms: do_bench median (host-bound calls show their host time here); host µs: the Python call alone; "
            "ratios: ms / the reference's ms in the same run\n\n"
            + report.markdown(["implementation", "ms", "host µs", "/ SDPA flash", "/ cuDNN"], body)
            + f"\n\nfunctional op - class: {'–' if extra is None else f'{extra:+.1f} µs per step'}"
        )
    if on_grid:
        _plot(on_grid, ours, out)
    return sections


def _plot(on_grid: list[Row], ours: list[str], out: Output) -> None:
    modes = [m for m in MODES if any(r["mode"] == m for r in on_grid)]
    fig, axes = report.new_figure(len(modes))
    for ax, mode in zip(axes, modes):
        lines = [dict(r, ratio=target_ratio(r)[0]) for r in on_grid
                 if r["mode"] == mode and r["impl"] in ours and r["n_kv_heads"] == r["n_heads"] and target_ratio(r)]
        report.line_plot(ax, lines, "seq_len", lambda r: f"{report.impl_label(r['impl'])}, {setting_label(r)}",
                         lambda r: r["ratio"], label=str)
        report.log_axes(ax, "sequence length (16,384 tokens per batch)", "", log_y=False)
        if report.has_data(ax):
            report.speedup_axis(ax, "ms / cuDNN ms (below 1: faster)")
        ax.set_title({"fwd_bwd": "forward + backward", "fwd": "forward"}[mode], fontsize=10)
    out.save(fig, "grid_ratio", "ours / cuDNN on the training grid (same run; lower is better)")
