"""overhead: host (Python) time per call of each implementation's forward and backward, beside its GPU time.

At a short sequence (default batch 1, 16 heads, seq 1024, d 64, bf16, causal) launch overhead, not
the kernels, can bound the step time. Per implementation (names of the `impls` registry) and mode:
  fwd      attn(q, k, v, is_causal)
  bwd      torch.autograd.grad(o, (q, k, v), dO, retain_graph=True) on one forward's output
  fwd_bwd  torch.autograd.grad(attn(q, k, v, is_causal), (q, k, v), dO): one training step's attention
CUDA-graph implementations (`*_cudagraphs`) get fwd_bwd only: CUDA-graph trees replay a forward and
its backward as a pair, and forwards without their backward (or one backward run again) leave the
fast path and re-record, which times the recording, not the op (rows "unsupported" with the reason).
three numbers are recorded:
  host_us  median (p20/p80) over `--iters` calls of the wall time the Python call takes to return,
           the device synchronized before each call (untimed) and not after it: the CPU cost of
           issuing the call's work, without the work and without queue back-pressure
  ms       GPU time per call, triton.testing.do_bench (CUDA events, L2 flushed), median, p20, p80
  wall_ms  median wall time per call, synchronized after each: what one isolated call costs
host_us / 1000 above `ms` means the call is host-bound when issued back to back. This replaces the
one-off cProfile script runs/profile/host_overhead.py.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cs336_systems.bench import impls, options, report, verify
from cs336_systems.bench.options import add_sized, nonnegative_int, positive_int
from cs336_systems.bench.record import Unsupported, key_of
from cs336_systems.bench.report import Output, Row
from cs336_systems.bench.timing import inputs_bytes

if TYPE_CHECKING:
    import torch

    from cs336_systems.bench.record import Recorder

NAME = "overhead"
HELP = "host microseconds per call of each implementation's forward and backward, beside the GPU time"
MODES = ("fwd", "bwd", "fwd_bwd")
PAIRED_ONLY = "CUDA-graph trees replay forward and backward as a pair: see mode fwd_bwd"
FIELDS = {"mode": str, "dtype": str, "batch": int, "n_heads": int, "seq_len": int, "d_head": int,
          "is_causal": bool}
OK_FIELDS = {"ms": (int, float), "host_us": (int, float), "wall_ms": (int, float)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impls", nargs="+", default=[impls.SHIPPED, "sdpa_flash"], metavar="IMPL",
                   type=impls.registry_name,
                   help="implementations, names of the impls registry (e.g. flash_triton_cudagraphs, sdpa_cudnn)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="passes to time")
    add_sized(p, "--batch", full=1, smoke=1, help="batch size", type=positive_int)
    add_sized(p, "--n-heads", full=16, smoke=2, help="heads", type=positive_int)
    add_sized(p, "--seq", full=1024, smoke=32, help="sequence length", type=positive_int)
    add_sized(p, "--d", full=64, smoke=16, help="head dim", type=positive_int)
    add_sized(p, "--dtype", full="bf16", smoke="fp32", help="Q/K/V dtype", choices=options.DTYPE_NAMES)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal masking")
    add_sized(p, "--iters", full=200, smoke=3, help="calls timed for host_us and wall_ms", type=positive_int)
    add_sized(p, "--warmup", full=20, smoke=1, help="untimed calls first (autotuning, compiling)",
              type=nonnegative_int)
    options.add_do_bench_args(p)
    options.add_compile_backend_arg(p)


def check(args: argparse.Namespace) -> None:
    impls.check_head_dims(args.impls, [args.d])


def largest_inputs(args: argparse.Namespace, device: torch.device) -> tuple[int, str]:
    return inputs_bytes(("q", "k", "v", "dO"), args.dtype, (args.batch, args.n_heads, args.seq, args.d))


def run(args: argparse.Namespace, rec: Recorder) -> int:
    import torch

    from cs336_systems.bench.timing import attention_flops, bench, host_times, time_calls, torch_dtype

    device = rec.device
    backend = options.compile_backend(args, device.type == "cuda")
    shape = dict(dtype=args.dtype, batch=args.batch, n_heads=args.n_heads, seq_len=args.seq, d_head=args.d,
                 is_causal=args.causal, iters=args.iters, warmup_iters=args.warmup, rep_ms=args.rep_ms,
                 warmup_ms=args.warmup_ms)
    for impl in options.progress(args.impls, args, NAME):
        base = {**shape, "impl": impl}
        compile_mode = impls.parse(impl)[1]
        if compile_mode is not None:
            base["compile_backend"] = backend
        built: dict = {}

        def measure(mode: str) -> dict[str, float]:
            if mode != "fwd_bwd" and compile_mode == "reduce-overhead":
                raise Unsupported(PAIRED_ONLY)  # inside the measurement: Unsupported becomes its row
            if "attn" not in built:
                built["attn"] = impls.build(impl, impls.Setup(device, args.dtype, args.seq, backend))
            attn = built["attn"]
            q, k, v = (torch.randn(args.batch, args.n_heads, args.seq, args.d, device=device,
                                   dtype=torch_dtype(args.dtype), requires_grad=True) for _ in range(3))
            if "errors" not in built:  # before anything is timed; a wrong result is an error row
                built["errors"] = verify.check(attn, q, k, v, args.causal, args.dtype, backward=args.modes != ["fwd"])
            if mode == "fwd":

                def call():
                    return attn(q, k, v, args.causal)

            elif mode == "bwd":
                o = attn(q, k, v, args.causal)
                do = torch.randn_like(o)

                def call():
                    return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

            else:
                do = torch.randn_like(q)

                def call():
                    return torch.autograd.grad(attn(q, k, v, args.causal), (q, k, v), do)

            host = host_times(call, device, iters=args.iters, warmup=args.warmup)
            gpu = bench(call, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
            wall = time_calls(call, device, iters=args.iters, warmup=0)
            return {**host, **gpu, "wall_ms": wall["ms"], **built["errors"]}

        for mode in args.modes:
            fields = {**base, "mode": mode}
            if not rec.is_done(fields):
                flops = attention_flops(mode, args.batch, args.n_heads, args.seq, args.d, args.causal)
                rec.measure(fields, lambda: measure(mode), flops=flops)
    return 0


def render(rows: list[Row], out: Output) -> list[str]:
    sections = []
    fields = report.SHAPE_FIELDS
    for key, group, modes in report.by_shape(_last_run_per_impl(rows), MODES):
        body = []
        for impl in report.distinct(group, "impl"):
            line = [report.impl_label(impl)]
            for mode in modes:
                r = report.pick(group, impl=impl, mode=mode)
                line += [report.field_cell("host_us")(r), _us_cell(r, "ms"), _us_cell(r, "wall_ms"),
                         report.status_cell(r) or f"{r['host_us'] / (r['ms'] * 1e3):.2f}"]
            body.append(line)
        headers = ["implementation"]
        for mode in modes:
            headers += [f"{mode} host µs", f"{mode} GPU µs", f"{mode} synced wall µs", f"{mode} host / GPU"]
        sections.append(
            f"## Host overhead per call, {report.subtitle(fields, key)}\n\n"
            "host µs: the Python call alone (queue drained before, not waited for after), median; GPU µs: "
            "do_bench median; synced wall µs: one call with a synchronize after it, median. host / GPU above 1: "
            "back-to-back calls are bound by the host\n\n"
            + report.markdown(headers, body)
        )
        _plot(group, modes, out, key, fields)
    return sections


def _last_run_per_impl(rows: list[Row]) -> list[Row]:
    """Each implementation's rows (per shape) from the last run that measured it, so that a line of the
    table never mixes runs: the latest-ok rule alone would put an older run's figures for a mode beside a
    newer run's, e.g. CUDA-graph forwards from before such forwards were declined (they time re-recording)."""
    last = {(key_of(r, report.SHAPE_FIELDS), r["impl"]): r["run_id"] for r in rows}  # file order is time order
    return [r for r in rows if r["run_id"] == last[(key_of(r, report.SHAPE_FIELDS), r["impl"])]]


