"""coldstart: what a new user waits for, each case in a fresh process with empty Triton and Inductor caches.

Cases (`--cases`):
  course      the course's FlashAttention tests (both classes, 4 × 128 × 64 fp32, forward and backward,
              causal and not: the first tests of tests/test_attention.py) under pytest: wall seconds cold,
              then again on the caches the cold run filled (warm)
  first_call  the first forward + backward of `flash_attention` per dtype (`--dtypes`) at 4 × `--seq` × 64,
              causal: seconds, and the second call's milliseconds
  new_length  after one warm-up call (S 1024), the first call of each new sequence length (`--lengths`, bf16,
              2 × 16 × S × 64, causal) at once, while the background compiles the warm-up started may still
              run ("first", "second"), then of lengths new again (`--settled-lengths`) once they have ended
              ("first settled"), and of new batches at S 1024 (`--settled-batches`): milliseconds
  cpu         the CPU fallback (no CUDA, no interpreter) at 1 × 8 × 1024 × 64 fp32: the first call's seconds,
              first calls at other shapes and dtypes, and forward + backward against SDPA (medians, same process)
Each case's child process prints one JSON object; a row per case and measure records it (`ms` is the measured
time in milliseconds). Timings on the GPU need it; the CPU case runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cs336_systems.bench import options, report
from cs336_systems.bench.options import add_sized, positive_int
from cs336_systems.bench.record import key_of
from cs336_systems.bench.report import Output, Row

if TYPE_CHECKING:
    from cs336_systems.bench.record import Recorder

NAME = "coldstart"
HELP = "first-call times in fresh processes with empty caches: the course's tests, new signatures and lengths, CPU"
CASES = ("course", "first_call", "new_length", "cpu")
FIELDS = {"variant": str, "mode": str}
OK_FIELDS = {"ms": (int, float)}
REPO = Path(__file__).resolve().parents[2]
COURSE_TESTS = "test_flash_forward_pass or test_flash_backward_pytorch or test_flash_backward_triton"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sized(p, "--cases", full=list(CASES), smoke=["first_call", "cpu"], help="cases to run", choices=CASES,
              nargs="+")
    add_sized(p, "--dtypes", full=["bf16", "fp16", "fp32"], smoke=["fp32"], help="dtypes of first_call",
              choices=options.DTYPE_NAMES, nargs="+")
    add_sized(p, "--seq", full=128, smoke=32, help="sequence length of first_call", type=positive_int)
    add_sized(p, "--lengths", full=[1536, 3000, 777], smoke=[40], help="new sequence lengths", type=positive_int,
              nargs="+")
    add_sized(p, "--settled-lengths", full=[1280, 2500, 1111, 2048, 4096], smoke=[56], type=positive_int, nargs="+",
              help="new sequence lengths called after the background compiles end (on an H200 2048 and 4096 route "
                   "to the Gluon kernels, which the first call's background compiles prepare)")
    add_sized(p, "--settled-batches", full=[3, 8], smoke=[3], type=positive_int, nargs="+",
              help="new batch sizes (x 16 x 1024 x 64) called after the background compiles end (8 routes the forward "
                   "to the Gluon kernel on an H200)")
    add_sized(p, "--cpu-seq", full=1024, smoke=64, help="sequence length of the CPU case", type=positive_int)
    add_sized(p, "--timeout", full=600, smoke=300, help="seconds a child process may take", type=positive_int)


def needs_device(args: argparse.Namespace) -> bool:
    return args.cases != ["cpu"]


def _child_env(cache: Path, cpu: bool, interpret: bool) -> dict[str, str]:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache / "triton"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
               PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _child(case: str, payload: dict, cache: Path, cpu: bool, interpret: bool, timeout: int) -> dict:
    """Run `case` in a fresh interpreter; its last stdout line is a JSON object."""
    cmd = [sys.executable, "-m", "cs336_systems.bench.coldstart", case, json.dumps(payload)]
    done = subprocess.run(cmd, env=_child_env(cache, cpu, interpret), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{case} child exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _course(cache: Path, interpret: bool, timeout: int) -> float:
    """Seconds of the course's tests under pytest (a fresh process)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_attention.py", "-k",
           COURSE_TESTS]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=_child_env(cache, False, interpret), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"the course's tests failed: {done.stdout.strip()[-400:]}")
    return seconds


