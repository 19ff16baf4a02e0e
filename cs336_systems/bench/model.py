"""benchmarking_script / torch_compile(b): end-to-end BasicsTransformerLM timing and memory.

Random weights and data (vocab 10,000, batch 4; `--tokens N` instead: batch N // context per context length,
so that every context runs the same tokens per step). For every model size x context length x {eager, compiled},
one model whose attention is each impl in turn, in `--rounds` interleaved rounds (a row keeps its median round):
`--warmup` untimed steps, then `--steps` timed steps (device synchronized after each) of each mode:
  fwd      forward + loss
  bwd      backward of the loss only (the forward runs untimed before each step)
  fwd_bwd  forward + loss + backward
  step     forward + loss + backward + AdamW step (zero_grad included)
Rows record mean +- std ms, tokens/s and peak memory (max_memory_allocated over the timed steps, MiB: reset
after the warm-up and the end of our kernels' background compiles). With
`--attention NAME` the model's module-global `scaled_dot_product_attention` is swapped for the `impls`
registry's NAME (e.g. flash_triton, our kernel; "flash" is kept as its old alias; sdpa, PyTorch's
F.scaled_dot_product_attention with its own choice of backend).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

from cs336_systems.bench import impls, options, report
from cs336_systems.bench.options import add_sized, nonnegative_int, positive_int
from cs336_systems.bench.report import Output, Row

if TYPE_CHECKING:
    from cs336_systems.bench.record import Recorder

NAME = "model"
HELP = "end-to-end Transformer LM fwd / bwd / fwd_bwd / train-step timing and memory, eager vs compiled"
MODES = ("fwd", "bwd", "fwd_bwd", "step")
SIZES = ("small", "medium", "large", "xl", "2.7B")
COMPILE_CHOICES = {"both": (False, True), "eager": (False,), "compiled": (True,)}
SMOKE_SIZE = "smoke"
FIELDS = {"mode": str, "dtype": str, "batch": int, "model_size": str, "context_length": int, "compiled": bool}
OK_FIELDS = {"ms": (int, float)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sized(p, "--sizes", full=list(SIZES), smoke=[SMOKE_SIZE], help="model sizes", nargs="+",
              choices=[*SIZES, SMOKE_SIZE])
    add_sized(p, "--context", full=[512], smoke=[32], help="context lengths", type=positive_int, nargs="+")
    batch = p.add_mutually_exclusive_group()
    add_sized(batch, "--batch", full=4, smoke=2, help="batch size", type=positive_int)
    batch.add_argument("--tokens", type=positive_int, default=None,
                       help="tokens per step instead of --batch: batch TOKENS // context per context length")
    add_sized(p, "--warmup", full=5, smoke=1, help="untimed warm-up steps per mode", type=nonnegative_int)
    add_sized(p, "--steps", full=10, smoke=2, help="timed steps per mode", type=positive_int)
    p.add_argument("--vocab", type=positive_int, default=10_000, help="vocabulary size")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="interleaved rounds: each times every implementation and mode once on one shared model; a "
                        "row keeps its median round (by median step time) and lists every round's in ms_rounds")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="what one timed step does")
    p.add_argument("--compile", choices=list(COMPILE_CHOICES), default="both", help="eager, compiled, or both")
    p.add_argument("--attention", nargs="+", default=["naive"], metavar="IMPL", type=impls.registry_name,
                   help="attention implementation(s), names of the impls registry ('flash' = flash_triton)")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="fp32 weights; bf16 = torch.autocast(bfloat16) around forward and loss",
    )
    options.add_compile_backend_arg(p)


def model_attention(attn):
    """`attn` (an impls registry callable) as the model's `scaled_dot_product_attention(Q, K, V, mask)`."""

    def swapped(Q, K, V, mask=None):
        # the model's causal mask comes with (batch, heads, seq, d) inputs; packed documents' block-diagonal mask
        # (with (heads, tokens, d) inputs) is not causal attention, and attn cannot take it
        if mask is not None and Q.dim() != 4:
            raise ValueError("a benchmark's swapped attention takes the model's causal mask only, not the "
                             "block-diagonal mask of packed documents")
        return attn(Q, K, V, mask is not None)

    return swapped