def _us_cell(r: Row | None, field: str) -> str:
    return report.status_cell(r) or report.fmt_num(r[field] * 1e3)


def _plot(group: list[Row], modes: list[str], out: Output, key: tuple, fields: tuple) -> None:
    import numpy as np
    from matplotlib.patches import Patch

    names = report.distinct(group, "impl")
    fig, axes = report.new_figure(len(modes))
    for ax, mode in zip(axes, modes):
        picked = [report.pick(group, impl=i, mode=mode) for i in names]
        x = np.arange(len(names))
        host = [r["host_us"] if report.ok(r) else 0.0 for r in picked]
        gpu = [r["ms"] * 1e3 if report.ok(r) else 0.0 for r in picked]
        colors = [report.impl_color(i) for i in names]
        ax.bar(x - 0.2, host, 0.4, color=colors)
        ax.bar(x + 0.2, gpu, 0.4, color=colors, hatch="//", edgecolor="white", alpha=0.6)
        ax.set_xticks(x, [report.impl_label(i) for i in names], fontsize=8, rotation=20, ha="right")
        ax.set_ylabel("µs per call (median; lower is better)")
        ax.set_title({"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}[mode], fontsize=10)
        ax.legend(handles=[Patch(color="#808080", label="host (Python call)"),
                           Patch(facecolor="#808080", hatch="//", edgecolor="white", alpha=0.6, label="GPU")],
                  fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    out.save(fig, report.slug("overhead", *key), f"host vs GPU time per call, {report.subtitle(fields, key)}")
