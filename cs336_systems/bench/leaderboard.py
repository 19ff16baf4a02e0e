"""leaderboard: the course's FlashAttention-2 timing harness, over our variants and PyTorch SDPA.

Exactly the course's test, per implementation:
    q, k, v = torch.randn(3, 16, 16384, 64, device='cuda', dtype=torch.bfloat16, requires_grad=True)
    flash = torch.compile(Impl.apply)
    def f(): o = flash(q, k, v, True); o.sum().backward()
    triton.testing.do_bench(f, rep=10000, warmup=1000)
The harness prints do_bench's mean, recorded as `ms_mean`; `ms` is the median of the same samples.
Mode fwd_bwd is the harness; mode fwd times `flash(q, k, v, True)` alone. The same harness (not
compiled) runs SDPA's flash and cuDNN backends on the (1, H, S, D) view of the same tensors, and the
speedups of ours over them (same run; on a GPU only, CPU timings being meaningless) are printed at the
end. `--seq 1024 --n-heads 16` gives the short-sequence run.
Variants: the keys of `cs336_systems.flash_ablation.ABLATION_VARIANTS` (rows: impl=flash_triton,
`variant_index` their order, `shipped` on the last one), "naive" (materialized reference, compiled)
and "flash_pytorch" (tiled PyTorch forward, run uncompiled: dynamo would unroll its Python tile loops),
or "all"; "flash_triton" and its alias "flash" name the shipped variant. CPU smoke runs call our
variants uncompiled (dynamo cannot trace Triton-interpreter kernels); every row records `compiled`,
the do_bench rep/warmup, the device and the fp32 matmul precision.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cs336_systems.bench import impls, options, report, verify
from cs336_systems.bench.options import add_sized, positive_float, positive_int
from cs336_systems.bench.record import key_of
from cs336_systems.bench.report import Output, Row
from cs336_systems.bench.timing import inputs_bytes

if TYPE_CHECKING:
    import torch

    from cs336_systems.bench.record import Recorder

NAME = "leaderboard"
HELP = "the course's leaderboard harness (B=1, H=16, S=16384, D=64, bf16, causal) over variants and SDPA"
MODES = ("fwd_bwd", "fwd")
EXTRA_VARIANTS = ("naive", "flash_pytorch")
SDPA_REFERENCES = ("sdpa_flash", "sdpa_cudnn")
# The ablation order of rows written before rows carried `variant_index` (the last was shipped).
LEGACY_ABLATION = ("fwd_triton_bwd_compiled", "bwd_triton", "causal_skip", "autotune")
FIELDS = {"mode": str, "dtype": str, "variant": str, "n_heads": int, "seq_len": int, "d_head": int,
          "is_causal": bool, "rep_ms": (int, float), "warmup_ms": (int, float)}
OK_FIELDS = {"ms": (int, float), "ms_mean": (int, float)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--variant",
        action="append",
        default=None,
        type=variant,
        help="ABLATION_VARIANTS key, naive, flash_pytorch, or all; flash or flash_triton: the shipped variant "
             "(repeatable; default: the shipped variant)",
    )
    p.add_argument("--no-sdpa", action="store_true", help="skip the SDPA flash / cuDNN reference rows")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="harness (fwd_bwd) and forward only")
    add_sized(p, "--rep-ms", full=10000, smoke=100, help="do_bench rep, ms (the course's)", type=positive_float)
    add_sized(p, "--warmup-ms", full=1000, smoke=25, help="do_bench warmup, ms (the course's)", type=positive_float)
    add_sized(p, "--n-heads", full=16, smoke=2, help="heads", type=positive_int)
    add_sized(p, "--seq", full=16384, smoke=64, help="sequence length", type=positive_int)
    add_sized(p, "--d", full=64, smoke=16, help="head dim", type=positive_int)
    p.add_argument("--dtype", choices=options.DTYPE_NAMES, default=None,
                   help="Q/K/V dtype (default: bf16; fp32 on the CPU, which has no bf16 dots in the interpreter)")
    options.add_compile_backend_arg(p)


def variant(text: str) -> str:
    """argparse type of --variant; our kernel's registry names (flash_triton, its alias flash) are the
    shipped variant, as they are our shipped kernel in every subcommand."""
    variants = impls.ablation_variants()
    if impls.ALIASES.get(text, text) == impls.SHIPPED:
        return variants[-1]
    choices = [*variants, *EXTRA_VARIANTS, "all"]
    if text not in choices:
        raise argparse.ArgumentTypeError(f"{options.unknown_choice('variant', text, choices)} "
                                         f"(choose from {', '.join(choices)})")
    return text


def check(args: argparse.Namespace) -> None:
    options.check_kernel_head_dims("--d", [args.d])


def dtype_name(args: argparse.Namespace, device: torch.device) -> str:
    return args.dtype or ("bf16" if device.type == "cuda" else "fp32")


def largest_inputs(args: argparse.Namespace, device: torch.device) -> tuple[int, str]:
    return inputs_bytes(("q", "k", "v"), dtype_name(args, device), (args.n_heads, args.seq, args.d))


def entries(requested: list[str] | None, on_cuda: bool, with_sdpa: bool) -> list[Row]:
    """Row fields (impl, variant, compiled, ...) and registry name of each implementation to time, in order."""
    variants = impls.ablation_variants()
    wanted = [variants[-1]] if not requested else [*variants, *EXTRA_VARIANTS] if "all" in requested else requested
    out = []
    for v in dict.fromkeys(wanted):
        if v in variants:  # the course's torch.compile(Impl.apply); not under the interpreter
            out.append(dict(impl=impls.SHIPPED, variant=v, compiled=on_cuda, variant_index=variants.index(v),
                            shipped=v == variants[-1],
                            registry=f"{impls.ABLATION_PREFIX}{v}" + ("_compiled" if on_cuda else "")))
        else:
            compiled = v == "naive"
            out.append(dict(impl=v, variant=v, compiled=compiled, registry=v + ("_compiled" if compiled else "")))
    if with_sdpa:
        out += [dict(impl=ref, variant=ref, compiled=False, registry=ref) for ref in SDPA_REFERENCES]
    return out


def run(args: argparse.Namespace, rec: Recorder) -> int:
    import torch

    from cs336_systems.bench.timing import attention_flops, harness_bench, torch_dtype

    device = rec.device
    on_cuda = device.type == "cuda"
    dtype = dtype_name(args, device)
    backend = options.compile_backend(args, on_cuda)
    shape = dict(dtype=dtype, batch=1, n_heads=args.n_heads, seq_len=args.seq, d_head=args.d, is_causal=True,
                 rep_ms=args.rep_ms, warmup_ms=args.warmup_ms)
    rows = []
    for entry in options.progress(entries(args.variant, on_cuda, not args.no_sdpa), args, NAME):
        registry = entry.pop("registry")
        if entry["compiled"]:
            entry["compile_backend"] = backend
        todo = [m for m in args.modes if not rec.is_done({**shape, **entry, "mode": m})]
        built: dict = {}

        def measure(mode: str) -> dict[str, float]:
            if "fn" not in built:  # one build (and compile) for both modes; Unsupported becomes a row
                built["fn"] = impls.build(registry, impls.Setup(device, dtype, args.seq, backend))
            fn = built["fn"]
            q, k, v = torch.randn(3, args.n_heads, args.seq, args.d, device=device, dtype=torch_dtype(dtype),
                                  requires_grad=True)
            if "errors" not in built:  # checked before anything is timed; a wrong result is an error row
                built["errors"] = verify.check(fn, q, k, v, True, dtype, backward="fwd_bwd" in todo)
            if mode == "fwd_bwd":

                def f():
                    o = fn(q, k, v, True)
                    loss = o.sum()
                    loss.backward()

            else:

                def f():
                    fn(q, k, v, True)

            return {**harness_bench(f, device, args.warmup_ms, args.rep_ms), **built["errors"]}

        for mode in todo:
            flops = attention_flops(mode, 1, args.n_heads, args.seq, args.d, True)
            rows.append(rec.measure({**shape, **entry, "mode": mode}, lambda: measure(mode), flops=flops))
    print_speedups(rows)
    return 0


def print_speedups(rows: list[Row]) -> None:
    """This run's ok rows: median, harness mean, and the SDPA references' mean / ours (or what is missing)."""
    done = [r for r in rows if r.get("status") == "ok"]
    if not done:
        return
    print(f"\n{'variant':<28} {'mode':<8} {'median ms':>10} {'mean ms':>10}  speedup (reference mean / mean)")
    refs = {(r["variant"], r["mode"]): r for r in rows if r["impl"] in SDPA_REFERENCES}
    for r in done:
        print(f"{r['variant']:<28} {r['mode']:<8} {r['ms']:>10.3f} {r['ms_mean']:>10.3f}  {speedups(r, refs)}".rstrip())


def speedups(r: Row, refs: dict[tuple[str, str], Row]) -> str:
    """Each reference's ratio where both it and `r` were measured in this run on a GPU, else what is missing."""
    if r["impl"] in SDPA_REFERENCES:
        return ""
    if r.get("timings_meaningless"):
        return "none: timings off the GPU are meaningless"
    cells = []
    for ref in SDPA_REFERENCES:
        other = refs.get((ref, r["mode"]))
        if other is None:
            cells.append(f"vs {ref}: not measured in this run")
        elif other["status"] != "ok":
            cells.append(f"vs {ref}: {report.status_cell(other)}")
        else:
            cells.append(f"vs {ref}={other['ms_mean'] / r['ms_mean']:.3g}x")
    return ", ".join(cells)


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def order(r: Row) -> tuple:
    """Ablation variants in order, then naive / flash_pytorch, then the SDPA references; then settings."""
    if r["impl"] in SDPA_REFERENCES:
        rank = (2, SDPA_REFERENCES.index(r["impl"]))
    elif r.get("variant_index") is not None:
        rank = (0, r["variant_index"])
    elif r["variant"] in LEGACY_ABLATION:
        rank = (0, LEGACY_ABLATION.index(r["variant"]))
    else:
        rank = (1, r["variant"])
    return (*rank, -r["rep_ms"], str(r.get("time")))


