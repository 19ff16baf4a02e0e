"""allreduce (distributed_communication_single_node): all-reduce time of float32 tensors on one host.

For every backend x world size, `world_size` processes are spawned (rank r on GPU r under NCCL, the
CPU under Gloo) and, for every tensor size, run `--warmup-iters` untimed all-reduces and then
`--iters` timed ones. Before each timed call the ranks meet at a barrier and synchronize the device;
each rank times `dist.all_reduce` plus `torch.cuda.synchronize()` with a wall clock; the per-rank
times are gathered with `all_gather_object`, and one iteration's time is the slowest rank's (the
collective is done when the last rank is). `ms` is the median over iterations.

Sizes are in MB = 10^6 bytes; bandwidths in GB/s = 10^9 bytes/s, as nccl-tests reports them:
algorithm bandwidth = bytes / time; bus bandwidth = algorithm bandwidth x 2(n-1)/n, the traffic
each link of a ring carries, comparable across world sizes and with the hardware's link speed.
Rank 0 hands each result to this process as soon as it has it; one JSONL row per (backend, world
size, size). NVLink multicast (NVLS) stays off in every rank.

Under torchrun (e.g. `torchrun --nnodes 2 --nproc-per-node 8 ... -m cs336_systems.bench.cli allreduce`)
no ranks are spawned: each process joins torchrun's job as its rank, the run is that job's one backend
and world size, and rank 0 records the rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from cs336_systems.bench import report
from cs336_systems.bench.options import add_sized, nonnegative_int, positive_float, positive_int
from cs336_systems.bench.record import KEY_FIELDS, Recorder, Row, key_of
from cs336_systems.bench.report import Output

NAME = "allreduce"
HELP = "all-reduce time and bandwidth: NCCL on GPUs, Gloo on the CPU, float32 1 MB - 1 GB, 2/4/6 ranks"
BACKENDS = ("nccl", "gloo")
WORLD_SIZES = (2, 4, 6)
MB = 10**6
NUMBER = (int, float)
FIELDS = {"backend": str, "world_size": int, "size_mb": NUMBER, "iters": int, "warmup_iters": int}
OK_FIELDS = {"ms": NUMBER, "algbw_gbps": NUMBER, "busbw_gbps": NUMBER}
# A row's identity: the shared key plus what this problem varies. `variant` only labels the progress line with
# the size and world size (rows recorded before it existed lack it), so it is left out.
KEY = (*(f for f in KEY_FIELDS if f != "variant"), "backend", "world_size", "size_mb")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                   help="default: nccl and gloo when CUDA is present, else gloo")
    p.add_argument("--world-sizes", nargs="+", type=positive_int, default=None,
                   help="ranks per run (default: 2 4 6 for gloo; for nccl those of 2 4 6 the GPUs allow; "
                        "2 with --smoke)")
    add_sized(p, "--sizes-mb", full=[1, 10, 100, 1000], smoke=[0.25, 1], help="float32 tensor sizes, MB (10^6 B)",
              type=float32_size_mb, nargs="+")
    add_sized(p, "--warmup-iters", full=5, smoke=1, help="untimed all-reduces per size", type=nonnegative_int)
    add_sized(p, "--iters", full=10, smoke=2, help="timed all-reduces per size", type=positive_int)
    p.add_argument("--timeout-s", type=positive_float, default=600.0,
                   help="give up on one backend x world size after this long (all its ranks are stopped); under "
                        "torchrun, which supervises the job: how long one collective may wait before it fails")


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(backend, world size) runs in order; ValueError for what this host cannot run."""
    from cs336_systems.distributed.launch import torchrun_place

    gpus = gpu_count()
    place = torchrun_place()
    if place is not None:  # one process group, already sized by torchrun
        backends = args.backends or ["nccl" if gpus else "gloo"]
        if len(backends) > 1:
            raise ValueError("--backends: a torchrun job is one process group; pass one backend")
        if args.world_sizes and set(args.world_sizes) != {place.world_size}:
            raise ValueError(f"--world-sizes: torchrun started {place.world_size} ranks")
        if place.world_size < 2:
            raise ValueError("an all-reduce needs at least 2 ranks; torchrun started 1")
        if backends[0] == "nccl" and place.local_world_size > gpus:
            raise ValueError(f"NCCL: torchrun started {place.local_world_size} ranks on this host, which has {gpus} GPU(s)")
        return [(backends[0], place.world_size)]
    backends = args.backends or (["nccl", "gloo"] if gpus else ["gloo"])
    runs = []
    for backend in backends:
        if args.world_sizes:
            sizes = list(dict.fromkeys(args.world_sizes))
        elif args.smoke:
            sizes = [2]
        else:
            sizes = [n for n in WORLD_SIZES if backend == "gloo" or n <= gpus]
        if backend == "nccl":
            too_many = [n for n in sizes if n > gpus]
            if too_many or not sizes:
                raise ValueError(
                    f"--world-sizes {' '.join(map(str, too_many or [2]))}: NCCL runs one rank per GPU and this "
                    f"host has {gpus} GPU(s); pass --world-sizes up to {gpus} or --backends gloo"
                )
        if min(sizes) < 2:
            raise ValueError("--world-sizes: an all-reduce needs at least 2 ranks")
        runs += [(backend, n) for n in sizes]
    return runs


