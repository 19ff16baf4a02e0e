"""`cs336-bench <problem>`: one subcommand per benchmarking problem, plus `report`.

A problem is a module with
    NAME, HELP              subcommand name and one-line help (its docstring is the long help)
    add_arguments(p)        its own options (`options.add_sized` for sizes with --smoke defaults)
    run(args, rec) -> int   the sweep; appends rows through the `record.Recorder` it is given
    render(rows, out)       markdown sections of its table.md; plots saved through `report.Output`
and optionally
    check(args)             raise ValueError on a bad combination of options (-> usage error, exit 2)
    largest_inputs(args, device) -> (bytes, description)
                            the input tensors of the largest measurement: sizes whose inputs exceed
                            the device's memory are usage errors
    NEEDS_DEVICE = False    runs without a device (no CUDA check, rows say gpu "none"), or
    needs_device(args)      the same decided per invocation (allreduce: Gloo alone needs no GPU)
    FIELDS, OK_FIELDS       {field: type} every row / every ok row must have for `render` (the report
                            skips other rows with a warning, --resume measures them again)
Problem modules import torch only inside their functions, so that `--help` stays instant. Plugging a
new problem in is one entry in `PROBLEMS`. Every subcommand takes --out, --resume, --smoke and
--no-progress; bad sizes are usage errors (exit 2) before anything is measured or written; Ctrl-C
stops a sweep with exit code 130, the rows recorded so far kept.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from cs336_systems.bench import (
    allreduce,
    attention,
    autotune,
    coldstart,
    ddp,
    flash,
    grid,
    leaderboard,
    memory,
    model,
    options,
    overhead,
    precision,
    profile,
    report,
    resources,
    varlen,
)

if TYPE_CHECKING:
    import torch

PROBLEMS: dict[str, ModuleType] = {
    m.NAME: m for m in (attention, model, memory, flash, leaderboard, grid, overhead, autotune, coldstart,
                        resources, allreduce, ddp, precision, profile, varlen)
}
DEFAULT_OUT = Path("runs")
INTERRUPTED = 130  # the shell's exit status for SIGINT


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the modules' docstring layout; shows non-trivial defaults the help text does not mention."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += f" (default: {options.describe(action.default)})".replace("%", "%%")
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cs336-bench",
        description="Benchmarks for CS336 assignment 2 (attention, end-to-end model, FlashAttention-2).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join([*PROBLEMS, report.NAME]) + "}")
    for name, module in PROBLEMS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__, formatter_class=HelpFormatter)
        module.add_arguments(p)
        options.add_common_args(p)
        p.set_defaults(usage_error=p.error)
    p = sub.add_parser(report.NAME, help=report.HELP, description=report.__doc__, formatter_class=HelpFormatter)
    report.add_arguments(p)
    return parser


def select_device(smoke: bool):
    """CUDA when present; the CPU (with the Triton interpreter) only for --smoke; None means refuse."""
    import torch

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


def check_inputs_fit(args: argparse.Namespace, need: int, inputs: str, device: torch.device) -> None:
    """A usage error (exit 2) when the inputs alone exceed what the device can hold."""
    from cs336_systems.bench.timing import memory_bytes

    have = memory_bytes(device)
    if need > have:
        args.usage_error(f"the largest measurement's inputs ({inputs}) need {need / 2**30:,.1f} GiB, more than the "
                         f"{device.type} memory ({have / 2**30:,.1f} GiB): pass smaller sizes")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == report.NAME:
        return report.run(args, PROBLEMS)
    try:
        return run_problem(args, PROBLEMS[args.command])
    except KeyboardInterrupt:  # before the first row: importing torch, waiting for another run's lock
        print(f"\ncs336-bench {args.command}: interrupted; nothing recorded", file=sys.stderr)
        return INTERRUPTED


def run_problem(args: argparse.Namespace, module: ModuleType) -> int:
    """Select the device, check the options, and run one problem's sweep into its Recorder."""
    options.resolve_sized(args)

    device = None
    needs_device = getattr(module, "needs_device", lambda _args: getattr(module, "NEEDS_DEVICE", True))
    if needs_device(args):
        device = select_device(args.smoke)
        if device is None:
            print(
                f"cs336-bench {args.command}: no CUDA device available. These benchmarks need a GPU; "
                "pass --smoke for a tiny CPU-only end-to-end check (timings meaningless).",
                file=sys.stderr,
            )
            return 2
    check = getattr(module, "check", None)
    if check is not None:
        try:
            check(args)
        except ValueError as e:
            args.usage_error(str(e))  # exits with code 2
    if device is not None and hasattr(module, "largest_inputs"):
        check_inputs_fit(args, *module.largest_inputs(args, device), device)

    out = args.out
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="cs336-bench-smoke-")) if args.smoke else DEFAULT_OUT
    from cs336_systems.bench.record import Recorder

    try:
        recorder = Recorder(out, args.command, device, resume=args.resume, smoke=args.smoke, schema=module)
    except OSError as e:
        print(f"cs336-bench {args.command}: cannot write results under {out}: {e}", file=sys.stderr)
        return 2
    with recorder:
        print(f"cs336-bench {args.command}: device={recorder.meta['gpu']} run_id={recorder.run_id} "
              f"out={recorder.path}")
        try:
            rc = module.run(args, recorder) or 0
        except KeyboardInterrupt:
            n = sum(recorder.counts.values())
            print(f"\ncs336-bench {args.command}: interrupted; {n} row{'s' * (n != 1)} kept in {recorder.path}, "
                  "rerun with --resume", file=sys.stderr)
            return INTERRUPTED
        print(recorder.summary())
    if rc == 0 and any(k.startswith("error") for k in recorder.counts):
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
