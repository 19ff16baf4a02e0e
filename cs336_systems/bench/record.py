"""Shared timing, memory accounting and JSONL recording for every `cs336-bench` problem.

One `Recorder` per invocation: it owns the run metadata (run id, commit, GPU, versions), the
append-only `<out>/<problem>/metrics.jsonl`, the `--resume` bookkeeping, and the per-measurement
failure policy (CUDA OOM -> an "oom" row, any other exception -> an "error: ..." row; the sweep
always continues and finished rows are already on disk).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

# Fields that identify one measurement; `--resume` and the report dedupe on them.
KEY_FIELDS = (
    "problem",
    "impl",
    "mode",
    "dtype",
    "batch",
    "n_heads",
    "seq_len",
    "d_head",
    "is_causal",
    "model_size",
    "context_length",
    "compiled",
    "warmup_steps",
    "variant",
)
# Measurement fields every row carries (null when the measurement did not complete).
METRIC_FIELDS = ("ms", "ms_p20", "ms_p80", "tflops", "peak_mem_mb")
DONE_STATUSES = ("ok", "oom")
QUANTILES = (0.5, 0.2, 0.8)
LOG_FIELDS = ("impl", "variant", "kernel", "model_size", "compiled", "mode", "dtype", "seq_len", "d_head")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_ERROR_CHARS = 500


class Unsupported(Exception):
    """Raised by a measurement whose implementation does not accept the configuration."""


def dtype_from_name(name: str) -> torch.dtype:
    return DTYPES[name]


def key_of(row: dict[str, Any], fields: Iterable[str] = KEY_FIELDS) -> tuple:
    """The hashable identity of a row (JSON lists become tuples)."""
    return tuple(tuple(v) if isinstance(v, list) else v for v in (row.get(f) for f in fields))


def read_rows(path: Path) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl, in file order; a truncated last line (killed run) is ignored."""
    if not path.exists():
        return []
    rows = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"warning: skipping unparsable line in {path}: {line[:80]!r}", file=sys.stderr)
    return rows


COMMIT_ENV = "CS336_BENCH_COMMIT"  # overrides git (e.g. on a machine that gets the tree without .git)


def git_commit() -> str:
    """Short HEAD hash, with "-dirty" when tracked files differ from it; "unknown" outside git."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    cwd = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


# ---------------------------------------------------------------------------------------------
# Device helpers (all lazy: nothing here touches CUDA at import time)
# ---------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def allocated_memory_mb(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(device) / 2**20


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def summarize_ms(times_ms: list[float]) -> dict[str, float]:
    """Median (the headline `ms`), 20th/80th percentiles, mean and sample std of per-call times."""
    t = torch.tensor(times_ms, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
    return {
        "ms": q[0],
        "ms_p20": q[1],
        "ms_p80": q[2],
        "ms_mean": statistics.fmean(times_ms),
        "ms_std": statistics.stdev(times_ms) if len(times_ms) > 1 else 0.0,
        "n_timed": len(times_ms),
    }


def time_calls(
    fn: Callable[[], Any],
    device: torch.device,
    iters: int,
    warmup: int,
    before: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """Time `iters` calls of `fn` with a wall clock, synchronizing the device after each call.

    `before` runs untimed ahead of every call (e.g. to drop accumulated grads or redo a forward).
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
        synchronize(device)
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return {**summarize_ms(times), "first_ms": times[0]}  # first_ms: shows what warm-up absorbs


def bench(
    fn: Callable[[], Any],
    device: torch.device,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    grad_to_none: list[torch.Tensor] | None = None,
    cpu_reps: int = 1,
) -> dict[str, float]:
    """`triton.testing.do_bench` (median and [0.2, 0.8] quantiles) on CUDA; a perf_counter loop on CPU."""
    if device.type != "cuda":

        def drop_grads() -> None:
            for t in grad_to_none or ():
                t.grad = None

        return time_calls(fn, device, iters=cpu_reps, warmup=1, before=drop_grads)
    import triton.testing

    ms, p20, p80 = triton.testing.do_bench(
        fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, quantiles=list(QUANTILES)
    )
    return {"ms": ms, "ms_p20": p20, "ms_p80": p80}


def attention_flops(mode: str, batch: int, n_heads: int, seq_len: int, d_head: int, is_causal: bool) -> float:
    """FLOPs of one attention call: fwd = 4*B*H*S^2*D (halved when causal), bwd = 2.5x, fwd_bwd = 3.5x."""
    fwd = 4.0 * batch * n_heads * seq_len**2 * d_head * (0.5 if is_causal else 1.0)
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------


