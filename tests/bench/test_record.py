"""Recorder: rows on disk at once, appends that never merge, identity by device and timing settings."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from cs336_systems.bench import cli
from cs336_systems.bench.record import KEY_FIELDS, PROVENANCE_FIELDS, RESUME_FIELDS, Recorder, key_of, read_rows, \
    run_metadata

from .helpers import rows_of, run_cli

FIELDS = dict(impl="naive", mode="fwd", dtype="fp32", batch=1, n_heads=1, seq_len=8, d_head=4, is_causal=False)


def this_code() -> dict:
    """The fields `--resume` compares with the running code's (sources digest, torch, triton), and the rest of a
    row's provenance."""
    meta = run_metadata(torch.device("cpu"))
    return {"commit": "abc1234", "run_id": "r1", **{f: meta[f] for f in RESUME_FIELDS}}


def test_recorder_appends_each_row_immediately(tmp_path):
    rec = Recorder(tmp_path, "attention", torch.device("cpu"))
    rec.measure(FIELDS, lambda: {"ms": 1.0, "ms_p20": 1.0, "ms_p80": 1.0}, flops=2e9)
    (row,) = read_rows(tmp_path / "attention" / "metrics.jsonl")
    assert row["tflops"] == pytest.approx(2.0) and row["status"] == "ok"
    assert row["matmul_precision"] == torch.get_float32_matmul_precision()
    assert rec.is_done(FIELDS)


def test_append_after_a_cut_last_line_starts_a_fresh_line(tmp_path):
    """A file not ending in a newline must not swallow the next row."""
    rec = Recorder(tmp_path, "attention", torch.device("cpu"))
    rec.write({**rec.base_row(FIELDS), "status": "ok", "ms": 1.0})
    rec.write({**rec.base_row({**FIELDS, "seq_len": 16}), "status": "ok", "ms": 2.0})
    path = rec.path
    path.write_bytes(path.read_bytes()[:-1])  # `truncate -s -1`: the last row loses its newline only
    rec.write({**rec.base_row({**FIELDS, "seq_len": 32}), "status": "ok", "ms": 3.0})
    assert [r["seq_len"] for r in read_rows(path)] == [8, 16, 32]

    path.write_bytes(path.read_bytes()[:-20])  # a row cut in the middle (killed run)
    rec.write({**rec.base_row({**FIELDS, "seq_len": 64}), "status": "ok", "ms": 4.0})
    assert [r["seq_len"] for r in read_rows(path)] == [8, 16, 64]


def test_resume_after_a_damaged_last_line_remeasures_only_that_key(tmp_path, capsys):
    """The issue's repro: the damaged row is skipped with a warning and re-measured; nothing else is lost."""
    base = ("flash", "--smoke", "--out", str(tmp_path), "--modes", "fwd", "--d", "16", "--seq", "16")
    assert run_cli(*base, "--impls", "naive") == 0
    path = tmp_path / "flash" / "metrics.jsonl"
    path.write_bytes(path.read_bytes()[:-1])
    assert run_cli(*base, "--impls", "naive", "flash_triton", "--resume") == 0
    lines = path.read_text().splitlines()
    assert all(isinstance(json.loads(line), dict) for line in lines)  # every line parses
    assert [r["impl"] for r in rows_of(tmp_path, "flash")] == ["naive", "flash_triton"]

    path.write_bytes(path.read_bytes()[:-30])  # now the flash_triton row is cut
    assert run_cli(*base, "--impls", "naive", "flash_triton", "--resume") == 0
    assert "skipping a line that is not a JSON object" in capsys.readouterr().err
    assert [r["impl"] for r in rows_of(tmp_path, "flash")] == ["naive", "flash_triton"]


def test_non_object_lines_are_skipped_by_resume(tmp_path, capsys):
    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "metrics.jsonl").write_text("42\nnull\n[1, 2]\n\"text\"\n")
    rec = Recorder(tmp_path, "attention", torch.device("cpu"), resume=True)
    assert not rec.done
    assert capsys.readouterr().err.count("not a JSON object") == 4


