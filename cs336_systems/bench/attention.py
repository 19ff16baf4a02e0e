"""pytorch_attention / torch_compile(a): naive (materialized) attention, eager and torch.compile'd.

No head dimension: Q, K, V of shape (batch, seq, d). For each (d, seq): time `--iters` forward
passes, then measure memory in use before the backward (one forward's saved activations) and time
`--iters` backward passes (retain_graph on one forward), synchronizing after every call. The
implementations come from `impls` (naive, naive_compiled).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cs336_systems.bench import impls, options, report, verify
from cs336_systems.bench.options import add_sized, nonnegative_int, positive_int
from cs336_systems.bench.report import Output, Row
from cs336_systems.bench.timing import inputs_bytes

if TYPE_CHECKING:
    import torch

    from cs336_systems.bench.record import Recorder

NAME = "attention"
HELP = "naive attention fwd/bwd latency and memory over d x seq (pytorch_attention, torch_compile a)"
MODES = ("fwd", "bwd")
D_COLORS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d")  # by head dim
FIELDS = {"mode": str, "dtype": str, "batch": int, "seq_len": int, "d_head": int, "is_causal": bool}
OK_FIELDS = {"ms": (int, float)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sized(p, "--d", full=[16, 32, 64, 128], smoke=[16], help="head dims", type=positive_int, nargs="+")
    add_sized(p, "--seq", full=[256, 1024, 4096, 8192, 16384], smoke=[32, 64], help="sequence lengths",
              type=positive_int, nargs="+")
    add_sized(p, "--batch", full=8, smoke=2, help="batch size", type=positive_int)
    add_sized(p, "--iters", full=100, smoke=2, help="timed forward and backward passes each", type=positive_int)
    add_sized(p, "--warmup", full=10, smoke=1, help="untimed warm-up passes", type=nonnegative_int)
    p.add_argument("--dtype", choices=options.DTYPE_NAMES, default="fp32", help="Q/K/V dtype")
    p.add_argument("--causal", action="store_true", help="apply a causal mask (default: no mask)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd naive attention (naive_compiled)")
    p.add_argument("--no-eager", action="store_true", help="skip the eager naive impl (e.g. with --compile)")
    options.add_compile_backend_arg(p)


def check(args: argparse.Namespace) -> None:
    if args.no_eager and not args.compile:
        raise ValueError("--no-eager without --compile leaves nothing to run")


def largest_inputs(args: argparse.Namespace, device: torch.device) -> tuple[int, str]:
    return inputs_bytes(("q", "k", "v", "dO"), args.dtype, (args.batch, max(args.seq), max(args.d)))


def run(args: argparse.Namespace, rec: Recorder) -> int:
    import torch

    from cs336_systems.bench.timing import allocated_memory_mib, attention_flops, reset_peak_memory, synchronize
    from cs336_systems.bench.timing import time_calls, torch_dtype

    device = rec.device
    dtype = torch_dtype(args.dtype)
    backend = options.compile_backend(args, device.type == "cuda")
    names = ([] if args.no_eager else ["naive"]) + (["naive_compiled"] if args.compile else [])

    shapes = [(impl, d, s) for impl in names for d in args.d for s in args.seq]
    for impl, d, seq in options.progress(shapes, args, NAME):
        base = dict(impl=impl, dtype=args.dtype, batch=args.batch, n_heads=1, seq_len=seq, d_head=d,
                    is_causal=args.causal, iters=args.iters, warmup_iters=args.warmup)
        if impl == "naive_compiled":
            base["compile_backend"] = backend
        todo = [m for m in MODES if not rec.is_done({**base, "mode": m})]
        if not todo:
            continue
        # built once per shape (a fresh static-shape compile for naive_compiled); fwd and bwd share it
        attn = impls.build(impl, impls.Setup(device, args.dtype, seq, backend))

        checked: dict[str, float] = {}

        def inputs():
            q, k, v = (torch.randn(args.batch, seq, d, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            if not checked:  # before anything is timed; a wrong result is an error row
                checked.update(verify.check(attn, q, k, v, args.causal, args.dtype, backward="bwd" in todo))
            return q, k, v

        def measure_fwd():
            q, k, v = inputs()
            stats = time_calls(lambda: attn(q, k, v, args.causal), device, iters=args.iters, warmup=args.warmup)
            saved = attn(q, k, v, args.causal)  # one forward whose activations stay alive, as before a backward
            synchronize(device)
            mem_before_bwd = allocated_memory_mib(device)
            del saved
            return {**stats, "mem_before_bwd_mb": mem_before_bwd, **checked}

        def measure_bwd():
            q, k, v = inputs()
            out = attn(q, k, v, args.causal)
            dout = torch.randn_like(out)
            synchronize(device)
            mem_before_bwd = allocated_memory_mib(device)
            reset_peak_memory(device)

            def drop_grads():
                q.grad = k.grad = v.grad = None

            stats = time_calls(lambda: out.backward(dout, retain_graph=True), device, iters=args.iters,
                               warmup=args.warmup, before=drop_grads)
            return {**stats, "mem_before_bwd_mb": mem_before_bwd, **checked}

        for mode, fn in (("fwd", measure_fwd), ("bwd", measure_bwd)):
            if mode in todo:
                flops = attention_flops(mode, args.batch, 1, seq, d, args.causal)
                rec.measure({**base, "mode": mode}, fn, flops=flops)
    return 0


def render(rows: list[Row], out: Output) -> list[str]:
    rows = report.latest(rows)
    sections = []
    group_fields = ("dtype", "batch", "is_causal")
    names = report.distinct(rows, "impl")
    for key, group in report.group_by(rows, group_fields):
        columns = [(f"{report.impl_label(i)} {m}", report.where(impl=i, mode=m)) for i in names for m in MODES]
        extra = [(f"MiB before bwd ({report.impl_label(i)})", _mem_before_bwd(i)) for i in names]
        if {"naive", "naive_compiled"} <= set(names):
            extra += [
                (f"compiled speedup {m}",
                 lambda p, m=m: report.ratio_cell(p[f"naive (compiled) {m}"], p[f"naive {m}"]))
                for m in MODES
            ]
        sections.append(
            f"## Attention latency (ms, median over iterations), {report.subtitle(group_fields, key)}\n\n"
            + report.pivot(group, ("d_head", "seq_len"), columns, report.ms_cell, extra)
        )
        dims = report.distinct(group, "d_head")
        fig, axes = report.new_figure(3, cols=3, height=3.8)
        for ax, (mode, field, ylabel) in zip(axes, (("fwd", "ms", "ms"), ("bwd", "ms", "ms"),
                                                    ("bwd", "mem_before_bwd_mb", "MiB"))):
            report.line_plot(ax, [r for r in group if r["mode"] == mode], "seq_len",
                             lambda r: f"{report.impl_label(r['impl'])} d={r['d_head']}",
                             lambda r, f=field: r.get(f), label=str, legend=ax is axes[0],
                             color=lambda r: D_COLORS[dims.index(r["d_head"]) % len(D_COLORS)],
                             linestyle=lambda r: "--" if "compiled" in r["impl"] else "-")
            report.log_axes(ax, "sequence length", ylabel)
            ax.set_title("memory allocated before backward" if field != "ms" else f"{mode} time (lower is better)",
                         fontsize=10)
        out.save(fig, report.slug("attention", *key), f"naive attention, {report.subtitle(group_fields, key)}")
    return sections


def _mem_before_bwd(impl: str):
    def cell(picked: dict[str, Row | None]) -> str:
        r = picked.get(f"{report.impl_label(impl)} bwd") or picked.get(f"{report.impl_label(impl)} fwd")
        return report.field_cell("mem_before_bwd_mb")(r)

    return cell
