"""The course's adapter functions: they hand the graded tests our autograd.Function classes."""

from __future__ import annotations

import torch


def get_flashattention_autograd_function_pytorch() -> type[torch.autograd.Function]:
    """FlashAttention-2 with a tiled PyTorch forward and a compiled PyTorch backward."""
    from cs336_systems.flash_pytorch import FlashAttention2Pytorch

    return FlashAttention2Pytorch


def get_flashattention_autograd_function_triton() -> type[torch.autograd.Function]:
    """FlashAttention-2 with Triton forward and backward kernels."""
    from cs336_systems.flash_triton import FlashAttention2Triton

    return FlashAttention2Triton