def test_a_non_utf8_byte_costs_its_line_only(tmp_path, capsys):
    """One stray byte (a bad editor save, a disk error) skips that line with a warning, in resume and report."""
    rows = [{"problem": "attention", **FIELDS, "seq_len": seq, "gpu": "cpu", "status": "ok", "ms": 1.0, **this_code()}
            for seq in (8, 16, 32)]
    lines = [json.dumps(r).encode() for r in rows]
    lines[1] = lines[1].replace(b'"ok"', b'"o\xffk"')
    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    rec = Recorder(tmp_path, "attention", torch.device("cpu"), resume=True)
    assert [rec.is_done({**FIELDS, "seq_len": seq}) for seq in (8, 16, 32)] == [True, False, True]
    assert "metrics.jsonl:2: skipping a line" in capsys.readouterr().err
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "attention"]) == 0
    assert "metrics.jsonl:2: skipping a line" in capsys.readouterr().err


def test_identity_includes_device_smoke_and_timing_settings(tmp_path):
    """A CPU or --smoke row never marks a GPU measurement done, nor one with other settings."""
    gpu_row = {"problem": "flash", **FIELDS, "gpu": "NVIDIA H200", "rep_ms": 100, "warmup_ms": 25, "status": "ok"}
    (tmp_path / "flash").mkdir()
    (tmp_path / "flash" / "metrics.jsonl").write_text(json.dumps(gpu_row) + "\n")
    rec = Recorder(tmp_path, "flash", torch.device("cpu"), resume=True, smoke=True)
    assert not rec.is_done({**FIELDS, "rep_ms": 100, "warmup_ms": 25})
    assert {"gpu", "smoke", "rep_ms", "warmup_ms", "iters", "warmup_iters", "steps", "warmup_steps"} <= set(KEY_FIELDS)
    assert key_of(gpu_row) != key_of({**gpu_row, "rep_ms": 10000})
    assert key_of(gpu_row) != key_of({**gpu_row, "gpu": "cpu"})
    assert key_of(gpu_row) != key_of({**gpu_row, "smoke": True})


def test_resume_skips_done_rows(tmp_path):
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

    # Other timing settings are other measurements.
    assert run_cli(*args, "--iters", "3", "--resume") == 0
    assert len(rows_of(tmp_path, "attention")) == len(kept) + 3 + 4


def test_resume_redoes_rows_the_report_rejects(tmp_path, capsys):
    """A row the report skips would leave its cell empty forever if --resume counted it as done."""
    args = ("attention", "--smoke", "--seq", "16", "--out", str(tmp_path))
    assert run_cli(*args) == 0
    first = rows_of(tmp_path, "attention")
    broken = [{**first[0], "ms": "fast"}, {**first[1], "ms": 0.0}]
    (tmp_path / "attention" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in broken))
    assert run_cli(*args, "--resume") == 0
    assert "skipping a row" in capsys.readouterr().err
    redone = rows_of(tmp_path, "attention")[len(broken):]
    assert sorted(r["mode"] for r in redone) == sorted(r["mode"] for r in broken)
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in redone)


def test_a_second_run_into_the_same_file_waits_then_resumes(tmp_path, capsys):
    """Two --resume runs to one --out: the second waits for the first's lock, then skips what it recorded."""
    first = Recorder(tmp_path, "attention", torch.device("cpu"), resume=True)
    second: list[Recorder] = []
    waiting = threading.Thread(target=lambda: second.append(
        Recorder(tmp_path, "attention", torch.device("cpu"), resume=True)), daemon=True)
    waiting.start()
    waiting.join(timeout=2)
    assert waiting.is_alive(), "the second run must wait for the first"
    first.measure(FIELDS, lambda: {"ms": 1.0})
    first.close()
    waiting.join(timeout=10)
    assert second and second[0].is_done(FIELDS)
    second[0].close()
    assert "waiting for another run writing" in capsys.readouterr().err