def run(args: argparse.Namespace, rec: Recorder) -> int:
    interpret = rec.device is not None and rec.device.type != "cuda"
    base = {"impl": "flash_triton"}
    for case in options.progress(args.cases, args, NAME):
        with tempfile.TemporaryDirectory(prefix="cs336-coldstart-") as tmp:
            cache = Path(tmp)
            if case == "course":
                if not (REPO / "tests" / "test_attention.py").exists():
                    rec.skip({**base, "variant": case, "mode": "cold"}, "unsupported",
                             error="the course's tests are in the repository, not in the installed package")
                    continue
                for mode in ("cold", "warm"):
                    rec.measure({**base, "variant": case, "mode": mode},
                                lambda: {"ms": 1e3 * _course(cache, interpret, args.timeout)})
                continue
            if case == "first_call":
                for dtype in args.dtypes:
                    fields = {**base, "variant": case, "dtype": dtype, "batch": 4, "n_heads": 1, "seq_len": args.seq,
                              "d_head": 64, "is_causal": True}
                    result = {}

                    def first(dtype=dtype, result=result, cache=cache):
                        result.update(_child("first_call", {"dtype": dtype, "seq": args.seq}, cache / dtype, False, interpret,
                                             args.timeout))
                        return {"ms": 1e3 * result["first_s"], "import_s": result["import_s"]}

                    if rec.measure({**fields, "mode": "first"}, first)["status"] == "ok":
                        rec.measure({**fields, "mode": "second"}, lambda r=result: {"ms": r["second_ms"]})
                continue
            if case == "new_length":
                result = _child("new_length", {"lengths": args.lengths, "settled": args.settled_lengths,
                                               "batches": args.settled_batches}, cache, False, interpret, args.timeout)
                fields = {**base, "variant": case, "dtype": "bf16", "batch": 2, "n_heads": 16, "d_head": 64,
                          "is_causal": True}
                for length, (first_ms, second_ms) in zip(args.lengths, result["ms"]):
                    rec.measure({**fields, "seq_len": length, "mode": "first"}, lambda ms=first_ms: {"ms": ms})
                    rec.measure({**fields, "seq_len": length, "mode": "second"}, lambda ms=second_ms: {"ms": ms})
                for length, ms in zip(args.settled_lengths, result["settled_ms"]):
                    rec.measure({**fields, "seq_len": length, "mode": "first settled"}, lambda ms=ms: {"ms": ms})
                for batch, ms in zip(args.settled_batches, result["batch_ms"]):
                    rec.measure({**fields, "batch": batch, "seq_len": 1024, "mode": "first settled"},
                                lambda ms=ms: {"ms": ms})
                continue
            result = _child("cpu", {"seq": args.cpu_seq}, cache, True, False, args.timeout)
            fields = {**base, "variant": case, "dtype": "fp32", "batch": 1, "n_heads": 8, "seq_len": args.cpu_seq,
                      "d_head": 64, "is_causal": True}
            rec.measure({**fields, "mode": "first"}, lambda: {"ms": 1e3 * result["first_s"]})
            for label, seconds in result["other_first_s"].items():
                rec.measure({**fields, "mode": f"first {label}"}, lambda s=seconds: {"ms": 1e3 * s})
            rec.measure({**fields, "mode": "fwd_bwd"}, lambda: {"ms": result["ours_ms"], "sdpa_ms": result["sdpa_ms"],
                                                               "x_sdpa": result["ours_ms"] / result["sdpa_ms"]})
    return 0


# ---------------------------------------------------------------------------------------------
# The child processes (`python -m cs336_systems.bench.coldstart CASE PAYLOAD`)
# ---------------------------------------------------------------------------------------------


def _step(attention, q, k, v) -> None:
    attention(q, k, v, is_causal=True).sum().backward()


