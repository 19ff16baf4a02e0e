"""The leaderboard ablation: FlashAttention-2 variants, each adding one step to the one before.

The last entry is the shipped kernel (`FlashAttention2Triton`). `cs336-bench leaderboard --variant`
times them with the course's harness; `runs/README.md` has the table.
"""

from __future__ import annotations

import torch

from cs336_systems.flash_triton import FlashAttention2Triton, KernelOptions, autograd_function

ABLATION_VARIANTS: dict[str, type[torch.autograd.Function]] = {
    "fwd_triton_bwd_compiled": autograd_function(
        "FlashFwdTritonBwdCompiled", KernelOptions(triton_backward=False, skip_masked_tiles=False, autotune=False)),
    "bwd_triton": autograd_function(
        "FlashBwdTriton", KernelOptions(triton_backward=True, skip_masked_tiles=False, autotune=False)),
    "causal_skip": autograd_function(
        "FlashCausalSkip", KernelOptions(triton_backward=True, skip_masked_tiles=True, autotune=False)),
    "autotune": FlashAttention2Triton,
}

__all__ = ["ABLATION_VARIANTS"]
