"""ddp (naive_ddp_benchmarking, minimal_ddp_flat_benchmarking, ddp_overlap_*_benchmarking,
ddp_bucketed_benchmarking, optimizer_state_sharding_accounting): data-parallel training steps.

One spawned group of `--world-size` ranks (NCCL, one GPU per rank; Gloo on the CPU with --smoke)
trains the BasicsTransformerLM (`--model-size`, default xl; vocab 10,000; fp32) with AdamW. Every
rank holds `--batch` sequences of `--context-length` tokens of its own random data (the global batch
is batch x world size). In the same run, one after the other, on a fresh model each:
  local       no gradient communication at all: the compute-only baseline (not correct DDP)
  naive       NaiveDDP: a blocking all-reduce per parameter after backward
  flat        FlatDDP: one all-reduce of the concatenated gradients after backward
  individual  DDPIndividualParameters: async all-reduce per parameter from its grad hook
  bucketed    DDPBucketed at each of `--bucket-sizes-mb` (MiB)
  torch_ddp   torch.nn.parallel.DistributedDataParallel with its defaults (25 MiB buckets)
and, for the sharding comparison, DDPBucketed at `--shard-bucket-mb` with a ShardedOptimizer(AdamW)
(its unsharded twin is the bucketed row of the same size).

Each run: `--warmup-steps` untimed steps, then `--steps` timed ones. A step is zero_grad, forward,
cross-entropy, backward, `finish_gradient_synchronization()`, optimizer step; its time is the wall
clock between device synchronizations, and the slowest rank's time counts. Inside the step, CUDA
events on the compute stream split it into fwd_bwd (until backward returns), sync (until
`finish_gradient_synchronization()` returns: the communication the backward pass did not hide) and
opt (the optimizer step, including the sharded optimizer's parameter broadcasts); on the CPU the
same split uses the wall clock. `comm_share` = sync / step. PyTorch's DDP waits for its all-reduces
inside backward, so its sync is ~0; compare every variant's step with `local` for the full
communication overhead. Memory per rank (MiB, torch.cuda allocator): allocated before the variant
is built (what earlier variants left behind), after the model, wrapper and optimizer are built, peak up to just before the optimizer step, peak including it, and
allocated after it (optimizer state exists from the first step on).

Under torchrun (e.g. `torchrun --nnodes 2 --nproc-per-node 8 ... -m cs336_systems.bench.cli ddp`) no
ranks are spawned: each process joins torchrun's job as its rank, the world size is the job's, and
rank 0 records the rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from cs336_systems.bench import report
from cs336_systems.bench.options import add_sized, nonnegative_int, positive_float, positive_int
from cs336_systems.bench.record import KEY_FIELDS, Recorder, Row, key_of
from cs336_systems.bench.report import Output

NAME = "ddp"
HELP = "DDP training step (xl, 2 GPUs): naive, flat, overlapped, bucketed vs PyTorch DDP; optimizer state sharding"
IMPLS = ("local", "naive", "flat", "individual", "bucketed", "torch_ddp")
SIZES = ("small", "medium", "large", "xl", "2.7B")
SMOKE_SIZE = "smoke"
NUMBER = (int, float)
FIELDS = {"variant": str, "backend": str, "world_size": int, "optimizer": str, "model_size": str,
          "context_length": int, "batch": int, "steps": int, "warmup_steps": int}
OK_FIELDS = {"ms": NUMBER, "fwd_bwd_ms": NUMBER, "sync_ms": NUMBER, "opt_ms": NUMBER}
KEY = (*KEY_FIELDS, "backend", "world_size", "optimizer", "bucket_mb", "vocab")
LABELS = {
    "local": "no sync (compute only)",
    "naive": "naive (all-reduce per parameter)",
    "flat": "flat (one all-reduce)",
    "individual": "overlapped, per parameter",
    "torch_ddp": "PyTorch DDP",
}
LR = 1e-4
DEFAULT_WORLD_SIZE = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sized(p, "--model-size", full="xl", smoke=SMOKE_SIZE, help="model size (handout §1.1.2)",
              choices=[*SIZES, SMOKE_SIZE])
    add_sized(p, "--context-length", full=512, smoke=32, help="tokens per sequence", type=positive_int)
    add_sized(p, "--batch", full=4, smoke=2, help="sequences per rank (global batch = batch x world size)",
              type=positive_int)
    add_sized(p, "--vocab", full=10_000, smoke=512, help="vocabulary size", type=positive_int)
    add_sized(p, "--warmup-steps", full=5, smoke=1, help="untimed steps per variant", type=nonnegative_int)
    add_sized(p, "--steps", full=10, smoke=2, help="timed steps per variant", type=positive_int)
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="variants to run, in this order")
    p.add_argument("--bucket-sizes-mb", nargs="+", type=positive_float, default=[1, 10, 100, 1000],
                   help="bucket sizes (MiB) of the bucketed runs")
    p.add_argument("--shard-bucket-mb", type=positive_float, default=100.0,
                   help="bucket size (MiB) of the bucketed DDP used for the sharded-optimizer comparison")
    p.add_argument("--no-sharding", action="store_true", help="skip the sharded-optimizer run")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help=f"ranks (one GPU each under NCCL; default: {DEFAULT_WORLD_SIZE}, or under torchrun the job's)")
    p.add_argument("--timeout-s", type=positive_float, default=540.0,
                   help="ranks it spawns: stop every rank and record errors after this long; under torchrun, "
                        "which supervises the job: how long one collective may wait before it fails")


def world_size_of(args: argparse.Namespace) -> int:
    """--world-size, or under torchrun the job's size (ValueError when the two differ)."""
    from cs336_systems.distributed.launch import torchrun_place

    place = torchrun_place()
    if place is None:
        return args.world_size or DEFAULT_WORLD_SIZE
    if args.world_size not in (None, place.world_size):
        raise ValueError(f"--world-size {args.world_size}: torchrun started {place.world_size} ranks")
    return place.world_size


