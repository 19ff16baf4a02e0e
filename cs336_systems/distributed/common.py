"""Checks and collectives shared by the DDP wrappers and the sharded optimizer.

Everything here validates before it communicates: a missing process group or a tensor on a device
the backend cannot communicate raises before any collective is issued, so a bad call fails on every
rank with a clear message instead of hanging the others.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


def require_process_group(what: str) -> tuple[int, int]:
    """(rank, world_size) of the default process group; RuntimeError if there is none."""
    if not dist.is_available():
        raise RuntimeError(f"{what} needs torch.distributed, which this PyTorch build does not provide")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs an initialized default process group: call "
            "torch.distributed.init_process_group(backend, rank=..., world_size=...) on every rank first"
        )
    return dist.get_rank(), dist.get_world_size()


def backend_device_types() -> dict[str, str] | None:
    """Device type -> backend name of the default group, or None when the backend is not one we know.

    `dist.get_backend()` is either a single backend ("nccl", "gloo") or a per-device list such as
    "cpu:gloo,cuda:nccl"; a single backend serves the device types in `Backend.backend_capability`.
    """
    name = str(dist.get_backend())
    if ":" in name:
        pairs = (item.split(":", 1) for item in name.split(","))
        return {device.strip(): backend.strip() for device, backend in pairs}
    capability = dist.Backend.backend_capability.get(name)
    if capability is None:
        return None
    return {device: name for device in capability}


def check_tensor_devices(tensors: Iterable[torch.Tensor], what: str) -> torch.device | None:
    """The one device all `tensors` live on, checked against the backend; None if there are no tensors.

    ValueError for tensors spread over several devices, for meta tensors (no data to communicate),
    and for a device type the process group's backend cannot communicate (e.g. CPU under NCCL).
    """
    devices = {t.device for t in tensors}
    if not devices:
        return None
    if len(devices) > 1:
        raise ValueError(f"{what}: all parameters and buffers must be on one device, found {sorted(map(str, devices))}")
    (device,) = devices
    if device.type == "meta":
        raise ValueError(f"{what}: tensors are on the meta device (no data); move the module to a real device first")
    supported = backend_device_types()
    if supported is not None and device.type not in supported:
        raise ValueError(
            f"{what}: tensors are on {device}, but the process group's backend {dist.get_backend()!r} "
            f"communicates only {sorted(supported)} tensors (NCCL needs CUDA tensors; use Gloo for the CPU)"
        )
    return device


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Distinct parameters then distinct buffers of `module` (a tied tensor appears once)."""
    return [*module.parameters(), *module.buffers()]


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that take gradients, in registration order, each tied/shared Parameter once."""
    return [p for p in module.parameters() if p.requires_grad]


@torch.no_grad()
def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int = 0) -> None:
    """Overwrite each tensor with rank `src`'s values (all broadcasts in flight at once)."""
    handles = [dist.broadcast(t.data, src=src, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()


def broadcast_module_state(module: nn.Module, src: int = 0) -> None:
    """Overwrite every parameter (trainable or frozen) and buffer with rank `src`'s values."""
    broadcast_tensors(module_tensors(module), src)
