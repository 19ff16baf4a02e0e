"""AdamW with the same update rule as torch.optim.AdamW."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


class AdamW(torch.optim.Optimizer):
    """Adam with bias correction and decoupled weight decay (p -= lr * wd * p before the Adam step)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        # (written `not x >= 0`, so that NaN fails too)
        if not lr >= 0:
            raise ValueError(f"invalid learning rate {lr}: must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if not eps >= 0:
            raise ValueError(f"invalid eps {eps}: must be >= 0")
        if not weight_decay >= 0:
            raise ValueError(f"invalid weight_decay {weight_decay}: must be >= 0")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                # a state loaded from torch.optim.AdamW holds `step` as a float32 tensor: counted here as a Python
                # number, so that beta**t is computed in double precision as for a fresh state
                state["step"] = int(state["step"]) + 1
                t = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if torch.is_complex(p):  # Adam per real component, as torch.optim.AdamW (|g|², not g²)
                    p, grad = torch.view_as_real(p), torch.view_as_real(grad)
                    exp_avg, exp_avg_sq = torch.view_as_real(exp_avg), torch.view_as_real(exp_avg_sq)

                p.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)  # m = b1 m + (1 - b1) g
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # v = b2 v + (1 - b2) g^2
                step_size = lr / (1 - beta1**t)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss
