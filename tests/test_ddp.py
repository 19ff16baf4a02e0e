"""DDP wrappers on the CPU with Gloo: two spawned ranks must train exactly like one process.

One launch of two ranks (module fixture) trains every wrapper on two toy models and returns each
rank's final weights; the tests compare them with single-process training on the whole batch. The
models are float64 so "exactly" can mean agreement to ~1e-12 (the only difference is the order of
the floating-point sums: two half-batch means averaged vs one full-batch mean). Each rank starts
from a different random init, so a missing rank-0 broadcast fails; SGD with momentum is sensitive
to the gradient scale, so a missing division by the world size fails too.

The training loops use a few lines of SGD with momentum instead of `torch.optim.SGD`: any
`torch.optim.Optimizer` imports torch._dynamo on construction (seconds per spawned rank), and the
wrappers do not care which optimizer follows them.

The same launch checks that a layer unfrozen after wrapping is synchronized (the `unfreeze` model),
that sparse gradients are averaged (the `sparse` model; the bucketed wrapper refuses it), and that
BatchNorm's running statistics follow rank 0's as under PyTorch's DDP (`broadcast_buffers`).

Input checks (bucket size, device, missing process group) run in this process.
"""

from __future__ import annotations

import functools
import math
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP, assign_buckets
from cs336_systems.distributed.launch import WorkerError, launch
from tests import adapters
from tests.helpers import ToyModel

WORLD_SIZE = 2
STEPS = 4
GLOBAL_BATCH = 8
LR = 0.05
MOMENTUM = 0.9
TOL = dict(rtol=1e-10, atol=1e-12)
# (variant name, bucket size in MiB or None). 1e-6 MiB (~1 byte) puts every parameter in its own
# bucket; 4e-4 MiB (~420 bytes) packs a few small ones together; 100 MiB makes one bucket.
VARIANTS = [
    ("naive", None),
    ("flat", None),
    ("individual", None),
    ("bucketed", 1e-6),
    ("bucketed", 4e-4),
    ("bucketed", 100.0),
]
# toy: ToyModel; tied: embedding and output share a weight; unfreeze: ToyModel whose fc1 is frozen at
# wrapping and unfrozen before step UNFREEZE_AT; sparse: an Embedding(sparse=True), not tied.
MODELS = ("toy", "tied", "unfreeze", "sparse")
UNFREEZE_AT = 1
CASES = [(kind, *v) for kind in MODELS for v in VARIANTS if not (kind == "sparse" and v[0] == "bucketed")]


class EmbeddingModel(nn.Module):
    """Embedding and output projection share one Parameter (registered under two names), or, with `sparse`,
    an embedding with sparse gradients and a separate output projection."""

    def __init__(self, vocab: int = 12, d: int = 6, sparse: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, sparse=sparse)
        self.hidden = nn.Linear(d, d)
        self.frozen_bias = nn.Parameter(torch.randn(d), requires_grad=False)
        self.out = nn.Linear(d, vocab, bias=False)
        if not sparse:
            self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(x))) + self.frozen_bias)

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


