"""`cs336-bench grid`: the issue's training grid, ratios from rows of the same run, the host-bound step, report."""

from __future__ import annotations

import pytest

from cs336_systems.bench import cli, grid, options
from cs336_systems.bench.record import read_rows
from cs336_systems.bench.timing import median_round

from .helpers import check_report, check_rows, rows_of, run_cli, timed, write_rows


def test_the_grid_is_the_issues():
    """(B, S) x 16 heads x d 64 and 128 x causal and not x bf16 (fp16 at d 64), plus GQA 16:4 at (8, 2048)."""
    batch_seq = [(32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)]
    settings = [(64, "bf16"), (128, "bf16"), (64, "fp16")]
    expected = {(b, s, 16, kv, d, dtype, causal) for d, dtype in settings for causal in (True, False)
                for b, s, kv in [*((b, s, 16) for b, s in batch_seq), (8, 2048, 4)]}
    points = [(p.batch, p.seq_len, p.n_heads, p.n_kv_heads, p.d_head, p.dtype, p.is_causal) for p in grid.GRID]
    assert len(points) == len(set(points)) == 42 and set(points) == expected
    assert (grid.HOST_POINT.batch, grid.HOST_POINT.n_heads, grid.HOST_POINT.seq_len, grid.HOST_POINT.d_head,
            grid.HOST_POINT.dtype, grid.HOST_POINT.is_causal) == (1, 16, 1024, 64, "bf16", True)


def parsed(*argv: str):
    args = cli.build_parser().parse_args(["grid", *argv])
    options.resolve_sized(args)
    return args


def test_filters_select_subsets_of_the_grid():
    assert len(grid.selected(parsed())) == 42
    assert {(p.d_head, p.dtype) for p in grid.selected(parsed("--d", "128"))} == {(128, "bf16")}
    gqa = grid.selected(parsed("--gqa", "--causal", "--dtype", "fp16"))
    assert [(p.batch, p.seq_len, p.n_kv_heads, p.is_causal, p.dtype) for p in gqa] == [(8, 2048, 4, True, "fp16")]
    picked = grid.selected(parsed("--batch-seq", "8x2048", "1x16384", "--no-gqa"))
    assert {(p.batch, p.seq_len) for p in picked} == {(8, 2048), (1, 16384)} and len(picked) == 12


@pytest.mark.parametrize("argv", [
    ["--dtype", "fp32"],  # the full grid has no fp32 point
    ["--d", "16"],
    ["--batch-seq", "3x3"],
    ["--gqa", "--batch-seq", "32x512"],  # selects nothing
])
def test_filters_outside_the_full_grid_are_refused(argv):
    with pytest.raises(ValueError):
        grid.check(parsed(*argv))