def shipped(r: Row) -> bool:
    return r.get("shipped", r["variant"] == LEGACY_ABLATION[-1])


def name(r: Row) -> str:
    return "ours (shipped)" if shipped(r) else report.impl_label(r["variant"])


def label(r: Row) -> str:
    return f"{name(r)} [rep {r['rep_ms']:g}, {r.get('commit')}]"


def color(r: Row) -> str:
    if r["impl"] == impls.SHIPPED and not shipped(r):
        return "#9ecae1"  # earlier ablation steps: a light shade of ours
    return report.impl_color(r["impl"])


def render(rows: list[Row], out: Output) -> list[str]:
    sections = []
    fields = report.SHAPE_FIELDS
    for key, group, modes in report.by_shape(rows, MODES):
        lines = sorted({key_of(r, ("variant", "rep_ms", "warmup_ms", "run_id")): r for r in group}.values(),
                       key=order)
        body = []
        for first in lines:
            same = dict(variant=first["variant"], rep_ms=first["rep_ms"], warmup_ms=first["warmup_ms"],
                        run_id=first["run_id"])
            line = [name(first), first.get("compiled"), f"{first['rep_ms']:g}/{first['warmup_ms']:g}",
                    first.get("commit")]
            for mode in modes:
                r = report.pick(group, mode=mode, **same)
                line += [report.status_cell(r) or f"{report.fmt_num(r['ms'])} / {report.fmt_num(r['ms_mean'])}",
                         report.field_cell("tflops")(r)]
                # (from every row: a later run's reference row replaces this run's in `group`)
                refs = [report.pick(rows, mode=mode, variant=ref, run_id=first["run_id"], **dict(zip(fields, key)))
                        for ref in SDPA_REFERENCES]
                line.append(" / ".join(report.ratio_cell(r, ref, "ms_mean") for ref in refs)
                            if first["impl"] not in SDPA_REFERENCES else "")
            body.append(line)
        headers = ["implementation", "compiled", "do_bench rep/warmup ms", "commit"]
        for mode in modes:
            headers += [f"{mode} ms (median / harness mean)", f"{mode} TFLOP/s",
                        f"{mode} speedup vs " + " / ".join(report.impl_label(ref) for ref in SDPA_REFERENCES)]
        sections.append(
            f"## Leaderboard harness, {report.subtitle(fields, key)}\n\n"
            "one line per implementation and do_bench setting (its latest run); speedups are the SDPA "
            "reference's harness mean / this line's, both from the same run (above 1× = faster than SDPA)\n\n"
            + report.markdown(headers, body)
        )
        _plot(group, modes, out, key, fields)
    return sections