def backend_for(args: argparse.Namespace) -> str:
    """NCCL with one GPU per rank; Gloo on the CPU only for --smoke; ValueError otherwise."""
    import torch

    from cs336_systems.distributed.launch import torchrun_place

    world_size = world_size_of(args)
    place = torchrun_place()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world_size < 2:
        raise ValueError("--world-size: data parallelism needs at least 2 ranks")
    if gpus >= (world_size if place is None else place.local_world_size):
        return "nccl"
    if args.smoke and gpus == 0:
        return "gloo"
    if place is not None:
        raise ValueError(f"torchrun started {place.local_world_size} ranks on this host, which has {gpus} GPU(s)")
    raise ValueError(
        f"--world-size {world_size}: NCCL runs one rank per GPU and this host has {gpus} GPU(s); "
        f"pass --world-size {gpus} or less" if gpus >= 2 else
        f"--world-size {world_size}: needs {world_size} GPUs, this host has {gpus}"
    )


def check(args: argparse.Namespace) -> None:
    backend_for(args)


def runs_of(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The variants of one invocation, in order: row fields that differ between them."""
    runs = []
    buckets = list(dict.fromkeys(args.bucket_sizes_mb))
    shard = not args.no_sharding and "bucketed" in args.impls
    if shard and args.shard_bucket_mb not in buckets:
        buckets = sorted([*buckets, args.shard_bucket_mb])  # the sharded run's unsharded twin
    for impl in args.impls:
        for mb in buckets if impl == "bucketed" else [None]:
            runs.append(dict(impl=impl, bucket_mb=mb, optimizer="adamw",
                             variant=LABELS.get(impl) or f"bucketed {mb:g} MiB"))
    if shard:
        runs.append(dict(impl="bucketed", bucket_mb=args.shard_bucket_mb, optimizer="sharded_adamw",
                         variant=f"bucketed {args.shard_bucket_mb:g} MiB + sharded AdamW"))
    return runs


def run(args: argparse.Namespace, rec: Recorder) -> int:
    from cs336_systems.distributed.launch import WorkerError, run_ranks, torchrun_place

    backend = backend_for(args)
    world_size = world_size_of(args)
    place = torchrun_place()
    common = dict(mode="train_step", dtype="fp32", backend=backend, world_size=world_size,
                  model_size=args.model_size, context_length=args.context_length, batch=args.batch,
                  vocab=args.vocab, steps=args.steps, warmup_steps=args.warmup_steps)
    done = rec.completed_keys(KEY) if args.resume else set()
    todo = [{**common, **r} for r in runs_of(args)]
    todo = [f for f in todo if key_of(rec.base_row(f), KEY) not in done]
    if not todo and place is None:  # under torchrun every rank joins: rank 0's plan, not this one's, decides
        return 0
    if place is None or place.rank == 0:
        print(f"[{NAME}] {world_size} ranks ({backend}), model {args.model_size}, {args.batch} x "
              f"{args.context_length} tokens per rank: {len(todo)} variant(s)", flush=True)
    written: set[int] = set()

    def on_message(rank: int, result: dict) -> None:
        written.add(result["index"])
        rec.write({**rec.base_row(todo[result["index"]]), **result["metrics"], "status": "ok"})

    setup = dict(model_size=args.model_size, context_length=args.context_length, batch=args.batch,
                 vocab=args.vocab, steps=args.steps, warmup_steps=args.warmup_steps)
    try:
        run_ranks(ddp_worker, world_size, (setup, todo), backend=backend, timeout_s=args.timeout_s,
                  num_threads=1 if args.smoke else None, on_message=on_message)
    except Exception as e:
        # launch(): a rank's failure (WorkerError) or the deadline; under torchrun this rank's own error, which rank 0
        # records before it propagates (torchrun then stops the job)
        if not isinstance(e, (WorkerError, TimeoutError)) and place is None:
            raise
        print(f"[{NAME}] {e}", file=sys.stderr)
        rec.skip_failed_ranks((fields for i, fields in enumerate(todo) if i not in written), e)
        if place is not None:
            raise
    return 0


# ---------------------------------------------------------------------------------------------
# The ranks
# ---------------------------------------------------------------------------------------------


def model_config(size: str):
    from cs336_basics.model import MODEL_CONFIGS, ModelConfig

    if size == SMOKE_SIZE:
        return ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=2)
    return MODEL_CONFIGS[size]


def wrap(impl: str, model, bucket_mb: float | None, device):
    import torch

    from cs336_systems.distributed import ddp

    if impl == "local":
        return model
    if impl == "torch_ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if impl == "bucketed":
        return ddp.DDPBucketed(model, bucket_mb)
    return {"naive": ddp.NaiveDDP, "flat": ddp.FlatDDP, "individual": ddp.DDPIndividualParameters}[impl](model)


class PhaseClock:
    """Marks inside one step: CUDA events on the current stream, or the wall clock on the CPU."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def phases_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (call after the device is synchronized)."""
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1e3 for a, b in pairs]


