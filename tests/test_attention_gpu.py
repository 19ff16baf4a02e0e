"""FlashAttention-2 on the GPU only: long bf16 sequences and the leaderboard's torch.compile harness.

These sizes are far past what Triton's interpreter can run, so without CUDA they are skipped;
tests/test_attention.py runs the same kernels through the interpreter on small sizes.
"""

from __future__ import annotations

import pytest
import torch

from .test_attention import IMPLS, _check_against_float64

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("seq_len", [4096, 16384])
@pytest.mark.parametrize("d_head", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_flash_triton_bf16_long_sequences_meet_2x_rule(seq_len, d_head, is_causal):
    """Error vs float64 at most 2x PyTorch's bf16 attention, for O, dQ, dK, dV (B=1, H=2)."""
    gen = torch.Generator(device="cuda").manual_seed(seq_len + d_head)
    q, k, v, do = (torch.randn(1, 2, seq_len, d_head, device="cuda", generator=gen).bfloat16() for _ in range(4))
    q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = IMPLS["triton"]().apply(q_, k_, v_, is_causal)
    o.backward(do)
    ours = (o.detach(), q_.grad, k_.grad, v_.grad)
    _check_against_float64(ours, q, k, v, do, is_causal, ("x_torch", 2.0))


@needs_cuda
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_flash_triton_under_torch_compile_matches_eager(is_causal):
    """The leaderboard calls torch.compile(FlashAttention2Triton.apply) and o.sum().backward()."""
    fn = IMPLS["triton"]()
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = torch.randn(3, 4, 1024, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    results = []
    for f in (fn.apply, torch.compile(fn.apply)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = f(*leaves, is_causal)
        o.sum().backward()
        results.append((o.detach(), *(t.grad for t in leaves)))
    for name, eager, compiled in zip(("O", "dQ", "dK", "dV"), *results):
        assert torch.equal(eager, compiled), f"{name}: compiled differs from eager by {(eager - compiled).abs().max():.3g}"
