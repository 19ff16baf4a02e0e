"""flash_benchmarking: FlashAttention-2 (Triton) vs materialized PyTorch attention, plus SDPA references.

Causal by default, Q/K/V of shape (batch, seq, d) (SDPA sees (1, batch, seq, d)). Timed with
triton.testing.do_bench (median and 20th/80th percentiles) per mode:
  fwd      o = attn(q, k, v)
  bwd      o.backward(dO, retain_graph=True) on one precomputed output and a random dO
  fwd_bwd  attn(q, k, v).backward(dO)
Besides `peak_mem_mb` (the whole measurement's peak: do_bench's 256 MiB L2-flush buffer and the
gradients its warm-up accumulates included), each CUDA row records `call_peak_mem_mb`: the peak of one
more call after the timing, gradients freed first, so only the inputs (q, k, v, dO; in bwd mode also
the forward's saved tensors) and what the call allocates are live, and `floor_mem_mb`: the bytes the
mode must hold at least (fwd_bwd and bwd: q, k, v, o, dO, dq, dk, dv and the fp32 row logsumexp;
fwd: q, k, v, o).
Implementations: any name of the `impls` registry (`--impls`); by default naive, ours (flash_triton)
and the SDPA flash, cuDNN and memory-efficient backends as references. A backend that rejects a dtype
gets an "unsupported" row.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cs336_systems.bench import impls, options, report, verify
from cs336_systems.bench.options import add_sized, positive_int
from cs336_systems.bench.report import Output, Row
from cs336_systems.bench.timing import ITEMSIZE, inputs_bytes

if TYPE_CHECKING:
    import torch

    from cs336_systems.bench.record import Recorder

NAME = "flash"
HELP = "FlashAttention-2 Triton vs naive vs SDPA: fwd / bwd / fwd_bwd latency (flash_benchmarking)"
MODES = ("fwd", "bwd", "fwd_bwd")
DEFAULT_IMPLS = ["naive", "flash_triton", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"]
REFERENCES = ("naive", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")  # what ours is compared with
OURS = impls.SHIPPED
FIELDS = {"mode": str, "dtype": str, "batch": int, "seq_len": int, "d_head": int, "is_causal": bool}
OK_FIELDS = {"ms": (int, float)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sized(p, "--seq", full=[2**i for i in range(7, 17)], smoke=[64], help="sequence lengths",
              type=positive_int, nargs="+")
    add_sized(p, "--d", full=[16, 32, 64, 128], smoke=[16], help="head dims", type=positive_int, nargs="+")
    add_sized(p, "--dtype", full=["bf16", "fp32"], smoke=["fp32"], help="dtypes", choices=options.DTYPE_NAMES,
              nargs="+")
    p.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS, metavar="IMPL", type=impls.registry_name,
                   help="implementations, names of the impls registry (e.g. flash_pytorch, naive_compiled, "
                        "sdpa_math, flash_triton:causal_skip)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="passes to time")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal masking")
    options.add_do_bench_args(p)
    options.add_compile_backend_arg(p)


def check(args: argparse.Namespace) -> None:
    impls.check_head_dims(args.impls, args.d)


def measure_mode(attn, mode: str, q, k, v, is_causal: bool, device, args: argparse.Namespace) -> dict[str, float]:
    import torch

    from cs336_systems.bench.timing import bench, one_call_peak_mib, peak_memory_mib

    timing = dict(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, grad_to_none=[q, k, v])
    if mode == "fwd":
        call = lambda: attn(q, k, v, is_causal)  # noqa: E731
    else:
        dout = torch.randn_like(q)
        if mode == "bwd":
            out = attn(q, k, v, is_causal)
            call = lambda: out.backward(dout, retain_graph=True)  # noqa: E731
        else:
            call = lambda: attn(q, k, v, is_causal).backward(dout)  # noqa: E731
    result = bench(call, device, **timing)
    whole = peak_memory_mib(device)  # read now: one_call_peak_mib resets the counter
    tensors = 4 if mode == "fwd" else 8  # q, k, v, o (+ dO, dq, dk, dv)
    lse = 0 if mode == "fwd" else q.numel() // q.shape[-1] * 4
    return {**result, "peak_mem_mb": whole,
            "call_peak_mem_mb": one_call_peak_mib(call, device, grads_of=[q, k, v]),
            "floor_mem_mb": (tensors * q.numel() * q.element_size() + lse) / 2**20}


def largest_inputs(args: argparse.Namespace, device: torch.device) -> tuple[int, str]:
    dtype = max(args.dtype, key=ITEMSIZE.__getitem__)
    return inputs_bytes(("q", "k", "v", "dO"), dtype, (args.batch, max(args.seq), max(args.d)))


def run(args: argparse.Namespace, rec: Recorder) -> int:
    import torch

    from cs336_systems.bench.timing import attention_flops, torch_dtype

    device = rec.device
    backend = options.compile_backend(args, device.type == "cuda")
    combos = [(dt, d, s, impl) for dt in args.dtype for d in args.d for s in args.seq for impl in args.impls]
    for dtype_name, d, seq, impl in options.progress(combos, args, NAME):
        base = dict(impl=impl, dtype=dtype_name, batch=args.batch, n_heads=1, seq_len=seq, d_head=d,
                    is_causal=args.causal, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
        if impls.parse(impl)[1] is not None:
            base["compile_backend"] = backend
        todo = [m for m in args.modes if not rec.is_done({**base, "mode": m})]
        if not todo:
            continue
        built: dict = {}

        def measure(mode: str) -> dict[str, float]:
            if "attn" not in built:  # built inside the first measurement: Unsupported becomes its row
                built["attn"] = impls.build(impl, impls.Setup(device, dtype_name, seq, backend))
            q, k, v = (torch.randn(args.batch, seq, d, device=device, dtype=torch_dtype(dtype_name),
                                   requires_grad=True) for _ in range(3))
            if "errors" not in built:  # checked before anything is timed; a wrong result is an error row
                built["errors"] = verify.check(built["attn"], q, k, v, args.causal, dtype_name,
                                               backward=todo != ["fwd"])
            return {**measure_mode(built["attn"], mode, q, k, v, args.causal, device, args), **built["errors"]}

        for mode in todo:
            flops = attention_flops(mode, args.batch, 1, seq, d, args.causal)
            rec.measure({**base, "mode": mode}, lambda: measure(mode), flops=flops)
    return 0


def render(rows: list[Row], out: Output) -> list[str]:
    rows = report.latest(rows)
    sections = []
    names = report.distinct(rows, "impl")
    fields = ("dtype", "mode", "batch", "is_causal")
    for key, group in report.group_by(rows, fields):
        columns = [(report.impl_label(i), report.where(impl=i)) for i in names]
        # references with at least one completed row here (SDPA flash / cuDNN have none in fp32)
        refs = [ref for ref in REFERENCES
                if OURS in names and any(r["impl"] == ref and report.ok(r) for r in group)]
        extra = [
            (f"ours vs {report.impl_label(ref)}",
             lambda p, ref=ref: report.ratio_cell(p["ours"], p[report.impl_label(ref)]))
            for ref in refs
        ]
        if OURS in names:
            extra.append(("ours TFLOP/s", lambda p: report.field_cell("tflops")(p["ours"])))
        sections.append(
            f"## Latency (ms, do_bench median), {report.subtitle(fields, key)}\n\n"
            "speedups are theirs / ours (above 1× = ours faster)\n\n"
            + report.pivot(group, ("d_head", "seq_len"), columns, report.ms_cell, extra)
        )
        dims = report.distinct(group, "d_head")
        title = ", ".join(f"{v}" for v in (key[0], {"fwd_bwd": "fwd+bwd"}.get(key[1], key[1]),
                                            f"batch {key[2]}", "causal" if key[3] else "not causal"))
        fig, axes = report.new_figure(len(dims))
        for ax, d in zip(axes, dims):
            report.line_plot(ax, [r for r in group if r["d_head"] == d], "seq_len", lambda r: r["impl"],
                             lambda r: r["ms"], color=lambda r: report.impl_color(r["impl"]))
            report.log_axes(ax, "sequence length", "ms (lower is better)")
            ax.set_title(f"d = {d}", fontsize=10)
        out.save(fig, report.slug("flash_latency", *key[:2]), f"attention latency, {title}")

        if refs:
            fig, axes = report.new_figure(len(refs))
            for ax, ref in zip(axes, refs):
                report.line_plot(ax, _speedups(group, ref, dims), "seq_len", lambda r: f"d = {r['d_head']}",
                                 lambda r: r["x"], label=str)
                report.log_axes(ax, "sequence length", "", log_y=False)
                report.speedup_axis(ax, f"{report.impl_label(ref)} ms / ours ms")
                ax.set_title(f"ours vs {report.impl_label(ref)}", fontsize=10)
            out.save(fig, report.slug("flash_speedup", *key[:2]), f"speedup of ours (higher is better), {title}")
    return sections


def _speedups(group: list[Row], ref: str, dims: list[int]) -> list[Row]:
    points = []
    for d in dims:
        for seq in report.distinct(group, "seq_len"):
            ours = report.pick(group, impl=OURS, d_head=d, seq_len=seq)
            theirs = report.pick(group, impl=ref, d_head=d, seq_len=seq)
            if report.ok(ours) and report.ok(theirs) and report.same_run(ours, theirs):
                points.append({"status": "ok", "d_head": d, "seq_len": seq, "x": theirs["ms"] / ours["ms"]})
    return points