class SGDMomentum:
    """torch.optim.SGD(params, lr, momentum)'s update (dampening 0, no Nesterov), skipping grad=None."""

    def __init__(self, params) -> None:
        self.params = list(params)
        self.buffers: dict[int, torch.Tensor] = {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            buf = self.buffers.get(id(p))
            if buf is None:
                buf = self.buffers[id(p)] = p.grad.clone()
            else:
                buf.mul_(MOMENTUM).add_(p.grad)
            p.add_(buf, alpha=-LR)


def make_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind in ("toy", "unfreeze"):
        model = ToyModel()
        model.fc1.requires_grad_(kind == "toy")
    else:
        model = EmbeddingModel(sparse=kind == "sparse")
    return model.double()


def make_batches(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of every step (identical in every process)."""
    g = torch.Generator().manual_seed(1234)
    if kind in ("toy", "unfreeze"):
        return [
            (torch.randn(GLOBAL_BATCH, 10, generator=g, dtype=torch.float64),
             torch.randn(GLOBAL_BATCH, 8, generator=g, dtype=torch.float64))
            for _ in range(STEPS)
        ]
    return [
        (torch.randint(0, 12, (GLOBAL_BATCH, 5), generator=g), torch.randint(0, 12, (GLOBAL_BATCH, 5), generator=g))
        for _ in range(STEPS)
    ]


def wrap(variant: str, bucket_mb: float | None, model: nn.Module, **kwargs) -> nn.Module:
    """The variant's wrapper; the adapters where the course has one (they take no options)."""
    if variant == "naive":
        return NaiveDDP(model, **kwargs)
    if variant == "flat":
        return FlatDDP(model, **kwargs)
    if variant == "individual":
        return DDPIndividualParameters(model, **kwargs) if kwargs else adapters.get_ddp_individual_parameters(model)
    return DDPBucketed(model, bucket_mb, **kwargs) if kwargs else adapters.get_ddp_bucketed(model, bucket_mb)


def train_ddp(ctx, kind: str, variant: str, bucket_mb: float | None) -> dict:
    """Train one wrapper on this rank's half of every batch; the final weights and what was seen."""
    model = make_model(kind, seed=100 + ctx.rank)  # different on every rank: the broadcast must fix it
    ddp = wrap(variant, bucket_mb, model)
    after_broadcast = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = SGDMomentum(ddp.parameters())
    per_rank = GLOBAL_BATCH // ctx.world_size
    pending_after_backward = []
    for step, (x, y) in enumerate(make_batches(kind)):
        x, y = x[ctx.rank * per_rank : (ctx.rank + 1) * per_rank], y[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]
        if kind == "unfreeze" and step == UNFREEZE_AT:
            model.fc1.requires_grad_(True)
        if variant == "bucketed":
            adapters.ddp_bucketed_on_train_batch_start(ddp, optimizer)
        optimizer.zero_grad()
        type(model).loss(ddp(x), y).backward()
        pending_after_backward.append(getattr(ddp, "num_pending", None))
        if variant == "individual":
            adapters.ddp_individual_parameters_on_after_backward(ddp, optimizer)
        elif variant == "bucketed":
            adapters.ddp_bucketed_on_after_backward(ddp, optimizer)
        else:
            ddp.finish_gradient_synchronization()
        optimizer.step()
    return {
        "after_broadcast": after_broadcast,
        "final": {k: v.clone() for k, v in model.state_dict().items()},
        "unused_grad_is_none": all(p.grad is None for n, p in model.named_parameters() if n.startswith("unused.")),
        "pending_after_backward": pending_after_backward,
        "n_buckets": len(ddp.buckets) if variant == "bucketed" else None,
        "n_params": len(ddp.params),
    }


def all_variants_worker(ctx) -> dict:
    results = {case: train_ddp(ctx, *case) for case in CASES}
    for broadcast in (True, False):
        for variant, mb in VARIANTS:
            results[("batchnorm", variant, mb, broadcast)] = train_batchnorm(
                ctx, functools.partial(wrap, variant, mb, broadcast_buffers=broadcast))
        results[("batchnorm", "torch_ddp", broadcast)] = train_batchnorm(
            ctx, functools.partial(nn.parallel.DistributedDataParallel, broadcast_buffers=broadcast))
    return results


def train_batchnorm(ctx, make_ddp) -> dict:
    """A BatchNorm model trained on this rank's half of each batch; its final parameters and buffers."""
    model = make_batchnorm_model(seed=100 + ctx.rank)
    ddp = make_ddp(model)
    optimizer = SGDMomentum(model.parameters())
    per_rank = GLOBAL_BATCH // ctx.world_size
    for x, y in make_batches("toy"):
        x, y = x[ctx.rank * per_rank : (ctx.rank + 1) * per_rank], y[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]
        optimizer.zero_grad()
        ToyModel.loss(ddp(x), y).backward()
        if hasattr(ddp, "finish_gradient_synchronization"):
            ddp.finish_gradient_synchronization()
        optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def make_batchnorm_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8)).double()


def train_single_process(kind: str) -> tuple[dict, dict]:
    """Reference: rank 0's initial model trained on the whole batch in this process."""
    model = make_model(kind, seed=100)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = SGDMomentum(model.parameters())
    for step, (x, y) in enumerate(make_batches(kind)):
        if kind == "unfreeze" and step == UNFREEZE_AT:
            model.fc1.requires_grad_(True)
        optimizer.zero_grad()
        type(model).loss(model(x), y).backward()
        optimizer.step()
    return init, model.state_dict()


@pytest.fixture(scope="module")
def ddp_results() -> list[dict]:
    return launch(all_variants_worker, WORLD_SIZE, backend="gloo", timeout_s=180, num_threads=1)


