"""Data-parallel wrappers around any `nn.Module`, from the naive one to bucketed overlap (handout §2).

Every wrapper, at construction: checks that a default process group exists and that the module's
tensors sit on one device the backend can communicate, then broadcasts all parameters (trainable or
frozen) and buffers from rank 0, so every replica starts identical. After `loss.backward()` the
training loop calls `finish_gradient_synchronization()`, and then every parameter that received a
gradient holds the average of that gradient over the ranks (a SUM all-reduce and a division by the
world size: Gloo has no AVG op; the overlapped variants divide before the all-reduce, inside the
hook, so that the scaling pass overlaps the backward pass too). Parameters with `requires_grad=False` are never
communicated; a tied parameter (one `Parameter` registered under several names) is one tensor, synchronized once.
Every forward with grad enabled re-reads which parameters require grad, so a layer unfrozen after wrapping is
synchronized from that step on (starting from rank 0's values), and broadcasts the buffers from rank 0 unless
`broadcast_buffers=False`, as PyTorch's DDP does.

- `NaiveDDP`: after backward, one blocking all-reduce per parameter gradient.
- `FlatDDP`: after backward, one blocking all-reduce of all gradients concatenated (one per dtype;
  a sparse gradient on its own).
- `DDPIndividualParameters`: a post-accumulate-grad hook per parameter launches an async
  all-reduce as soon as that gradient is final; the handles are waited for in
  `finish_gradient_synchronization()`, so communication overlaps the rest of the backward pass.
- `DDPBucketed`: parameters in reverse registration order (roughly the order their gradients become
  ready) are packed into buckets of at most `bucket_size_mb` MiB (a larger parameter gets a bucket of
  its own); hooks copy each gradient into its bucket's flat buffer and launch one async all-reduce per
  bucket once all of its gradients are in. Modules with sparse gradients are refused at wrapping.

The hooks hold the wrapper only through a weak reference: a hook registered on a parameter lives in
autograd's C++ structures, where a strong reference back to the wrapper would form a cycle Python's
garbage collector cannot see, and every dropped wrapper (with its module, gradients and buckets)
would stay in memory. A dropped wrapper's hooks do nothing; `remove_hooks()` detaches them.

A parameter that got a gradient on some ranks only ends with the average on every rank (the others contributing
zeros), as under PyTorch's DDP with `find_unused_parameters`; one that got none anywhere keeps `grad=None`.
`NaiveDDP` and `FlatDDP` all-reduce a flag per parameter first to agree on which; `DDPBucketed` launches its buckets
in one order on every rank with the flags inside them, a missing gradient reduced as zeros (a bucket that never
filled during backward inside `finish_gradient_synchronization()`). `DDPIndividualParameters` needs, as
PyTorch's DDP without `find_unused_parameters` does, every rank to run the same graph (the same parameters get
gradients in the same order); its `finish_gradient_synchronization()` checks that and raises where ranks differ.
The price of the one order: a parameter that gets no gradient holds back the buckets after it until
`finish_gradient_synchronization()` (no overlap for them in that step).
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
    broadcast_tensors,
    check_tensor_devices,
    module_tensors,
    require_process_group,
    trainable_parameters,
)

MIB = 2**20


class DataParallelBase(nn.Module):
    """What every wrapper shares: validation, the rank-0 broadcasts, forward delegation.

    `broadcast_buffers` (default True, as in PyTorch's DDP): every forward with grad enabled first
    overwrites the module's buffers (e.g. BatchNorm's running statistics) with rank 0's, so that
    the replicas do not drift apart; a forward under `torch.no_grad()` (evaluation, perhaps on one
    rank only) communicates nothing.
    """

    def __init__(self, module: nn.Module, broadcast_buffers: bool = True) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"{type(self).__name__} wraps an nn.Module, got {type(module).__name__}")
        if not isinstance(broadcast_buffers, bool):
            raise TypeError(f"broadcast_buffers must be True or False, got {broadcast_buffers!r}")
        self._check_module(module)
        name = type(self).__name__
        rank, world_size = require_process_group(name)
        device = check_tensor_devices(module_tensors(module), name)
        super().__init__()
        self.module = module
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.broadcast_buffers = broadcast_buffers
        self.params: list[nn.Parameter] = trainable_parameters(module)
        self._hooks: list = []
        self._hooked = False
        broadcast_module_state(module, src=0)

    def _check_module(self, module: nn.Module) -> None:
        """What a subclass refuses in the module, checked before any communication."""

    def _register_gradient_hooks(self) -> None:
        """Call `self._on_gradient_ready(param)` once each parameter's gradient is accumulated."""
        wrapper = weakref.ref(self)

        def hook(param: nn.Parameter) -> None:
            alive = wrapper()
            if alive is not None:
                alive._on_gradient_ready(param)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.params]
        self._hooked = True

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        raise NotImplementedError

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the wrapped module's parameters (the wrapper stops syncing)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._hooked = False

    def forward(self, *inputs, **kwargs):
        if torch.is_grad_enabled():
            self._follow_requires_grad()
            if self.broadcast_buffers and self.world_size > 1:
                broadcast_tensors(self.module.buffers(), src=0)
        return self.module(*inputs, **kwargs)

    def _follow_requires_grad(self) -> None:
        """Take in the parameters whose `requires_grad` changed since wrapping (layers unfrozen or frozen)."""
        params = trainable_parameters(self.module)
        if len(params) == len(self.params) and all(p is q for p, q in zip(params, self.params)):
            return
        known = {id(p) for p in self.params}
        # A newly trained parameter starts from rank 0's values, as every parameter did at wrapping.
        broadcast_tensors([p for p in params if id(p) not in known], src=0)
        self.params = params
        self._parameters_changed()

    def _parameters_changed(self) -> None:
        """Rebuild what depends on `self.params`: the gradient hooks, where there are any."""
        if self._hooked:
            self.remove_hooks()
            self._register_gradient_hooks()

    def on_train_batch_start(self) -> None:
        """Called before each batch's forward; nothing to do unless a subclass keeps per-step state."""

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def _gradients_anywhere(self) -> list[torch.Tensor]:
        """The gradients to average, the same list on every rank: those of the parameters that got one on any rank
        (one all-reduce of a flag per parameter), zeros allocated where this rank got none."""
        if not self.params:
            return []
        device = self.params[0].device
        flags = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        grads = []
        for p, count in zip(self.params, flags.tolist()):
            if count and p.grad is None:
                p.grad = torch.zeros_like(p)
            if count:
                grads.append(p.grad)
        return grads


