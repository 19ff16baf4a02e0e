"""memory_profiling: the CUDA memory of BasicsTransformerLM inference and training steps, recorded by the allocator.

Random weights and data (vocab 10,000). For every model size x context length x dtype x mode:
`--warmup` unrecorded steps, then `torch.cuda.memory._record_memory_history(max_entries=...)` over
`--steps` step(s), `torch.cuda.memory._snapshot()`, recording stopped. Modes:
  fwd    the forward pass alone (logits, no loss) under torch.inference_mode()
  step   forward + cross-entropy loss, backward, cs336_basics' AdamW step, zero_grad(set_to_none=True)
bf16 = torch.autocast(bfloat16) around forward and loss (the weights and AdamW state stay fp32).

Each row records
  start_mem_mb   memory_allocated when the recorded steps start: weights (+ AdamW's two moments for step,
                 which its first warm-up step creates)
  peak_mem_mb    max_memory_allocated over the recorded steps (the allocator's rounded blocks)
  trace_peak_mb  the peak of the active-memory timeline replayed from the snapshot (requested bytes)
  largest        the `--top` largest allocations of the recorded steps: MiB, count, and where (the
                 innermost frame in cs336_basics / cs336_systems, else the autograd node of backward,
                 whose engine thread has no Python stack: --stacks all records the C++ frames naming it)
  residual_mb    the handout's (d): one residual-stream activation tensor in fp32,
                 batch x context x d_model x 4 bytes / 1024^2 (2.7B, batch 4: 5 / 10 / 20 MiB at 128 / 256 / 512)
  timeline       memory/timelines/<config>.png: the active memory over the allocator's events drawn from
                 the snapshot (largest code locations as bands, forward / backward / optimizer shaded)
  snapshot       with --snapshots, memory/snapshots/<config>.pickle for https://pytorch.org/memory_viz
                 (an earlier row's file of the same name is kept: the new one takes the run id before its suffix)
Memory history exists for CUDA only: on the CPU (--smoke) every row is "unsupported".
"""

from __future__ import annotations

import argparse
import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

from cs336_systems.bench import options, report
from cs336_systems.bench.memory_snapshot import MIB, Phase
from cs336_systems.bench.model import SIZES, SMOKE_SIZE, model_config, random_lm
from cs336_systems.bench.options import add_sized, nonnegative_int, positive_int
from cs336_systems.bench.record import NUMBER
from cs336_systems.bench.report import Output, Row

if TYPE_CHECKING:
    import torch

    from cs336_systems.bench.record import Recorder

NAME = "memory"
HELP = "memory_profiling: peak memory, largest allocations and active-memory timelines of fwd and train steps"
MODES = ("fwd", "step")
DTYPES = ("fp32", "bf16")
FIELDS = {"mode": str, "dtype": str, "batch": int, "model_size": str, "context_length": int, "residual_mb": NUMBER}
OK_FIELDS = {"peak_mem_mb": NUMBER, "start_mem_mb": NUMBER, "largest": list}
CPU_REASON = "needs CUDA: torch.cuda.memory._record_memory_history records the CUDA caching allocator only"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sized(p, "--sizes", full=["2.7B"], smoke=[SMOKE_SIZE], help="model sizes", nargs="+",
              choices=[*SIZES, SMOKE_SIZE])
    add_sized(p, "--context", full=[128, 256, 512], smoke=[32], help="context lengths", type=positive_int, nargs="+")
    add_sized(p, "--batch", full=4, smoke=2, help="batch size", type=positive_int)
    add_sized(p, "--warmup", full=2, smoke=1, help="unrecorded warm-up steps per mode", type=nonnegative_int)
    p.add_argument("--steps", type=positive_int, default=1, help="recorded steps per mode")
    p.add_argument("--vocab", type=positive_int, default=10_000, help="vocabulary size")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="what one recorded step does")
    p.add_argument("--dtype", nargs="+", choices=DTYPES, default=list(DTYPES),
                   help="fp32 weights; bf16 = torch.autocast(bfloat16) around forward and loss")
    p.add_argument("--max-entries", type=positive_int, default=1_000_000,
                   help="allocator events the history keeps (a ring buffer: older ones are dropped)")
    p.add_argument("--stacks", choices=["all", "python"], default="all",
                   help="frames recorded per event: all (C++ too: backward's autograd nodes) or python (faster)")
    p.add_argument("--top", type=positive_int, default=5, help="largest allocations recorded per row")
    p.add_argument("--snapshots", action="store_true",
                   help="also write each snapshot pickle (for pytorch.org/memory_viz; tens of MB each)")


def residual_mb(batch: int, context: int, d_model: int) -> float:
    """The handout's (d): one fp32 residual-stream activation tensor (batch x context x d_model), in MiB."""
    return batch * context * d_model * 4 / MIB


