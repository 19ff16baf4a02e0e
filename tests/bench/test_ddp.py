"""`cs336-bench ddp`: every variant in one Gloo smoke run on the CPU (2 spawned ranks), checks, report."""

from __future__ import annotations

import argparse

import pytest

from cs336_systems.bench import ddp as ddp_bench

from .helpers import check_report, rows_of, run_cli, timed, write_rows


def test_smoke_ddp(tmp_path, capsys):
    assert run_cli("ddp", "--smoke", "--bucket-sizes-mb", "0.001", "100", "--shard-bucket-mb", "0.01",
                   "--out", str(tmp_path)) == 0
    assert "[ddp] 2 ranks (gloo), model smoke, 2 x 32 tokens per rank: 9 variant(s)" in capsys.readouterr().out
    rows = rows_of(tmp_path, "ddp")
    assert [(r["impl"], r["bucket_mb"], r["optimizer"]) for r in rows] == [
        ("local", None, "adamw"), ("naive", None, "adamw"), ("flat", None, "adamw"), ("individual", None, "adamw"),
        ("bucketed", 0.001, "adamw"), ("bucketed", 0.01, "adamw"), ("bucketed", 100, "adamw"),
        ("torch_ddp", None, "adamw"), ("bucketed", 0.01, "sharded_adamw"),
    ]
    n_params = rows[0]["n_params"]
    for r in rows:
        assert r["status"] == "ok" and r["smoke"] is True, r
        assert (r["backend"], r["world_size"], r["model_size"], r["context_length"], r["batch"]) == (
            "gloo", 2, "smoke", 32, 2)
        assert r["vocab"] == 512
        assert (r["steps"], r["warmup_steps"], r["n_timed"]) == (2, 1, 2)
        assert r["ms"] > 0 and min(r["fwd_bwd_ms"], r["sync_ms"], r["opt_ms"]) >= 0
        assert 0 <= r["comm_share"] < 1 and len(r["rank_median_ms"]) == 2
        assert r["n_params"] == n_params and r["peak_mem_mb"] is None  # no CUDA allocator on the CPU
    buckets = {r["bucket_mb"]: r["n_buckets"] for r in rows if r["impl"] == "bucketed"}
    assert buckets[0.001] > buckets[0.01] > buckets[100] == 1  # the smoke model is ~0.2 MiB of fp32
    table = check_report(tmp_path, "ddp")
    assert "| PyTorch DDP |" in table and "bucketed 0.01 MiB + sharded AdamW" in table


def test_world_size_checks(monkeypatch):
    import torch

    def args(**kw):
        return argparse.Namespace(**{"world_size": 2, "smoke": False, **kw})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert ddp_bench.backend_for(args()) == "nccl"
    with pytest.raises(ValueError, match="2 GPU"):
        ddp_bench.backend_for(args(world_size=4))
    with pytest.raises(ValueError, match="at least 2"):
        ddp_bench.backend_for(args(world_size=1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert ddp_bench.backend_for(args(smoke=True, world_size=3)) == "gloo"


def test_world_size_under_torchrun(monkeypatch):
    """The job's world size; NCCL needs a GPU per rank on this host, not per rank of the job."""
    import torch

    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "node0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = argparse.Namespace(world_size=None, smoke=False)
    assert (ddp_bench.world_size_of(args), ddp_bench.backend_for(args)) == (4, "nccl")
    with pytest.raises(ValueError, match="torchrun started 4 ranks"):
        ddp_bench.backend_for(argparse.Namespace(world_size=2, smoke=False))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 ranks on this host, which has 1 GPU"):
        ddp_bench.backend_for(args)


def test_runs_include_the_sharded_twin():
    args = argparse.Namespace(impls=["naive", "bucketed"], bucket_sizes_mb=[10, 1], shard_bucket_mb=25,
                              no_sharding=False)
    runs = [(r["impl"], r["bucket_mb"], r["optimizer"]) for r in ddp_bench.runs_of(args)]
    assert runs == [("naive", None, "adamw"), ("bucketed", 1, "adamw"), ("bucketed", 10, "adamw"),
                    ("bucketed", 25, "adamw"), ("bucketed", 25, "sharded_adamw")]
    args.no_sharding = True
    assert len(ddp_bench.runs_of(args)) == 3


def test_render_rows(tmp_path):
    base = dict(mode="train_step", dtype="fp32", backend="nccl", world_size=2, model_size="xl", context_length=512,
                batch=4, vocab=10000, steps=10, warmup_steps=5, optimizer="adamw", bucket_mb=None, n_buckets=None)
    mem = dict(mem_before_build_mib=[0.0, 0.0], mem_init_mib=[8192.0, 8192.0], peak_before_step_mib=[40960.0, 40960.0],
               peak_step_mib=[57344.0, 57344.0], mem_after_step_mib=[32768.0, 32768.0])

    def row(impl, variant, ms, sync, **extra):
        return {**base, "impl": impl, "variant": variant, **timed(ms), "fwd_bwd_ms": ms - sync - 50,
                "sync_ms": sync, "opt_ms": 50.0, "comm_share": sync / ms, **mem, **extra}

    write_rows(tmp_path, "ddp", [
        row("local", "no sync (compute only)", 800.0, 0.0),
        row("naive", "naive (all-reduce per parameter)", 850.0, 40.0),
        row("bucketed", "bucketed 100 MiB", 820.0, 10.0, bucket_mb=100, n_buckets=80),
        row("torch_ddp", "PyTorch DDP", 810.0, 0.0),
        row("bucketed", "bucketed 100 MiB + sharded AdamW", 840.0, 10.0, bucket_mb=100, n_buckets=80,
            optimizer="sharded_adamw", mem_after_step_mib=[24576.0, 24576.0]),
    ])
    table = check_report(tmp_path, "ddp")
    assert "| naive (all-reduce per parameter) | 850.0 | 760.0 | 40.000 | 50.000 | 4.7% | 50.000 (5.9%) | 0.95× |" in table
    assert "| bucketed 100 MiB + sharded AdamW | 0.00 / 0.00 | 8.00 / 8.00 | 40.00 / 40.00 | 56.00 / 56.00 | 24.00 / 24.00 |" in table
