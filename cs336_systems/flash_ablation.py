"""The leaderboard ablation: FlashAttention-2 variants, each adding one step to the one before.

The last entry is the shipped kernel (`FlashAttention2Triton`: autotuned, causal tile skipping,
TMA descriptors, deterministic two-pass backward whose passes issue dP's matmul before P's
exponentials). "tma" is the same kernel with the other order (`dp_first=False`). "atomic_dq" is the
alternative backward: the single-pass backward with fp32 atomic dQ (`deterministic=False`), measured
slower on the H200. The steps before "tma" load tiles through block pointers. `cs336-bench
leaderboard --variant all` times them with the course's harness; `runs/README.md` has the table.
"""

from __future__ import annotations

import torch

from cs336_systems.flash_triton import FlashAttention2Triton, KernelOptions, autograd_function

_PLAIN = KernelOptions(triton_backward=False, skip_masked_tiles=False, autotune=False, tma=False)

ABLATION_VARIANTS: dict[str, type[torch.autograd.Function]] = {
    "fwd_triton_bwd_compiled": autograd_function("FlashFwdTritonBwdCompiled", _PLAIN),
    "bwd_triton": autograd_function(
        "FlashBwdTriton", KernelOptions(skip_masked_tiles=False, autotune=False, tma=False)),
    "causal_skip": autograd_function("FlashCausalSkip", KernelOptions(autotune=False, tma=False)),
    "autotune": autograd_function("FlashAutotune", KernelOptions(tma=False)),
    "tma": autograd_function("FlashTma", KernelOptions(dp_first=False)),
    "atomic_dq": autograd_function("FlashAtomicDq", KernelOptions(deterministic=False)),
    "dp_first": FlashAttention2Triton,
}

__all__ = ["ABLATION_VARIANTS"]
