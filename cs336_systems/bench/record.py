"""JSONL recording shared by every `cs336-bench` problem.

One `Recorder` per invocation: it owns the run metadata (run id, commit, device, versions, fp32 matmul
precision), the append-only `<out>/<problem>/metrics.jsonl`, the `--resume` bookkeeping and the
per-measurement failure policy (CUDA OOM -> an "oom" row, `Unsupported` -> an "unsupported" row, any
other exception -> an "error: ..." row with its traceback on stderr; the sweep continues, finished
rows are already on disk).

One run at a time writes a file (a lock on it); `--resume` skips the keys with an ok, oom or unsupported row
measured by the same code (`code_sha`) under the same torch and triton. A row's identity (`KEY_FIELDS`, used
by `--resume` and by the report) includes the device (`gpu`), the `smoke` mark and the timing settings
(do_bench rep/warmup, timed/warm-up iterations or steps), so rows of another GPU, of the CPU or of other
settings are never taken for the same measurement. The file is only ever appended to; every append starts on a
fresh line, so a cut last line (killed run, an editor that drops the final newline) stays a lone unparsable
line that readers skip with a warning.
torch is imported lazily: this module is imported when the CLI builds its parser.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import traceback
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from cs336_systems.bench.timing import free_memory, peak_memory_mib
from cs336_systems.bench.verify import ERROR_FIELDS

if TYPE_CHECKING:
    import torch

# Fields that identify one measurement; `--resume` and the report dedupe on them.
KEY_FIELDS = (
    "problem",
    "gpu",
    "smoke",
    "impl",
    "variant",
    "kernel",
    "mode",
    "dtype",
    "batch",
    "n_heads",
    "n_kv_heads",
    "seq_len",
    "d_head",
    "is_causal",
    "model_size",
    "context_length",
    "compiled",
    "compile_backend",
    "vocab_size",
    "target",
    "tuning_key",
    # timing settings
    "rep_ms",
    "warmup_ms",
    "iters",
    "warmup_iters",
    "steps",
    "warmup_steps",
)
# Measurement fields every row carries (null when the measurement did not complete).
METRIC_FIELDS = ("ms", "ms_p20", "ms_p80", "tflops", "peak_mem_mb")
DONE_STATUSES = ("ok", "oom", "unsupported")  # what --resume does not measure again
RESUME_FIELDS = ("code_sha", "torch", "triton")  # ... when measured by the same code
LOG_FIELDS = ("impl", "variant", "kernel", "model_size", "compiled", "mode", "dtype", "seq_len", "d_head")
NUMBER = (int, float)
# Optional numeric fields: when present they must be numbers (or null).
NUMERIC_FIELDS = ("ms", "ms_p20", "ms_p80", "ms_mean", "ms_std", "tflops", "peak_mem_mb", *ERROR_FIELDS)
# Times that tables divide by and plots take logs of: when present, positive and finite.
TIME_FIELDS = ("ms", "ms_p20", "ms_p80", "ms_mean")
# Provenance every rendered row must carry (`run_metadata`); code_sha is newer than some committed rows.
PROVENANCE_FIELDS = {"gpu": str, "torch": str, "triton": str, "commit": str, "run_id": str}
BASE_FIELDS = {"status": str, "impl": str, **PROVENANCE_FIELDS}
MAX_ERROR_CHARS = 500
COMMIT_ENV = "CS336_BENCH_COMMIT"  # overrides git (e.g. on a machine that gets the tree without .git)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")  # = distributed.launch.TORCHRUN_ENV (torch-free)
NO_DEVICE = "none"  # `gpu` of rows measured without a device (resources)

Row = dict[str, Any]


class Unsupported(Exception):
    """Raised by a measurement whose implementation does not accept the configuration."""


def key_of(row: Row, fields: Iterable[str] = KEY_FIELDS) -> tuple:
    """The hashable identity of a row (JSON lists become tuples)."""
    return tuple(tuple(v) if isinstance(v, list) else v for v in (row.get(f) for f in fields))


def read_rows(path: Path) -> list[Row]:
    """All JSON-object rows of a metrics.jsonl, in file order; other lines are skipped with a warning."""
    if not path.exists():
        return []
    rows = []
    with path.open("rb") as f:  # decoded line by line: a stray non-UTF-8 byte costs its line only
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            try:
                row = json.loads(line.decode())
            except (UnicodeDecodeError, json.JSONDecodeError):
                row = None
            if isinstance(row, dict):
                rows.append(row)
            else:
                print(f"warning: {path}:{number}: skipping a line that is not a JSON object: "
                      f"{line[:80].decode(errors='replace')!r}",
                      file=sys.stderr)
    return rows


def type_ok(value: Any, kind: type | tuple[type, ...]) -> bool:
    if isinstance(value, bool) and kind in (int, NUMBER):
        return False
    return isinstance(value, kind)


def problem_of_row(row: Row, schema: ModuleType | None) -> str | None:
    """Why `row` cannot be rendered (missing or mistyped field, provenance included, a time that is not positive
    and finite), or None when it can. `schema`: the problem module, whose FIELDS / OK_FIELDS the row must have."""
    fields = ({**BASE_FIELDS, **getattr(schema, "FIELDS", {})} if schema is not None
              else {"status": str, **PROVENANCE_FIELDS})
    if row.get("status") == "ok":
        fields.update(getattr(schema, "OK_FIELDS", {}))
    for field, kind in fields.items():
        if field not in row:
            return f"missing {field!r}"
        if not type_ok(row[field], kind):
            return f"{field!r} is {row[field]!r}"
    for field in NUMERIC_FIELDS:
        value = row.get(field)
        if value is None:
            continue
        if not type_ok(value, NUMBER):
            return f"{field!r} is {value!r}, not a number"
        if field in TIME_FIELDS and not (math.isfinite(value) and value > 0):
            return f"{field!r} is {value!r}, not a positive finite time"
    return None


def valid_rows(rows: list[Row], schema: ModuleType | None, path: Path, shown: int = 3) -> list[Row]:
    """The rows the report can render (and `--resume` may count as done); the others are counted and
    the first few shown on stderr."""
    kept, skipped = [], 0
    for r in rows:
        reason = problem_of_row(r, schema)
        if reason is None:
            kept.append(r)
            continue
        skipped += 1
        if skipped <= shown:
            print(f"warning: {path}: skipping a row ({reason}): {str(r)[:100]}", file=sys.stderr)
    if skipped > shown:
        print(f"warning: {path}: skipped {skipped} rows in all", file=sys.stderr)
    return kept


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


def package_digest(*roots: Path) -> str:
    """sha256 (12 hex digits) of the sources that are running: cs336_systems and cs336_basics (the model, the
    naive attention and AdamW that several problems time), or the package directories `roots`. Which code a row
    measured, whatever `commit` says: a commit label set through the environment, or a second copy of the package
    put on PYTHONPATH for a before/after run, can name another tree than the one imported (`python -m` puts the
    working directory first on sys.path). cs336_basics is found, not imported (this module stays light)."""
    if not roots:
        basics = importlib.util.find_spec("cs336_basics")
        roots = (Path(__file__).resolve().parents[1],
                 *((Path(basics.origin).parent,) if basics is not None and basics.origin else ()))
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{root.name}/{path.relative_to(root).as_posix()}".encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def run_metadata(device: torch.device | None) -> Row:
    """What every row of one invocation shares: device, versions, commit (and the digest of the package
    that ran), fp32 matmul precision."""
    import torch
    import triton

    if device is None:
        gpu = NO_DEVICE
    else:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        "code_sha": package_digest(),
        "matmul_precision": torch.get_float32_matmul_precision(),
    }


def append_line(path: Path, line: str) -> None:
    """Append one line, starting a fresh line if the file does not end in one; flushed to disk."""
    with path.open("a+b") as f:
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(line.encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def rank_failure_status(e: BaseException) -> str:
    """An error row's status for a multi-rank run that failed: the exception's type, and its message's head (which
    rank failed) and tail (why), at most MAX_ERROR_CHARS."""
    text = " ".join(str(e).split())
    half = MAX_ERROR_CHARS // 2
    return f"error: {type(e).__name__}: {text if len(text) <= MAX_ERROR_CHARS else text[:half] + ' ... ' + text[-half:]}"


def torchrun_follower() -> bool:
    """Whether this process is a rank other than 0 of a torchrun job (which records nothing): the environment names
    one as `distributed.launch.torchrun_place` reads it (all of TORCHRUN_ENV; a partial set is no torchrun job, and
    the run spawns its own ranks), and RANK is not 0."""
    return all(name in os.environ for name in TORCHRUN_ENV) and os.environ["RANK"] != "0"


class Recorder:
    """Appends one flat JSON row per measurement to `<out>/<problem>/metrics.jsonl`.

    `device` None means nothing runs on a device (rows say gpu "none"). The output file is opened for
    appending here, so an unwritable `--out` fails before the first measurement, and locked until `close`
    (a second run into the same file waits, then resumes from what the first recorded). With `resume`,
    the rows that `valid_rows(rows, schema)` keeps (as the report does) and that completed are done.
    """

    def __init__(
        self, out: Path, problem: str, device: torch.device | None, resume: bool = False, smoke: bool = False,
        schema: ModuleType | None = None,
    ) -> None:
        self.problem = problem
        self.device = device
        self.smoke = smoke
        self.dir = Path(out) / problem
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.lock = self.path.open("a")  # the data file itself: no lock file left beside committed rows
        if not torchrun_follower():  # (a torchrun job's rank 0 records; the other ranks would wait on it forever)
            try:
                fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"waiting for another run writing {self.path} to finish", file=sys.stderr)
                fcntl.flock(self.lock, fcntl.LOCK_EX)
        self.run_id = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"
        self.meta = {**run_metadata(device), "run_id": self.run_id}
        self.done: set[tuple] = set()
        if resume:
            rows = valid_rows(read_rows(self.path), schema, self.path)
            self.done = {key_of(r) for r in rows if r.get("status") in DONE_STATUSES and self.same_code(r)}
        self.counts: dict[str, int] = {}

    def new_file(self, relative: str) -> Path:
        """A path under this problem's folder for a file a row points to (a trace, a timeline): `relative`, or, where
        a file is there already (an earlier row's), the same name with this run's id before its suffixes. An
        earlier row's file is never overwritten."""
        path = self.dir / relative
        if path.exists():
            stem, dot, suffixes = path.name.partition(".")
            path = path.with_name(f"{stem}-{self.run_id}{dot}{suffixes}")
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def completed_keys(self, fields: Iterable[str], statuses: Iterable[str] = ("ok", "oom")) -> set[tuple]:
        """`fields`' values of every row on file with one of `statuses` measured by this run's code (`same_code`): what
        a problem with its own row identity (allreduce, ddp) does not measure again under `--resume`."""
        statuses = tuple(statuses)
        return {key_of(r, fields) for r in read_rows(self.path) if r.get("status") in statuses and self.same_code(r)}

    def same_code(self, row: Row) -> bool:
        """Whether `row` measured what this run measures: the same sources (`code_sha`) under the same torch and
        triton. `--resume` counts only such rows as done; a changed kernel is measured again."""
        return all(row.get(f) == self.meta[f] for f in RESUME_FIELDS)

    def close(self) -> None:
        """Release the file lock (the process's exit releases it too)."""
        self.lock.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def base_row(self, fields: Row) -> Row:
        row = {"problem": self.problem, **fields, **self.meta}
        if self.smoke:
            row["smoke"] = True
        if self.device is not None and self.device.type != "cuda":
            row["timings_meaningless"] = True
        return row

    def is_done(self, fields: Row) -> bool:
        return key_of(self.base_row(fields)) in self.done

    def write(self, row: Row) -> Row:
        row = dict(row)
        for field in METRIC_FIELDS:
            row.setdefault(field, None)
        row["time"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        append_line(self.path, json.dumps(row, default=str))
        status = str(row.get("status"))
        bucket = status.split(":")[0]
        self.counts[bucket] = self.counts.get(bucket, 0) + 1
        if status in DONE_STATUSES:
            self.done.add(key_of(row))
        self.log(row)
        return row

    def log(self, row: Row) -> None:
        """One line per recorded row on stdout (through tqdm, so a progress bar stays intact)."""
        from tqdm.auto import tqdm

        shown = [f"{f}={row[f]}" for f in LOG_FIELDS if row.get(f) is not None]
        result = f"{row['ms']:.4g} ms" if row.get("ms") is not None else ""
        tqdm.write(f"[{self.problem}] {' '.join(shown)}: {row['status']} {result}".rstrip(), file=sys.stdout)

    def skip(self, fields: Row, status: str, **extra: Any) -> Row:
        """Record a measurement that was deliberately not run (e.g. "unsupported", "skipped: ...")."""
        return self.write({**self.base_row(fields), "status": status, **extra})

    def skip_failed_ranks(self, unfinished: Iterable[Row], e: BaseException) -> None:
        """A multi-rank run that failed with `e`: an error row (`rank_failure_status`) for each measurement it did not
        finish; recorded by rank 0 only (a torchrun job's other ranks record nothing)."""
        if torchrun_follower():
            return
        status = rank_failure_status(e)
        for fields in unfinished:
            self.skip(fields, status)

    def measure(self, fields: Row, fn: Callable[[], Row], flops: float | None = None) -> Row:
        """Run one measurement `fn() -> metrics`, record it (or its OOM / error), and return the row.

        The device's peak-memory counter is reset before `fn`; `peak_mem_mb` (MiB) defaults to the peak
        seen during `fn` unless `fn` reports its own. `tflops` is derived from `flops` and the median `ms`.
        """
        import torch

        row = self.base_row(fields)
        device = self.device or torch.device("cpu")
        free_memory(device)
        try:
            metrics = fn()
        except torch.OutOfMemoryError as e:
            row.update(status="oom", error=_short(e))
        except Unsupported as e:
            row.update(status="unsupported", error=_short(e))
        except Exception as e:  # recorded as an error row (traceback on stderr); the sweep goes on
            print(f"[{self.problem}] {fields}: {type(e).__name__}", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            row.update(status=f"error: {type(e).__name__}: {_short(e)}")
        else:
            row.update(metrics)
            row.setdefault("peak_mem_mb", peak_memory_mib(device))
            ms = row.get("ms")
            if flops is not None and ms and math.isfinite(ms) and ms > 0:
                row["tflops"] = flops / (ms * 1e-3) / 1e12
            row["status"] = "ok"
        written = self.write(row)
        free_memory(device)
        return written

    def summary(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())) or "no new rows"
        return f"[{self.problem}] {counts} -> {self.path}"


def _short(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return msg if len(msg) <= MAX_ERROR_CHARS else msg[: MAX_ERROR_CHARS - 3] + "..."
