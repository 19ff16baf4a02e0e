"""Data-parallel wrappers around any `nn.Module`, from the naive one to bucketed overlap (handout §2).

Every wrapper, at construction: checks that a default process group exists and that the module's
tensors sit on one device the backend can communicate, then broadcasts all parameters (trainable or
frozen) and buffers from rank 0, so every replica starts identical. After `loss.backward()` the
training loop calls `finish_gradient_synchronization()`, and then every parameter that received a
gradient holds the average of that gradient over the ranks (a SUM all-reduce and a division by the
world size: Gloo has no AVG op; the overlapped variants divide before the all-reduce, inside the
hook, so that the scaling pass overlaps the backward pass too). Parameters with `requires_grad=False` are never communicated;
a tied parameter (one `Parameter` registered under several names) is one tensor, synchronized once.

- `NaiveDDP`: after backward, one blocking all-reduce per parameter gradient.
- `FlatDDP`: after backward, one blocking all-reduce of all gradients concatenated (one per dtype).
- `DDPIndividualParameters`: a post-accumulate-grad hook per parameter launches an async
  all-reduce as soon as that gradient is final; the handles are waited for in
  `finish_gradient_synchronization()`, so communication overlaps the rest of the backward pass.
- `DDPBucketed`: parameters in reverse registration order (roughly the order their gradients become
  ready) are packed into buckets of at most `bucket_size_mb` MiB (a larger parameter gets a bucket of
  its own); hooks copy each gradient into its bucket's flat buffer and launch one async all-reduce per
  bucket once all of its gradients are in.

The hooks hold the wrapper only through a weak reference: a hook registered on a parameter lives in
autograd's C++ structures, where a strong reference back to the wrapper would form a cycle Python's
garbage collector cannot see, and every dropped wrapper (with its module, gradients and buckets)
would stay in memory. A dropped wrapper's hooks do nothing; `remove_hooks()` detaches them.

Assumption shared with PyTorch's DDP (without `find_unused_parameters`): every rank runs the same
graph, so the same parameters get gradients in the same order. A parameter that gets no gradient in
a step keeps `grad=None`; in `DDPBucketed` its slot is reduced as zeros, and a bucket that never
filled during backward is reduced inside `finish_gradient_synchronization()`.
"""

from __future__ import annotations

import math
import numbers
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.common import (
    broadcast_module_state,
    check_tensor_devices,
    module_tensors,
    require_process_group,
    trainable_parameters,
)

MIB = 2**20


class DataParallelBase(nn.Module):
    """What every wrapper shares: validation, the rank-0 broadcast, forward delegation."""

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"{type(self).__name__} wraps an nn.Module, got {type(module).__name__}")
        name = type(self).__name__
        rank, world_size = require_process_group(name)
        device = check_tensor_devices(module_tensors(module), name)
        super().__init__()
        self.module = module
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.params: list[nn.Parameter] = trainable_parameters(module)
        self._hooks: list = []
        broadcast_module_state(module, src=0)

    def _register_gradient_hooks(self) -> None:
        """Call `self._on_gradient_ready(param)` once each parameter's gradient is accumulated."""
        wrapper = weakref.ref(self)

        def hook(param: nn.Parameter) -> None:
            alive = wrapper()
            if alive is not None:
                alive._on_gradient_ready(param)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        raise NotImplementedError

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the wrapped module's parameters (the wrapper stops syncing)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def on_train_batch_start(self) -> None:
        """Called before each batch's forward; nothing to do unless a subclass keeps per-step state."""

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError


class NaiveDDP(DataParallelBase):
    """After backward: a blocking all-reduce per parameter gradient, then division by the world size."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(self.world_size)


class FlatDDP(DataParallelBase):
    """After backward: the gradients concatenated into one flat tensor per dtype, one all-reduce each."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numels,)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world_size)
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))


