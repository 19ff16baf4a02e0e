"""`cs336-bench report`: GPU-shaped rows render, bad rows are skipped, devices are never mixed."""

from __future__ import annotations

import json
import os

import pytest

from cs336_systems.bench import cli

from .helpers import META, rows_of, run_cli, timed, write_rows


def flash_rows() -> list[dict]:
    rows = []
    for dtype in ("bf16", "fp32"):
        for d in (64, 128):
            for seq in (1024, 65536):
                for impl in ("naive", "flash_triton", "sdpa_flash"):
                    for mode in ("fwd", "bwd", "fwd_bwd"):
                        shape = dict(impl=impl, mode=mode, dtype=dtype, batch=1, n_heads=1, seq_len=seq, d_head=d,
                                     is_causal=True, rep_ms=100, warmup_ms=25)
                        if impl == "naive" and seq == 65536:
                            rows.append({**shape, "status": "oom"})
                        elif impl == "sdpa_flash" and dtype == "fp32":
                            rows.append({**shape, "status": "unsupported"})
                        else:
                            rows.append({**shape, **timed(seq / 1000 * (3 if impl == "naive" else 1))})
    return rows


def overhead_row(ms: float) -> dict:
    """One overhead row: 130 µs of host time per call of `ms` on the GPU."""
    return dict(impl="flash_triton", mode="fwd", dtype="bf16", batch=1, n_heads=16, seq_len=1024, d_head=64,
                is_causal=True, host_us=130.0, wall_ms=0.2, **timed(ms))


def test_report_renders_gpu_shaped_rows(tmp_path):
    """Rows shaped like a GPU sweep (several d / seq / contexts, OOMs, tuned autotune keys) render fully."""
    write_rows(tmp_path, "flash", flash_rows())
    model = []
    for size in ("small", "2.7B"):
        for ctx in (512, 16384):
            for impl in ("naive", "flash_triton"):
                for compiled in (False, True):
                    for mode in ("fwd", "bwd", "fwd_bwd", "step"):
                        shape = dict(impl=impl, mode=mode, dtype="fp32", batch=4, n_heads=12, seq_len=ctx, d_head=64,
                                     is_causal=True, model_size=size, context_length=ctx, compiled=compiled,
                                     warmup_steps=5, steps=10)
                        if ctx == 16384 and impl == "naive":
                            model.append({**shape, "status": "oom"})
                        else:
                            model.append({**shape, **timed(ctx / 10, tokens_per_s=1e5, peak_mem_mb=2e4)})
    write_rows(tmp_path, "model", model)
    configs = [{"config": f"Q_TILE_SIZE: {q}", "Q_TILE_SIZE": q, "num_warps": 4, "num_stages": 3, "num_ctas": 1,
                "ms": ms, "ms_p20": ms, "ms_p80": ms} for q, ms in ((64, 1.0), (128, float("inf")), (32, 2.0))]
    autotune = []
    for seq in (1024, 4096):
        shape = dict(impl="flash_triton", mode="fwd_bwd", dtype="bf16", batch=1, n_heads=16, seq_len=seq, d_head=64,
                     is_causal=True)
        autotune.append({**shape, "kernel": "(tuning call)", "status": "ok", "tune_wall_s": 3.0, "n_launches": 3})
        for kernel in ("flash_fwd", "flash_bwd_dq"):
            autotune.append({**shape, "kernel": kernel, "status": "ok", "tuned": True,
                             "tuning_key": [str(seq), str(seq), "64", "True", "torch.bfloat16"],
                             "best_config": "Q_TILE_SIZE: 64", "best_config_kwargs": configs[0], "configs": configs,
                             "n_tried": 3, "bench_time_s": 1.5, "ms": 1.0, "ms_p20": 1.0, "ms_p80": 1.0})
    write_rows(tmp_path, "autotune", autotune)
    leaderboard = [
        dict(impl=impl, variant=variant, mode=mode, dtype="bf16", batch=1, n_heads=16, seq_len=16384, d_head=64,
             is_causal=True, compiled=impl != "sdpa_flash", rep_ms=rep, warmup_ms=rep / 10, run_id=f"run{rep}",
             **timed(ms))
        for rep, variants in ((500, (("flash_triton", "causal_skip", 6.8), ("naive", "naive", 40.0))),
                              (10000, (("flash_triton", "autotune", 6.2), ("sdpa_flash", "sdpa_flash", 7.1))))
        for impl, variant, ms in variants for mode in ("fwd_bwd", "fwd")
    ]
    # a later run's SDPA rows replace run10000's in the table; ours of run10000 keeps its ratio to its own run's
    leaderboard += [dict(leaderboard[-1], run_id="later", mode=mode, **timed(9.9)) for mode in ("fwd_bwd", "fwd")]
    write_rows(tmp_path, "leaderboard", leaderboard)

    assert cli.main(["report", "--out", str(tmp_path)]) == 0
    flash_md = (tmp_path / "flash" / "table.md").read_text()
    assert "OOM" in flash_md and "unsupported" in flash_md and "3.00×" in flash_md
    assert len(list((tmp_path / "flash").glob("flash_speedup_*.png"))) == 6
    model_md = (tmp_path / "model" / "table.md").read_text()
    assert "compile speedup step" in model_md and "OOM" in model_md and "Peak memory (MiB" in model_md
    assert list((tmp_path / "model").glob("model_context_*.png"))
    autotune_md = (tmp_path / "autotune" / "table.md").read_text()
    assert "Every config tried" in autotune_md and "1024 1024 64 True torch.bfloat16" in autotune_md
    assert (tmp_path / "autotune" / "autotune_configs.png").exists()
    board = (tmp_path / "leaderboard" / "table.md").read_text()
    assert "| ours (shipped) | True | 10000/1000 | abc1234 | 6.200 / 6.200 | 1.000 | 1.15× / – |" in board  # same run
    assert "| causal_skip | True | 500/50 | abc1234 | 6.800 / 6.800 | 1.000 | – / – |" in board  # no SDPA in its run


