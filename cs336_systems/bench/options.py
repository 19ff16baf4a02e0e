"""Command-line plumbing shared by every `cs336-bench` subcommand; imports nothing heavy (no torch).

- argparse types that refuse bad sizes before any work (`positive_int`, `positive_float`, ...): argparse turns
  their ValueError/ArgumentTypeError into a usage error (exit code 2) naming the option;
- `add_sized`: an option whose default depends on `--smoke`, declared once: the help text and the
  value the problem's `run` reads (filled in by `resolve_sized` after parsing) come from the same pair;
- the options every problem takes (`--out`, `--resume`, `--smoke`, `--no-progress`).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

DTYPE_NAMES = ("fp32", "bf16", "fp16")
# CUDA compute capabilities with bf16 tensor cores that Triton 3.6 compiles for (90 = sm_90a, H100/H200).
CUDA_ARCHES = (80, 86, 87, 89, 90, 100, 103, 120, 121)
SIZED = "_sized_defaults"  # namespace attribute: {dest: (full-size default, --smoke default)}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def check_kernel_head_dims(option: str, dims: Iterable[int]) -> None:
    """ValueError unless our kernels accept every head dim (imports the kernels: call it from `check`)."""
    from cs336_systems.flash_triton import MAX_HEAD_DIM

    too_large = [d for d in dims if d > MAX_HEAD_DIM]
    if too_large:
        raise ValueError(f"{option}: our kernels support head dims up to {MAX_HEAD_DIM}, got {too_large}")


def describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def add_sized(p: argparse.ArgumentParser, flag: str, *, full: Any, smoke: Any, help: str, **kwargs: Any) -> None:
    """An option whose default is `full`, or `smoke` under --smoke; the help text shows both."""
    action = p.add_argument(
        flag, default=None, help=f"{help} (default: {describe(full)}; with --smoke: {describe(smoke)})", **kwargs
    )
    table = dict(p.get_default(SIZED) or {})
    table[action.dest] = (full, smoke)
    p.set_defaults(**{SIZED: table})


def resolve_sized(args: argparse.Namespace) -> None:
    """Fill every sized option the user did not pass with its full-size or --smoke default."""
    for dest, (full, smoke) in (getattr(args, SIZED, None) or {}).items():
        if getattr(args, dest) is None:
            value = smoke if args.smoke else full
            setattr(args, dest, list(value) if isinstance(value, (list, tuple)) else value)


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=None, help="output root (default: runs/; a temp dir with --smoke)")
    p.add_argument("--resume", action="store_true", help="skip keys that already have an ok, oom or unsupported row")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes that run end to end without a GPU (CPU + TRITON_INTERPRET=1); timings are meaningless",
    )
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is also off when stderr is not a terminal)")


def add_compile_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend for compiled impls (default: inductor; aot_eager on the CPU)",
    )


def add_do_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup-ms", type=positive_float, default=25, help="do_bench warm-up time (ms)")
    p.add_argument("--rep-ms", type=positive_float, default=100, help="do_bench repetition time (ms)")


def compile_backend(args: argparse.Namespace, on_cuda: bool) -> str:
    """Inductor, except on the CPU, where aot_eager exercises dynamo/AOTAutograd without a C++ build."""
    if args.compile_backend is not None:
        return args.compile_backend
    return "inductor" if on_cuda else "aot_eager"


def progress(items: Iterable, args: argparse.Namespace, desc: str):
    """A tqdm bar over `items`, on stderr, only when stderr is a terminal (piped output stays clean)."""
    from tqdm.auto import tqdm

    return tqdm(list(items), desc=desc, disable=args.no_progress or not sys.stderr.isatty(), dynamic_ncols=True)


def unknown_choice(what: str, value: str, allowed: Sequence[str]) -> str:
    """"unknown <what> 'x'", and "; did you mean 'y'?" when one of `allowed` is close to it."""
    close = difflib.get_close_matches(value, allowed, n=1)
    return f"unknown {what} {value!r}" + (f"; did you mean {close[0]!r}?" if close else "")


def choices_check(option: str, values: Iterable[str], allowed: Iterable[str]) -> None:
    """ValueError naming the option when a value is not among `allowed` (for choices known only at run time)."""
    allowed = list(allowed)
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise ValueError(f"{option}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(allowed)}")
