"""ShardedOptimizer on the CPU with Gloo: two spawned ranks must end where the unsharded optimizer does.

One launch of two ranks (module fixture) runs every scenario and returns each rank's final weights
and its shard; the tests compare with the plain optimizer run in this process. Without DDP every
rank sees the same batch, so sharded and unsharded runs do the same arithmetic per parameter and
must agree bit for bit; with DDP (half a batch per rank) they agree to float64 rounding.
Scenarios: parameter groups whose lr changes mid-run, a group added mid-run, SGD behind DDP, one
parameter for two ranks, a run resumed from a checkpoint (AdamW + StepLR) against an uninterrupted
one, and a layer unfrozen mid-run behind DDP.

Input checks run in this process.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.ddp import DDPBucketed
from cs336_systems.distributed.launch import launch
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer
from tests import adapters
from tests.helpers import ToyModel

WORLD_SIZE = 2
STEPS = 5
BATCH = 8
TOL = dict(rtol=1e-10, atol=1e-12)
SCENARIOS = ("groups", "add_group", "ddp_sgd", "one_param", "resume", "unfreeze")
DDP_SCENARIOS = ("ddp_sgd", "unfreeze")
RESUME_AT = 3  # StepLR has already lowered the lr: the resumed run must not restart from the initial one
UNFREEZE_AT = 2


def make_model(scenario: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(10, 4, bias=False) if scenario == "one_param" else ToyModel(out_features=4, extras=False)
    if scenario == "unfreeze":
        model.fc1.requires_grad_(False)
    return model.double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(BATCH, 10, generator=g, dtype=torch.float64), torch.randn(BATCH, 4, generator=g, dtype=torch.float64))
        for _ in range(STEPS)
    ]


def build_optimizer(scenario: str, model: nn.Module, make):
    """`make(params, optimizer_cls, **kwargs)`: the plain constructor or the sharded one."""
    if scenario in ("groups", "resume"):
        return make(
            [
                {"params": model.fc1.parameters(), "lr": 3e-2, "weight_decay": 0.1},
                {"params": [*model.norm.parameters(), model.fc2.weight]},
            ],
            torch.optim.AdamW,
            lr=1e-2,
            weight_decay=0.01,
            betas=(0.8, 0.95),
        )
    if scenario == "add_group":
        return make([model.fc2.weight], torch.optim.AdamW, lr=1e-2)
    if scenario == "ddp_sgd":
        return make(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    return make(model.parameters(), torch.optim.AdamW, lr=1e-2)


def plain(params, optimizer_cls, **kwargs):
    return optimizer_cls(params, **kwargs)


def train(
    scenario: str, make, rank: int = 0, world_size: int = 1, ddp: bool = False, resume_at: int | None = None
) -> tuple[nn.Module, object]:
    """The scenario's training loop; with `ddp`, each rank trains on its slice of every batch; at step
    `resume_at`, the model, optimizer and scheduler are rebuilt from a checkpoint."""
    model = make_model(scenario)
    net = DDPBucketed(model, 1e-4) if ddp else model
    optimizer = build_optimizer(scenario, model, make)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if scenario == "resume" else None
    per_rank = BATCH // world_size
    for step, (x, y) in enumerate(batches()):
        if ddp:
            x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        if step == resume_at:
            model, optimizer, scheduler = resume(scenario, make, model, optimizer, scheduler)
            net = model
        if step == 2 and scenario == "groups":
            optimizer.param_groups[1]["lr"] = 2e-3  # a schedule changes a group's lr mid-run
        if step == 2 and scenario == "add_group":  # unfreeze more of the model mid-run
            optimizer.add_param_group({"params": [*model.fc1.parameters(), *model.norm.parameters()], "lr": 5e-3})
        if step == UNFREEZE_AT and scenario == "unfreeze":  # requires_grad only: the optimizer has it already
            model.fc1.requires_grad_(True)
        optimizer.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        if ddp:
            net.finish_gradient_synchronization()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return model, optimizer


def resume(scenario: str, make, model: nn.Module, optimizer, scheduler):
    """A fresh model, optimizer and scheduler loaded from a checkpoint of these, through torch.save."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model = make_model(scenario)
    model.load_state_dict(checkpoint["model"])
    optimizer = build_optimizer(scenario, model, make)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    return model, optimizer, scheduler


def sharded_worker(ctx) -> dict:
    out = {}
    for scenario in SCENARIOS:
        model, optimizer = train(scenario, adapters.get_sharded_optimizer, ctx.rank, ctx.world_size,
                                 ddp=scenario in DDP_SCENARIOS, resume_at=RESUME_AT if scenario == "resume" else None)
        names = {id(p): n for n, p in model.named_parameters()}
        local = optimizer.local_optimizer
        out[scenario] = {
            "final": {k: v.clone() for k, v in model.state_dict().items()},
            "owned": sorted(names[id(p)] for p in optimizer.owned_parameters()),
            "state_for": sorted(names[id(p)] for p in local.state) if local is not None else [],
            "shard_numel": list(optimizer.shard_numel),
            "n_params_in_groups": sum(len(g["params"]) for g in optimizer.param_groups),
            "has_local_optimizer": local is not None,
        }
    return out


