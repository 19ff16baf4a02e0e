"""`cs336-bench flash` (flash_benchmarking): a smoke sweep over the default implementations and a variant, report."""

from __future__ import annotations

from .helpers import check_report, check_rows, rows_of, run_cli


def test_smoke_flash(tmp_path):
    assert run_cli("flash", "--smoke", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "flash")
    check_rows(rows, "flash", ("rep_ms", "warmup_ms"))
    by_impl = {(r["impl"], r["mode"]): r for r in rows}
    for impl in ("naive", "flash_triton"):
        for mode in ("fwd", "bwd", "fwd_bwd"):
            assert by_impl[(impl, mode)]["status"] == "ok"
            assert by_impl[(impl, mode)]["tflops"] > 0
    assert {r["impl"] for r in rows} >= {"sdpa_flash", "sdpa_cudnn", "sdpa_efficient"}
    for r in rows:  # no CUDA here: no one-call peak; the floor is q, k, v, o (+ dO, dq, dk, dv, L) in fp32
        if r["status"] == "ok":
            n = r["batch"] * r["seq_len"] * r["d_head"] * 4
            floor = 4 * n if r["mode"] == "fwd" else 8 * n + r["batch"] * r["seq_len"] * 4
            assert r["call_peak_mem_mb"] is None and r["floor_mem_mb"] == floor / 2**20
    table = check_report(tmp_path, "flash")
    assert "| naive | ours |" in table and "| ours vs naive |" in table  # the shipped kernel is "ours"
    assert (tmp_path / "flash" / "flash_speedup_fp32_fwd.png").exists()


def test_smoke_flash_registry_names(tmp_path):
    from cs336_systems.flash_ablation import ABLATION_VARIANTS

    first = f"flash_triton:{next(iter(ABLATION_VARIANTS))}"
    assert run_cli("flash", "--smoke", "--impls", first, "sdpa_math", "--modes", "fwd_bwd",
                   "--out", str(tmp_path)) == 0
    assert {(r["impl"], r["status"]) for r in rows_of(tmp_path, "flash")} == {(first, "ok"), ("sdpa_math", "ok")}