@pytest.fixture(scope="module")
def references() -> dict:
    return {kind: train_single_process(kind) for kind in MODELS}


def variant_id(v: tuple[str, float | None]) -> str:
    return v[0] if v[1] is None else f"{v[0]}-{v[1]:g}MiB"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{variant_id(c[1:])}")
def test_ddp_matches_single_process(ddp_results, references, case):
    kind = case[0]
    init, expected = references[kind]
    # The reference must actually move (else the comparison proves nothing), except frozen tensors.
    moved = [k for k in expected if not torch.equal(init[k], expected[k])]
    assert "fc1.weight" in moved or "embed.weight" in moved
    for rank, results in enumerate(ddp_results):
        result = results[case]
        for name, value in result["after_broadcast"].items():
            torch.testing.assert_close(value, init[name], rtol=0, atol=0, msg=f"rank {rank} {name} after broadcast")
        for name, value in result["final"].items():
            torch.testing.assert_close(value, expected[name], **TOL, msg=f"rank {rank} {name} after {STEPS} steps")
        for name in ("frozen", "scale", "frozen_bias", "unused.weight", "unused.bias"):
            if name in init:
                assert torch.equal(result["final"][name], init[name]), f"{name} changed"
        assert result["unused_grad_is_none"]
        if kind == "tied":
            assert result["n_params"] == 3  # embed/out weight once, hidden weight and bias


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast_buffers", "local_buffers"])
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_buffers_follow_pytorch_ddp(ddp_results, variant, broadcast):
    """Every rank's BatchNorm statistics and weights end where PyTorch's DDP with the same setting leaves them."""
    for rank, results in enumerate(ddp_results):
        expected = results[("batchnorm", "torch_ddp", broadcast)]
        for name, value in results[("batchnorm", *variant, broadcast)].items():
            torch.testing.assert_close(value, expected[name], **TOL, msg=f"rank {rank} {name}")
    # The setting matters on rank 1 (rank 0 is the source), so the comparison can fail.
    rank1 = ddp_results[1]
    assert not torch.equal(rank1[("batchnorm", "torch_ddp", True)]["1.running_mean"],
                           rank1[("batchnorm", "torch_ddp", False)]["1.running_mean"])


@pytest.mark.parametrize("kind", ("toy", "tied"))
def test_overlapped_variants_communicate_during_backward(ddp_results, kind):
    """Right after backward() returns, the overlapped wrappers have already launched their all-reduces."""
    for results in ddp_results:
        individual = results[(kind, "individual", None)]
        n_with_grad = individual["n_params"] - (2 if kind == "toy" else 0)  # toy: `unused` gets no gradient
        assert individual["pending_after_backward"] == [n_with_grad] * STEPS
        one_per_param = results[(kind, "bucketed", 1e-6)]
        assert one_per_param["n_buckets"] == one_per_param["n_params"]
        # toy: `unused` (registered last) is in the first bucket, and every rank launches its buckets in one order:
        # a parameter without a gradient holds back the buckets after it until finish_gradient_synchronization
        assert one_per_param["pending_after_backward"] == [0 if kind == "toy" else n_with_grad] * STEPS
        one_bucket = results[(kind, "bucketed", 100.0)]
        assert one_bucket["n_buckets"] == 1
        # toy: the single bucket also holds `unused`, so it is only launched in finish_gradient_synchronization
        assert one_bucket["pending_after_backward"] == [0 if kind == "toy" else 1] * STEPS