class DDPIndividualParameters(DataParallelBase):
    """Async all-reduce of each gradient from its post-accumulate-grad hook, overlapping backward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self._pending: list[tuple[torch.Tensor, dist.Work]] = []
        self._launched: set[int] = set()  # id() of parameters whose gradient is in flight this step
        self._register_gradient_hooks()

    @property
    def num_pending(self) -> int:
        """All-reduces launched since the last `finish_gradient_synchronization()`."""
        return len(self._pending)

    @torch.no_grad()
    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        if id(param) in self._launched:
            raise RuntimeError(
                f"{type(self).__name__}: a parameter's gradient became ready twice without "
                "finish_gradient_synchronization() in between (gradient accumulation over several "
                "backward passes is not supported); call it after every backward"
            )
        self._launched.add(id(param))
        grad = param.grad
        grad.div_(self.world_size)
        self._pending.append((grad, dist.all_reduce(grad, op=dist.ReduceOp.SUM, async_op=True)))

    def finish_gradient_synchronization(self) -> None:
        for _, work in self._pending:
            work.wait()
        self._pending.clear()
        self._launched.clear()


def assign_buckets(params: list[torch.Tensor], bucket_size_bytes: float) -> list[list[int]]:
    """Indices into `params`, grouped into buckets in reverse order.

    Walking `params` from last to first, a parameter joins the current bucket if it has the bucket's
    dtype and the bucket stays within `bucket_size_bytes`; otherwise it opens a new bucket. A
    parameter larger than the limit therefore sits alone in its bucket.
    """
    if not bucket_size_bytes > 0:
        raise ValueError(f"bucket size must be positive, got {bucket_size_bytes} bytes")
    buckets: list[list[int]] = []
    used = 0.0
    dtype = None
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if buckets and params[i].dtype == dtype and used + nbytes <= bucket_size_bytes:
            buckets[-1].append(i)
            used += nbytes
        else:
            buckets.append([i])
            used = nbytes
            dtype = params[i].dtype
    return buckets


@dataclass
class Bucket:
    """One flat gradient buffer, the parameters packed in it, and this step's synchronization state."""

    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor  # (total numel,), the parameters' dtype and device
    arrived: list[bool] = field(default_factory=list)
    n_arrived: int = 0
    work: dist.Work | None = None

    def __post_init__(self) -> None:
        self.arrived = [False] * len(self.params)

    def slot(self, j: int) -> torch.Tensor:
        return self.buffer[self.offsets[j] : self.offsets[j] + self.params[j].numel()]

    def reset(self) -> None:
        self.arrived = [False] * len(self.params)
        self.n_arrived = 0
        self.work = None


class DDPBucketed(DataParallelBase):
    """Bucketed async all-reduce: each bucket is reduced as soon as all its gradients are final."""

    def __init__(self, module: nn.Module, bucket_size_mb: float) -> None:
        if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, numbers.Real):
            raise TypeError(f"bucket_size_mb must be a number, got {type(bucket_size_mb).__name__}")
        if not (math.isfinite(bucket_size_mb) and bucket_size_mb > 0):
            raise ValueError(f"bucket_size_mb must be a positive finite number of MiB, got {bucket_size_mb}")
        super().__init__(module)
        self.bucket_size_mb = float(bucket_size_mb)
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket index, position in bucket)
        for b, indices in enumerate(assign_buckets(self.params, self.bucket_size_mb * MIB)):
            params = [self.params[i] for i in indices]
            offsets = [0]
            for p in params[:-1]:
                offsets.append(offsets[-1] + p.numel())
            buffer = torch.zeros(offsets[-1] + params[-1].numel(), dtype=params[0].dtype, device=params[0].device)
            self.buckets.append(Bucket(params, offsets, buffer))
            for j, p in enumerate(params):
                self._where[id(p)] = (b, j)
        self._register_gradient_hooks()

    @property
    def num_pending(self) -> int:
        """Buckets whose all-reduce has been launched and not yet waited for."""
        return sum(bucket.work is not None for bucket in self.buckets)

    @torch.no_grad()
    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        b, j = self._where[id(param)]
        bucket = self.buckets[b]
        if bucket.arrived[j]:
            raise RuntimeError(
                f"{type(self).__name__}: a parameter's gradient became ready twice without "
                "finish_gradient_synchronization() in between (gradient accumulation over several "
                "backward passes is not supported); call it after every backward"
            )
        torch.div(param.grad.reshape(-1), self.world_size, out=bucket.slot(j))  # copy in, pre-scaled
        bucket.arrived[j] = True
        bucket.n_arrived += 1
        if bucket.n_arrived == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, async_op=True)

    def on_train_batch_start(self) -> None:
        """Start a fresh step: wait out (and discard) any reduction left over from an unfinished one."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.reset()

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        # Buckets that never filled (some parameter got no gradient) are reduced now, in bucket order,
        # with zeros in the missing slots.
        for bucket in self.buckets:
            if bucket.work is None:
                for j, arrived in enumerate(bucket.arrived):
                    if not arrived:
                        bucket.slot(j).zero_()
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            for j, p in enumerate(bucket.params):
                if bucket.arrived[j]:
                    p.grad.copy_(bucket.slot(j).view_as(p.grad))
            bucket.reset()