def test_resume_does_not_repeat_unsupported_rows(tmp_path):
    (tmp_path / "attention").mkdir()
    unsupported = {"problem": "attention", **FIELDS, "gpu": "cpu", "status": "unsupported", "error": "no kernel",
                   **this_code()}
    (tmp_path / "attention" / "metrics.jsonl").write_text(json.dumps(unsupported) + "\n")
    assert Recorder(tmp_path, "attention", torch.device("cpu"), resume=True).is_done(FIELDS)


@pytest.mark.parametrize("field", RESUME_FIELDS)
def test_resume_measures_again_what_other_code_measured(tmp_path, field):
    """A row of other sources (a changed kernel) or another torch or triton is not done for --resume."""
    (tmp_path / "attention").mkdir()
    row = {"problem": "attention", **FIELDS, "gpu": "cpu", "status": "ok", "ms": 1.0, **this_code(), field: "other"}
    (tmp_path / "attention" / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert not Recorder(tmp_path, "attention", torch.device("cpu"), resume=True).is_done(FIELDS)


def test_rows_carry_the_digest_of_the_code_that_ran(tmp_path):
    """`code_sha` hashes the imported packages' sources (cs336_systems and cs336_basics): a second copy (as a
    before/after run puts on PYTHONPATH) has the same digest only when its sources are the same, and a change to
    either package changes it."""
    import shutil

    import cs336_basics
    import cs336_systems
    from cs336_systems.bench.record import package_digest, run_metadata

    systems, basics = (Path(m.__file__).parent for m in (cs336_systems, cs336_basics))
    assert run_metadata(None)["code_sha"] == package_digest() == package_digest(systems, basics)
    copies = []
    for package in (systems, basics):
        copies.append(tmp_path / package.name)
        shutil.copytree(package, copies[-1], ignore=shutil.ignore_patterns("__pycache__"))
    assert package_digest(*copies) == package_digest()
    (copies[1] / "model.py").write_text((copies[1] / "model.py").read_text() + "\n# changed\n")
    assert package_digest(*copies) != package_digest()


def test_files_rows_point_to_are_never_overwritten(tmp_path):
    """A second run's trace or timeline of the same configuration gets its run id in its name."""
    first = Recorder(tmp_path, "profile", torch.device("cpu"))
    path = first.new_file("traces/small_512_step_fp32.json.gz")
    assert path == tmp_path / "profile" / "traces" / "small_512_step_fp32.json.gz" and path.parent.is_dir()
    path.write_bytes(b"first")
    first.close()
    second = Recorder(tmp_path, "profile", torch.device("cpu"))
    again = second.new_file("traces/small_512_step_fp32.json.gz")
    assert again.name == f"small_512_step_fp32-{second.run_id}.json.gz" and not again.exists()
    assert path.read_bytes() == b"first"


def test_torchrun_follower_reads_the_environment_as_the_launcher_does(monkeypatch):
    """A partial torchrun environment (WORLD_SIZE and RANK alone) is no torchrun job for the recorder either: it
    records and takes the lock, as the run spawns its own ranks."""
    from cs336_systems.bench import record
    from cs336_systems.distributed import launch

    assert record.TORCHRUN_ENV == launch.TORCHRUN_ENV
    for name in launch.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert not record.torchrun_follower() and launch.torchrun_place() is None
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert record.torchrun_follower() and launch.torchrun_place() is not None


@pytest.mark.parametrize("field", PROVENANCE_FIELDS)
def test_a_row_without_provenance_is_neither_rendered_nor_done(tmp_path, capsys, field):
    """A row that cannot say where, with what and from which commit it was measured is skipped with a warning."""
    row = {"problem": "attention", **FIELDS, "gpu": "cpu", "status": "ok", "ms": 1.0, **this_code()}
    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "metrics.jsonl").write_text(json.dumps({**row, "seq_len": 16}) + "\n"
                                                          + json.dumps({k: v for k, v in row.items() if k != field})
                                                          + "\n")
    assert not Recorder(tmp_path, "attention", torch.device("cpu"), resume=True).is_done(FIELDS)
    assert f"missing {field!r}" in capsys.readouterr().err
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "attention"]) == 0
    assert f"missing {field!r}" in capsys.readouterr().err
