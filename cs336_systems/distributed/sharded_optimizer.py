"""Optimizer state sharding (handout §3): each rank keeps optimizer state for its shard only.

`ShardedOptimizer(params, optimizer_cls, **kwargs)` is a `torch.optim.Optimizer` whose
`param_groups` list every parameter (so `zero_grad()` and learning-rate schedules see the whole
model), while the wrapped `optimizer_cls` instance on each rank is built over the parameters this
rank owns. Ownership is decided identically on every rank from the parameters' order and sizes: each
new parameter goes to the rank that owns the fewest elements so far (ties to the lower rank), which
balances the shards by size. `step()` first copies the hyper-parameters of each group (e.g. an
updated `lr`) into the wrapped optimizer, steps it (updating the owned parameters only), then
broadcasts every parameter from its owner, so all replicas hold the same updated parameters.

Parameters must already be identical on every rank (e.g. wrapped by one of the DDP classes), and
gradients must already be averaged; the optimizer does not communicate gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.distributed.common import check_tensor_devices, require_process_group


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer_cls`: state and updates for this rank's shard, parameters broadcast after."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: Any,
    ) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        if issubclass(optimizer_cls, ShardedOptimizer):
            raise TypeError("optimizer_cls must be a plain optimizer, not another ShardedOptimizer")
        self.rank, self.world_size = require_process_group(type(self).__name__)
        self.optimizer_cls = optimizer_cls
        self.optimizer_kwargs = dict(kwargs)
        self.owner: dict[int, int] = {}  # id(param) -> owning rank
        self.shard_numel = [0] * self.world_size
        self.local_optimizer: torch.optim.Optimizer | None = None
        self._local_group_of: list[int | None] = []  # global group index -> local group index
        # Calls self.add_param_group() for every group; kwargs become the groups' defaults.
        super().__init__(params, kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Register a group (at construction or later, e.g. to unfreeze layers) and assign its parameters."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        params = param_group.get("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        not_tensors = sorted({type(p).__name__ for p in params if not isinstance(p, torch.Tensor)})
        if not_tensors:
            raise TypeError(f"{type(self).__name__} optimizes tensors; the parameter group holds {not_tensors}")
        check_tensor_devices(params, type(self).__name__)
        # The base class validates (leaf tensors, no parameter in two groups) and fills defaults.
        super().add_param_group({**param_group, "params": params})
        group = self.param_groups[-1]
        owned = []
        for p in group["params"]:
            rank = min(range(self.world_size), key=lambda r: (self.shard_numel[r], r))
            self.owner[id(p)] = rank
            self.shard_numel[rank] += p.numel()
            if rank == self.rank:
                owned.append(p)
        if not owned:
            self._local_group_of.append(None)
            return
        local_group = {k: v for k, v in group.items() if k != "params"}
        local_group["params"] = owned
        if self.local_optimizer is None:
            self.local_optimizer = self.optimizer_cls([local_group], **self.optimizer_kwargs)
        else:
            self.local_optimizer.add_param_group(local_group)
        self._local_group_of.append(len(self.local_optimizer.param_groups) - 1)

    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters whose optimizer state lives on this rank."""
        return [p for group in self.param_groups for p in group["params"] if self.owner[id(p)] == self.rank]

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step the local shard, then broadcast every parameter from the rank that owns it."""
        loss = None
        if self.local_optimizer is not None:
            self._sync_hyperparameters()
            loss = self.local_optimizer.step(closure, **kwargs)
        elif closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._broadcast_parameters()
        return loss

    def _sync_hyperparameters(self) -> None:
        for group, local_index in zip(self.param_groups, self._local_group_of):
            if local_index is None:
                continue
            local = self.local_optimizer.param_groups[local_index]
            for key, value in group.items():
                if key != "params":
                    local[key] = value

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        handles = [
            dist.broadcast(p.data, src=self.owner[id(p)], async_op=True)
            for group in self.param_groups
            for p in group["params"]
        ]
        for handle in handles:
            handle.wait()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "ShardedOptimizer holds only this rank's shard of the state; save local_optimizer.state_dict() "
            "on every rank (the shard assignment is deterministic) instead"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError(
            "ShardedOptimizer holds only this rank's shard of the state; load into local_optimizer on every rank"
        )