class NaiveDDP(DataParallelBase):
    """After backward: a blocking all-reduce per parameter gradient, then division by the world size."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        for grad in self._gradients_anywhere():
            _average(grad, self.world_size)


def _average(grad: torch.Tensor, world_size: int) -> None:
    """Blocking SUM all-reduce of one gradient (dense or sparse), then division by the world size."""
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)
    grad.div_(world_size)


class FlatDDP(DataParallelBase):
    """After backward: the gradients concatenated into one flat tensor per dtype, one all-reduce each.

    A sparse gradient (`nn.Embedding(sparse=True)`) cannot be concatenated: it is all-reduced on its
    own, as `NaiveDDP` does.
    """

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in self._gradients_anywhere():
            if grad.is_sparse:
                _average(grad, self.world_size)
            else:
                by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numels,)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world_size)
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))


# the order check's hash of the parameters' positions: a polynomial over them modulo a prime below 2^61 (int64)
_ORDER_BASE = 1_000_003
_ORDER_PRIME = 2**61 - 1


class DDPIndividualParameters(DataParallelBase):
    """Async all-reduce of each gradient from its post-accumulate-grad hook, overlapping backward.

    The all-reduces pair up across ranks by the order they are issued in, so every rank must issue the same
    gradients in the same order (run the same graph). `finish_gradient_synchronization()` checks that first, over a
    Gloo group of its own (a few bytes on the host, apart from the gradients' group, which a mismatch may leave
    waiting): where the ranks differ it raises a RuntimeError on every rank instead of handing back averages of
    different parameters' gradients."""

    def __init__(self, module: nn.Module, broadcast_buffers: bool = True) -> None:
        super().__init__(module, broadcast_buffers)
        self._pending: list[tuple[torch.Tensor, dist.Work]] = []
        self._launched: set[int] = set()  # id() of parameters whose gradient is in flight this step
        self._order = 0  # the hash of the positions (in self.params) of the gradients launched this step, in order
        self._positions = {id(p): i for i, p in enumerate(self.params)}
        # (new_group is collective: every rank constructs its wrapper)
        self._check_group = dist.new_group(backend="gloo") if self.world_size > 1 else None
        self._register_gradient_hooks()

    def _parameters_changed(self) -> None:
        super()._parameters_changed()
        self._positions = {id(p): i for i, p in enumerate(self.params)}

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
        self._order = (self._order * _ORDER_BASE + self._positions[id(param)] + 1) % _ORDER_PRIME
        grad = param.grad
        grad.div_(self.world_size)
        self._pending.append((grad, dist.all_reduce(grad, op=dist.ReduceOp.SUM, async_op=True)))

    def finish_gradient_synchronization(self) -> None:
        launched, order = len(self._pending), self._order
        self._order = 0
        if self._check_group is not None:
            self._check_same_gradients(launched, order)
        for _, work in self._pending:
            work.wait()
        self._pending.clear()
        self._launched.clear()

    def _check_same_gradients(self, launched: int, order: int) -> None:
        """RuntimeError on every rank unless every rank launched the same gradients in the same order this step."""
        seen = torch.tensor([launched, order, -launched, -order], dtype=torch.int64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self._check_group)
        most, highest, fewest, lowest = seen[0].item(), seen[1].item(), -seen[2].item(), -seen[3].item()
        if most != fewest or highest != lowest:
            self._pending.clear()  # (not waited for: a rank may never issue their partners)
            self._launched.clear()
            what = (f"between {fewest} and {most} gradients" if most != fewest
                    else f"{most} gradients each, but not the same ones in the same order")
            raise RuntimeError(
                f"{type(self).__name__}: the ranks all-reduced different gradients this step ({what}), so the "
                "all-reduces paired different parameters' gradients and the averages are wrong. It needs every "
                "rank to run the same graph (the same parameters getting gradients, in the same order); "
                "DDPBucketed, NaiveDDP and FlatDDP take parameters that get gradients on some ranks only. The "
                "process group is out of step: start the ranks again.")


