"""`cs336-bench attention`: smoke sweep, OOM and error rows, report."""

from __future__ import annotations

import torch

import cs336_basics.model as basics_model

from .helpers import check_report, check_rows, rows_of, run_cli


def test_smoke_attention(tmp_path):
    assert run_cli("attention", "--smoke", "--compile", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "attention")
    check_rows(rows, "attention", ("mem_before_bwd_mb", "ms_mean", "ms_std", "iters", "warmup_iters"))
    assert {(r["impl"], r["mode"]) for r in rows} == {
        (i, m) for i in ("naive", "naive_compiled") for m in ("fwd", "bwd")
    }
    assert all(r["status"] == "ok" for r in rows)
    table = check_report(tmp_path, "attention")
    assert "naive (compiled) fwd" in table and "compiled speedup fwd" in table


def test_oom_becomes_a_row_and_sweep_continues(tmp_path, monkeypatch):
    real = basics_model.scaled_dot_product_attention

    def oom_at_seq_16(q, k, v, mask=None):
        if q.shape[-2] == 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return real(q, k, v, mask=mask)

    monkeypatch.setattr(basics_model, "scaled_dot_product_attention", oom_at_seq_16)
    assert run_cli("attention", "--smoke", "--seq", "16", "32", "--out", str(tmp_path)) == 0
    status = {(r["seq_len"], r["mode"]): r["status"] for r in rows_of(tmp_path, "attention")}
    assert status == {(16, "fwd"): "oom", (16, "bwd"): "oom", (32, "fwd"): "ok", (32, "bwd"): "ok"}
    oom_row = next(r for r in rows_of(tmp_path, "attention") if r["status"] == "oom")
    assert oom_row["ms"] is None and "out of memory" in oom_row["error"]
    assert "OOM" in check_report(tmp_path, "attention")


def test_error_is_recorded_not_swallowed(tmp_path, monkeypatch):
    def broken(q, k, v, mask=None):
        raise ValueError("bad shape")

    monkeypatch.setattr(basics_model, "scaled_dot_product_attention", broken)
    assert run_cli("attention", "--smoke", "--seq", "16", "--out", str(tmp_path)) == 1
    assert {r["status"] for r in rows_of(tmp_path, "attention")} == {"error: ValueError: bad shape"}
