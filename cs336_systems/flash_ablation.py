"""The leaderboard ablation: FlashAttention-2 variants, each adding one step to the one before.

The last entry is the shipped kernel (`FlashAttention2Triton`: autotuned, causal tile skipping,
TMA descriptors; on large sm_90 calls the forward in Gluon (FlashAttention-3's schedule) and, at d 64,
the single-pass backward in Gluon with FlashAttention-3's d-64 schedule: keys on rows, P and dS in registers,
a loader warp and a dQ warp, dQ added by TMA bulk reductions; elsewhere the two-pass backward, whose passes
issue dP's matmul before P's exponentials and whose dQ pass, run first, computes delta and copies an expanded
dO itself). "single_pass" is the previous single pass, on the queries-on-rows dK/dV kernel
(`single_qrows=True`, the default before the keys-on-rows kernel). "gluon_kv" is the deterministic two-pass
backward (`deterministic=True`) with its dK/dV pass in Gluon, "gluon_fwd" the same with the Triton dK/dV
pass everywhere (`gluon_kv=False`), "fused_prep" also with the Triton forward (`gluon_fwd=False`).
"tma" issues dP's matmul after the exponentials (`dp_first=False`); "dp_first" keeps the delta
pre-pass kernel and PyTorch's dO copy (`fused_prep=False`), as every step before it does.
"gluon_everywhere" is the shipped kernel with the Gluon kernels at every size they take, short calls too (the
measurement behind `chooser.GLUON_FWD_MIN_WORK` and `GLUON_BWD_MIN_WORK`); "gluon_fwd_everywhere" only its forward,
"gluon_bwd_everywhere" only its backward (the forward by its threshold), "gluon_two_pass_everywhere" the
deterministic two-pass backward with its dK/dV pass in Gluon at every size (at d 64 the single pass is what
"gluon_everywhere" runs). "atomic_dq" is the single-pass backward in Triton (fp32 atomic dQ, `deterministic=False`),
measured slower than the two-pass design on the H200. The steps before "tma" load tiles through block pointers.
`cs336-bench leaderboard --variant all` times them with the course's harness; `runs/README.md` has the table.
Non-shipped variants launch eagerly (a graph break under torch.compile).
"""

from __future__ import annotations

import torch

from cs336_systems.flash_triton import FlashAttention2Triton, KernelOptions, autograd_function

_TRITON_ONLY = dict(gluon_fwd=False, gluon_kv=False)  # the steps before the Gluon kernels
_PLAIN = KernelOptions(triton_backward=False, skip_masked_tiles=False, autotune=False, tma=False,
                       fused_prep=False, **_TRITON_ONLY)

ABLATION_VARIANTS: dict[str, type[torch.autograd.Function]] = {
    "fwd_triton_bwd_compiled": autograd_function("FlashFwdTritonBwdCompiled", _PLAIN),
    "bwd_triton": autograd_function(
        "FlashBwdTriton", KernelOptions(skip_masked_tiles=False, autotune=False, tma=False, fused_prep=False,
                                        **_TRITON_ONLY)),
    "causal_skip": autograd_function(
        "FlashCausalSkip", KernelOptions(autotune=False, tma=False, fused_prep=False, **_TRITON_ONLY)),
    "autotune": autograd_function("FlashAutotune", KernelOptions(tma=False, fused_prep=False, **_TRITON_ONLY)),
    "tma": autograd_function("FlashTma", KernelOptions(dp_first=False, fused_prep=False, **_TRITON_ONLY)),
    "atomic_dq": autograd_function("FlashAtomicDq", KernelOptions(deterministic=False, **_TRITON_ONLY)),
    "dp_first": autograd_function("FlashDpFirst", KernelOptions(fused_prep=False, **_TRITON_ONLY)),
    "fused_prep": autograd_function("FlashFusedPrep", KernelOptions(**_TRITON_ONLY)),
    "gluon_fwd": autograd_function("FlashGluonFwd", KernelOptions(gluon_kv=False, deterministic=True)),
    "gluon_kv": autograd_function("FlashGluonKv", KernelOptions(deterministic=True)),
    "single_pass": autograd_function("FlashSinglePassQrows", KernelOptions(single_qrows=True)),
    "gluon_everywhere": autograd_function("FlashGluonEverywhere", KernelOptions(gluon_fwd=True, gluon_kv=True)),
    "gluon_fwd_everywhere": autograd_function("FlashGluonFwdEverywhere", KernelOptions(gluon_fwd=True)),
    "gluon_bwd_everywhere": autograd_function("FlashGluonBwdEverywhere", KernelOptions(gluon_kv=True)),
    "gluon_two_pass_everywhere": autograd_function(
        "FlashGluonTwoPassEverywhere", KernelOptions(gluon_fwd=True, gluon_kv=True, deterministic=True)),
    "single_keys": FlashAttention2Triton,
}

__all__ = ["ABLATION_VARIANTS"]