def measure(ctx, setup: dict, fields: dict) -> dict[str, Any] | None:
    """Build, warm up and time one variant on this rank; rank 0 returns the row metrics."""
    import torch
    import torch.distributed as dist

    from cs336_basics.model import BasicsTransformerLM
    from cs336_basics.nn_utils import cross_entropy
    from cs336_basics.optimizer import AdamW
    from cs336_systems.bench.timing import allocated_memory_mib, free_memory, peak_memory_mib, summarize_ms
    from cs336_systems.bench.timing import reset_peak_memory, synchronize
    from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

    device = ctx.device
    on_cuda = device.type == "cuda"
    if on_cuda:  # gc.collect() costs ~0.15 s per call once dynamo is loaded: only worth it for the GPU's memory
        free_memory(device)
    mem_before = allocated_memory_mib(device)  # what earlier variants left behind: ~0 unless something leaks
    torch.manual_seed(0)
    model = BasicsTransformerLM.from_config(
        model_config(setup["model_size"]), vocab_size=setup["vocab"], context_length=setup["context_length"],
        device=device,
    )
    net = wrap(fields["impl"], model, fields["bucket_mb"], device)
    if fields["optimizer"] == "sharded_adamw":
        optimizer = ShardedOptimizer(model.parameters(), AdamW, lr=LR)
    else:
        optimizer = AdamW(model.parameters(), lr=LR)
    synchronize(device)
    mem_init = allocated_memory_mib(device)
    gen = torch.Generator(device).manual_seed(1000 + ctx.rank)
    shape = (setup["batch"], setup["context_length"])
    x = torch.randint(0, setup["vocab"], shape, device=device, generator=gen)
    y = torch.randint(0, setup["vocab"], shape, device=device, generator=gen)
    finish = getattr(net, "finish_gradient_synchronization", None)
    batch_start = getattr(net, "on_train_batch_start", None)

    def step(clock: PhaseClock) -> tuple[float | None, float | None]:
        if batch_start is not None:
            batch_start()
        optimizer.zero_grad(set_to_none=True)
        clock.mark()
        loss = cross_entropy(net(x), y)
        loss.backward()
        clock.mark()
        if finish is not None:
            finish()
        clock.mark()
        peak_before = peak_memory_mib(device)  # the allocator's host-side count: no sync needed
        optimizer.step()
        clock.mark()
        return peak_before, peak_memory_mib(device)

    for _ in range(setup["warmup_steps"]):
        step(PhaseClock(device))
    synchronize(device)
    steps, phases, peaks_before, peaks = [], [], [], []
    for _ in range(setup["steps"]):
        dist.barrier()
        synchronize(device)
        reset_peak_memory(device)
        clock = PhaseClock(device)
        start = time.perf_counter()
        peak_before, peak = step(clock)
        synchronize(device)
        steps.append((time.perf_counter() - start) * 1e3)
        phases.append(clock.phases_ms())
        peaks_before.append(peak_before)
        peaks.append(peak)
    mine = {
        "steps": steps,
        "phases": phases,
        "mem_before_build_mib": mem_before,
        "mem_init_mib": mem_init,
        "peak_before_step_mib": max(peaks_before) if on_cuda else None,
        "peak_step_mib": max(peaks) if on_cuda else None,
        "mem_after_step_mib": allocated_memory_mib(device),
    }
    n_params = sum(p.numel() for p in model.parameters())
    n_buckets = len(net.buckets) if hasattr(net, "buckets") else None
    del net, model, optimizer, x, y
    if on_cuda:
        free_memory(device)  # collects garbage first
    everyone: list[dict | None] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    if ctx.rank != 0:
        return None
    n = len(steps)
    slowest = [max(r["steps"][i] for r in everyone) for i in range(n)]
    phase = [[max(r["phases"][i][k] for r in everyone) for i in range(n)] for k in range(3)]
    stats = summarize_ms(slowest)
    fwd_bwd, sync, opt = (statistics.median(p) for p in phase)
    per_rank = {k: [r[k] for r in everyone] for k in ("mem_before_build_mib", "mem_init_mib", "peak_before_step_mib",
                                                       "peak_step_mib", "mem_after_step_mib")}
    tokens = setup["batch"] * setup["context_length"] * ctx.world_size
    return {
        **stats,
        "fwd_bwd_ms": fwd_bwd,
        "sync_ms": sync,
        "opt_ms": opt,
        "comm_share": sync / stats["ms"],
        "tokens_per_s": tokens / (stats["ms"] * 1e-3),
        "rank_median_ms": [statistics.median(r["steps"]) for r in everyone],
        **per_rank,
        "peak_mem_mb": max(per_rank["peak_step_mib"]) if on_cuda else None,
        "n_params": n_params,
        "param_mib": n_params * 4 / 2**20,
        "n_buckets": n_buckets,
    }


