"""The `cs336-bench` command line: instant help, one registration loop, usage errors before any work."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cs336_systems.bench import cli, options

from .helpers import rows_of, run_cli


def test_parser_imports_no_torch():
    """--help must not wait for torch (issue: it took ~5 s); the modules import it inside their functions."""
    code = "import sys; from cs336_systems.bench import cli; cli.build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_help_for_every_subcommand(capsys):
    for command in [*cli.PROBLEMS, "report"]:
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert "usage: cs336-bench" in out
        if command != "report":
            assert "--smoke" in out, command


def test_every_problem_has_the_interface():
    for name, module in cli.PROBLEMS.items():
        assert module.NAME == name and module.HELP and module.__doc__
        for function in ("add_arguments", "run", "render"):
            assert callable(getattr(module, function)), (name, function)


def test_sized_defaults_are_declared_once(capsys):
    """Help text and the value run() reads come from the same (full, smoke) pair."""
    with pytest.raises(SystemExit):
        cli.main(["flash", "--help"])
    assert "(default: 16 32 64 128; with --smoke: 16)" in " ".join(capsys.readouterr().out.split())
    for smoke, expected in ((False, [16, 32, 64, 128]), (True, [16])):
        args = cli.build_parser().parse_args(["flash", *(["--smoke"] if smoke else [])])
        options.resolve_sized(args)
        assert args.d == expected
    args = cli.build_parser().parse_args(["flash", "--smoke", "--d", "32"])
    options.resolve_sized(args)
    assert args.d == [32]


def test_requires_gpu_without_smoke(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, module in cli.PROBLEMS.items():
        if getattr(module, "NEEDS_DEVICE", True):
            assert cli.main([name, "--out", str(tmp_path)]) == 2
            assert "no CUDA device" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [
    ["attention", "--d", "0"],
    ["attention", "--seq", "-64"],
    ["attention", "--seq", "0"],
    ["attention", "--batch", "0"],
    ["attention", "--batch", "-1"],
    ["attention", "--iters", "0"],
    ["attention", "--no-eager"],
    ["model", "--context", "0"],
    ["model", "--attention", "nosuch"],
    ["model", "--tokens", "16", "--context", "32"],
    ["model", "--tokens", "64", "--batch", "2"],
    ["memory", "--context", "0"],
    ["memory", "--dtype", "fp16"],
    ["flash", "--rep-ms", "-5"],
    ["flash", "--d", "1024"],
    ["overhead", "--d", "1024"],
    ["autotune", "--d", "1024"],
    ["flash", "--impls", "nosuch"],
    ["leaderboard", "--variant", "nosuch"],
    ["leaderboard", "--seq", "0"],
    ["overhead", "--iters", "0"],
    ["overhead", "--impls", "flash_triton_bogus"],
    ["autotune", "--wide", "nosuch"],
    ["resources", "--d", "0"],
    ["resources", "--d", "1024"],
    ["resources", "--arch", "0"],
    ["precision", "--cases", "nosuch"],
    *([problem, "--seq", str(10**12)] for problem in ("attention", "flash", "leaderboard", "overhead")),
], ids=lambda argv: " ".join(argv))
def test_bad_input_is_a_usage_error_before_any_row(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli(*argv, "--smoke", "--out", str(tmp_path))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: cs336-bench" in err and "error:" in err
    assert not list(tmp_path.iterdir()), "nothing may be written for a usage error"


def test_inputs_larger_than_the_device_are_named(tmp_path, capsys):
    """The README's promise: sizes that cannot run are usage errors before anything runs, not error rows."""
    with pytest.raises(SystemExit) as exc:
        run_cli("leaderboard", "--smoke", "--seq", str(10**12), "--out", str(tmp_path))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"inputs (q, k, v of 2 × {10**12} × 16 " in err and "GiB, more than the " in err


def test_unwritable_out_fails_before_measuring(tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert run_cli("attention", "--smoke", "--out", str(not_a_dir)) == 2
    assert "cannot write results" in capsys.readouterr().err


def test_head_dims_past_the_kernels_limit_are_refused(tmp_path, capsys):
    from cs336_systems.flash_triton import MAX_HEAD_DIM

    with pytest.raises(SystemExit) as exc:
        run_cli("leaderboard", "--smoke", "--d", str(MAX_HEAD_DIM + 1), "--out", str(tmp_path))
    assert exc.value.code == 2 and f"head dims up to {MAX_HEAD_DIM}" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_ctrl_c_keeps_the_rows_and_says_how_to_resume(monkeypatch, tmp_path, capsys):
    fields = dict(impl="naive", mode="fwd", dtype="fp32", batch=1, n_heads=1, seq_len=8, d_head=4, is_causal=True)

    def interrupted(args, rec):
        rec.measure(fields, lambda: {"ms": 1.0})

        def ctrl_c():
            raise KeyboardInterrupt

        rec.measure({**fields, "mode": "bwd"}, ctrl_c)

    def run_attention() -> int:
        try:
            return run_cli("attention", "--smoke", "--out", str(tmp_path))
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C ended in a traceback")

    monkeypatch.setattr(cli.PROBLEMS["attention"], "run", interrupted)
    assert run_attention() == 130
    path = tmp_path / "attention" / "metrics.jsonl"
    assert capsys.readouterr().err.strip() == (f"cs336-bench attention: interrupted; 1 row kept in {path}, "
                                               "rerun with --resume")
    assert [r["mode"] for r in rows_of(tmp_path, "attention")] == ["fwd"]

    def ctrl_c_at_start(smoke):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "select_device", ctrl_c_at_start)
    assert run_attention() == 130
    assert capsys.readouterr().err.strip() == "cs336-bench attention: interrupted; nothing recorded"
