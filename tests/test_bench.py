"""End-to-end checks of `cs336-bench`: every problem's --smoke sweep, report, resume, OOM and no-GPU handling.

The smoke runs use the CPU (and Triton's interpreter, enabled in conftest.py) unless CUDA is present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cs336_systems import flash_triton
from cs336_systems.bench import attention as attention_bench
from cs336_systems.bench import autotune as autotune_bench
from cs336_systems.bench import cli
from cs336_systems.bench import resources as resources_bench
from cs336_systems.bench.record import KEY_FIELDS, Recorder, read_rows
from cs336_systems.bench.report import fmt_num, mean_std_cell

REQUIRED = (
    "problem", "impl", "mode", "dtype", "batch", "n_heads", "seq_len", "d_head", "is_causal", "ms", "ms_p20",
    "ms_p80", "tflops", "peak_mem_mb", "status", "gpu", "torch", "triton", "commit", "run_id", "time",
)
# Rows a smoke run may legitimately not complete: SDPA backends that have no kernel for the CPU / dtype,
# and compiled flash attention (dynamo cannot trace Triton-interpreter kernels).
ALLOWED_NOT_OK = {"sdpa_flash", "sdpa_cudnn", "sdpa_efficient"}


def run_cli(*argv: str) -> int:
    return cli.main([*argv, "--no-progress"])


def rows_of(out: Path, problem: str) -> list[dict]:
    return read_rows(out / problem / "metrics.jsonl")


def check_rows(rows: list[dict], problem: str, extra_fields: tuple[str, ...] = (), timed: bool = True) -> None:
    assert rows, f"no rows for {problem}"
    assert len({r["run_id"] for r in rows}) == 1
    for r in rows:
        missing = [f for f in (*REQUIRED, *(extra_fields if r["status"] == "ok" else ())) if f not in r]
        assert not missing, f"{problem} row lacks {missing}: {r}"
        assert r["problem"] == problem
        if r["status"] != "ok":
            assert r["status"] == "unsupported" and (r["impl"] in ALLOWED_NOT_OK or r.get("compiled")), r
        elif timed:
            assert r["ms"] > 0 and r["ms_p20"] <= r["ms_p80"], r
        if not torch.cuda.is_available():
            assert r["timings_meaningless"] is True and r["gpu"] == "cpu"


def check_report(out: Path, problem: str) -> None:
    assert cli.main(["report", "--out", str(out), "--problems", problem]) == 0
    table = (out / problem / "table.md").read_text()
    assert table.startswith(f"# {problem}") and "|---|" in table
    assert list((out / problem).glob("*.png")), f"no plot for {problem}"


def test_bench_smoke_attention(tmp_path):
    assert run_cli("attention", "--smoke", "--compile", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "attention")
    check_rows(rows, "attention", ("mem_before_bwd_mb", "ms_mean", "ms_std"))
    assert {(r["impl"], r["mode"]) for r in rows} == {
        (i, m) for i in ("naive", "naive_compiled") for m in ("fwd", "bwd")
    }
    assert all(r["status"] == "ok" for r in rows)
    check_report(tmp_path, "attention")
    assert "naive_compiled fwd" in (tmp_path / "attention" / "table.md").read_text()


def test_bench_smoke_model(tmp_path):
    assert run_cli("model", "--smoke", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "model")
    check_rows(rows, "model", ("model_size", "context_length", "compiled", "ms_mean", "ms_std", "tokens_per_s"))
    assert {(r["mode"], r["compiled"]) for r in rows} == {
        (m, c) for m in ("fwd", "bwd", "fwd_bwd", "step") for c in (False, True)
    }
    assert all(r["status"] == "ok" for r in rows)
    check_report(tmp_path, "model")


def test_bench_smoke_model_warmup_experiment(tmp_path):
    """benchmarking_script (c): runs with 0 and 1 warm-up steps sit side by side, first timed step shown."""
    for warmup in ("0", "1"):
        assert run_cli("model", "--smoke", "--warmup", warmup, "--steps", "2", "--compile", "eager",
                       "--modes", "fwd", "--out", str(tmp_path), "--resume") == 0
    rows = read_rows(tmp_path / "model" / "metrics.jsonl")
    assert sorted(r["warmup_steps"] for r in rows) == [0, 1]
    assert all(r["first_ms"] > 0 for r in rows), rows
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "model"]) == 0
    table = (tmp_path / "model" / "table.md").read_text()
    section = table.split("## Warm-up effect")[1].split("##")[0]
    assert "warmup 0" in section and "warmup 1" in section
    first = {r["warmup_steps"]: r["first_ms"] for r in rows}
    assert f"({fmt_num(first[0])})" in section and f"({fmt_num(first[1])})" in section, section
    steps = table.split("## Step time")[1].split("##")[0]
    warmed = next(r for r in rows if r["warmup_steps"] == 1)
    assert mean_std_cell(warmed) in steps, f"step-time table should show the 1-warm-up run:\n{steps}"
    assert "warmup_steps" not in steps, f"only the most warmed-up run belongs in the step-time table:\n{steps}"


def test_bench_smoke_model_swapped_attention(tmp_path):
    import cs336_basics.model as basics_model

    original = basics_model.scaled_dot_product_attention
    assert run_cli("model", "--smoke", "--attention", "flash", "--compile", "eager", "--modes", "fwd_bwd",
                   "--out", str(tmp_path)) == 0
    assert basics_model.scaled_dot_product_attention is original
    (row,) = rows_of(tmp_path, "model")
    assert row["impl"] == "flash_triton" and row["status"] == "ok"


def test_bench_smoke_flash(tmp_path):
    assert run_cli("flash", "--smoke", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "flash")
    check_rows(rows, "flash")
    by_impl = {(r["impl"], r["mode"]): r for r in rows}
    for impl in ("naive", "flash_triton"):
        for mode in ("fwd", "bwd", "fwd_bwd"):
            assert by_impl[(impl, mode)]["status"] == "ok"
            assert by_impl[(impl, mode)]["tflops"] > 0
    assert {r["impl"] for r in rows} >= {"sdpa_flash", "sdpa_cudnn", "sdpa_efficient"}
    check_report(tmp_path, "flash")


def test_bench_smoke_leaderboard(tmp_path, capsys):
    from cs336_systems.flash_ablation import ABLATION_VARIANTS

    final = list(ABLATION_VARIANTS)[-1]
    assert run_cli("leaderboard", "--smoke", "--variant", final, "--variant", "naive", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "leaderboard")
    check_rows(rows, "leaderboard", ("variant", "ms_mean", "compiled"))
    ours = [r for r in rows if r["variant"] == final]
    assert {r["mode"] for r in ours} == {"fwd", "fwd_bwd"}
    assert all(r["impl"] == "flash_triton" and r["status"] == "ok" for r in ours)
    assert {r["variant"] for r in rows} == {final, "naive", "sdpa_flash", "sdpa_cudnn"}
    assert [r for r in rows if r["variant"] == "naive"][0]["compiled"] is True
    check_report(tmp_path, "leaderboard")


def test_bench_smoke_autotune(tmp_path):
    assert run_cli("autotune", "--smoke", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "autotune")
    check_rows(rows, "autotune", ("kernel",), timed=False)  # one config under the interpreter: nothing tuned
    from cs336_systems.flash_triton import AUTOTUNED_KERNELS

    assert {r["kernel"] for r in rows} == {autotune_bench.TUNING_CALL, *AUTOTUNED_KERNELS}
    for r in rows:
        if r["kernel"] != autotune_bench.TUNING_CALL:
            assert r["best_config_kwargs"]["num_warps"] >= 1
    check_report(tmp_path, "autotune")


def test_bench_smoke_autotune_wide(tmp_path):
    """--wide: the named kernel tunes over its own grid, rows say so, and the shipped configs come back."""
    from cs336_systems.flash_triton import AUTOTUNED_KERNELS

    shipped = {n: k.configs for n, k in AUTOTUNED_KERNELS.items()}
    assert run_cli("autotune", "--smoke", "--wide", "flash_bwd_dkdv", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "autotune")
    assert {r["variant"] for r in rows} == {"wide: flash_bwd_dkdv"}, rows
    grids = {n: [autotune_bench.config_dict(c) for c in configs] for n, configs in shipped.items()}
    grids["flash_bwd_dkdv"] = [autotune_bench.config_dict(c) for c in autotune_bench.wide_configs("flash_bwd_dkdv")]
    for r in rows:
        if r["kernel"] != autotune_bench.TUNING_CALL:
            grid = grids[r["kernel"]]
            assert r["best_config_kwargs"] in grid and r["n_configs"] == len(grid), (r["kernel"], r)
    assert {n: k.configs for n, k in AUTOTUNED_KERNELS.items()} == shipped
    check_report(tmp_path, "autotune")
    assert "wide: flash_bwd_dkdv" in (tmp_path / "autotune" / "table.md").read_text()


def test_bench_autotune_wide_grid():
    """Every tile pair of the wide grid with every warp and stage count, no duplicates."""
    from unittest import mock

    with mock.patch("cs336_systems.flash_triton.INTERPRET", False):
        for name, tiles in autotune_bench.WIDE_TILES.items():
            configs = autotune_bench.wide_configs(name)
            seen = {(c.kwargs["Q_TILE_SIZE"], c.kwargs["K_TILE_SIZE"], c.num_warps, c.num_stages) for c in configs}
            assert len(seen) == len(configs) == len(tiles) * len(autotune_bench.WIDE_WARPS) * len(
                autotune_bench.WIDE_STAGES
            ), name


def test_bench_autotune_observe_records_every_config():
    """A real (interpreted) Autotuner with a fake benchmarker: observe() captures key, choice and all timings."""
    if torch.cuda.is_available():
        pytest.skip("uses the Triton interpreter")
    import triton
    import triton.language as tl

    fake_ms = {16: 3.0, 32: 1.0, 64: 2.0}

    def fake_bench(kernel_call, quantiles):
        kernel_call()
        ms = fake_ms[current["block"]]
        return [ms, ms * 0.9, ms * 1.1]

    current = {"block": None}

    def remember_block(kwargs):
        current["block"] = kwargs["BLOCK"]

    configs = [triton.Config({"BLOCK": b}, pre_hook=remember_block) for b in fake_ms]

    @triton.autotune(configs=configs, key=["n"], do_bench=fake_bench)
    @triton.jit
    def double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    x = torch.randn(64)
    y = torch.empty_like(x)
    with autotune_bench.observe({"double": double}) as events:
        for _ in range(2):  # the second launch reuses the cached choice
            double[lambda meta: (triton.cdiv(64, meta["BLOCK"]),)](x, y, 64)
    assert "run" not in double.__dict__
    torch.testing.assert_close(y, 2 * x)
    tuned, cached = events
    assert tuned["tuned"] and not cached["tuned"]
    metrics = autotune_bench.event_metrics(tuned)
    assert metrics["best_config_kwargs"]["BLOCK"] == 32 and metrics["ms"] == 1.0
    assert [c["BLOCK"] for c in metrics["configs"]] == [32, 64, 16]
    assert metrics["tuning_key"][0] == "64"
    assert metrics["bench_time_s"] is not None and metrics["from_disk_cache"] is False


def test_bench_requires_gpu_without_smoke(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for problem in cli.PROBLEMS:
        assert cli.main([problem, "--out", str(tmp_path)]) == 2
        assert "no CUDA device" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_bench_help_for_every_subcommand(capsys):
    for command in [*cli.PROBLEMS, "report"]:
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--help"])
        assert exc.value.code == 0
        assert "usage: cs336-bench" in capsys.readouterr().out


def test_bench_resume_skips_done_rows(tmp_path):
    args = ("attention", "--smoke", "--seq", "16", "32", "--out", str(tmp_path))
    assert run_cli(*args) == 0
    first = rows_of(tmp_path, "attention")
    assert len(first) == 4
    assert run_cli(*args, "--resume") == 0
    assert rows_of(tmp_path, "attention") == first  # nothing re-measured

    # Drop the seq=32 rows and turn one seq=16 row into an error: resume redoes exactly those three.
    path = tmp_path / "attention" / "metrics.jsonl"
    kept = [r for r in first if r["seq_len"] == 16]
    kept[0] = {**kept[0], "status": "error: RuntimeError: boom"}
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert run_cli(*args, "--resume") == 0
    redone = rows_of(tmp_path, "attention")[len(kept):]
    assert sorted((r["seq_len"], r["mode"]) for r in redone) == [(16, kept[0]["mode"]), (32, "bwd"), (32, "fwd")]
    assert all(r["status"] == "ok" for r in redone)


def test_bench_oom_becomes_a_row_and_sweep_continues(tmp_path, monkeypatch):
    real = attention_bench.naive_attention

    def oom_at_seq_16(q, k, v, mask):
        if q.shape[-2] == 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return real(q, k, v, mask)

    monkeypatch.setattr(attention_bench, "naive_attention", oom_at_seq_16)
    assert run_cli("attention", "--smoke", "--seq", "16", "32", "--out", str(tmp_path)) == 0
    status = {(r["seq_len"], r["mode"]): r["status"] for r in rows_of(tmp_path, "attention")}
    assert status == {(16, "fwd"): "oom", (16, "bwd"): "oom", (32, "fwd"): "ok", (32, "bwd"): "ok"}
    oom_row = next(r for r in rows_of(tmp_path, "attention") if r["status"] == "oom")
    assert oom_row["ms"] is None and "out of memory" in oom_row["error"]
    assert cli.main(["report", "--out", str(tmp_path)]) == 0
    assert "OOM" in (tmp_path / "attention" / "table.md").read_text()


def test_bench_error_is_recorded_not_swallowed(tmp_path, monkeypatch):
    def broken(q, k, v, mask):
        raise ValueError("bad shape")

    monkeypatch.setattr(attention_bench, "naive_attention", broken)
    assert run_cli("attention", "--smoke", "--seq", "16", "--out", str(tmp_path)) == 1
    assert {r["status"] for r in rows_of(tmp_path, "attention")} == {"error: ValueError: bad shape"}


def test_bench_recorder_appends_each_row_immediately(tmp_path):
    rec = Recorder(tmp_path, "attention", torch.device("cpu"))
    fields = dict(impl="naive", mode="fwd", dtype="fp32", batch=1, n_heads=1, seq_len=8, d_head=4, is_causal=False)
    rec.measure(fields, lambda: {"ms": 1.0, "ms_p20": 1.0, "ms_p80": 1.0}, flops=2e9)
    (row,) = read_rows(tmp_path / "attention" / "metrics.jsonl")
    assert row["tflops"] == pytest.approx(2.0) and row["status"] == "ok"
    assert rec.is_done(fields) and set(KEY_FIELDS) >= {"variant", "model_size", "compiled"}


def test_bench_report_renders_gpu_shaped_rows(tmp_path):
    """Rows shaped like a GPU sweep (several d / seq / contexts, OOMs, tuned autotune keys) render fully."""
    meta = dict(gpu="NVIDIA H200", torch="2.11", triton="3.6", commit="abc1234", run_id="r1", time="t")

    def write(problem: str, rows: list[dict]) -> None:
        (tmp_path / problem).mkdir()
        lines = [json.dumps({"problem": problem, **meta, **r}) for r in rows]
        (tmp_path / problem / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    def timed(ms: float, **extra) -> dict:
        return dict(status="ok", ms=ms, ms_p20=0.9 * ms, ms_p80=1.1 * ms, ms_mean=ms, ms_std=0.1, tflops=1.0, **extra)

    flash = []
    for dtype in ("bf16", "fp32"):
        for d in (64, 128):
            for seq in (1024, 65536):
                for impl in ("naive", "flash_triton", "sdpa_flash"):
                    for mode in ("fwd", "bwd", "fwd_bwd"):
                        shape = dict(impl=impl, mode=mode, dtype=dtype, batch=1, n_heads=1, seq_len=seq, d_head=d,
                                     is_causal=True)
                        if impl == "naive" and seq == 65536:
                            flash.append({**shape, "status": "oom"})
                        elif impl == "sdpa_flash" and dtype == "fp32":
                            flash.append({**shape, "status": "unsupported"})
                        else:
                            flash.append({**shape, **timed(seq / 1000 * (3 if impl == "naive" else 1))})
    write("flash", flash)

    model = []
    for size in ("small", "2.7B"):
        for ctx in (512, 16384):
            for impl in ("naive", "flash_triton"):
                for compiled in (False, True):
                    for mode in ("fwd", "bwd", "fwd_bwd", "step"):
                        shape = dict(impl=impl, mode=mode, dtype="fp32", batch=4, n_heads=12, seq_len=ctx, d_head=64,
                                     is_causal=True, model_size=size, context_length=ctx, compiled=compiled,
                                     warmup_steps=5)
                        if ctx == 16384 and impl == "naive":
                            model.append({**shape, "status": "oom"})
                        else:
                            model.append({**shape, **timed(ctx / 10, tokens_per_s=1e5, peak_mem_mb=2e4)})
    write("model", model)

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
    write("autotune", autotune)

    assert cli.main(["report", "--out", str(tmp_path)]) == 0
    flash_md = (tmp_path / "flash" / "table.md").read_text()
    assert "OOM" in flash_md and "unsupported" in flash_md and "3.00x" in flash_md
    assert len(list((tmp_path / "flash").glob("flash_speedup_*.png"))) == 6
    model_md = (tmp_path / "model" / "table.md").read_text()
    assert "compile speedup step" in model_md and "OOM" in model_md
    assert list((tmp_path / "model").glob("model_context_*.png"))
    autotune_md = (tmp_path / "autotune" / "table.md").read_text()
    assert "Every config tried" in autotune_md and "1024 1024 64 True torch.bfloat16" in autotune_md
    assert (tmp_path / "autotune" / "autotune_configs.png").exists()


def test_bench_resources_compiles_every_kernel_for_sm90(tmp_path):
    """The real kernels (not the interpreter) compile for sm_90a without a GPU; ptxas's report is recorded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "cs336_systems.bench.cli", "resources", "--configs", "first", "--out", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"resources failed:\n{done.stdout}\n{done.stderr}"
    rows = rows_of(tmp_path, "resources")
    assert sorted(r["mode"] for r in rows) == ["dkdv", "dq", "fwd"], rows
    for r in rows:
        assert r["status"] == "ok" and r["target"] == "sm_90a" and r["gpu"] == "none", r
        assert 0 < r["registers"] <= 255 and r["shared_mem_bytes"] > 0, r
        assert r["wgmma"] is True, f"{r['mode']} {r['variant']}: bf16 on sm_90a should use wgmma"
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "resources"]) == 0
    assert "| dkdv | " in (tmp_path / "resources" / "table.md").read_text()