def ddp_worker(ctx, setup: dict, todo: list[dict]) -> None:
    for index, fields in enumerate(todo):
        metrics = measure(ctx, setup, fields)
        if metrics is not None:
            ctx.send({"index": index, "metrics": metrics})


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def order(r: Row) -> tuple:
    """Table order: the variants as run, the sharded-optimizer run last."""
    return (r.get("optimizer") != "adamw", IMPLS.index(r["impl"]) if r["impl"] in IMPLS else len(IMPLS),
            r.get("bucket_mb") or 0)


def mib_cell(field: str):
    def cell(r: Row | None) -> str:
        s = report.status_cell(r)
        if s:
            return s
        values = [v for v in r.get(field) or [] if v is not None]
        return " / ".join(f"{v / 1024:.2f}" for v in values) if values else "–"

    return cell


def render(rows: list[Row], out: Output) -> list[str]:
    rows = report.latest(rows, KEY)
    fields = ("model_size", "context_length", "batch", "world_size", "backend", "steps", "warmup_steps")
    sections = []
    for key, group in report.group_by(rows, fields):
        group = sorted(group, key=order)
        for run_id in dict.fromkeys(r["run_id"] for r in group):
            same_run = [r for r in group if r["run_id"] == run_id]
            local = report.pick(same_run, impl="local")
            torch_ddp = report.pick(same_run, impl="torch_ddp")
            body = []
            for r in same_run:
                over = "–"
                if report.ok(r) and report.ok(local) and r is not local:
                    over = f"{report.fmt_num(r['ms'] - local['ms'])} ({(r['ms'] - local['ms']) / r['ms']:.1%})"
                body.append([
                    r["variant"], report.ms_cell(r), report.field_cell("fwd_bwd_ms")(r),
                    report.field_cell("sync_ms")(r), report.field_cell("opt_ms")(r),
                    f"{r['comm_share']:.1%}" if report.ok(r) and r["impl"] not in ("local", "torch_ddp") else "–",
                    over, report.ratio_cell(r, torch_ddp) if r is not torch_ddp else "1.00×",
                    str(r.get("n_buckets")) if report.ok(r) and r["impl"] == "bucketed" else "",
                ])
            first = same_run[0]
            sections.append(
                f"## Training step, {report.subtitle(fields, key)}\n\n"
                f"run {run_id} (commit {first.get('commit')}); ms = median over steps of the slowest rank; "
                "sync = time from the end of backward until finish_gradient_synchronization() returns "
                "(communication not hidden by backward); overhead = step - the no-sync step; "
                "vs PyTorch DDP = its step time / this one (above 1× = faster)\n\n"
                + report.markdown(["variant", "step ms", "fwd+bwd ms", "sync ms", "opt ms", "sync share of step",
                                   "overhead vs no sync, ms (share)", "vs PyTorch DDP", "buckets"], body)
            )
            memory = [[r["variant"], mib_cell("mem_before_build_mib")(r), mib_cell("mem_init_mib")(r),
                       mib_cell("peak_before_step_mib")(r),
                       mib_cell("peak_step_mib")(r), mib_cell("mem_after_step_mib")(r)]
                      for r in same_run if r["impl"] == "bucketed" or r["optimizer"] != "adamw"]
            if memory and any(r.get("peak_step_mib") and any(r["peak_step_mib"]) for r in same_run):
                sections.append(
                    "### Memory per rank, GiB (rank 0 / rank 1 / ...)\n\n"
                    "allocated before the variant is built (left over from earlier ones: should be ~0), after "
                    "building model + wrapper + optimizer; peak up to the optimizer step; peak including it; "
                    "allocated after it\n\n"
                    + report.markdown(["variant", "before build", "after init", "peak before opt step",
                                       "peak with opt step", "after opt step"], memory)
                )
            _plot(same_run, out, key, run_id)
    return sections


def _plot(rows: list[Row], out: Output, key: tuple, run_id: str) -> None:
    bars = [r for r in rows if report.ok(r)]
    if not bars:
        return
    fig, (ax,) = report.new_figure(1, cols=1, height=0.4 * len(bars) + 1.6)
    ys = list(range(len(bars)))
    left = [0.0] * len(bars)
    for name, field, color in (("fwd+bwd", "fwd_bwd_ms", "#1f77b4"), ("sync", "sync_ms", "#d62728"),
                               ("optimizer", "opt_ms", "#2ca02c")):
        widths = [r[field] for r in bars]
        ax.barh(ys, widths, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, widths)]
    for y, r in zip(ys, bars):
        ax.plot([r["ms"]], [y], marker="|", color="black", ms=12)
        ax.text(max(left) * 1.01, y, f"{r['ms']:.1f}", va="center", fontsize=8)
    ax.set_yticks(ys, [r["variant"] for r in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median per phase, slowest rank; | = median step)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)  # below the axis: every bar reaches the right
    out.save(fig, report.slug("ddp", *key, run_id[-6:]), "DDP training step by phase")
