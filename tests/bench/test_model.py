"""`cs336-bench model`: smoke sweep eager and compiled, the warm-up experiment, swapped attention."""

from __future__ import annotations

import pytest
import torch

import cs336_basics.model as basics_model
from cs336_systems.bench.report import fmt_num, mean_std_cell

from .helpers import check_report, check_rows, rows_of, run_cli


def test_smoke_model(tmp_path):
    assert run_cli("model", "--smoke", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "model")
    check_rows(rows, "model", ("model_size", "context_length", "compiled", "ms_mean", "ms_std", "tokens_per_s"))
    assert {(r["mode"], r["compiled"]) for r in rows} == {
        (m, c) for m in ("fwd", "bwd", "fwd_bwd", "step") for c in (False, True)
    }
    assert all(r["status"] == "ok" for r in rows)
    check_report(tmp_path, "model")


def test_smoke_model_warmup_experiment(tmp_path):
    """benchmarking_script (c): runs with 0 and 1 warm-up steps sit side by side, first timed step shown."""
    for warmup in ("0", "1"):
        assert run_cli("model", "--smoke", "--warmup", warmup, "--steps", "2", "--compile", "eager",
                       "--modes", "fwd", "--out", str(tmp_path), "--resume") == 0
    rows = rows_of(tmp_path, "model")
    assert sorted(r["warmup_steps"] for r in rows) == [0, 1]
    assert all(r["first_ms"] > 0 for r in rows), rows
    table = check_report(tmp_path, "model", plots=False)
    section = table.split("## Warm-up effect")[1].split("##")[0]
    assert "warmup 0" in section and "warmup 1" in section
    first = {r["warmup_steps"]: r["first_ms"] for r in rows}
    assert f"({fmt_num(first[0])})" in section and f"({fmt_num(first[1])})" in section, section
    steps = table.split("## Step time")[1].split("##")[0]
    warmed = next(r for r in rows if r["warmup_steps"] == 1)
    assert mean_std_cell(warmed) in steps, f"step-time table should show the 1-warm-up run:\n{steps}"
    assert "warmup_steps" not in steps, f"only the most warmed-up run belongs in the step-time table:\n{steps}"


def test_smoke_model_swapped_attention(tmp_path):
    """Any registry name swaps the model's attention (and 'flash' still means ours); the swap is undone."""
    original = basics_model.scaled_dot_product_attention
    assert run_cli("model", "--smoke", "--attention", "flash", "sdpa_math", "--compile", "both",
                   "--modes", "fwd_bwd", "--out", str(tmp_path)) == 0
    assert basics_model.scaled_dot_product_attention is original
    status = {(r["impl"], r["compiled"]): r["status"] for r in rows_of(tmp_path, "model")}
    compiled_ours = "ok" if torch.cuda.is_available() else "unsupported"  # no dynamo over the interpreter
    assert status == {("flash_triton", False): "ok", ("flash_triton", True): compiled_ours,
                      ("sdpa_math", False): "ok", ("sdpa_math", True): "ok"}


def test_sdpa_in_the_model_is_the_models_causal_attention():
    """`--attention sdpa` (PyTorch's backend choice) gives the model the logits of its own masked attention."""
    from cs336_basics.model import BasicsTransformerLM
    from cs336_systems.bench import impls
    from cs336_systems.bench.model import attention_function, model_attention, model_config

    torch.manual_seed(0)
    model = BasicsTransformerLM.from_config(model_config("smoke"), vocab_size=100, context_length=32)
    x = torch.randint(0, 100, (2, 32))
    expected = model(x)
    sdpa = impls.build("sdpa", impls.Setup(torch.device("cpu"), "fp32", seq_len=32))
    with attention_function(model_attention(sdpa)):
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4)