def needs_device(args: argparse.Namespace) -> bool:
    """Gloo alone runs on the CPU (rows say gpu "none"); NCCL, or the default choice, needs CUDA."""
    return args.backends is None or "nccl" in args.backends


def check(args: argparse.Namespace) -> None:
    plan(args)


def run(args: argparse.Namespace, rec: Recorder) -> int:
    from cs336_systems.distributed.launch import WorkerError, run_ranks, torchrun_place

    joining = torchrun_place() is not None
    done = rec.completed_keys(KEY) if args.resume else set()
    for backend, world_size in plan(args):
        fields = {
            size_mb: dict(impl=backend, mode="all_reduce", dtype="fp32", backend=backend, world_size=world_size,
                          size_mb=size_mb, device="cuda" if backend == "nccl" else "cpu",
                          iters=args.iters, warmup_iters=args.warmup_iters,
                          variant=f"{size_mb:g} MB, {world_size} ranks")
            for size_mb in dict.fromkeys(args.sizes_mb)
        }
        todo = [mb for mb, f in fields.items() if key_of(rec.base_row(f), KEY) not in done]
        if not todo and not joining:  # under torchrun every rank joins: rank 0's plan, not this one's, decides
            continue
        written: set[float] = set()

        def on_message(rank: int, result: dict, fields=fields, written=written) -> None:
            written.add(result["size_mb"])
            rec.write({**rec.base_row(fields[result["size_mb"]]), **result["metrics"], "status": "ok"})

        try:
            run_ranks(allreduce_worker, world_size, (todo, args.warmup_iters, args.iters), backend=backend,
                      timeout_s=args.timeout_s, num_threads=1 if args.smoke else None, on_message=on_message)
        except Exception as e:
            # launch(): a rank's failure (WorkerError) or the deadline; under torchrun this rank's own error, which
            # rank 0 records before it propagates (torchrun then stops the job)
            if not isinstance(e, (WorkerError, TimeoutError)) and not joining:
                raise
            print(f"[{NAME}] {backend} x {world_size}: {e}", file=sys.stderr)
            rec.skip_failed_ranks((fields[mb] for mb in todo if mb not in written), e)
            if joining:
                raise
    return 0


def float32_size_mb(text: str) -> float:
    """A size in MB that is a whole number of float32 elements (what the row's size_mb says is what is reduced)."""
    size_mb = positive_float(text)
    nbytes = round(size_mb * MB)
    if abs(size_mb * MB - nbytes) > 1e-9 * max(1, nbytes) or nbytes % 4:
        raise argparse.ArgumentTypeError(f"{text} MB is {size_mb * MB:g} bytes, not a whole number of float32 (4 B)")
    return size_mb