@pytest.mark.parametrize("argv", [
    ["--batch-seq", "8"],
    ["--batch-seq", "0x64"],
    ["--d", "64"],  # not in the smoke grid
    ["--gqa", "--batch-seq", "1x64"],
    ["--impls", "flash_trition"],
    ["--sections", "nosuch"],
    ["--iters", "0"],
], ids=lambda argv: " ".join(argv))
def test_bad_options_are_usage_errors_before_any_row(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli("grid", *argv, "--smoke", "--out", str(tmp_path))
    assert exc.value.code == 2
    assert "usage: cs336-bench grid" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_smoke_grid(tmp_path, capsys):
    assert run_cli("grid", "--smoke", "--causal", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "grid")
    check_rows(rows, "grid", ("x_cudnn", "x_flash", "tflops"))
    on_grid = [r for r in rows if r["section"] == "grid"]
    assert {(r["batch"], r["seq_len"], r["n_kv_heads"]) for r in on_grid} == {(2, 32, 2), (1, 64, 2), (2, 32, 1)}
    assert {r["impl"] for r in on_grid} == set(grid.DEFAULT_IMPLS) and all(r["is_causal"] for r in on_grid)
    ours = [r for r in on_grid if r["impl"] == "flash_triton"]
    assert len(ours) == 6 and all(r["status"] == "ok" for r in ours)
    for r in ours:  # each ratio from the reference's row at the same point and mode of this run
        for ref, field in grid.REFERENCES.items():
            theirs = next(x for x in on_grid if x["impl"] == ref and x["mode"] == r["mode"]
                          and (x["batch"], x["seq_len"], x["n_kv_heads"]) == (r["batch"], r["seq_len"], r["n_kv_heads"]))
            assert r[field] == (r["ms"] / theirs["ms"] if theirs["status"] == "ok" else None)
    host = [r for r in rows if r["section"] == "host"]
    assert {r["impl"] for r in host} == set(grid.HOST_IMPLS) and {r["mode"] for r in host} == {"fwd_bwd"}
    assert all(r["host_us"] > 0 for r in host if r["impl"] in ("flash_triton", "flash_op"))
    assert "targets (ratios" in capsys.readouterr().out
    table = check_report(tmp_path, "grid")
    assert "## Targets" in table and "## Training grid, d 16 fp32 causal, 2 heads" in table
    assert "| 2 × 32, GQA 2:1 |" in table and "functional op - class:" in table

    assert run_cli("grid", "--smoke", "--causal", "--out", str(tmp_path), "--resume") == 0
    assert len(rows_of(tmp_path, "grid")) == len(rows)  # all done: nothing measured again


def test_resume_measures_a_point_again_whole(tmp_path):
    """A point with a row missing is measured again with its references, so that its ratios come from one run."""
    argv = ("grid", "--smoke", "--sections", "grid", "--batch-seq", "1x64", "--no-causal", "--modes", "fwd",
            "--impls", "flash_triton", "sdpa_math", "--out", str(tmp_path))
    assert run_cli(*argv, "--resume") == 0
    first = rows_of(tmp_path, "grid")
    assert {r["impl"] for r in first} == {"flash_triton", "sdpa_math"}
    path = tmp_path / "grid" / "metrics.jsonl"
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()
                            if '"impl": "sdpa_math"' not in line))
    assert run_cli(*argv, "--resume") == 0
    second = [r for r in read_rows(path) if r["run_id"] != first[0]["run_id"]]
    assert sorted(r["impl"] for r in second) == ["flash_triton", "sdpa_math"]


def row(impl: str, mode: str, ms: float | None, batch: int = 8, seq: int = 2048, kv: int = 16,
        x_cudnn: float | None = None, x_flash: float | None = None, section: str = "grid", **extra) -> dict:
    status = extra.pop("status", "ok")
    metrics = timed(ms, x_cudnn=x_cudnn, x_flash=x_flash) if status == "ok" else dict(status=status, ms=None)
    return dict(section=section, impl=impl, mode=mode, dtype="bf16", batch=batch, n_heads=16, n_kv_heads=kv,
                seq_len=seq, d_head=64, is_causal=True, rep_ms=100, warmup_ms=25, **metrics, **extra)


def test_render_states_the_worst_ratio_per_target(tmp_path):
    """ours / cuDNN per point; where cuDNN refused, ours / SDPA flash, said so; the host-bound targets."""
    write_rows(tmp_path, "grid", [
        row("sdpa_cudnn", "fwd_bwd", 2.0), row("sdpa_flash", "fwd_bwd", 2.5, x_cudnn=1.25),
        row("flash_triton", "fwd_bwd", 1.8, x_cudnn=0.9, x_flash=0.72),
        row("sdpa_cudnn", "fwd_bwd", None, kv=4, status="unsupported"), row("sdpa_flash", "fwd_bwd", 2.0, kv=4),
        row("flash_triton", "fwd_bwd", 2.2, kv=4, x_flash=1.1),
        *(row(impl, "fwd_bwd", ms, batch=1, seq=1024, x_flash=x, section="host", host_us=us, iters=200,
              warmup_iters=20)
          for impl, ms, x, us in (("sdpa_flash", 0.1, None, 40.0), ("flash_triton", 0.11, 1.1, 60.0),
                                  ("flash_op", 0.118, 1.18, 66.0))),
    ])
    table = check_report(tmp_path, "grid")
    assert "| 8 × 2048 | 1.800 | 2.500 | 2.000 | 0.90 |" in table
    assert "| 8 × 2048, GQA 16:4 | 2.200 | 2.000 | unsupported | 1.10 (vs SDPA flash) |" in table
    assert "worst 1.100 vs SDPA flash (missed) at 8 × 2048, GQA 16:4" in table
    assert "ours ≤ 1.25× SDPA flash: 1.100 (met)" in table
    assert "op - class = +8.0 µs (met)" in table


