"""FlashAttention-2 in Triton: the public names. The code lives in `cs336_systems.flash`, split by role.

`flash_attention(q, k, v, is_causal=False, scale=None, enable_gqa=False, deterministic=None, window=(-1, -1))`
is the SDPA-style op, `flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`
its packed-sequence form; `FlashAttention2Triton` is the course's autograd.Function. Set TRITON_INTERPRET=1 before
importing this module to run the kernels on the CPU through Triton's interpreter.
"""

from __future__ import annotations

from cs336_systems.flash.autotune import AUTOTUNED_KERNELS, KERNELS, KernelSpec, make_configs
from cs336_systems.flash.chooser import KernelOptions, split_rows
from cs336_systems.flash.launch import (
    INTERPRET, MAX_HEAD_DIM, attention_backward, attention_forward, flash_backward_triton, flash_forward_triton,
    launch_cache_sizes, launch_hooks_installed,
)
from cs336_systems.flash.ops import FlashAttention2Triton, autograd_function, flash_attention, flash_attention_varlen

__all__ = [
    "AUTOTUNED_KERNELS", "INTERPRET", "KERNELS", "MAX_HEAD_DIM", "FlashAttention2Triton", "KernelOptions",
    "KernelSpec", "attention_backward", "attention_forward", "autograd_function", "flash_attention",
    "flash_attention_varlen", "flash_attn_bwd", "flash_attn_fwd", "flash_backward_triton", "flash_forward_triton",
    "launch_cache_sizes", "launch_hooks_installed", "make_configs", "split_rows",
]


def __getattr__(name: str):
    """The ops torch.compile traces, registered when torch._dynamo loads (`flash.ops`)."""
    if name in ("flash_attn_fwd", "flash_attn_bwd"):
        from cs336_systems.flash import ops

        return getattr(ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
