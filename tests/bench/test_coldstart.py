"""`cs336-bench coldstart`: first calls in fresh processes with empty caches."""

from __future__ import annotations

from .helpers import check_report, rows_of, run_cli, timed, write_rows


def test_smoke_coldstart_cpu_case(tmp_path):
    """The CPU fallback case in a fresh process (no CUDA, no interpreter): its first calls and the step against
    SDPA in the same process, one row each."""
    assert run_cli("coldstart", "--smoke", "--cases", "cpu", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "coldstart")
    assert [r["status"] for r in rows] == ["ok"] * 5, rows
    assert {r["mode"] for r in rows} >= {"first", "fwd_bwd"}
    step = next(r for r in rows if r["mode"] == "fwd_bwd")
    assert step["ms"] > 0 and step["sdpa_ms"] > 0 and step["x_sdpa"] == step["ms"] / step["sdpa_ms"]
    assert "SDPA" in check_report(tmp_path, "coldstart", plots=False)


def test_coldstart_table_has_a_column_per_commit(tmp_path):
    """Before and after side by side: one column per commit, in the order first measured, the latest row of each."""
    shape = dict(impl="flash_triton", variant="first_call", mode="first", dtype="bf16", batch=4, n_heads=1,
                 seq_len=128, d_head=64, is_causal=True)
    write_rows(tmp_path, "coldstart", [{**shape, **timed(16800.0)}], commit="old1234")
    write_rows(tmp_path, "coldstart", [{**shape, **timed(9000.0)}, {**shape, **timed(4300.0)}], commit="new5678")
    table = check_report(tmp_path, "coldstart", plots=False)
    assert "| old1234 | new5678 |" in table and "| 16.80 s | 4.30 s |" in table