def test_targets_say_when_no_reference_ran():
    """A grid of variants only (--impls without cuDNN and SDPA flash) has no ratios: the targets say so rather than
    print nothing."""
    rows = [row("flash_triton", "fwd_bwd", 1.8), row("flash_triton:gluon_bwd_everywhere", "fwd_bwd", 1.7)]
    assert grid.target_lines(rows)[-1].startswith("- no reference on the grid")
    with_reference = [row("sdpa_cudnn", "fwd_bwd", 2.0), row("flash_triton", "fwd_bwd", 1.8, x_cudnn=0.9)]
    assert not any("no reference" in line for line in grid.target_lines(with_reference))


def test_largest_inputs_are_those_of_the_sections_run():
    """q, k, v and dO of the largest point measured (the device only bounds them)."""
    assert grid.largest_inputs(parsed("--sections", "host"), None)[0] == 4 * 16 * 1024 * 64 * 2
    assert grid.largest_inputs(parsed("--d", "128"), None)[0] == 4 * 16 * 16384 * 128 * 2


def test_a_row_keeps_the_round_of_its_median_time():
    """The round of the median ms (the lower middle one of an even count), every round's ms, the median host time,
    the largest peak memory."""
    rounds = [dict(ms=3.0, ms_p20=2.9, host_us=30.0, peak_mem_mb=5.0), dict(ms=1.0, ms_p20=0.9, host_us=10.0,
                                                                           peak_mem_mb=7.0),
              dict(ms=2.0, ms_p20=1.9, host_us=50.0, peak_mem_mb=6.0)]
    row = median_round(rounds)
    assert row == dict(ms=2.0, ms_p20=1.9, host_us=30.0, peak_mem_mb=7.0, ms_rounds=[3.0, 1.0, 2.0])
    assert median_round(rounds[:2])["ms"] == 1.0
    assert median_round([dict(ms=1.0, peak_mem_mb=None)])["peak_mem_mb"] is None


def test_rounds_interleave_and_a_failed_measurement_is_its_row(tmp_path):
    """Each round times every implementation once: an ok row lists its rounds' times and keeps the median one; an
    implementation that cannot run the point (cuDNN on the CPU) gives its row once, and the ratios against it
    are None."""
    assert run_cli("grid", "--smoke", "--sections", "grid", "--batch-seq", "1x64", "--no-causal", "--modes", "fwd",
                   "--impls", "flash_triton", "sdpa_cudnn", "sdpa_math", "--rounds", "3", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "grid")
    assert sorted(r["impl"] for r in rows) == ["flash_triton", "sdpa_cudnn", "sdpa_math"]
    assert all(r["rounds"] == 3 for r in rows)
    cudnn = next(r for r in rows if r["impl"] == "sdpa_cudnn")
    assert cudnn["status"] != "ok" and "ms_rounds" not in cudnn
    for r in rows:
        if r["impl"] != "sdpa_cudnn":
            assert r["status"] == "ok" and len(r["ms_rounds"]) == 3
            assert r["ms"] == sorted(r["ms_rounds"])[1] and r["x_cudnn"] is None


def test_grid_measures_a_name_given_twice_once(tmp_path):
    assert run_cli("grid", "--smoke", "--sections", "grid", "--batch-seq", "2x32", "--causal", "--no-gqa",
                   "--modes", "fwd", "--impls", "naive", "naive", "--out", str(tmp_path)) == 0
    rows = [r for r in rows_of(tmp_path, "grid") if r["impl"] == "naive"]
    assert len(rows) == 1 and len(rows[0]["ms_rounds"]) == rows[0]["rounds"], rows
