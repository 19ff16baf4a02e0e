"""`cs336-bench precision`: the handout's accumulation loops and the ToyModel's dtypes under autocast."""

from __future__ import annotations

import pytest
import torch

from cs336_systems.bench import precision

from .helpers import check_report, rows_of, run_cli

TOY_SHAPE = precision.TOY_SHAPE


def test_smoke_precision(tmp_path):
    """Four sums and one dtype row, all ok; the report shows both tables."""
    assert run_cli("precision", "--smoke", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "precision")
    assert [(r["variant"], r["mode"], r["status"]) for r in rows] == [
        *(("accumulation", mode, "ok") for mode in precision.LOOPS), ("toy", "autocast", "ok")]
    for r in rows[:4]:
        assert r["ran_on"] == "cpu" and r["abs_error"] == abs(r["value"] - 10.0)
    assert rows[4]["dtype"] == ("fp16" if torch.cuda.is_available() else "bf16")
    table = check_report(tmp_path, "precision", plots=False)
    assert "| fp16 | fp16 += fp16 | float16 | 9.953125 | 0.0469 |" in table
    assert "| " + " | ".join(rows[4][f] for f in precision.DTYPE_FIELDS) + " |" in table


def test_accumulation_runs_without_a_device(tmp_path):
    """The sums alone need no GPU and no --smoke; --resume then measures nothing again."""
    assert run_cli("precision", "--cases", "accumulation", "--out", str(tmp_path)) == 0
    assert run_cli("precision", "--cases", "accumulation", "--resume", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "precision")
    assert len(rows) == 4 and {r["gpu"] for r in rows} == {"none"}


def test_accumulation_answers():
    """fp32 is close to 10; fp16 drifts as the sum's spacing grows past the addend's; adding fp16 into fp32 is off
    by 1000 times fp16's rounding of 0.01, whether the addend is converted implicitly or explicitly."""
    sums = {mode: precision.accumulate(acc, addend, convert) for mode, (acc, addend, convert, _) in
            precision.LOOPS.items()}
    assert {mode: s.dtype for mode, s in sums.items()} == {
        "fp32": torch.float32, "fp16": torch.float16, "fp16_into_fp32": torch.float32, "fp16_cast_fp32": torch.float32}
    error = {mode: abs(s.item() - 10.0) for mode, s in sums.items()}
    assert error["fp32"] < 2e-4  # 1.34e-4: fp32's rounding of 0.01 plus 1000 rounded adds
    assert sums["fp16"].item() == 9.953125 and error["fp16"] > 0.01
    assert sums["fp16_into_fp32"].item() == sums["fp16_cast_fp32"].item()
    fp16_hundredth = torch.tensor(0.01, dtype=torch.float16).item()  # 0.01000213623046875
    assert sums["fp16_into_fp32"].item() == pytest.approx(1000 * fp16_hundredth, abs=1e-5)
    assert error["fp32"] < error["fp16_into_fp32"] < error["fp16"]


def test_toy_model_dtypes_under_cpu_bf16_autocast():
    """CPU autocast (torch 2.11) has no fp32 rule for layer_norm, unlike CUDA's: the layer norm returns bf16 there."""
    assert precision.toy_dtypes(torch.device("cpu"), torch.bfloat16, **TOY_SHAPE) == {
        "params": "float32", "fc1_out": "bfloat16", "ln_out": "bfloat16", "logits": "bfloat16", "loss": "float32",
        "grads": "float32"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast needs a GPU")
def test_toy_model_dtypes_under_cuda_fp16_autocast():
    """The handout's setting: matmuls in fp16; layer norm and the loss in fp32; fp32 parameters and gradients."""
    assert precision.toy_dtypes(torch.device("cuda"), torch.float16, **TOY_SHAPE) == {
        "params": "float32", "fc1_out": "float16", "ln_out": "float32", "logits": "float16", "loss": "float32",
        "grads": "float32"}