class BranchModel(nn.Module):
    """Three linear layers; `b` runs only where the caller says (a data-dependent branch, an MoE expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return self.c(h + self.b(x) if use_b else h)


def branch_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(GLOBAL_BATCH, 4, generator=g, dtype=torch.float64) for _ in range(STEPS)]


BRANCH_VARIANTS = [("naive", None), ("flat", None), ("bucketed", 1e-6), ("bucketed", 100.0)]


def bucketed_edges_worker(ctx) -> dict:
    """The wrappers where ranks differ in which parameters get gradients (`b` on rank 0 only); DDPBucketed after the
    module is cast to float64 behind the wrapper's back (wrapped in float32)."""
    per_rank = GLOBAL_BATCH // ctx.world_size
    results = {}
    for variant in BRANCH_VARIANTS:
        torch.manual_seed(100 + ctx.rank)
        model = BranchModel().double()
        ddp = wrap(*variant, model)
        optimizer = SGDMomentum(ddp.parameters())
        for x in branch_batches():
            ddp.on_train_batch_start()
            optimizer.zero_grad()
            ddp(x[ctx.rank * per_rank : (ctx.rank + 1) * per_rank], use_b=ctx.rank == 0).square().mean().backward()
            ddp.finish_gradient_synchronization()
            optimizer.step()
        results[("branch", *variant)] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(100 + ctx.rank)
    model = BranchModel()  # float32 when wrapped
    ddp = DDPBucketed(model, 100.0)
    model.double()
    ddp(torch.ones(2, 4, dtype=torch.float64), use_b=True).sum().backward()
    ddp.finish_gradient_synchronization()
    results["cast"] = {name: p.grad.clone() for name, p in model.named_parameters()}
    results["cast_buckets"] = [b.buffer.dtype for b in ddp.buckets]
    return results


@pytest.fixture(scope="module")
def bucketed_edges() -> list[dict]:
    return launch(bucketed_edges_worker, WORLD_SIZE, backend="gloo", timeout_s=180, num_threads=1)


@pytest.mark.parametrize("variant", BRANCH_VARIANTS, ids=variant_id)
def test_parameter_used_on_some_ranks_only(bucketed_edges, variant):
    """A parameter with a gradient on rank 0 only gets the average (rank 1 contributing zeros) on every rank: the
    replicas stay identical and equal one process training on the mean of the two ranks' losses."""
    torch.manual_seed(100)
    model = BranchModel().double()
    optimizer = SGDMomentum(model.parameters())
    half = GLOBAL_BATCH // WORLD_SIZE
    for x in branch_batches():
        optimizer.zero_grad()
        ((model(x[:half], True).square().mean() + model(x[half:], False).square().mean()) / 2).backward()
        optimizer.step()
    for rank, results in enumerate(bucketed_edges):
        for name, value in results[("branch", *variant)].items():
            torch.testing.assert_close(value, model.state_dict()[name], **TOL, msg=f"rank {rank} {name}")


class SwapModel(nn.Module):
    """Two linear layers of one shape, in an order the caller picks: the gradients become ready in the reverse."""

    def __init__(self) -> None:
        super().__init__()
        self.p, self.q = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, p_first: bool) -> torch.Tensor:
        return self.q(self.p(x)) if p_first else self.p(self.q(x))


def individual_swapped_worker(ctx) -> str:
    """DDPIndividualParameters where the ranks' gradients become ready in different orders (the same count and
    sizes, so the all-reduces pair up and complete): the RuntimeError's message on this rank."""
    torch.manual_seed(0)
    ddp = DDPIndividualParameters(SwapModel())
    ddp(torch.ones(2, 4), p_first=True).sum().backward()  # the same graph on every rank first: no error
    ddp.finish_gradient_synchronization()
    ddp(torch.ones(2, 4), p_first=ctx.rank == 0).sum().backward()
    try:
        ddp.finish_gradient_synchronization()
    except RuntimeError as e:
        return str(e)
    return "no error"


def individual_unused_worker(ctx) -> None:
    """DDPIndividualParameters where `b` gets a gradient on rank 0 only: raises (the launcher reports it)."""
    torch.manual_seed(0)
    ddp = DDPIndividualParameters(BranchModel())
    ddp(torch.ones(2, 4), use_b=ctx.rank == 0).sum().backward()
    ddp.finish_gradient_synchronization()


def test_individual_parameters_refuses_ranks_that_ran_different_graphs():
    """Averages of different parameters' gradients are never handed back: gradients ready in another order on each
    rank (all-reduces that pair and complete, wrongly) and a gradient on one rank only both raise on every rank."""
    messages = launch(individual_swapped_worker, WORLD_SIZE, backend="gloo", timeout_s=120, num_threads=1)
    for message in messages:
        assert "ranks all-reduced different gradients this step (4 gradients each, but not the same ones" in message
    with pytest.raises(WorkerError, match=r"different gradients this step \(between 4 and 6 gradients\)"):
        launch(individual_unused_worker, WORLD_SIZE, backend="gloo", timeout_s=120, num_threads=1)


