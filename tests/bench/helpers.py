"""Shared helpers of the `cs336-bench` tests: run the CLI in-process, read and check its rows."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cs336_systems.bench import cli
from cs336_systems.bench.record import read_rows

REQUIRED = (
    "problem", "impl", "mode", "dtype", "batch", "n_heads", "seq_len", "d_head", "is_causal", "ms", "ms_p20",
    "ms_p80", "tflops", "peak_mem_mb", "status", "gpu", "torch", "triton", "commit", "run_id", "time",
    "matmul_precision", "code_sha", "smoke",
)
# Rows a smoke run may legitimately not complete: SDPA backends that have no kernel for the CPU / dtype,
# and torch.compile around our kernels (dynamo cannot trace Triton-interpreter kernels).
ALLOWED_NOT_OK = {"sdpa_flash", "sdpa_cudnn", "sdpa_efficient"}
META = dict(gpu="NVIDIA H200", torch="2.11", triton="3.6", commit="abc1234", run_id="r1", time="t",
            matmul_precision="highest")


def run_cli(*argv: str) -> int:
    return cli.main([*argv, "--no-progress"])


def rows_of(out: Path, problem: str) -> list[dict]:
    return read_rows(out / problem / "metrics.jsonl")


def check_rows(rows: list[dict], problem: str, extra_fields: tuple[str, ...] = (), timed: bool = True) -> None:
    """Every row of one smoke run: complete, of this problem, ok (or an allowed unsupported), marked smoke."""
    assert rows, f"no rows for {problem}"
    assert len({r["run_id"] for r in rows}) == 1
    for r in rows:
        missing = [f for f in (*REQUIRED, *(extra_fields if r["status"] == "ok" else ())) if f not in r]
        assert not missing, f"{problem} row lacks {missing}: {r}"
        assert r["problem"] == problem and r["smoke"] is True
        if r["status"] != "ok":
            assert r["status"] == "unsupported" and (r["impl"] in ALLOWED_NOT_OK or "compiled" in r["impl"]
                                                     or r.get("compiled")), r
        elif timed:
            assert r["ms"] > 0 and r["ms_p20"] <= r["ms"] <= r["ms_p80"], r
        if not torch.cuda.is_available():
            assert r["timings_meaningless"] is True and r["gpu"] == "cpu"


def check_report(out: Path, problem: str, plots: bool = True) -> str:
    """Render one problem; return its table.md."""
    assert cli.main(["report", "--out", str(out), "--problems", problem]) == 0
    table = (out / problem / "table.md").read_text()
    assert table.startswith(f"# {problem}") and "|---|" in table
    if plots:
        assert list((out / problem).glob("*.png")), f"no plot for {problem}"
    return table


def write_rows(out: Path, problem: str, rows: list[dict], **meta) -> Path:
    """A metrics.jsonl of hand-made rows (each with `META` unless overridden)."""
    (out / problem).mkdir(parents=True, exist_ok=True)
    path = out / problem / "metrics.jsonl"
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps({"problem": problem, **META, **meta, **r}) + "\n")
    return path


def timed(ms: float, **extra) -> dict:
    """The metric fields of an ok row taking `ms`."""
    return dict(status="ok", ms=ms, ms_p20=0.9 * ms, ms_p80=1.1 * ms, ms_mean=ms, ms_std=0.1, tflops=1.0, **extra)
