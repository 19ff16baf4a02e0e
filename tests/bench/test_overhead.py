"""`cs336-bench overhead`: host time per call beside the GPU time, per implementation and pass."""

from __future__ import annotations

import time

import torch

from cs336_systems.bench.timing import host_times

from .helpers import check_report, check_rows, rows_of, run_cli, timed, write_rows


def test_smoke_overhead(tmp_path):
    assert run_cli("overhead", "--smoke", "--impls", "flash_triton", "sdpa_math", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "overhead")
    check_rows(rows, "overhead", ("host_us", "host_us_p20", "host_us_p80", "wall_ms", "iters", "warmup_iters"))
    assert {(r["impl"], r["mode"], r["status"]) for r in rows} == {
        (i, m, "ok") for i in ("flash_triton", "sdpa_math") for m in ("fwd", "bwd", "fwd_bwd")
    }
    for r in rows:
        assert r["host_us"] > 0 and r["host_us_p20"] <= r["host_us"] <= r["host_us_p80"]
        assert (r["batch"], r["n_heads"], r["seq_len"], r["d_head"], r["is_causal"]) == (1, 2, 32, 16, True)
    table = check_report(tmp_path, "overhead")
    assert "fwd host µs" in table and "fwd_bwd host µs" in table and "| ours |" in table


def test_overhead_cuda_graphs_time_forward_and_backward_as_a_pair(tmp_path):
    """A CUDA-graph impl's lone forward or backward would time re-recording: unsupported rows that say so."""
    from cs336_systems.bench.overhead import PAIRED_ONLY

    assert run_cli("overhead", "--smoke", "--impls", "flash_triton_cudagraphs", "--out", str(tmp_path)) == 0
    rows = {r["mode"]: r for r in rows_of(tmp_path, "overhead")}
    assert set(rows) == {"fwd", "bwd", "fwd_bwd"} and all(r["status"] == "unsupported" for r in rows.values())
    assert rows["fwd"]["error"] == rows["bwd"]["error"] == PAIRED_ONLY
    assert "CPU" in rows["fwd_bwd"]["error"]  # cannot compile here; on a GPU the pair is timed


def test_host_times_measure_the_call_not_waiting():
    """host_us is the time the call takes to return (here: a sleep of 2 ms)."""
    stats = host_times(lambda: time.sleep(0.002), torch.device("cpu"), iters=5, warmup=1)
    assert 2000 <= stats["host_us"] < 50_000


def test_overhead_table_lines_come_from_one_run(tmp_path):
    """A line of the table shows one run: a later run's unsupported forward is not covered by an earlier
    run's figure for it (the latest-ok rule alone would mix the two runs in one line)."""
    shape = dict(impl="flash_triton_cudagraphs", dtype="bf16", batch=1, n_heads=16, seq_len=1024, d_head=64,
                 is_causal=True, peak_mem_mb=1.0)
    extra = dict(host_us=100.0, host_us_p20=90.0, host_us_p80=110.0, wall_ms=0.2)
    write_rows(tmp_path, "overhead", [{**shape, "mode": m, **timed(7.013, **extra)} for m in ("fwd", "bwd")]
               + [{**shape, "mode": "fwd_bwd", **timed(1.0, **extra)}], run_id="old")
    write_rows(tmp_path, "overhead", [{**shape, "mode": m, "status": "unsupported", "error": "paired"}
                                      for m in ("fwd", "bwd")]
               + [{**shape, "mode": "fwd_bwd", **timed(0.363, **extra)}], run_id="new")
    table = check_report(tmp_path, "overhead")
    line = next(x for x in table.splitlines() if x.startswith("| ours (CUDA graphs) |"))
    assert "7,013" not in line and "unsupported" in line and "363" in line, line
