"""The Triton op's edges on the CPU: autocast, torch.compile with strided inputs and symbolic scales, empty and meta
inputs, torch.func transforms.

"interpreter" runs the kernels through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a
GPU); "pytorch" is the fallback of a CPU without the interpreter (`launch.INTERPRET` patched to False).
"""

from __future__ import annotations

import pytest
import torch

import cs336_systems.flash.launch as launch
from cs336_systems.flash_triton import flash_attention

from .helpers import run


@pytest.fixture
def pytorch_path(monkeypatch):
    """The CPU fallback alone (torch.compile cannot trace Triton kernels under the interpreter)."""
    monkeypatch.setattr(launch, "INTERPRET", False)


def _inputs(seed: int) -> list[torch.Tensor]:
    """q, k, v, dO of (batch 1, 2 heads, 24 positions, d 16)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, 24, 16, generator=gen) for _ in range(4)]


# ---------------------------------------------------------------------------------------------------------------
# A scale that torch.compile traces as a symbolic float
# ---------------------------------------------------------------------------------------------------------------


def test_flash_fullgraph_compile_with_a_changing_scale(pytorch_path):
    """A Python-float scale that changes between calls reaches the scale check as a SymFloat: still no graph
    break, and each call uses its own scale."""
    q, k, v, do = _inputs(seed=10)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c, s: flash_attention(a, b, c, True, scale=s), backend="aot_eager",
                             fullgraph=True)
    for scale in (0.5, 0.3, 0.2):
        ours = run(compiled, q, k, v, do, scale)
        eager = run(lambda *a: flash_attention(*a, True, scale=scale), q, k, v, do)
        for name, x, y in zip(("O", "dQ", "dK", "dV"), ours, eager):
            assert torch.equal(x, y), f"{name} at scale {scale}: compiled differs from eager"


