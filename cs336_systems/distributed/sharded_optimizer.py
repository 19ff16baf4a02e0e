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

Checkpoints: `state_dict()` is this rank's shard in `torch.optim`'s format (every group's
hyper-parameters, such as a scheduler's current `lr`, with the parameters numbered over the whole
model; the state of the parameters this rank owns; and `shard`: the rank, world size and parameter
numbers it covers). Each rank saves its own and, resuming with the same world size and parameters,
loads it back with `load_state_dict()`, which also accepts a plain optimizer's state dict of the
whole model. Neither communicates.
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
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or of parameter-group dicts, not one tensor")
        # (groups' parameter iterables made lists: `_defaults` reads them, and a generator reads once)
        params = [{**entry, "params": _tensor_list(entry["params"])} if isinstance(entry, dict) and "params" in entry
                  else entry for entry in params]
        # Calls self.add_param_group() for every group; the wrapped optimizer's defaults (with kwargs) become the
        # groups' defaults, so that every group shows all its hyper-parameters (a scheduler reads `betas`, say).
        super().__init__(params, _defaults(optimizer_cls, params, kwargs))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Register a group (at construction or later, e.g. to unfreeze layers) and assign its parameters."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        params = _tensor_list(param_group.get("params") or [])
        names = None
        if params and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in params):
            names, params = [n for n, _ in params], [p for _, p in params]  # named_parameters(), as torch.optim takes
            param_group = {**param_group, "param_names": names}
        not_tensors = sorted({type(p).__name__ for p in params if not isinstance(p, torch.Tensor)})
        if not_tensors:
            raise TypeError(f"{type(self).__name__} optimizes tensors; the parameter group holds {not_tensors}")
        if len({id(p) for p in params}) != len(params):  # a plain optimizer would step it twice, a shard once
            raise ValueError(f"{type(self).__name__}: a parameter appears twice in one parameter group")
        check_tensor_devices(params, type(self).__name__)
        # The base class validates (leaf tensors, no parameter in two groups) and fills defaults.
        super().add_param_group({**param_group, "params": params})
        group = self.param_groups[-1]
        owned = []
        for i, p in enumerate(group["params"]):
            rank = min(range(self.world_size), key=lambda r: (self.shard_numel[r], r))
            self.owner[id(p)] = rank
            self.shard_numel[rank] += p.numel()
            if rank == self.rank:
                owned.append(i)
        if not owned:
            self._local_group_of.append(None)
            return
        local_group = _hyperparameters(group)
        local_group["params"] = [group["params"][i] for i in owned]
        if names is not None:
            local_group["param_names"] = [names[i] for i in owned]
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
            if local_index is not None:
                self.local_optimizer.param_groups[local_index].update(_hyperparameters(group))

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        handles = [
            dist.broadcast(p.data, src=self.owner[id(p)], async_op=True)
            for group in self.param_groups
            for p in group["params"]
        ]
        for handle in handles:
            handle.wait()

    def _numbers(self) -> dict[int, int]:
        """id(param) -> its number in a state dict: its position over all groups, as `torch.optim` numbers them."""
        return {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: all groups' hyper-parameters, the owned parameters' state, and what it covers."""
        number = self._numbers()
        state = {}
        if self.local_optimizer is not None:
            local_params = [p for group in self.local_optimizer.param_groups for p in group["params"]]
            local_state = self.local_optimizer.state_dict()["state"]
            state = {number[id(local_params[i])]: s for i, s in local_state.items()}
        return {
            "state": state,
            "param_groups": [
                {**_hyperparameters(group), "params": [number[id(p)] for p in group["params"]]}
                for group in self.param_groups
            ],
            "shard": {"rank": self.rank, "world_size": self.world_size,
                      "params": [number[id(p)] for p in self.owned_parameters()]},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the hyper-parameters of every group and the state of the parameters this rank owns."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        missing_keys = {"state", "param_groups"} - state_dict.keys()
        if missing_keys:
            raise ValueError(f"state_dict lacks {sorted(missing_keys)}: not an optimizer state dict")
        saved_groups = state_dict["param_groups"]
        sizes = [len(group["params"]) for group in self.param_groups]
        saved_sizes = [len(group["params"]) for group in saved_groups]
        if saved_sizes != sizes:
            raise ValueError(
                f"state_dict has parameter groups of sizes {saved_sizes}; this optimizer's groups have sizes {sizes}"
            )
        number = self._numbers()
        shard = state_dict.get("shard")
        if shard is not None:
            lacking = sorted({number[id(p)] for p in self.owned_parameters()} - set(shard["params"]))
            if lacking:
                raise ValueError(
                    f"state_dict is the shard of rank {shard['rank']} of {shard['world_size']}, without the state of "
                    f"parameters {lacking} that rank {self.rank} of {self.world_size} owns: load the state dict this "
                    "rank saved, with the same world size and parameters"
                )
        for group, saved in zip(self.param_groups, saved_groups):
            group.update(_hyperparameters(saved))
        if self.local_optimizer is None:
            return
        # The local optimizer numbers its own parameters over its groups, which follow the global groups' order.
        local_groups, local_state, start = [], {}, 0
        for saved, local_index in zip(saved_groups, self._local_group_of):
            if local_index is None:
                continue
            local = self.local_optimizer.param_groups[local_index]
            local_groups.append({**_hyperparameters(local), **_hyperparameters(saved),
                                 "params": list(range(start, start + len(local["params"])))})
            for i, p in enumerate(local["params"], start):
                if number[id(p)] in state_dict["state"]:
                    local_state[i] = state_dict["state"][number[id(p)]]
            start += len(local["params"])
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})


def _defaults(optimizer_cls: type[torch.optim.Optimizer], params: list, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`optimizer_cls(..., **kwargs).defaults`: read off one built over a stand-in tensor on the first parameter's
    device (its hyper-parameters checked here, on every rank, also one that owns nothing)."""
    tensors = [p for entry in params for p in (entry.get("params", ()) if isinstance(entry, dict) else (entry,))]
    device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))
    return dict(optimizer_cls([torch.zeros(1, device=device, requires_grad=True)], **kwargs).defaults)


def _tensor_list(params: Any) -> list:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