def test_report_skips_malformed_rows_and_renders_the_rest(tmp_path, capsys):
    """Bad rows are warned about and skipped; every other problem still renders."""
    path = write_rows(tmp_path, "flash", flash_rows()[:9])
    with path.open("a") as f:
        f.write('42\nnull\n{"problem": "flash", "status": "ok"}\n')
        row = {"problem": "flash", **META, "impl": "naive", "mode": "fwd", "dtype": "bf16", "batch": 1, "seq_len": 8,
               "d_head": 4, "is_causal": True, "status": "ok"}
        f.write(json.dumps({**row, "ms": "fast"}) + "\n" + json.dumps(row) + "\n")
        f.write(json.dumps({**row, "ms": 1.0, "gpu": None}) + "\n")  # no provenance
    write_rows(tmp_path, "model", [{"impl": "naive", "status": "ok"}])  # nothing renderable
    write_rows(tmp_path, "overhead", [overhead_row(0.05)])
    assert cli.main(["report", "--out", str(tmp_path)]) == 0  # model has no valid row: warned, not fatal
    err = capsys.readouterr().err
    assert err.count("skipping") >= 6 and "'ms' is 'fast'" in err and "missing 'ms'" in err and "flash/metrics.jsonl: skipped 4 rows in all" in err
    assert "| 64 | 1024 |" in (tmp_path / "flash" / "table.md").read_text()
    assert "| ours | 130.0 | 50.000 | 200.0 | 2.60 |" in (tmp_path / "overhead" / "table.md").read_text()
    assert not (tmp_path / "model" / "table.md").exists()
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "model"]) == 1  # asked for, nothing there


def test_report_skips_rows_whose_times_are_not_positive_and_finite(tmp_path, capsys):
    """ms 0, negative, inf or NaN (a clock that went wrong, a hand edit) is skipped with a warning, not divided by."""
    good = flash_rows()[:9]
    bad = [{**good[3], **timed(ms)} for ms in (0.0, -1.0, float("inf"), float("nan"))]
    write_rows(tmp_path, "flash", good + bad)
    write_rows(tmp_path, "overhead", [overhead_row(0.05), {**overhead_row(0.0), "run_id": "r2"}])
    for problem in ("flash", "overhead"):
        (tmp_path / problem / "table.md").write_text("stale\n")
    assert cli.main(["report", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.count("not a positive finite time") == 4 and "'ms' is inf" in err and "skipped 4 rows in all" in err
    assert "| 64 | 1024 |" in (tmp_path / "flash" / "table.md").read_text()
    assert "| ours | 130.0 | 50.000 | 200.0 | 2.60 |" in (tmp_path / "overhead" / "table.md").read_text()


def test_report_asked_for_a_missing_problem_fails(tmp_path, capsys):
    write_rows(tmp_path, "flash", flash_rows()[:3])
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "nosuch"]) == 1
    assert "nosuch" in capsys.readouterr().err
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "flash"]) == 0


