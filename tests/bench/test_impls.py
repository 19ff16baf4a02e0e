"""The implementation registry: one place from a name to a callable, every entry computes attention."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cs336_systems.bench import cli, impls
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
            "flash_triton_cudagraphs", "flash_op", "flash_op_compiled", "flash_op_cudagraphs", "sdpa",
            *impls.SDPA_BACKENDS, "sdpa_flash_compiled", "sdpa_flash_cudagraphs"} <= set(names)
    assert {f"flash_triton:{v}" for v in ABLATION_VARIANTS} <= set(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", ["naive", "naive_compiled", "flash_pytorch", "flash_triton", "flash_op", "sdpa",
                                  "sdpa_math", "sdpa_efficient", "sdpa_math_compiled"])
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


@pytest.mark.parametrize("name", ["flash_triton", "flash_op", "flash_triton_gluon_kv", "sdpa", "sdpa_math",
                                  f"{impls.ABLATION_PREFIX}{impls.ablation_variants()[-2]}"])
def test_grouped_entries_compute_grouped_query_attention(name):
    """Setup.grouped: k and v with fewer heads than q, each serving H / Hkv query heads (SDPA's enable_gqa)."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 32, 16)
    k, v = (torch.randn(1, 2, 32, 16) for _ in range(2))
    o = impls.build(name, impls.Setup(torch.device("cpu"), "fp32", seq_len=32, grouped=True))(q, k, v, True)
    expected = reference(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), True)
    torch.testing.assert_close(o, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", ["naive", "flash_pytorch"])
def test_entries_without_grouped_query_attention_are_unsupported(name):
    with pytest.raises(Unsupported, match="grouped"):
        impls.build(name, impls.Setup(torch.device("cpu"), "fp32", seq_len=32, grouped=True))


def test_the_functional_op_is_not_the_class():
    """flash_op times `cs336_systems.flash_attention` itself; flash_triton the autograd.Function's apply."""
    import cs336_systems
    from cs336_systems.flash_triton import FlashAttention2Triton

    assert impls.build("flash_op", CPU) is cs336_systems.flash_attention
    assert impls.build("flash_triton", CPU) == FlashAttention2Triton.apply


def test_ablation_names_read_without_torch_are_the_variants():
    from cs336_systems.flash_ablation import ABLATION_VARIANTS

    assert list(impls.ablation_variants()) == list(ABLATION_VARIANTS)


def test_unknown_names_are_refused_before_torch_with_a_suggestion():
    """Each option taking an implementation name: a usage error naming the closest name and where the list
    is, before torch is imported (it takes seconds), not a dump of every name."""
    code = """if True:
        import sys
        from cs336_systems.bench import cli
        for argv in (["flash", "--impls", "flash_trition"], ["overhead", "--impls", "sdpa_cudn"],
                     ["model", "--attention", "flash_triton_compild"], ["leaderboard", "--variant", "causal_skp"]):
            try:
                cli.main([*argv, "--smoke"])
            except SystemExit as e:
                print(e.code, "torch" in sys.modules)
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[:4] == ["2 False"] * 4
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    suggested = ["flash_triton", "sdpa_cudnn", "flash_triton_compiled", "causal_skip"]
    assert [f"did you mean {name!r}?" in line for line, name in zip(errors, suggested)] == [True] * 4
    assert all(f"(every name: {impls.LISTING})" in line and len(line) < 250 for line in errors[:3])
    listing = subprocess.run([sys.executable, "-m", "cs336_systems.bench.impls"], capture_output=True, text=True,
                             check=True)
    assert listing.stdout.split() == impls.names()


def test_the_flash_alias_is_our_kernel_in_every_subcommand():
    shipped = impls.ablation_variants()[-1]
    for argv, dest, expected in ((["flash", "--impls", "flash"], "impls", [impls.SHIPPED]),
                                 (["overhead", "--impls", "flash"], "impls", [impls.SHIPPED]),
                                 (["model", "--attention", "flash"], "attention", [impls.SHIPPED]),
                                 (["leaderboard", "--variant", "flash"], "variant", [shipped]),
                                 (["leaderboard", "--variant", "flash_triton"], "variant", [shipped])):
        assert getattr(cli.build_parser().parse_args(argv), dest) == expected, argv


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