def allreduce_worker(ctx, sizes_mb: list[float], warmup: int, iters: int) -> None:
    """One rank: time `iters` all-reduces per size; rank 0 sends each size's row metrics."""
    import torch
    import torch.distributed as dist

    from cs336_systems.bench.timing import summarize_ms, synchronize

    for size_mb in sizes_mb:
        numel = round(size_mb * MB) // 4
        x = torch.randn(numel, dtype=torch.float32, device=ctx.device)
        for _ in range(warmup):
            dist.all_reduce(x)
        synchronize(ctx.device)
        times = []
        for _ in range(iters):
            dist.barrier()
            synchronize(ctx.device)
            start = time.perf_counter()
            dist.all_reduce(x)
            synchronize(ctx.device)
            times.append((time.perf_counter() - start) * 1e3)
        per_rank: list[list[float] | None] = [None] * ctx.world_size
        dist.all_gather_object(per_rank, times)
        del x
        if ctx.rank != 0:
            continue
        slowest = [max(rank_times[i] for rank_times in per_rank) for i in range(iters)]
        stats = summarize_ms(slowest)
        nbytes = numel * 4
        algbw = nbytes / (stats["ms"] * 1e-3) / 1e9
        ctx.send({"size_mb": size_mb, "metrics": {
            **stats,
            "bytes": nbytes,
            "rank_median_ms": [statistics.median(t) for t in per_rank],
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * 2 * (ctx.world_size - 1) / ctx.world_size,
        }})


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def label(r: Row) -> str:
    return f"{r['backend']} ({'GPU' if r['backend'] == 'nccl' else 'CPU'}), {r['world_size']} ranks"


def render(rows: list[Row], out: Output) -> list[str]:
    rows = report.latest(rows, KEY)
    sections = []
    for key, group in report.group_by(rows, ("iters", "warmup_iters")):
        sizes = report.distinct(group, "size_mb")

        def cell(r: Row | None) -> str:
            return report.status_cell(r) or (
                f"{report.fmt_num(r['ms'])} ms, {report.fmt_num(r['busbw_gbps'])} GB/s"
            )

        columns = [(f"{mb:g} MB", report.where(size_mb=mb)) for mb in sizes]
        table = report.pivot(group, ("backend", "world_size"), columns, cell)
        sections.append(
            f"## All-reduce of float32 tensors, {report.subtitle(('iters', 'warmup_iters'), key)}\n\n"
            "each cell: median time of the slowest rank, then bus bandwidth (algorithm bandwidth x 2(n-1)/n; "
            "MB = 10^6 B, GB/s = 10^9 B/s)\n\n" + table
        )
        detail = report.markdown(
            ["backend", "ranks", "size MB", "ms (median)", "ms p20-p80", "algbw GB/s", "busbw GB/s",
             "per-rank median ms"],
            [[r["backend"], r["world_size"], f"{r['size_mb']:g}", report.ms_cell(r),
              "–" if not report.ok(r) else f"{report.fmt_num(r['ms_p20'])}–{report.fmt_num(r['ms_p80'])}",
              report.field_cell("algbw_gbps")(r), report.field_cell("busbw_gbps")(r),
              ", ".join(report.fmt_num(t) for t in r.get("rank_median_ms") or [])]
             for r in report.sort_rows(group, ("backend", "world_size", "size_mb"))],
        )
        sections.append("### Every measurement\n\n" + detail)
        _plot(group, out, key)
    return sections


def _plot(group: list[Row], out: Output, key: tuple) -> None:
    fig, (ax_ms, ax_bw) = report.new_figure(2)
    series = sorted({label(r) for r in group})
    colors = {name: report.EXTRA_COLORS[i % len(report.EXTRA_COLORS)] for i, name in enumerate(series)}
    report.line_plot(ax_ms, group, "size_mb", label, lambda r: r.get("ms"), color=lambda r: colors[label(r)],
                     label=str)
    report.line_plot(ax_bw, group, "size_mb", label, lambda r: r.get("busbw_gbps"),
                     color=lambda r: colors[label(r)], label=str)
    for ax, ylabel, log_y in ((ax_ms, "ms (median, slowest rank)", True), (ax_bw, "bus bandwidth, GB/s", False)):
        ax.set_xlabel("tensor size, MB")
        ax.set_ylabel(ylabel)
        if report.has_data(ax):
            ax.set_xscale("log")
            if log_y:
                ax.set_yscale("log")
    ax_ms.set_title("time per all-reduce", fontsize=10)
    ax_bw.set_title("bus bandwidth", fontsize=10)
    out.save(fig, report.slug("allreduce", *key), "all-reduce, float32")