@contextmanager
def phase(phases: list[Phase], name: str) -> Iterator[None]:
    """Append (name, start, end) in epoch microseconds, the clock of the snapshot's `time_us`."""
    start = time.time_ns() // 1000
    yield
    phases.append((name, start, time.time_ns() // 1000))


def forward_only(model, x, autocast) -> Callable[[list[Phase]], None]:
    import torch

    def step(phases: list[Phase]) -> None:
        with phase(phases, "forward"), torch.inference_mode(), autocast:
            model(x)

    return step


def train_step(model, x, y, optimizer, autocast) -> Callable[[list[Phase]], None]:
    from cs336_basics.nn_utils import cross_entropy

    def step(phases: list[Phase]) -> None:
        with phase(phases, "forward"):
            with autocast:
                loss = cross_entropy(model(x), y)
        with phase(phases, "backward"):
            loss.backward()
        with phase(phases, "optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def record_history(step: Callable[[list[Phase]], None], steps: int, max_entries: int, stacks: str,
                   device: torch.device) -> tuple[dict, list[Phase]]:
    """Run `steps` steps under the allocator's memory history; return its snapshot and the steps' phases."""
    import torch

    phases: list[Phase] = []
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks=stacks, clear_history=True)
    try:
        for _ in range(steps):
            step(phases)
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:  # the history costs host time and memory: never leave it on for the next row
        torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot, phases


def run(args: argparse.Namespace, rec: Recorder) -> int:
    device = rec.device
    combos = [(size, ctx) for size in args.sizes for ctx in args.context]
    for size, ctx in options.progress(combos, args, NAME):
        config = model_config(size)
        fields = {
            (dtype, mode): dict(
                impl="naive", mode=mode, dtype=dtype, batch=args.batch, n_heads=config.num_heads, seq_len=ctx,
                d_head=config.d_model // config.num_heads, is_causal=True, model_size=size, context_length=ctx,
                vocab_size=args.vocab,
                warmup_steps=args.warmup, steps=args.steps, d_model=config.d_model, num_layers=config.num_layers,
                residual_mb=residual_mb(args.batch, ctx, config.d_model),
            )
            for dtype in args.dtype for mode in args.modes
        }
        todo = [k for k, f in fields.items() if not rec.is_done(f)]
        if device.type != "cuda":
            for k in todo:
                rec.skip(fields[k], "unsupported", error=CPU_REASON)
            continue
        state: dict = {}
        for dtype, mode in todo:
            rec.measure(fields[dtype, mode], lambda: _profile(args, rec, state, size, ctx, dtype, mode))
        state.clear()
    return 0


def _profile(args: argparse.Namespace, rec: Recorder, state: dict, size: str, ctx: int, dtype: str, mode: str) -> Row:
    """One configuration's recorded steps: the row's metrics, its timeline PNG (and snapshot pickle)."""
    import torch

    from cs336_basics.optimizer import AdamW
    from cs336_systems.bench.memory_snapshot import draw_timeline, largest_allocations, replay

    device = rec.device
    if "model" not in state:  # shared by the (size, context)'s rows; each step row builds its own optimizer
        state["model"], state["x"], state["y"] = random_lm(model_config(size), args.vocab, ctx, args.batch, device)
    model = state["model"]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()
    if mode == "fwd":
        step = forward_only(model, state["x"], autocast)
    else:
        step = train_step(model, state["x"], state["y"], AdamW(model.parameters(), lr=1e-4), autocast)
    try:
        for _ in range(args.warmup):
            step([])
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        snapshot, phases = record_history(step, args.steps, args.max_entries, args.stacks, device)
        peak = torch.cuda.max_memory_allocated(device)
    finally:  # grads left by an OOM in backward must not count in the next row
        model.zero_grad(set_to_none=True)
    index = torch.cuda.current_device()
    timeline = replay(snapshot, index)
    name = report.slug(size, f"ctx{ctx}", mode, dtype)
    title = f"{size}, context {ctx}, {mode}, {dtype}: active memory over {args.steps} recorded step(s)"
    png = draw_timeline(snapshot, rec.new_file(f"timelines/{name}.png"), title, phases, index)
    row = {
        "start_mem_mb": start / MIB, "peak_mem_mb": peak / MIB, "trace_peak_mb": timeline.peak / MIB,
        "largest": largest_allocations(timeline, args.top),
        # a full ring buffer dropped the earliest events: the replayed timeline then starts mid-step
        "trace_truncated": len(snapshot["device_traces"][index]) >= args.max_entries,
        "timeline": png.relative_to(rec.dir).as_posix(), "snapshot": None,
        "n_params": sum(p.numel() for p in model.parameters()),
    }
    if args.snapshots:
        path = rec.new_file(f"snapshots/{name}.pickle")
        with path.open("wb") as f:
            pickle.dump(snapshot, f)
        row["snapshot"] = path.relative_to(rec.dir).as_posix()
    return row


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def render(rows: list[Row], out: Output) -> list[str]:
    rows = report.latest(rows)
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in rows)]
    columns = [(f"{m} {d}", report.where(mode=m, dtype=d)) for m in modes for d in dtypes]
    index = ["model_size", "context_length", "batch", "residual_mb"]
    sections = [
        "## Peak memory (MiB: max_memory_allocated over the recorded step)\n\n"
        "`residual_mb`: one fp32 residual-stream activation, batch × context × d_model × 4 bytes / 1024².\n\n"
        + report.pivot(rows, index, columns, report.field_cell("peak_mem_mb")),
        "## Memory when the step starts (MiB: weights, + AdamW state for step)\n\n"
        + report.pivot(rows, index, columns, report.field_cell("start_mem_mb")),
    ]
    setup = ("model_size", "context_length", "mode", "dtype")
    done = [r for r in report.sort_rows(rows, setup) if r["status"] == "ok"]
    body = [[*(r[f] for f in setup), report.fmt_num(a["mb"]), a["count"], f"`{a['where']}`"]
            for r in done for a in r["largest"]]
    sections.append("## Largest allocations of the recorded step (MiB, how many, innermost frame in our code)\n\n"
                    + (report.markdown([*setup, "MiB", "count", "where"], body) if body
                       else "No completed measurement (memory history needs CUDA)."))
    images = [f"### {r['model_size']}, context {r['context_length']}, {r['mode']}, {r['dtype']}\n\n"
              f"![{r['mode']} {r['dtype']} active memory]({r['timeline']})"
              + (f"\n\nSnapshot for pytorch.org/memory_viz: [{r['snapshot']}]({r['snapshot']})" if r.get("snapshot")
                 else "")
              for r in done if r.get("timeline")]
    if images:
        sections.append("## Active memory timelines\n\n" + "\n\n".join(images))
    return sections