def test_smoke_model_fixed_tokens_per_step(tmp_path):
    """--tokens N: batch N // context per context length, the same tokens per step at every context."""
    assert run_cli("model", "--smoke", "--context", "16", "32", "--tokens", "64", "--attention", "flash", "sdpa",
                   "--compile", "eager", "--modes", "fwd_bwd", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "model")
    assert {(r["impl"], r["context_length"], r["batch"], r["status"]) for r in rows} == {
        (impl, ctx, 64 // ctx, "ok") for impl in ("flash_triton", "sdpa") for ctx in (16, 32)}


def test_settled_timing_resets_the_peak_after_the_warmup_and_our_compiles(monkeypatch):
    """time_calls(settled=True): the warm-up calls, then the end of our background compiles and a reset of the peak
    counter, then the timed calls; the model benchmark's peak memory is thus that of its timed steps."""
    from cs336_systems.bench import timing
    from cs336_systems.flash import launch

    events = []
    monkeypatch.setattr(launch, "wait_for_background_compiles", lambda: events.append("wait"))
    monkeypatch.setattr(timing, "reset_peak_memory", lambda device: events.append("reset"))
    stats = timing.time_calls(lambda: events.append("call"), torch.device("cpu"), iters=2, warmup=1, settled=True)
    assert events == ["call", "wait", "reset", "call", "call"] and stats["n_timed"] == 2
    events.clear()
    timing.time_calls(lambda: events.append("call"), torch.device("cpu"), iters=1, warmup=1)
    assert events == ["call", "call"]


def test_smoke_model_rounds_interleave_on_one_model(tmp_path, monkeypatch):
    """--rounds 2: each round times every implementation and mode once, on one model whose attention is swapped in
    turn (the same function object for an implementation every round, so a compiled model's guards match it); a row
    keeps its median round and lists every round's time."""
    from cs336_systems.bench import timing

    calls = []
    time_calls = timing.time_calls

    def recording(fn, device, **kw):
        calls.append(basics_model.scaled_dot_product_attention)
        return time_calls(fn, device, **kw)

    monkeypatch.setattr(timing, "time_calls", recording)
    assert run_cli("model", "--smoke", "--attention", "sdpa_math", "naive", "--rounds", "2", "--compile", "eager",
                   "--modes", "fwd", "fwd_bwd", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "model")
    assert {(r["impl"], r["mode"], r["status"], r["rounds"], len(r["ms_rounds"])) for r in rows} == {
        (impl, mode, "ok", 2, 2) for impl in ("sdpa_math", "naive") for mode in ("fwd", "fwd_bwd")}
    assert all(r["ms"] in r["ms_rounds"] for r in rows)
    # round 1: sdpa_math fwd, fwd_bwd, naive fwd, fwd_bwd; round 2 the same, with the same functions
    assert len(calls) == 8 and calls[:4] == calls[4:]
    assert calls[0] is calls[1] and calls[2] is calls[3] and calls[0] is not calls[2]
    assert basics_model.scaled_dot_product_attention not in calls  # swapped back


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA graphs run where CUDA is")
def test_smoke_model_an_implementation_that_cannot_run_is_its_rows(tmp_path):
    """An implementation that cannot run (CUDA graphs without CUDA) becomes its rows, tried once; the others run."""
    assert run_cli("model", "--smoke", "--attention", "sdpa_math_cudagraphs", "sdpa_math", "--rounds", "2",
                   "--compile", "eager", "--modes", "fwd", "fwd_bwd", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "model")
    assert {(r["impl"], r["mode"], r["status"]) for r in rows} == {
        *(("sdpa_math_cudagraphs", m, "unsupported") for m in ("fwd", "fwd_bwd")),
        *(("sdpa_math", m, "ok") for m in ("fwd", "fwd_bwd"))}
    assert all("CUDA graphs" in r["error"] for r in rows if r["status"] != "ok")


def test_smoke_model_rounds_on_a_compiled_model(tmp_path):
    """A compiled model shared by two implementations over two rounds: each row ok (one graph per implementation, the
    recompile limit raised for them and an error, not dynamo's fallback to eager, past it)."""
    assert run_cli("model", "--smoke", "--attention", "sdpa_math", "naive", "--rounds", "2", "--compile", "compiled",
                   "--modes", "fwd", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "model")
    assert {(r["impl"], r["compiled"], r["status"], len(r["ms_rounds"])) for r in rows} == {
        ("sdpa_math", True, "ok", 2), ("naive", True, "ok", 2)}