@contextmanager
def attention_function(function) -> Iterator[None]:
    """Swap `cs336_basics.model.scaled_dot_product_attention` (looked up at call time) for `function`: one object per
    implementation, installed again each round, so that a compiled model's guards on it match and it compiles once."""
    import cs336_basics.model as basics_model

    original = basics_model.scaled_dot_product_attention
    basics_model.scaled_dot_product_attention = function
    try:
        yield
    finally:
        basics_model.scaled_dot_product_attention = original


def check(args: argparse.Namespace) -> None:
    if args.tokens is not None and args.tokens < max(args.context):
        raise ValueError(f"--tokens {args.tokens} is fewer than the context length {max(args.context)}: "
                         "a step holds at least one sequence")


def batch_size(args: argparse.Namespace, context: int) -> int:
    return args.tokens // context if args.tokens is not None else args.batch


def model_config(size: str):
    from cs336_basics.model import MODEL_CONFIGS, ModelConfig

    if size == SMOKE_SIZE:
        return ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=2)
    return MODEL_CONFIGS[size]


def random_lm(config, vocab: int, context: int, batch: int, device):
    """(model, inputs, targets): the LM with random weights, and one random batch of `batch` × `context` tokens (the
    model, profile and memory benchmarks all run this)."""
    import torch

    from cs336_basics.model import BasicsTransformerLM

    model = BasicsTransformerLM.from_config(config, vocab_size=vocab, context_length=context, device=device)
    x, y = (torch.randint(0, vocab, (batch, context), device=device) for _ in range(2))
    return model, x, y