def _plot(group: list[Row], modes: list[str], out: Output, key: tuple, fields: tuple) -> None:
    from matplotlib.patches import Patch

    fig, axes = report.new_figure(len(modes), cols=1, height=0.45 * len(group) / max(len(modes), 1) + 1.6,
                                  width=report.FIGURE_WIDTH)
    for ax, mode in zip(axes, modes):
        bars = sorted((r for r in group if r["mode"] == mode and report.ok(r)), key=order)
        ax.set_title({"fwd_bwd": "forward + backward (the harness)", "fwd": "forward only"}[mode], fontsize=10)
        if not bars:  # (every row of the mode OOM or failed: no log axis over nothing)
            ax.text(0.5, 0.5, "no completed measurements", ha="center", va="center", transform=ax.transAxes)
            continue
        ys = list(range(len(bars)))
        ms = [r["ms"] for r in bars]
        err = [[r["ms"] - r.get("ms_p20", r["ms"]) for r in bars], [r.get("ms_p80", r["ms"]) - r["ms"] for r in bars]]
        ax.barh(ys, ms, xerr=err, color=[color(r) for r in bars], capsize=2,
                hatch=["//" if r["impl"] in SDPA_REFERENCES else "" for r in bars], edgecolor="white")
        for y, r in zip(ys, bars):
            ax.text(r["ms"] * 1.04, y, f"{r['ms']:.2f}", va="center", fontsize=8)
        first_ref = next((i for i, r in enumerate(bars) if r["impl"] in SDPA_REFERENCES), None)
        if first_ref:
            ax.axhline(first_ref - 0.5, color="black", lw=0.6, ls="--")
        ax.set_yticks(ys, [label(r) for r in bars], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        report.plain_ticks(ax.xaxis)
        if ms:
            ax.set_xlim(min(ms) / 1.5, max(ms) * 2.5)
        ax.set_xlabel("ms (median, p20–p80; log scale; lower is better)")
        legend = [Patch(color=report.impl_color(impls.SHIPPED), label="ours (shipped)"),
                  Patch(color="#9ecae1", label="earlier ablation steps")]
        legend += [Patch(facecolor=report.impl_color(x), hatch="//", edgecolor="white", label=report.impl_label(x))
                   for x in SDPA_REFERENCES]
        legend += [Patch(color=report.impl_color(x), label=report.impl_label(x)) for x in EXTRA_VARIANTS
                   if any(r["impl"] == x for r in bars)]
        ax.legend(handles=legend, fontsize=8, loc="lower right")
        ax.grid(True, axis="x", alpha=0.3)
    dtype, batch, heads, seq, d, causal = key
    title = f"leaderboard harness: {dtype}, {batch} × {heads} × {seq} × {d}{', causal' if causal else ''}"
    out.save(fig, report.slug("leaderboard", *key), title)