def sparse_gradient_modules(module: nn.Module) -> list[str]:
    """Names of the submodules that produce sparse gradients: `nn.Embedding` / `nn.EmbeddingBag` with sparse=True."""
    return [
        repr(name) if name else type(m).__name__
        for name, m in module.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    ]


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
    """One flat gradient buffer, the parameters packed in it, and this step's synchronization state. The buffer
    ends with one flag per parameter (1 where this rank has its gradient), reduced with the gradients: after the
    all-reduce a flag counts the ranks that had that gradient."""

    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor  # (total numel + len(params),), the parameters' dtype and device
    arrived: list[bool] = field(default_factory=list)
    n_arrived: int = 0
    work: dist.Work | None = None

    def __post_init__(self) -> None:
        self.arrived = [False] * len(self.params)

    def slot(self, j: int) -> torch.Tensor:
        return self.buffer[self.offsets[j] : self.offsets[j] + self.params[j].numel()]

    @property
    def full(self) -> bool:
        return self.n_arrived == len(self.params)

    @property
    def flags(self) -> torch.Tensor:
        return self.buffer[self.buffer.numel() - len(self.params):]

    def reset(self) -> None:
        self.arrived = [False] * len(self.params)
        self.n_arrived = 0
        self.work = None


class DDPBucketed(DataParallelBase):
    """Bucketed async all-reduce: each bucket is reduced as soon as all its gradients are final.

    The buckets are dense flat buffers, so a module with sparse gradients (`nn.Embedding` or
    `nn.EmbeddingBag` with `sparse=True`) is refused at wrapping; use `NaiveDDP`, `FlatDDP` or
    `DDPIndividualParameters` for it.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | None, broadcast_buffers: bool = True) -> None:
        """`bucket_size_mb`: MiB per bucket at most; None: no limit (one bucket per dtype), as the course's adapter
        documents it."""
        if bucket_size_mb is not None:
            if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, numbers.Real):
                raise TypeError(f"bucket_size_mb must be a number or None, got {type(bucket_size_mb).__name__}")
            if not (math.isfinite(bucket_size_mb) and bucket_size_mb > 0):
                raise ValueError(f"bucket_size_mb must be a positive finite number of MiB, got {bucket_size_mb}")
        super().__init__(module, broadcast_buffers)
        self.bucket_size_mb = math.inf if bucket_size_mb is None else float(bucket_size_mb)
        self._build_buckets()
        self._register_gradient_hooks()

    def _check_module(self, module: nn.Module) -> None:
        sparse = sparse_gradient_modules(module)
        if sparse:
            raise ValueError(
                f"{type(self).__name__} packs gradients into dense buckets and cannot reduce the sparse gradients "
                f"of {', '.join(sparse)} (sparse=True); use NaiveDDP, FlatDDP or DDPIndividualParameters, "
                "or sparse=False"
            )

    def _build_buckets(self) -> None:
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket index, position in bucket)
        for b, indices in enumerate(assign_buckets(self.params, self.bucket_size_mb * MIB)):
            params = [self.params[i] for i in indices]
            offsets = [0]
            for p in params[:-1]:
                offsets.append(offsets[-1] + p.numel())
            buffer = torch.zeros(offsets[-1] + params[-1].numel() + len(params), dtype=params[0].dtype,
                                 device=params[0].device)
            self.buckets.append(Bucket(params, offsets, buffer))
            for j, p in enumerate(params):
                self._where[id(p)] = (b, j)
        self._layout = [(p.dtype, p.device) for p in self.params]  # what the buffers were built for
        self._next = 0  # the next bucket to launch: launches go in bucket order on every rank

    def _parameters_changed(self) -> None:
        self.on_train_batch_start()  # no reduction of the old buckets may still be writing into them
        self._build_buckets()
        super()._parameters_changed()

    def forward(self, *inputs, **kwargs):
        if torch.is_grad_enabled() and [(p.dtype, p.device) for p in self.params] != self._layout:
            # the module was cast or moved after wrapping (`.double()`, `.to(...)`): buffers of its new dtypes,
            # not a reduction through the old ones (a float64 gradient averaged in float32)
            self.on_train_batch_start()
            self._build_buckets()
        return super().forward(*inputs, **kwargs)

    @property
    def num_pending(self) -> int:
        """Buckets whose all-reduce has been launched and not yet waited for."""
        return sum(bucket.work is not None for bucket in self.buckets)

    @torch.no_grad()
    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        b, j = self._where[id(param)]
        bucket = self.buckets[b]
        if param.grad.is_sparse:  # a sparse gradient from a functional call (no sparse module to refuse)
            raise RuntimeError(
                f"{type(self).__name__}: a parameter's gradient is sparse (e.g. F.embedding(..., sparse=True)) and "
                "the buckets are dense; use NaiveDDP, FlatDDP or DDPIndividualParameters"
            )
        if bucket.arrived[j]:
            raise RuntimeError(
                f"{type(self).__name__}: a parameter's gradient became ready twice without "
                "finish_gradient_synchronization() in between (gradient accumulation over several "
                "backward passes is not supported); call it after every backward"
            )
        if param.grad.dtype != bucket.buffer.dtype:
            raise RuntimeError(
                f"{type(self).__name__}: a {param.grad.dtype} gradient for a {bucket.buffer.dtype} bucket (the module "
                "was cast between forward and backward)")
        torch.div(param.grad.reshape(-1), self.world_size, out=bucket.slot(j))  # copy in, pre-scaled
        bucket.arrived[j] = True
        bucket.n_arrived += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the filled buckets from the next one on, in bucket order: every rank issues its all-reduces in
        one order (collectives pair up by order), whatever order its gradients arrived in."""
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        if bucket.full:
            bucket.flags.fill_(1)
        else:
            bucket.flags.copy_(torch.tensor(bucket.arrived, dtype=bucket.buffer.dtype))
        bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, async_op=True)
        self._next += 1

    def on_train_batch_start(self) -> None:
        """Start a fresh step: wait out (and discard) any reduction left over from an unfinished one."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.reset()
        self._next = 0

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        # Buckets that never filled (some parameter got no gradient here) are reduced now, in bucket order, with
        # zeros in the missing slots. A parameter that got a gradient on another rank only then takes the average
        # too (allocated here: the replicas must not drift apart); one that got none anywhere keeps grad None.
        for bucket in self.buckets[self._next:]:
            for j, arrived in enumerate(bucket.arrived):
                if not arrived:
                    bucket.slot(j).zero_()
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            counts = None if bucket.full else bucket.flags.tolist()  # (a device sync, only where one is missing)
            for j, p in enumerate(bucket.params):
                if bucket.arrived[j]:
                    p.grad.copy_(bucket.slot(j).view_as(p.grad))
                elif counts[j] > 0:
                    p.grad = bucket.slot(j).view_as(p).clone()
            bucket.reset()
        self._next = 0