def test_report_out_that_is_no_folder_is_an_error(tmp_path, capsys):
    assert cli.main(["report", "--out", str(tmp_path / "no" / "such")]) == 2
    assert cli.main(["report", "--out", str(tmp_path)]) == 1  # a folder without any metrics.jsonl
    err = capsys.readouterr().err.splitlines()
    assert err == [f"report: --out {tmp_path / 'no' / 'such'}: no such folder",
                   f"report: no <problem>/metrics.jsonl under {tmp_path}"]


@pytest.mark.parametrize("cause", ["read-only folder", "table.md is a folder"])
def test_report_that_cannot_write_is_a_one_line_error(cause, tmp_path, capsys):
    write_rows(tmp_path, "flash", flash_rows()[:9])
    write_rows(tmp_path, "overhead", [overhead_row(0.05)])
    if cause == "read-only folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        (tmp_path / "flash").chmod(0o555)
    else:
        (tmp_path / "flash" / "table.md").mkdir()
    try:
        assert cli.main(["report", "--out", str(tmp_path)]) == 2
    finally:
        (tmp_path / "flash").chmod(0o755)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"report: cannot write under {tmp_path / 'flash'}: ")
    assert (tmp_path / "overhead" / "table.md").exists()  # the other problems still render


def test_smoke_rows_never_replace_gpu_cells(tmp_path):
    """A --smoke run into a folder of GPU rows gets its own section and plot files."""
    gpu = [dict(impl=impl, mode="fwd", dtype="fp32", batch=1, n_heads=1, seq_len=64, d_head=16, is_causal=True,
                rep_ms=100, warmup_ms=25, **timed(ms)) for impl, ms in (("naive", 0.896), ("flash_triton", 0.5))]
    write_rows(tmp_path, "flash", gpu)
    assert run_cli("flash", "--smoke", "--impls", "naive", "flash_triton", "--modes", "fwd",
                   "--out", str(tmp_path)) == 0
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "flash"]) == 0
    table = (tmp_path / "flash" / "table.md").read_text()
    smoke_device = rows_of(tmp_path, "flash")[-1]["gpu"]  # "cpu", or this machine's GPU
    gpu_part, smoke_part = table.split("## Device: NVIDIA H200\n")[1].split(f"## Device: {smoke_device} --smoke")
    assert "| 16 | 64 | 0.896 | 0.5 | 1.79× |" in gpu_part
    assert "0.896" not in smoke_part
    assert (tmp_path / "flash" / "flash_latency_fp32_fwd.png").exists()
    assert list((tmp_path / "flash").glob("flash_latency_fp32_fwd_*--smoke.png"))


def test_smoke_plots_say_so_in_their_title(tmp_path, monkeypatch):
    """A plot of --smoke rows carries the warning in its title (a PNG is read without its table)."""
    from cs336_systems.bench import report

    figures = []
    save = report.Output.save
    monkeypatch.setattr(report.Output, "save", lambda self, fig, name, title: figures.append(fig) or save(
        self, fig, name, title))
    assert run_cli("overhead", "--smoke", "--impls", "sdpa_math", "--modes", "fwd", "--out", str(tmp_path)) == 0
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "overhead"]) == 0
    assert figures and all("--smoke: timings meaningless" in f.get_suptitle() for f in figures)
    fig, _ = report.new_figure(1)
    report.Output(tmp_path).save(fig, "real", "a real run")
    assert fig.get_suptitle() == "a real run"


def test_plot_names_hold_no_colon():
    """An ablation's implementation name ("flash_triton:<variant>") names plots too: no ":" in a file name."""
    from cs336_systems.bench.report import slug

    name = slug("model", 256, "flash_triton:gluon_everywhere", "bf16", " NVIDIA H100")
    assert ":" not in name and " " not in name and name == "model_256_flash_triton-gluon_everywhere_bf16_NVIDIAH100"


