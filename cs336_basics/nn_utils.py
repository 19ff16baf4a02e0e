"""Loss and gradient utilities."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; logits (..., vocab), targets (...) int64. Computed in >= float32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # (..., vocab)
    log_normalizer = torch.log(torch.exp(shifted).sum(dim=-1))  # (...)
    target_logits = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (...)
    return (log_normalizer - target_logits).mean()


def clip_gradient(parameters: Iterable[torch.nn.Parameter], max_l2_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most `max_l2_norm`; returns the pre-clip norm."""
    if not max_l2_norm > 0:  # (NaN fails too)
        raise ValueError(f"max_l2_norm must be positive, got {max_l2_norm}")
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads]
    total_norm = torch.linalg.vector_norm(torch.stack(norms))
    scale = torch.clamp(max_l2_norm / (total_norm + eps), max=1.0)
    for g in grads:
        g.mul_(scale.to(device=g.device, dtype=g.dtype))
    return total_norm