def run(args: argparse.Namespace, rec: Recorder) -> int:
    import torch

    device = rec.device
    backend = options.compile_backend(args, device.type == "cuda")
    autocast = (
        torch.autocast(device_type=device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext()
    )
    groups = [(size, ctx, compiled) for size in args.sizes for ctx in args.context
              for compiled in COMPILE_CHOICES[args.compile]]
    for size, ctx, compiled in options.progress(groups, args, NAME):
        measure_group(size, ctx, compiled, args, rec, backend, autocast)
    return 0


def measure_group(size: str, ctx: int, compiled: bool, args: argparse.Namespace, rec: Recorder, backend: str,
                  autocast) -> None:
    """Every attention implementation on one model (size, context, eager or compiled), in `args.rounds` interleaved
    rounds (each round times every implementation and mode once; a row keeps its median round): the model and its
    data are built once and shared, the implementations swapped in turn (a compiled model recompiles once per
    implementation, in its first warm-up step)."""
    import torch

    from cs336_basics.nn_utils import cross_entropy
    from cs336_basics.optimizer import AdamW
    from cs336_systems.bench.timing import (free_memory, interleaved_rounds, median_of_rounds, peak_memory_mib,
                                            time_calls)

    device = rec.device
    config = model_config(size)
    batch = batch_size(args, ctx)

    def fields(attn_name: str, mode: str) -> Row:
        return dict(
            impl=attn_name, mode=mode, dtype=args.dtype, batch=batch, n_heads=config.num_heads, seq_len=ctx,
            d_head=config.d_model // config.num_heads, is_causal=True, model_size=size, context_length=ctx,
            vocab_size=args.vocab,
            compiled=compiled, warmup_steps=args.warmup, steps=args.steps, d_model=config.d_model,
            num_layers=config.num_layers, **({"compile_backend": backend} if compiled else {}),
            **({"rounds": args.rounds} if args.rounds > 1 else {}),
        )

    todo = {attn: [m for m in args.modes if not rec.is_done(fields(attn, m))] for attn in args.attention}
    todo = {attn: modes for attn, modes in todo.items() if modes}
    if compiled and device.type != "cuda":
        for attn in [attn for attn in todo if impls.uses_triton(attn)]:
            for mode in todo.pop(attn):
                rec.skip(fields(attn, mode), "unsupported",
                         error="dynamo cannot trace Triton-interpreter kernels (CPU)")
    if not todo:
        return

    state: dict = {}

    def setup() -> None:
        """Model (+ compile wrapper) and data, built on first use and shared by the group's measurements."""
        if "model" not in state:
            model, x, y = random_lm(config, args.vocab, ctx, batch, device)
            if compiled:
                torch._dynamo.reset()
                model = torch.compile(model, backend=backend, dynamic=False)
            state.update(model=model, n_params=sum(p.numel() for p in model.parameters()), x=x, y=y)

    def loss_fn():
        with autocast:
            return cross_entropy(state["model"](state["x"]), state["y"])

    def zero_grad():
        state["model"].zero_grad(set_to_none=True)

    def time_mode(mode: str) -> dict:
        timing = dict(device=device, iters=args.steps, warmup=args.warmup, settled=True)
        if mode == "fwd":
            return time_calls(loss_fn, **timing)
        if mode == "bwd":

            def forward():
                zero_grad()
                state["loss"] = loss_fn()

            return time_calls(lambda: state["loss"].backward(), before=forward, **timing)
        if mode == "fwd_bwd":
            return time_calls(lambda: loss_fn().backward(), before=zero_grad, **timing)
        state["optimizer"] = optimizer = AdamW(state["model"].parameters(), lr=1e-4)

        def train_step():
            optimizer.zero_grad(set_to_none=True)
            loss_fn().backward()
            optimizer.step()

        return time_calls(train_step, **timing)

    def measure(mode: str) -> dict:
        setup()
        try:
            stats = time_mode(mode)
            peak = peak_memory_mib(device)  # (time_calls reset the counter after the warm-up: the timed steps')
        finally:  # drop this mode's graph, grads and optimizer state even after an OOM, before the next measurement
            state.pop("loss", None)
            state.pop("optimizer", None)
            zero_grad()
        return {**stats, "peak_mem_mb": peak, "n_params": state["n_params"],
                "tokens_per_s": batch * ctx / (stats["ms_mean"] * 1e-3)}

    built: dict[str, object] = {}

    def measure_with(attn_name: str, mode: str) -> dict:
        if attn_name not in built:  # built inside its first measurement: Unsupported becomes its rows
            built[attn_name] = model_attention(impls.build(attn_name, impls.Setup(device, args.dtype, ctx, backend)))
        with attention_function(built[attn_name]):
            return measure(mode)

    # a compiled model holds one graph per implementation: room for them all, and an error rather than dynamo's
    # silent fallback to eager past its recompile limit
    limits = torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 2 * len(todo)),
                                        fail_on_recompile_limit_hit=True) if compiled else nullcontext()
    with limits:
        results = interleaved_rounds([(attn, mode) for attn, modes in todo.items() for mode in modes], args.rounds,
                                     measure_with, device)
    state.clear()
    free_memory(device)

    for attn_name, modes in todo.items():
        for mode in modes:
            rec.measure(fields(attn_name, mode), lambda: median_of_rounds(results[attn_name, mode]))


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def render(rows: list[Row], out: Output) -> list[str]:
    rows = report.latest(rows)
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    variants = [(c, "compiled" if c else "eager") for c in report.distinct(rows, "compiled")]
    setup = ("model_size", "context_length", "impl", "dtype", "batch", "compiled", "mode")
    by_setup = report.group_by(rows, setup)
    warmups = report.distinct(rows, "warmup_steps")
    # Step-time tables and plots: per setup the most warmed-up run; fewer warm-up steps only in their own table.
    steady = [max(g, key=lambda r: r.get("warmup_steps") or 0) for _, g in by_setup]
    index = ["model_size", "context_length", "impl", "dtype", "batch"]
    if len(report.distinct(steady, "warmup_steps")) > 1:
        index.append("warmup_steps")
    columns = [(mode, report.where(mode=mode)) for mode in modes]  # one line per eager / compiled setup
    sections = []
    if len(warmups) > 1:
        warm_rows = [r for _, g in by_setup if len(report.distinct(g, "warmup_steps")) > 1 for r in g]
        sections.append(
            "## Warm-up effect (ms: mean ± std over timed steps; first timed step in brackets)\n\n"
            + report.pivot(
                warm_rows, ["model_size", "context_length", "impl", "dtype", "compiled", "mode"],
                [(f"warmup {w}", report.where(warmup_steps=w)) for w in warmups], _mean_std_first_cell,
            )
        )
    setups = [*index, "compiled"]
    sections += [
        "## Step time (ms, mean ± std over timed steps)\n\n"
        + report.pivot(steady, setups, columns, report.mean_std_cell),
        "## Throughput (tokens/s, from the mean step time)\n\n"
        + report.pivot(steady, setups, columns, report.field_cell("tokens_per_s")),
        "## Peak memory (MiB, max_memory_allocated over the mode's steps)\n\n"
        + report.pivot(steady, setups, columns, report.field_cell("peak_mem_mb")),
    ]
    if len(variants) == 2:
        by_variant = [(f"{m} {label}", report.where(mode=m, compiled=c)) for m in modes for c, label in variants]
        speedups = [(f"compile speedup {m}",
                     lambda p, m=m: report.ratio_cell(p[f"{m} compiled"], p[f"{m} eager"], "ms_mean")) for m in modes]
        sections.append("## torch.compile speedup (eager mean / compiled mean)\n\n"
                        + report.pivot(steady, index, by_variant, None, speedups))
    _size_plots(steady, modes, variants, out)
    _context_plots(steady, modes, out)
    return sections