class Recorder:
    """Appends one flat JSON row per measurement to `<out>/<problem>/metrics.jsonl`."""

    def __init__(self, out: Path, problem: str, device: torch.device, resume: bool = False) -> None:
        self.problem = problem
        self.device = device
        self.dir = Path(out) / problem
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.run_id = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"
        self.meta = {
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "triton": triton_version(),
            "commit": git_commit(),
            "run_id": self.run_id,
        }
        self.done: set[tuple] = set()
        if resume:
            self.done = {key_of(r) for r in read_rows(self.path) if r.get("status") in DONE_STATUSES}
        self.counts: dict[str, int] = {}

    def base_row(self, fields: dict[str, Any]) -> dict[str, Any]:
        row = {"problem": self.problem, **fields, **self.meta}
        if self.device.type != "cuda":
            row["timings_meaningless"] = True
        return row

    def is_done(self, fields: dict[str, Any]) -> bool:
        return key_of({"problem": self.problem, **fields}) in self.done

    def write(self, row: dict[str, Any]) -> dict[str, Any]:
        row = dict(row)
        for field in METRIC_FIELDS:
            row.setdefault(field, None)
        row["time"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        status = str(row.get("status"))
        bucket = status.split(":")[0]
        self.counts[bucket] = self.counts.get(bucket, 0) + 1
        if status in DONE_STATUSES:
            self.done.add(key_of(row))
        self.log(row)
        return row

    def log(self, row: dict[str, Any]) -> None:
        """One line per recorded row (through tqdm, so a progress bar stays intact)."""
        from tqdm.auto import tqdm

        shown = [f"{f}={row[f]}" for f in LOG_FIELDS if row.get(f) is not None]
        result = f"{row['ms']:.4g} ms" if row.get("ms") is not None else ""
        tqdm.write(f"[{self.problem}] {' '.join(shown)}: {row['status']} {result}".rstrip())

    def skip(self, fields: dict[str, Any], status: str, **extra: Any) -> dict[str, Any]:
        """Record a measurement that was deliberately not run (e.g. "unsupported", "skipped: ...")."""
        return self.write({**self.base_row(fields), "status": status, **extra})

    def measure(
        self,
        fields: dict[str, Any],
        fn: Callable[[], dict[str, Any]],
        flops: float | None = None,
    ) -> dict[str, Any]:
        """Run one measurement `fn() -> metrics`, record it (or its OOM / error), and return the row.

        The device's peak-memory counter is reset before `fn`; `peak_mem_mb` defaults to the peak seen
        during `fn` unless `fn` reports its own. `tflops` is derived from `flops` and the median `ms`.
        """
        row = self.base_row(fields)
        free_memory(self.device)
        try:
            metrics = fn()
        except torch.OutOfMemoryError as e:
            row.update(status="oom", error=_short(e))
        except Unsupported as e:
            row.update(status="unsupported", error=_short(e))
        except Exception as e:
            print(f"[{self.problem}] {fields}: {type(e).__name__}", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            row.update(status=f"error: {type(e).__name__}: {_short(e)}")
        else:
            row.update(metrics)
            row.setdefault("peak_mem_mb", peak_memory_mb(self.device))
            ms = row.get("ms")
            if flops is not None and ms and math.isfinite(ms) and ms > 0:
                row["tflops"] = flops / (ms * 1e-3) / 1e12
            row["status"] = "ok"
        written = self.write(row)
        free_memory(self.device)
        return written

    def summary(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())) or "no new rows"
        return f"[{self.problem}] {counts} -> {self.path}"


def _short(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return msg if len(msg) <= MAX_ERROR_CHARS else msg[: MAX_ERROR_CHARS - 3] + "..."


# ---------------------------------------------------------------------------------------------
# CLI plumbing shared by the problem modules
# ---------------------------------------------------------------------------------------------


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="output root (default runs/; a temp dir with --smoke)")
    parser.add_argument("--resume", action="store_true", help="skip keys that already have an ok/oom row")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes that run end to end without a GPU (CPU + TRITON_INTERPRET=1); timings are meaningless",
    )
    parser.add_argument("--no-progress", action="store_true", help="disable the tqdm progress bar")


def progress(items: list, args: argparse.Namespace, desc: str):
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, disable=args.no_progress, dynamic_ncols=True)


def resolve(args: argparse.Namespace, name: str, default: Any, smoke_default: Any) -> Any:
    """An option's value: what the user passed, else the --smoke or the full-size default."""
    value = getattr(args, name)
    if value is not None:
        return value
    return smoke_default if args.smoke else default


def default_compile_backend(args: argparse.Namespace, device: torch.device) -> str:
    """Inductor, except for CPU smoke runs where aot_eager exercises dynamo/AOTAutograd without a C++ build."""
    if args.compile_backend is not None:
        return args.compile_backend
    return "aot_eager" if device.type != "cuda" else "inductor"


def add_compile_backend_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend for compiled impls (default inductor; aot_eager for CPU smoke runs)",
    )
