"""`cs336-bench <problem>`: one subcommand per benchmarking problem, plus `report` and `resources`.

Every problem appends rows to `<out>/<problem>/metrics.jsonl` (see `record.py`); `report` renders
tables and plots from those files only. `resources` needs no GPU: it compiles the kernels for a CUDA
target and records what ptxas reports.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from cs336_systems.bench import attention, autotune, flash, leaderboard, model, report, resources
from cs336_systems.bench.record import Recorder, add_common_args

PROBLEMS = {m.NAME: m for m in (attention, model, flash, leaderboard, autotune)}
DEFAULT_OUT = Path("runs")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the modules' docstring layout; shows non-trivial defaults the help text does not mention."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cs336-bench",
        description="Benchmarks for CS336 assignment 2 (attention, end-to-end model, FlashAttention-2).",
    )
    commands = [*PROBLEMS, "report", resources.NAME]
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(commands) + "}")
    for name, module in PROBLEMS.items():
        p = sub.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=HelpFormatter,
        )
        module.add_arguments(p)
        add_common_args(p)
    p = sub.add_parser("report", help=report.HELP, description=report.__doc__, formatter_class=HelpFormatter)
    report.add_arguments(p)
    p = sub.add_parser(resources.NAME, help=resources.HELP, description=resources.__doc__,
                       formatter_class=HelpFormatter)
    resources.add_arguments(p)
    return parser


def select_device(smoke: bool) -> torch.device | None:
    """CUDA when present; the CPU (with the Triton interpreter) only for --smoke; None means refuse."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not smoke:
        return None
    # Must happen before cs336_systems.flash_triton is imported (problem modules import it lazily).
    os.environ["TRITON_INTERPRET"] = "1"
    flash_triton = sys.modules.get("cs336_systems.flash_triton")
    if flash_triton is not None and not getattr(flash_triton, "INTERPRET", True):
        print(
            "warning: cs336_systems.flash_triton was imported before TRITON_INTERPRET=1 was set; "
            "its kernels will fail on the CPU",
            file=sys.stderr,
        )
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "report":
        return report.run(args)
    if args.command == resources.NAME:  # compiles for a target; no device involved
        return run_problem(resources, args, Recorder(args.out, resources.NAME, torch.device("cpu"), args.resume))

    device = select_device(args.smoke)
    if device is None:
        print(
            f"cs336-bench {args.command}: no CUDA device available. These benchmarks need a GPU; "
            "pass --smoke for a tiny CPU-only end-to-end check (timings meaningless).",
            file=sys.stderr,
        )
        return 2
    out = args.out
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="cs336-bench-smoke-")) if args.smoke else DEFAULT_OUT
    recorder = Recorder(out, args.command, device, resume=args.resume)
    print(f"cs336-bench {args.command}: device={recorder.meta['gpu']} run_id={recorder.run_id} out={recorder.path}")
    return run_problem(PROBLEMS[args.command], args, recorder)


def run_problem(module, args: argparse.Namespace, recorder: Recorder) -> int:
    """Run one problem's sweep; exit code 1 if any row recorded an error."""
    rc = module.run(args, recorder) or 0
    print(recorder.summary())
    if rc == 0 and any(k.startswith("error") for k in recorder.counts):
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
