"""`cs336-bench leaderboard`: the course's harness on tiny sizes, every row's settings recorded, report."""

from __future__ import annotations

import torch

from .helpers import check_report, check_rows, rows_of, run_cli


def test_smoke_leaderboard(tmp_path, capsys):
    from cs336_systems.flash_ablation import ABLATION_VARIANTS

    variants = list(ABLATION_VARIANTS)
    final = variants[-1]
    assert run_cli("leaderboard", "--smoke", "--variant", final, "--variant", "naive", "--variant", variants[0],
                   "--seq", "32", "--n-heads", "2", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "leaderboard")
    check_rows(rows, "leaderboard", ("variant", "ms_mean", "compiled", "rep_ms", "warmup_ms"))
    for r in rows:
        assert (r["seq_len"], r["n_heads"], r["rep_ms"], r["warmup_ms"]) == (32, 2, 100, 25), r
        assert r["matmul_precision"] == torch.get_float32_matmul_precision()
    ours = [r for r in rows if r["variant"] == final]
    assert {r["mode"] for r in ours} == {"fwd", "fwd_bwd"}
    assert all(r["impl"] == "flash_triton" and r["status"] == "ok" and r["shipped"] for r in ours)
    assert {r["variant_index"] for r in rows if r["impl"] == "flash_triton"} == {0, len(variants) - 1}
    assert {r["variant"] for r in rows} == {final, variants[0], "naive", "sdpa_flash", "sdpa_cudnn"}
    assert [r for r in rows if r["variant"] == "naive"][0]["compiled"] is True
    assert "speedup (reference mean / mean)" in capsys.readouterr().out
    table = check_report(tmp_path, "leaderboard")
    assert "ours (shipped)" in table