def _size_plots(steady: list[Row], modes: list[str], variants: list[tuple[bool, str]], out: Output) -> None:
    import numpy as np

    fields = ("context_length", "impl", "dtype")
    for key, group in report.group_by(steady, fields):
        sizes = report.distinct(group, "model_size")
        if len(sizes) < 2 and len(report.distinct(group, "compiled")) < 2:
            continue  # one bar per mode: the context-sweep plot shows it
        fig, axes = report.new_figure(len(modes))
        width = 0.8 / max(len(variants), 1)
        for ax, mode in zip(axes, modes):
            heights = []
            for i, (c, label) in enumerate(variants):
                picked = [report.pick(group, model_size=size, mode=mode, compiled=c) for size in sizes]
                ys = [r.get("ms_mean", r["ms"]) if report.ok(r) else 0.0 for r in picked]
                errs = [(r.get("ms_std") or 0.0) if report.ok(r) else 0.0 for r in picked]
                ax.bar(np.arange(len(sizes)) + i * width, ys, width, yerr=errs, label=label, capsize=2,
                       color="#4c72b0" if c else "#c0c0c0")
                heights += ys
            ax.set_xticks(np.arange(len(sizes)) + width * (len(variants) - 1) / 2, [str(s) for s in sizes])
            report.log_if_spread(ax, heights)
            ax.set_ylabel("ms per step (mean ± std)")
            ax.set_title(f"{mode} (lower is better)", fontsize=10)
            ax.legend(fontsize=8)
            ax.grid(True, axis="y", alpha=0.3)
        out.save(fig, report.slug("model", *key), f"model step time by size, {report.subtitle(fields, key)}")


def _context_plots(steady: list[Row], modes: list[str], out: Output) -> None:
    fields = ("model_size", "dtype")
    for key, group in report.group_by(steady, fields):
        swept = [m for m in modes if len(report.distinct([r for r in group if r["mode"] == m], "context_length")) > 1]
        if not swept:
            continue
        fig, axes = report.new_figure(2 * len(swept))
        for i, mode in enumerate(swept):
            sel = [r for r in group if r["mode"] == mode]
            for ax, (field, ylabel, what) in zip(axes[2 * i:2 * i + 2], (("ms_mean", "ms per step", "time"),
                                                                        ("peak_mem_mb", "peak MiB", "peak memory"))):
                report.line_plot(ax, sel, "context_length", _series, lambda r, f=field: r.get(f),
                                 color=lambda r: report.impl_color(r["impl"] + ("_compiled" if r["compiled"] else "")),
                                 label=str)
                report.log_axes(ax, "context length", ylabel)
                ax.set_title(f"{mode} {what}", fontsize=10)
        out.save(fig, report.slug("model_context", *key), f"model context sweep, {report.subtitle(fields, key)}")


def _mean_std_first_cell(r: Row | None) -> str:
    cell = report.mean_std_cell(r)
    if report.ok(r) and r.get("first_ms") is not None:
        cell += f" ({report.fmt_num(r['first_ms'])})"
    return cell


def _series(r: Row) -> str:
    return f"{report.impl_label(r['impl'])} {'compiled' if r['compiled'] else 'eager'}"
