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


def get_ddp_individual_parameters(module: torch.nn.Module) -> torch.nn.Module:
    """DDP that all-reduces each gradient asynchronously as soon as backward has accumulated it."""
    from cs336_systems.distributed.ddp import DDPIndividualParameters

    return DDPIndividualParameters(module)


def ddp_individual_parameters_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After backward, before the optimizer step: wait for the gradient all-reduces."""
    ddp_model.finish_gradient_synchronization()


def get_ddp_bucketed(module: torch.nn.Module, bucket_size_mb: float | None) -> torch.nn.Module:
    """DDP that all-reduces gradients in buckets of at most `bucket_size_mb` MiB (None: no limit), overlapping
    backward."""
    from cs336_systems.distributed.ddp import DDPBucketed

    return DDPBucketed(module, bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After backward, before the optimizer step: wait for the bucket all-reduces."""
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Before each batch: reset the buckets' per-step state."""
    ddp_model.on_train_batch_start()


def get_sharded_optimizer(params, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
    """An optimizer that keeps `optimizer_cls` state only for this rank's shard of `params`."""
    from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

    return ShardedOptimizer(params, optimizer_cls, **kwargs)