def _child_first_call(payload: dict) -> dict:
    start = time.perf_counter()
    import torch

    from cs336_systems import flash_attention
    from cs336_systems.bench.timing import torch_dtype

    import_s = time.perf_counter() - start
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(4, 1, payload["seq"], 64, device=device, dtype=torch_dtype(payload["dtype"]), requires_grad=True)
               for _ in range(3))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        _step(flash_attention, q, k, v)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"import_s": import_s, "first_s": times[0], "second_ms": 1e3 * times[1]}


def _child_new_length(payload: dict) -> dict:
    import torch

    from cs336_systems import flash_attention
    from cs336_systems.flash import launch

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def call(n: int, batch: int = 2) -> float:
        q, k, v = (torch.randn(batch, 16, n, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _step(flash_attention, q, k, v)
        if device == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start)

    call(1024)  # compiles the signature's kernels, and starts the other length class's in the background
    ms = [(call(n), call(n)) for n in payload["lengths"]]
    launch.wait_for_background_compiles()
    settled = [call(n) for n in payload["settled"]]
    return {"ms": ms, "settled_ms": settled, "batch_ms": [call(1024, batch) for batch in payload["batches"]]}


def _child_cpu(payload: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from cs336_systems import flash_attention

    n = payload["seq"]

    def inputs(shape, dtype=torch.float32):
        return [torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3)]

    start = time.perf_counter()
    _step(flash_attention, *inputs((1, 8, n, 64)))
    first_s = time.perf_counter() - start
    other = {}
    for label, shape, dtype in (("2x4x300x32", (2, 4, 300, 32), torch.float32),
                                ("1x8x512x64 bf16", (1, 8, 512, 64), torch.bfloat16),
                                ("1x2x2000x128", (1, 2, 2000, 128), torch.float32)):
        start = time.perf_counter()
        _step(flash_attention, *inputs(shape, dtype))
        other[label] = time.perf_counter() - start
    q, k, v = inputs((1, 8, n, 64))

    def median_ms(attention) -> float:
        times = []
        for _ in range(7):
            start = time.perf_counter()
            _step(attention, q, k, v)
            times.append(1e3 * (time.perf_counter() - start))
        return sorted(times)[len(times) // 2]

    sdpa = F.scaled_dot_product_attention
    median_ms(sdpa)  # warm both before the rounds
    ours, theirs = [], []
    for _ in range(5):  # interleaved rounds: the machine's state drifts alike for both
        ours.append(median_ms(flash_attention))
        theirs.append(median_ms(sdpa))
    return {"first_s": first_s, "other_first_s": other, "ours_ms": min(ours), "sdpa_ms": min(theirs)}


_CHILDREN = {"first_call": _child_first_call, "new_length": _child_new_length, "cpu": _child_cpu}


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _cell(r: Row | None) -> str:
    if r is None:
        return "–"
    if r["status"] != "ok":
        return r["status"].split(":")[0] + (" (timeout)" if "TimeoutExpired" in r["status"] else "")
    ms = r["ms"]
    shown = f"{ms / 1e3:.2f} s" if ms >= 1000 else f"{ms:.1f} ms"
    return shown + (f", {r['x_sdpa']:.2f}× SDPA" if r.get("x_sdpa") else "")


def render(rows: list[Row], out: Output) -> list[str]:
    """One column per commit (in the order first measured), one line per case and measure: before and after."""
    shape = ("variant", "mode", "dtype", "batch", "n_heads", "seq_len", "d_head")
    commits = list(dict.fromkeys(r["commit"] for r in rows))
    latest = {(key_of(r, shape), r["commit"]): r for r in rows}  # file order is time order
    keys = list(dict.fromkeys(key_of(r, shape) for r in report.sort_rows(rows, shape)))
    cells = [[*("–" if v is None else v for v in key), *(_cell(latest.get((key, c))) for c in commits)] for key in keys]
    return ["## First calls (fresh processes, empty caches), per commit\n\n"
            + report.markdown([*shape, *commits], cells)]


if __name__ == "__main__":
    print(json.dumps(_CHILDREN[sys.argv[1]](json.loads(sys.argv[2]))))