def test_bucketed_follows_a_cast_after_wrapping(bucketed_edges):
    """Cast to float64 after wrapping: buckets of float64, gradients averaged without a float32 rounding."""
    for results in bucketed_edges:
        assert results["cast_buckets"] == [torch.float64]
        for name, grad in results["cast"].items():
            assert grad.dtype == torch.float64
            torch.testing.assert_close(grad, bucketed_edges[0]["cast"][name], rtol=0, atol=0)
    # every rank ran the same input from rank 0's weights: the average is each rank's own float64 gradient
    torch.manual_seed(100)
    model = BranchModel().double()
    model(torch.ones(2, 4, dtype=torch.float64), use_b=True).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(bucketed_edges[0]["cast"][name], p.grad, rtol=1e-15, atol=1e-15)


def test_assign_buckets_reverse_order_and_size_limit():
    params = [torch.empty(n) for n in (10, 20, 5, 40, 3)]  # float32: 40, 80, 20, 160, 12 bytes
    # From the last: 12 (+160 would exceed 100), 160 alone, 20 + 80 = 100 (at most: fits), 40.
    assert assign_buckets(params, 100) == [[4], [3], [2, 1], [0]]
    assert assign_buckets(params, 200) == [[4, 3, 2], [1, 0]]
    assert assign_buckets(params, 1) == [[4], [3], [2], [1], [0]]  # each alone, even above the limit
    assert assign_buckets(params, 1e9) == [[4, 3, 2, 1, 0]]
    mixed = [torch.empty(2), torch.empty(2, dtype=torch.float64), torch.empty(2)]
    assert assign_buckets(mixed, 1e9) == [[2], [1], [0]]  # a bucket holds one dtype
    with pytest.raises(ValueError, match="positive"):
        assign_buckets(params, 0)


WRAPPERS = [NaiveDDP, FlatDDP, DDPIndividualParameters, lambda m: DDPBucketed(m, 1.0)]


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf])
def test_bucket_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="bucket_size_mb"):
        DDPBucketed(nn.Linear(2, 2), bad)


@pytest.mark.parametrize("bad", ["10", True])
def test_bucket_size_must_be_a_number(bad):
    with pytest.raises(TypeError, match="bucket_size_mb"):
        DDPBucketed(nn.Linear(2, 2), bad)


def test_bucket_size_none_means_no_limit(single_rank_group):
    """The course's adapter documents None as one unbounded bucket (per dtype)."""
    ddp = adapters.get_ddp_bucketed(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)), bucket_size_mb=None)
    assert len(ddp.buckets) == 1 and len(ddp.buckets[0].params) == 4


@pytest.mark.parametrize("make", WRAPPERS)
def test_no_process_group_is_a_clear_error(make):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        make(nn.Linear(2, 2))


@pytest.mark.parametrize("make", WRAPPERS)
def test_module_on_a_device_the_backend_cannot_use(single_rank_group, make):
    with pytest.raises(ValueError, match="meta"):
        make(nn.Linear(2, 2, device="meta"))
    with pytest.raises(TypeError, match="nn.Module"):
        make(torch.zeros(2))