def test_bench_resources_refuses_interpreted_kernels(tmp_path):
    # conftest.py enabled the interpreter (no CUDA here), so the kernels cannot be compiled for a target
    if not flash_triton.INTERPRET:
        pytest.skip("kernels are compiled for the GPU in this session")
    with pytest.raises(SystemExit, match="without TRITON_INTERPRET=1"):
        cli.main(["resources", "--configs", "first", "--out", str(tmp_path)])


def test_resources_launch_arithmetic():
    # contiguous (B, H=16, S=1024, D=64) tensors; L is (B, H, S)
    assert [resources_bench.stride_value(n, 16, 1024, 64) for n in ("stride_qb", "stride_qh", "stride_qq", "stride_qd")] \
        == [16 * 1024 * 64, 1024 * 64, 64, 1]
    assert [resources_bench.stride_value(n, 16, 1024, 64) for n in ("stride_lb", "stride_lh", "stride_lq")] \
        == [16 * 1024, 1024, 1]
    assert resources_bench.stride_value("stride_dkk", 16, 1024, 64) == 64
    # 255 registers round to 256: one 8-warp CTA (256 threads) fills the 65,536-register file
    assert resources_bench.warps_per_sm(255, 8) == 8
    assert resources_bench.warps_per_sm(128, 4) == 16
    assert resources_bench.warps_per_sm(129, 4) == 12