@pytest.fixture(scope="module")
def sharded_results() -> list[dict]:
    return launch(sharded_worker, WORLD_SIZE, backend="gloo", timeout_s=180, num_threads=1)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_sharded_matches_unsharded(sharded_results, scenario):
    model, _ = train(scenario, plain)  # uninterrupted, on the whole batch
    expected = model.state_dict()
    init = make_model(scenario).state_dict()
    assert any(not torch.equal(init[k], expected[k]) for k in expected)
    for rank, results in enumerate(sharded_results):
        for name, value in results[scenario]["final"].items():
            torch.testing.assert_close(value, expected[name], **TOL, msg=f"rank {rank}: {scenario} {name}")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_parameter_has_one_owner_and_state_lives_there(sharded_results, scenario):
    model = make_model(scenario)
    if scenario == "unfreeze":
        model.fc1.requires_grad_(True)  # as at the end of the run
    all_params = scenario in (*DDP_SCENARIOS, "one_param")  # the optimizer got model.parameters()
    given = {n: p for n, p in model.named_parameters() if all_params or p.requires_grad}
    owned = [set(r[scenario]["owned"]) for r in sharded_results]
    assert set.union(*owned) == set(given) and sum(map(len, owned)) == len(given)
    for results, mine in zip(sharded_results, owned):
        # Optimizer state only for this rank's shard (and only where a gradient arrived: not `frozen`).
        assert set(results[scenario]["state_for"]) == {n for n in mine if given[n].requires_grad}
        assert results[scenario]["n_params_in_groups"] == len(given)  # param_groups list the whole model
        numel = results[scenario]["shard_numel"]
        assert sum(numel) == sum(p.numel() for p in given.values())
        assert max(numel) - min(numel) <= max(p.numel() for p in given.values())  # balanced by size
    if scenario == "one_param":
        assert [r[scenario]["has_local_optimizer"] for r in sharded_results] == [True, False]


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("bad", [object, torch.nn.Linear, lambda params, **kw: None, "SGD"])
def test_optimizer_cls_must_be_an_optimizer_class(bad):
    with pytest.raises(TypeError, match="optimizer_cls"):
        ShardedOptimizer(nn.Linear(2, 2).parameters(), bad, lr=0.1)


def test_bad_parameters(single_rank_group):
    with pytest.raises(ValueError, match="meta"):
        ShardedOptimizer(nn.Linear(2, 2, device="meta").parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="empty"):
        ShardedOptimizer([], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="Linear"):
        ShardedOptimizer([{"params": [nn.Linear(2, 2)]}], torch.optim.SGD, lr=0.1)
    layer = nn.Linear(2, 2)
    optimizer = ShardedOptimizer([layer.weight], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="more than one"):
        optimizer.add_param_group({"params": [layer.weight]})
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        optimizer.load_state_dict([])
    with pytest.raises(ValueError, match="lacks"):
        optimizer.load_state_dict({"state": {}})
    with pytest.raises(ValueError, match=r"sizes \[2\].*sizes \[1\]"):
        optimizer.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1], "lr": 0.1}]})
    other_shard = optimizer.state_dict()
    other_shard["shard"] = {"rank": 1, "world_size": 2, "params": []}
    with pytest.raises(ValueError, match=r"shard of rank 1 of 2.*parameters \[0\]"):
        optimizer.load_state_dict(other_shard)


def test_groups_show_the_wrapped_optimizers_defaults(single_rank_group):
    """Every group holds all the wrapped optimizer's hyper-parameters, as a plain optimizer's groups do: a schedule
    that reads one (OneCycleLR: betas) works; a parameter twice in a group is refused (a plain optimizer steps it
    twice, a shard would once); a generator of parameters in a group is read once, whole."""
    layer = nn.Linear(2, 2)
    sharded = ShardedOptimizer([{"params": layer.parameters()}], torch.optim.AdamW, lr=1e-2)
    plain_groups = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=1e-2).param_groups
    assert set(sharded.param_groups[0]) == set(plain_groups[0]) and len(sharded.param_groups[0]["params"]) == 2
    torch.optim.lr_scheduler.OneCycleLR(sharded, max_lr=0.1, total_steps=10)
    with pytest.raises(ValueError, match="appears twice"):
        ShardedOptimizer([layer.weight, layer.weight], torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # checked on a rank that may own nothing
        ShardedOptimizer(layer.parameters(), torch.optim.AdamW, lr=-1.0)
    with pytest.raises(TypeError, match="not one tensor"):
        ShardedOptimizer(layer.weight, torch.optim.AdamW, lr=1e-2)


def test_loads_a_plain_optimizer_state_dict(single_rank_group):
    """A checkpoint of unsharded training resumes under the sharded optimizer: state and lr come back."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    plain_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(x).sum().backward()
    plain_optimizer.step()
    plain_optimizer.param_groups[0]["lr"] = 3e-3
    sharded = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    sharded.load_state_dict(plain_optimizer.state_dict())
    assert sharded.param_groups[0]["lr"] == 3e-3
    before = [p.clone() for p in model.parameters()]
    sharded.step()
    expected = [p.clone() for p in model.parameters()]
    with torch.no_grad():
        for p, value in zip(model.parameters(), before):
            p.copy_(value)
    plain_optimizer.step()
    for p, value in zip(model.parameters(), expected):
        torch.testing.assert_close(p, value, **TOL)


def test_single_rank_owns_everything(single_rank_group):
    model, optimizer = train("groups", adapters.get_sharded_optimizer)
    expected, _ = train("groups", plain)
    assert len(optimizer.owned_parameters()) == 5
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected.state_dict()[name], **TOL)


def test_takes_named_parameters(single_rank_group):
    """`model.named_parameters()`, as torch.optim optimizers take it: the same steps as plain parameters."""
    torch.manual_seed(0)
    models = [nn.Linear(3, 2).double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [ShardedOptimizer(models[0].named_parameters(), torch.optim.AdamW, lr=1e-2),
                  ShardedOptimizer(models[1].parameters(), torch.optim.AdamW, lr=1e-2)]
    assert optimizers[0].param_groups[0]["param_names"] == ["weight", "bias"]
    x = torch.randn(4, 3, dtype=torch.float64)
    for _ in range(3):
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            model(x).square().sum().backward()
            optimizer.step()
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b)
