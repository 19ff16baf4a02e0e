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
    out = capsys.readouterr().out
    assert "speedup (reference mean / mean)" in out and "0.00x" not in out
    if not torch.cuda.is_available():
        assert f"{final:<28} fwd_bwd" in out and "none: timings off the GPU are meaningless" in out
    table = check_report(tmp_path, "leaderboard")
    assert "ours (shipped)" in table


def test_speedups_only_where_both_sides_were_measured(capsys):
    from cs336_systems.bench.leaderboard import print_speedups

    def row(variant: str, mode: str, ms: float | None, status: str = "ok", **extra) -> dict:
        impl = variant if variant.startswith("sdpa") else "flash_triton"
        return dict(impl=impl, variant=variant, mode=mode, status=status, ms=ms, ms_mean=ms, **extra)

    print_speedups([row("ours", "fwd_bwd", 4.0), row("sdpa_flash", "fwd_bwd", 7.0),
                    row("sdpa_cudnn", "fwd_bwd", None, "unsupported"), row("ours", "fwd", 500.0),
                    row("sdpa_flash", "fwd", 0.5)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].endswith("vs sdpa_flash=1.75x, vs sdpa_cudnn: unsupported")
    assert lines[3].endswith("7.000")  # a reference's own line
    assert lines[4].endswith("vs sdpa_flash=0.001x, vs sdpa_cudnn: not measured in this run")
    print_speedups([row("ours", "fwd", 500.0, timings_meaningless=True), row("sdpa_flash", "fwd", 0.5)])
    assert capsys.readouterr().out.splitlines()[2].endswith("none: timings off the GPU are meaningless")