def _flash_row(impl: str, ms: float | None = None, **extra) -> dict:
    shape = dict(impl=impl, mode="fwd", dtype="bf16", batch=1, n_heads=1, seq_len=64, d_head=16, is_causal=True,
                 rep_ms=100, warmup_ms=25)
    return {**shape, **(timed(ms) if ms is not None else {}), **extra}


def test_ratios_of_rows_from_two_runs_are_marked(tmp_path):
    """A speedup of ours over a reference measured in another run carries †, one of the same run does not."""
    write_rows(tmp_path, "flash", [_flash_row("naive", 0.9), _flash_row("flash_triton", 0.5)], run_id="r1")
    write_rows(tmp_path, "flash", [_flash_row("naive", 0.9, seq_len=128)], run_id="r2")
    write_rows(tmp_path, "flash", [_flash_row("flash_triton", 0.5, seq_len=128)], run_id="r3")
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "flash"]) == 0
    table = (tmp_path / "flash" / "table.md").read_text()
    assert "| 16 | 64 | 0.9 | 0.5 | 1.80× |" in table
    assert "| 16 | 128 | 0.9 | 0.5 | 1.80×† |" in table
    assert "marked †" in table


def test_a_newer_error_row_is_shown_over_an_older_ok_row(tmp_path):
    """The report shows a key's last row whatever its status: a regression to an error is not hidden."""
    write_rows(tmp_path, "flash", [_flash_row("flash_triton", 0.5)], run_id="r1", commit="old1111")
    write_rows(tmp_path, "flash", [_flash_row("flash_triton", status="error: RuntimeError: broke")], run_id="r2",
               commit="new2222")
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "flash"]) == 0
    table = (tmp_path / "flash" / "table.md").read_text()
    assert "| 16 | 64 | error |" in table and "0.5" not in table.split("## Latency")[1]


def test_a_problem_that_fails_to_render_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    """A renderer that raises on its rows costs that problem only: the others render, the exit code is 1."""
    from cs336_systems.bench import leaderboard

    write_rows(tmp_path, "flash", [_flash_row("flash_triton", 0.5)])
    write_rows(tmp_path, "overhead", [overhead_row(0.2)])
    monkeypatch.setattr(leaderboard, "render", lambda rows, out: 1 / 0)
    oom = dict(impl="flash_triton", variant="v", mode="fwd_bwd", dtype="bf16", batch=1, n_heads=16, seq_len=16384,
               d_head=64, is_causal=True, rep_ms=10000, warmup_ms=1000, status="oom")
    write_rows(tmp_path, "leaderboard", [oom])
    assert cli.main(["report", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "cannot render" in err and "ZeroDivisionError" in err and "could not render leaderboard" in err
    assert (tmp_path / "flash" / "table.md").exists() and (tmp_path / "overhead" / "table.md").exists()


def test_a_leaderboard_mode_without_completed_rows_renders(tmp_path):
    """Every row of one mode OOM: its panel says so instead of failing on a log axis over nothing."""
    base = dict(impl="flash_triton", variant="v", dtype="bf16", batch=1, n_heads=16, seq_len=16384, d_head=64,
                is_causal=True, rep_ms=10000, warmup_ms=1000)
    write_rows(tmp_path, "leaderboard", [{**base, "mode": "fwd", **timed(1.0)}, {**base, "mode": "fwd_bwd",
                                                                                 "status": "oom"}])
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "leaderboard"]) == 0


def test_an_unknown_problem_name_says_so(tmp_path, capsys):
    write_rows(tmp_path, "flash", [_flash_row("flash_triton", 0.5)])
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "flsh"]) == 1
    assert "no problem or folder named 'flsh'" in capsys.readouterr().err


@pytest.mark.parametrize("problem", sorted(cli.PROBLEMS))
def test_committed_rows_all_render(problem, capsys):
    """Every row committed in runs/<problem>/metrics.jsonl matches its problem's schema today: a field made
    required after rows without it were recorded would drop those rows from the committed tables."""
    from pathlib import Path

    from cs336_systems.bench import record

    path = Path(__file__).resolve().parents[2] / "runs" / problem / "metrics.jsonl"
    if not path.exists():
        pytest.skip(f"no committed rows for {problem}")
    rows = record.read_rows(path)
    assert rows and len(record.valid_rows(rows, cli.PROBLEMS[problem], path)) == len(rows), capsys.readouterr().err
