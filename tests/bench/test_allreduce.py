"""`cs336-bench allreduce`: a Gloo smoke run on the CPU (2 spawned ranks, then 2 ranks of torchrun), the run
plan per host, report."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_systems.bench import allreduce

from .helpers import check_report, rows_of, run_cli, timed, write_rows

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost"}


def test_smoke_allreduce(tmp_path, capsys):
    assert run_cli("allreduce", "--smoke", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "allreduce")
    assert [(r["backend"], r["world_size"], r["size_mb"]) for r in rows] == [("gloo", 2, 0.25), ("gloo", 2, 1)]
    progress = capsys.readouterr().out
    assert "variant=0.25 MB, 2 ranks" in progress and "variant=1 MB, 2 ranks" in progress
    for r in rows:
        assert r["status"] == "ok" and r["smoke"] is True and r["device"] == "cpu"
        assert (r["iters"], r["warmup_iters"], r["n_timed"]) == (2, 1, 2)
        assert r["bytes"] == r["size_mb"] * 10**6
        assert r["ms_p20"] <= r["ms"] <= r["ms_p80"]
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["ms"] * 1e-3) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # 2(n-1)/n = 1 for two ranks
        assert len(r["rank_median_ms"]) == 2 and max(r["rank_median_ms"]) <= r["ms_p80"] + 1e-9
    # --resume: every measurement is done, so nothing is spawned and nothing written.
    assert run_cli("allreduce", "--smoke", "--resume", "--out", str(tmp_path)) == 0
    assert len(rows_of(tmp_path, "allreduce")) == 2
    # ... unless other code measured them: a row of another code_sha is measured again
    path = tmp_path / "allreduce" / "metrics.jsonl"
    path.write_text("".join(json.dumps({**r, "code_sha": "other"}) + "\n" for r in rows))
    assert run_cli("allreduce", "--smoke", "--resume", "--out", str(tmp_path)) == 0
    assert len(rows_of(tmp_path, "allreduce")) == 4
    table = check_report(tmp_path, "allreduce")
    assert "| gloo | 2 |" in table


def namespace(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"backends": None, "world_sizes": None, "smoke": False, **kw})


def test_plan_follows_the_host(monkeypatch):
    monkeypatch.setattr(allreduce, "gpu_count", lambda: 2)
    assert allreduce.plan(namespace()) == [("nccl", 2), ("gloo", 2), ("gloo", 4), ("gloo", 6)]
    assert allreduce.plan(namespace(backends=["gloo"], world_sizes=[6, 2])) == [("gloo", 6), ("gloo", 2)]
    with pytest.raises(ValueError, match="2 GPU"):
        allreduce.plan(namespace(backends=["nccl"], world_sizes=[2, 4]))
    with pytest.raises(ValueError, match="at least 2"):
        allreduce.plan(namespace(backends=["gloo"], world_sizes=[1]))
    monkeypatch.setattr(allreduce, "gpu_count", lambda: 0)
    assert allreduce.plan(namespace(smoke=True)) == [("gloo", 2)]
    with pytest.raises(ValueError, match="0 GPU"):
        allreduce.plan(namespace(backends=["nccl"]))


def test_smoke_allreduce_under_torchrun(tmp_path):
    """Started by torchrun, the two processes are the two ranks (none spawned), and rank 0 alone records."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "cs336_systems.bench.cli", "allreduce", "--smoke", "--no-progress", "--timeout-s", "60",
               "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = rows_of(tmp_path, "allreduce")
    assert [(r["backend"], r["world_size"], r["size_mb"], r["status"]) for r in rows] == [
        ("gloo", 2, 0.25, "ok"), ("gloo", 2, 1, "ok")]
    assert "variant=1 MB, 2 ranks" in done.stdout


def test_plan_under_torchrun(monkeypatch):
    """The job's one process group: its world size, one backend, GPUs for the ranks on this host."""
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(allreduce, "gpu_count", lambda: 0)
    assert allreduce.plan(namespace()) == [("gloo", 2)]
    with pytest.raises(ValueError, match="torchrun started 2 ranks"):
        allreduce.plan(namespace(world_sizes=[4]))
    with pytest.raises(ValueError, match="one backend"):
        allreduce.plan(namespace(backends=["nccl", "gloo"]))
    with pytest.raises(ValueError, match="2 ranks on this host, which has 0 GPU"):
        allreduce.plan(namespace(backends=["nccl"]))
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 4 hosts of 2 GPUs
    monkeypatch.setattr(allreduce, "gpu_count", lambda: 2)
    assert allreduce.plan(namespace()) == [("nccl", 8)]
    monkeypatch.setenv("RANK", "first")
    with pytest.raises(ValueError, match="integers"):
        allreduce.plan(namespace())


def test_nccl_without_gpus_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(allreduce, "gpu_count", lambda: 0)
    with pytest.raises(SystemExit) as exc:
        run_cli("allreduce", "--smoke", "--backends", "nccl")
    assert exc.value.code == 2


def test_render_rows(tmp_path):
    base = dict(impl="nccl", mode="all_reduce", dtype="fp32", backend="nccl", device="cuda", iters=10,
                warmup_iters=5)
    write_rows(tmp_path, "allreduce", [
        {**base, "world_size": 2, "size_mb": 1, **timed(0.05), "algbw_gbps": 20.0, "busbw_gbps": 20.0,
         "rank_median_ms": [0.049, 0.05]},
        {**base, "world_size": 2, "size_mb": 1000, **timed(3.0), "algbw_gbps": 333.3, "busbw_gbps": 333.3,
         "rank_median_ms": [2.9, 3.0]},
        {**base, "impl": "gloo", "backend": "gloo", "device": "cpu", "world_size": 4, "size_mb": 1,
         "status": "error: WorkerError: rank 1 raised"},
    ])
    table = check_report(tmp_path, "allreduce")
    assert "| nccl | 2 | 0.05 ms, 20.000 GB/s | 3.000 ms, 333.3 GB/s |" in table
    assert "| gloo | 4 | error | – |" in table


def test_gloo_alone_needs_no_gpu():
    """`--backends gloo` runs on the CPU machine; NCCL (or the default choice) needs CUDA."""
    assert not allreduce.needs_device(namespace(backends=["gloo"]))
    assert allreduce.needs_device(namespace(backends=["gloo", "nccl"]))
    assert allreduce.needs_device(namespace())


@pytest.mark.parametrize("size", ["0.000001", "0.0000025", "1.0000001"])
def test_a_size_that_is_no_whole_number_of_floats_is_a_usage_error(size, capsys):
    """A row's size_mb is what was reduced: 1 byte (was reduced as one float32, 4 bytes) is refused before any run."""
    with pytest.raises(SystemExit) as exc:
        run_cli("allreduce", "--smoke", "--backends", "gloo", "--sizes-mb", size)
    assert exc.value.code == 2 and "not a whole number of float32" in capsys.readouterr().err


def test_sizes_in_whole_floats_are_taken():
    from cs336_systems.bench.allreduce import float32_size_mb

    assert float32_size_mb("0.25") == 0.25 and float32_size_mb("0.000004") == 4e-6 and float32_size_mb("1000") == 1000
