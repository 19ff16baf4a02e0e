"""`cs336-bench autotune`: the autotuner's choices and every config's time, shipped and --wide grids."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from cs336_systems.bench import autotune as autotune_bench

from .helpers import check_report, check_rows, rows_of, run_cli


def test_smoke_autotune(tmp_path):
    assert run_cli("autotune", "--smoke", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "autotune")
    check_rows(rows, "autotune", ("kernel",), timed=False)  # one config under the interpreter: nothing tuned
    launched = {r["kernel"] for r in rows}
    from cs336_systems.flash_triton import AUTOTUNED_KERNELS

    assert autotune_bench.TUNING_CALL in launched and launched - {autotune_bench.TUNING_CALL} <= set(AUTOTUNED_KERNELS)
    for r in rows:
        if r["kernel"] != autotune_bench.TUNING_CALL:
            assert r["best_config_kwargs"]["num_warps"] >= 1
    check_report(tmp_path, "autotune")


def test_smoke_autotune_wide(tmp_path):
    """--wide: the named kernel tunes over its own grid, rows say so, and the shipped configs come back."""
    from cs336_systems.flash_triton import AUTOTUNED_KERNELS

    shipped = {n: k.configs for n, k in AUTOTUNED_KERNELS.items()}
    assert run_cli("autotune", "--smoke", "--wide", "flash_fwd", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "autotune")
    assert {r["variant"] for r in rows} == {"wide: flash_fwd"}, rows
    grids = {n: [autotune_bench.config_dict(c) for c in configs] for n, configs in shipped.items()}
    grids["flash_fwd"] = [autotune_bench.config_dict(c) for c in autotune_bench.wide_configs("flash_fwd")]
    for r in rows:
        if r["kernel"] != autotune_bench.TUNING_CALL:
            grid = grids[r["kernel"]]
            assert r["best_config_kwargs"] in grid and r["n_configs"] == len(grid), (r["kernel"], r)
    assert {n: k.configs for n, k in AUTOTUNED_KERNELS.items()} == shipped
    assert "wide: flash_fwd" in check_report(tmp_path, "autotune")


def test_autotune_wide_grid():
    """Every tile pair of each kernel's wide grid with every warp and stage count, no duplicates."""
    from cs336_systems.flash_triton import KERNELS

    with mock.patch("cs336_systems.flash.autotune.INTERPRET", False):
        for name, spec in KERNELS.items():
            configs = autotune_bench.wide_configs(name)
            seen = {(c.kwargs["Q_TILE_SIZE"], c.kwargs["K_TILE_SIZE"], c.num_warps, c.num_stages) for c in configs}
            assert len(seen) == len(configs) == len(spec.wide_tiles) * len(autotune_bench.WIDE_WARPS) * len(
                autotune_bench.WIDE_STAGES
            ), name


def test_autotune_observe_records_every_config():
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


def test_autotune_write_table_merges_entries_and_loads_back(tmp_path):
    """--write-table: a run's entries (with every config's time) merge over the file's, one line each, and the
    package's loader reads them."""
    from cs336_systems.flash import tuning

    path = tmp_path / "table.json"
    meta = {"gpu": "NVIDIA H200", "torch": "2", "triton": "3", "commit": "abc", "run_id": "r1"}
    old = dict(kernel="kv", arch="sm90", d=64, dtype="16bit", causal=True, bucket=1024, config=[32, 128, 4, 3])
    new = dict(old, config=[64, 64, 4, 2], tried=[[64, 64, 4, 2, 0.1], [32, 128, 4, 3, 0.2]])
    autotune_bench.write_table(path, [old], meta)
    autotune_bench.write_table(path, [new, dict(old, bucket=2048)], meta)
    lines = path.read_text().splitlines()
    assert sum('"kernel"' in line for line in lines) == 2 and len(lines) == 10
    loaded = tuning.load_table(path)
    assert loaded[tuning.TableKey("kv", "sm90", 64, "16bit", True, 1024)] == tuning.TileConfig(64, 64, 4, 2)
    assert loaded[tuning.TableKey("kv", "sm90", 64, "16bit", True, 2048)] == tuning.TileConfig(32, 128, 4, 3)



def test_autotune_write_table_with_smoke_is_a_usage_error(tmp_path, capsys):
    """--write-table under --smoke (interpreter configs, nothing a GPU table can hold) is refused up front."""
    with pytest.raises(SystemExit) as exit_info:
        run_cli("autotune", "--smoke", "--write-table", str(tmp_path / "t.json"), "--out", str(tmp_path / "out"))
    assert exit_info.value.code == 2 and "--smoke run tunes nothing" in capsys.readouterr().err
    assert not (tmp_path / "out" / "autotune" / "metrics.jsonl").exists()


@pytest.mark.parametrize("setup,words", [
    (lambda p: p.write_text("{not json"), "not a readable tuning table"),
    (lambda p: p.write_text('{"entries": 3}'), "not a tuning table"),
    (lambda p: p.mkdir(), "a folder"),
], ids=["not-json", "not-a-table", "folder"])
def test_autotune_write_table_path_is_checked_before_any_tuning(tmp_path, setup, words):
    path = tmp_path / "table.json"
    setup(path)
    with pytest.raises(ValueError, match=words):
        autotune_bench.check_table_path(path, smoke=False)
    autotune_bench.check_table_path(tmp_path / "new.json", smoke=False)  # a table not there yet is fine