def test_single_rank_group_trains_like_plain_module(single_rank_group):
    """World size 1: the wrapper is transparent (sync of one rank is the identity)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    ref = nn.Linear(4, 3).double()
    ref.load_state_dict(model.state_dict())
    ddp = DDPBucketed(model, 1e-6)
    x = torch.randn(5, 4, dtype=torch.float64)
    ddp(x).sum().backward()
    ddp.finish_gradient_synchronization()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    # A second backward without finish_gradient_synchronization() is refused, not silently mixed in.
    ddp(x).sum().backward()
    with pytest.raises(RuntimeError, match="finish_gradient_synchronization"):
        ddp(x).sum().backward()


OVERLAPPED = [DDPIndividualParameters, lambda m: DDPBucketed(m, 1.0)]


@pytest.mark.parametrize("make", OVERLAPPED)
def test_dropped_wrapper_is_freed(single_rank_group, make):
    """Hooks live in autograd's C++ side: a strong reference from them would keep every dropped wrapper
    (module, gradients, buckets) alive for good, e.g. across the variants of one benchmark process."""
    model = nn.Linear(4, 3)
    ddp = make(model)
    ref = weakref.ref(ddp)
    del ddp
    assert ref() is None  # freed by reference counting alone
    model(torch.randn(2, 4)).sum().backward()  # the orphaned hooks do nothing
    assert model.weight.grad is not None


@pytest.mark.parametrize("make", OVERLAPPED)
def test_remove_hooks_stops_synchronization(single_rank_group, make):
    ddp = make(nn.Linear(4, 3))
    ddp(torch.randn(2, 4)).sum().backward()
    assert ddp.num_pending > 0
    ddp.finish_gradient_synchronization()
    ddp.remove_hooks()
    ddp(torch.randn(2, 4)).sum().backward()
    assert ddp.num_pending == 0


def test_adapters_take_the_course_keyword_names(single_rank_group):
    """The course's tests call every adapter by keyword, with the names of its tests/adapters.py."""
    model = nn.Linear(4, 3)
    optimizer = adapters.get_sharded_optimizer(params=model.parameters(), optimizer_cls=torch.optim.SGD, lr=0.1)
    for ddp_model, after_backward in (
        (adapters.get_ddp_individual_parameters(module=model), adapters.ddp_individual_parameters_on_after_backward),
        (adapters.get_ddp_bucketed(module=model, bucket_size_mb=1.0), adapters.ddp_bucketed_on_after_backward),
    ):
        adapters.ddp_bucketed_on_train_batch_start(ddp_model=ddp_model, optimizer=optimizer)
        ddp_model(torch.randn(2, 4)).sum().backward()
        after_backward(ddp_model=ddp_model, optimizer=optimizer)
        optimizer.step()
        ddp_model.remove_hooks()


def test_bucketed_refuses_sparse_gradients(single_rank_group):
    with pytest.raises(ValueError, match=r"sparse gradients of 'embed'.*NaiveDDP"):
        DDPBucketed(EmbeddingModel(sparse=True), 1.0)

    class FunctionalSparse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(5, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.embedding(x, self.weight, sparse=True)

    ddp = DDPBucketed(FunctionalSparse(), 1.0)
    with pytest.raises(RuntimeError, match="sparse.*NaiveDDP"):
        ddp(torch.tensor([0, 3])).sum().backward()


@pytest.mark.parametrize("make", [NaiveDDP, lambda m, **kw: DDPBucketed(m, 1.0, **kw)])
def test_broadcast_buffers_must_be_a_bool(make):
    with pytest.raises(TypeError, match="broadcast_buffers"):
        make(nn.Linear(2, 2), broadcast_buffers="no")


def _chatty_hang(ctx) -> None:
    """Sends a message every 2 ms forever."""
    import time

    while True:
        ctx.send("still here")
        time.sleep(0.002)


def _hang_reporting_pid(ctx, folder: str) -> None:
    import os
    import time
    from pathlib import Path

    (Path(folder) / f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def test_launch_deadline_holds_while_ranks_keep_sending():
    """Messages arriving faster than the poll interval must not hold off the deadline."""
    import time

    start = time.monotonic()
    # (10 s: the ranks start sending well before it, a few seconds after their start)
    with pytest.raises(TimeoutError, match="did not finish within 10 s"):
        launch(_chatty_hang, 2, backend="gloo", timeout_s=10, num_threads=1, on_message=lambda rank, message: None)
    assert time.monotonic() - start < 25


def test_ranks_die_with_a_killed_launcher(tmp_path):
    """A launcher ended by SIGTERM (a scheduler's), whose `finally` never runs: its ranks go too, not left holding
    their devices until their own deadline."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = ("from cs336_systems.distributed.launch import launch\n"
            "from tests.test_ddp import _hang_reporting_pid\n"
            f"launch(_hang_reporting_pid, 2, ({str(tmp_path)!r},), backend='gloo', timeout_s=300, num_threads=1)\n")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=30)

        def alive(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True

        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in pids), "ranks outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def _rank1_dies_in_a_collective(ctx) -> None:
    import os
    import time

    if ctx.rank == 1:
        time.sleep(1.0)  # rank 0 is inside the all-reduce by now
        os._exit(3)
    dist.all_reduce(torch.ones(4))


def test_launch_names_the_rank_that_died_not_its_peer():
    """A rank that dies while its peer waits in a collective: the report names the dead rank first, not the peer's
    "connection closed" that arrives before it."""
    with pytest.raises(WorkerError) as failure:
        launch(_rank1_dies_in_a_collective, 2, backend="gloo", timeout_s=60, num_threads=1)
    assert str(failure.value).startswith("rank 1 exited with code 3"), str(failure.value)[:300]
