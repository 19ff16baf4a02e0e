"""The implementation registry: one place from a name to a callable, every entry computes attention."""

from __future__ import annotations

import pytest
import torch

from cs336_systems.bench import impls
from cs336_systems.bench.record import Unsupported

CPU = impls.Setup(torch.device("cpu"), "fp32", seq_len=32, compile_backend="aot_eager")


def reference(q, k, v, is_causal):
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if is_causal:
        n = q.shape[-2]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


def test_names_cover_every_family():
    from cs336_systems.flash_ablation import ABLATION_VARIANTS

    names = impls.names()
    assert {"naive", "naive_compiled", "flash_pytorch", "flash_triton", "flash_triton_compiled",
            "flash_triton_cudagraphs", *impls.SDPA_BACKENDS, "sdpa_flash_compiled", "sdpa_flash_cudagraphs"} <= set(names)
    assert {f"flash_triton:{v}" for v in ABLATION_VARIANTS} <= set(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", ["naive", "naive_compiled", "flash_pytorch", "flash_triton", "sdpa_math",
                                  "sdpa_efficient", "sdpa_math_compiled"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_every_eager_entry_computes_attention(name, is_causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 32, 16) for _ in range(3))
    try:
        o = impls.build(name, CPU)(q, k, v, is_causal)
    except Unsupported:
        pytest.skip(f"{name} has no CPU kernel here")
    torch.testing.assert_close(o, reference(q, k, v, is_causal), atol=2e-3, rtol=2e-3)


def test_every_ablation_variant_computes_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    for variant in impls.ablation_variants():
        o = impls.build(f"flash_triton:{variant}", CPU)(q, k, v, True)
        torch.testing.assert_close(o, reference(q, k, v, True), atol=2e-3, rtol=2e-3)


def test_unknown_and_unsupported():
    with pytest.raises(ValueError, match="unknown implementation 'nosuch'"):
        impls.build("nosuch", CPU)
    with pytest.raises(ValueError, match="unknown implementation"):
        impls.parse("flash_pytorch_compiled")  # an entry without a compiled form
    with pytest.raises(Unsupported, match="Triton-interpreter"):
        impls.build("flash_triton_compiled", CPU)
    cuda_setup = impls.Setup(torch.device("cuda"), "fp32", seq_len=32)
    with pytest.raises(Unsupported, match="does not support fp32"):
        impls.build("sdpa_flash", cuda_setup)  # refused before anything touches the device
