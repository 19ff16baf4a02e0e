"""`cs336-bench memory`: the smoke sweep, the snapshot analysis and the timeline PNG on a synthetic snapshot."""

from __future__ import annotations

import pickle
from contextlib import nullcontext

import pytest
import torch

from cs336_basics.model import BasicsTransformerLM
from cs336_basics.optimizer import AdamW
from cs336_systems.bench import cli, memory, options
from cs336_systems.bench.memory_snapshot import BEFORE, MIB, draw_timeline, largest_allocations, replay, where
from cs336_systems.bench.model import model_config
from cs336_systems.bench.record import Recorder

from .helpers import check_report, rows_of, run_cli, write_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000_000_000  # epoch microseconds, as the snapshot's time_us


def frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


LINEAR = [frame("/x/torch/nn/modules/module.py", 1775, "_call_impl"),
          frame("/repo/cs336_basics/model.py", 77, "forward"),
          frame("/repo/cs336_systems/bench/memory.py", 90, "step")]
SOFTMAX = [frame("/repo/cs336_basics/nn_utils.py", 12, "softmax"), frame("/repo/cs336_basics/model.py", 190, "forward")]
BACKWARD = [frame("??", 0, "c10::cuda::CUDACachingAllocator::malloc"),
            frame("??", 0, "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)")]


def event(action: str, addr: int, mib: float, t: int, frames=()) -> dict:
    return {"action": action, "addr": addr, "size": int(mib * MIB), "stream": 0, "time_us": T0 + t,
            "frames": list(frames)}


def synthetic_snapshot() -> dict:
    """Weights W (8 MiB, live throughout) and a pre-existing buffer P (2 MiB, freed while recording) exist
    before recording; then two 4 MiB and one 3 MiB allocation, a backward one, frees in between."""
    trace = [
        event("alloc", 100, 4, 10, LINEAR),
        event("free_requested", 100, 4, 11),
        event("alloc", 200, 4, 12, LINEAR),         # active: 10 + 4 + 4 = 18 MiB, the peak
        event("free_completed", 100, 4, 13, SOFTMAX),  # a free's frames are where it was freed: not used
        event("alloc", 300, 3, 14, SOFTMAX),
        event("free_completed", 900, 2, 20),         # P: allocated before recording
        event("alloc", 400, 1, 30, BACKWARD),
        event("segment_alloc", 5000, 20, 31),
        event("free_completed", 300, 3, 40),
        event("snapshot", 0, 0, 50),
    ]
    blocks = [{"address": 800, "size": int(8 * MIB), "requested_size": int(8 * MIB), "state": "active_allocated",
               "frames": []},
              {"address": 200, "size": int(4 * MIB), "requested_size": int(4 * MIB), "state": "active_allocated",
               "frames": LINEAR},
              {"address": 400, "size": int(1 * MIB), "requested_size": int(1 * MIB), "state": "active_allocated",
               "frames": BACKWARD},
              {"address": 600, "size": int(6 * MIB), "requested_size": 0, "state": "inactive", "frames": []}]
    return {"segments": [{"device": 0, "address": 0, "total_size": int(20 * MIB), "stream": 0,
                          "segment_type": "large", "allocated_size": int(13 * MIB), "active_size": int(13 * MIB),
                          "blocks": blocks}],
            "device_traces": [trace]}


PHASES = [("forward", T0 + 5, T0 + 25), ("backward", T0 + 26, T0 + 35), ("optimizer", T0 + 36, T0 + 45)]


def test_smoke_memory(tmp_path):
    """On the CPU every row is unsupported with its reason (memory history is CUDA's); on a GPU they complete."""
    assert run_cli("memory", "--smoke", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "memory")
    assert {(r["mode"], r["dtype"]) for r in rows} == {(m, d) for m in memory.MODES for d in memory.DTYPES}
    for r in rows:
        assert r["residual_mb"] == 2 * 32 * 32 * 4 / MIB and r["smoke"] is True
        if torch.cuda.is_available():
            assert r["status"] == "ok" and r["peak_mem_mb"] >= r["start_mem_mb"] > 0, r
            assert len(r["largest"]) == 5 and (tmp_path / "memory" / r["timeline"]).exists()
        else:
            assert r["status"] == "unsupported" and r["error"].startswith("needs CUDA"), r
    table = check_report(tmp_path, "memory", plots=False)
    assert "| smoke | 32 | 2 | 0.0078125 |" in table and "## Largest allocations" in table


def test_residual_stream_size():
    """The handout's (d) at the reference hyperparameters: 2.7B (d_model 2560), batch 4."""
    assert [memory.residual_mb(4, ctx, 2560) for ctx in (128, 256, 512)] == [5.0, 10.0, 20.0]


def test_where_names_our_code_then_the_autograd_node():
    assert where(LINEAR) == "cs336_basics/model.py:77 forward"
    assert where([frame("/site-packages/cs336_systems/bench/memory.py", 90, "step")]) == \
        "cs336_systems/bench/memory.py:90 step"
    assert where(BACKWARD) == "MmBackward0 (autograd)"
    assert where([frame("/x/torch/optim/adamw.py", 5, "step")]) == "adamw.py:5 step"
    assert where([frame("??", 0, "c10::cuda::CUDACachingAllocator::malloc")]) == \
        "no frame of ours, autograd's or Python's"
    assert where([]) == "no stack recorded"


def test_replay_peak_and_largest_allocations():
    timeline = replay(synthetic_snapshot())
    assert timeline.baseline == 10 * MIB  # W still live + P freed while recording
    assert [a / MIB for a in timeline.active] == [14, 18, 14, 17, 15, 16, 13]
    assert timeline.peak == 18 * MIB
    assert timeline.steps[2] == (T0 + 13, -4 * MIB, "cs336_basics/model.py:77 forward")  # the alloc's location
    assert timeline.steps[4][2] == BEFORE
    assert largest_allocations(timeline, top=3) == [
        {"mb": 4.0, "where": "cs336_basics/model.py:77 forward", "count": 2},
        {"mb": 3.0, "where": "cs336_basics/nn_utils.py:12 softmax", "count": 1},
        {"mb": 1.0, "where": "MmBackward0 (autograd)", "count": 1},
    ]
    with pytest.raises(ValueError, match="device 1"):
        replay(synthetic_snapshot(), device=1)


def test_timeline_png(tmp_path):
    path = draw_timeline(synthetic_snapshot(), tmp_path / "timelines" / "t.png", "synthetic", PHASES)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) < 200_000


def test_timeline_png_of_a_long_trace_stays_small(tmp_path):
    """A 2.7B step has tens of thousands of events: sampled to MAX_POINTS, the PNG stays a few hundred KB."""
    locations = [[frame("/repo/cs336_basics/model.py", line, "forward")] for line in range(20)]
    trace = []
    for layer in range(2000):
        trace += [event("alloc", layer * 100 + i, 1 + i % 5, len(trace) + i, frames)
                  for i, frames in enumerate(locations)]
        trace += [event("free_completed", layer * 100 + i, 1 + i % 5, len(trace) + i) for i in range(len(locations))]
    t = len(trace)
    snapshot = {"segments": [], "device_traces": [trace]}
    assert replay(snapshot).peak == sum(1 + i % 5 for i in range(20)) * MIB
    phases = [("forward", T0, T0 + t // 2), ("backward", T0 + t // 2 + 1, T0 + t)]
    data = draw_timeline(snapshot, tmp_path / "long.png", "long", phases).read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) < 300_000


@pytest.mark.parametrize("mode", memory.MODES)
def test_steps_mark_their_phases_in_order(mode):
    """The recorded workloads run on the CPU too; their phases cover the step in order."""
    model = BasicsTransformerLM.from_config(model_config("smoke"), vocab_size=50, context_length=8)
    x, y = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    if mode == "fwd":
        step = memory.forward_only(model, x, nullcontext())
    else:
        step = memory.train_step(model, x, y, AdamW(model.parameters()), nullcontext())
    phases = []
    step(phases)
    expected = ["forward"] if mode == "fwd" else ["forward", "backward", "optimizer"]
    assert [name for name, _, _ in phases] == expected
    bounds = [t for _, start, end in phases for t in (start, end)]
    assert bounds == sorted(bounds)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", memory.MODES)
def test_profile_with_the_cuda_calls_stubbed(monkeypatch, tmp_path, mode):
    """The recorded path end to end on the CPU: warm-up, history on and off again, snapshot analysed, PNG and
    pickle written (CUDA's counters and history replaced by fixed numbers and the synthetic snapshot)."""
    history = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * MIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 18 * MIB)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: history.append(kwargs))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", synthetic_snapshot)
    args = cli.build_parser().parse_args(["memory", "--smoke", "--snapshots", "--modes", mode, "--dtype", "fp32"])
    options.resolve_sized(args)
    rec = Recorder(tmp_path, "memory", torch.device("cpu"))
    row = memory._profile(args, rec, {}, "smoke", 32, "fp32", mode)
    assert [h.get("enabled", "all") for h in history] == ["all", None]
    assert (row["start_mem_mb"], row["peak_mem_mb"], row["trace_peak_mb"]) == (10, 18, 18)
    assert row["largest"][0] == {"mb": 4.0, "where": "cs336_basics/model.py:77 forward", "count": 2}
    assert (rec.dir / row["timeline"]).read_bytes().startswith(PNG_MAGIC)
    assert pickle.loads((rec.dir / row["snapshot"]).read_bytes()) == synthetic_snapshot()


def test_render_tables_and_timeline_links(tmp_path):
    setup = dict(impl="naive", batch=4, model_size="2.7B", context_length=128, residual_mb=5.0, warmup_steps=2,
                 steps=1, smoke=False)
    largest = [{"mb": 39.1, "where": "cs336_basics/model.py:77 forward", "count": 32}]
    rows = [{**setup, "mode": "fwd", "dtype": "fp32", "status": "ok", "peak_mem_mb": 13000.0,
             "start_mem_mb": 12500.0, "largest": largest, "timeline": "timelines/2p7B_ctx128_fwd_fp32.png"},
            {**setup, "mode": "step", "dtype": "fp32", "status": "oom", "error": "CUDA out of memory"}]
    write_rows(tmp_path, "memory", rows)
    table = check_report(tmp_path, "memory", plots=False)
    assert "| 2.7B | 128 | 4 | 5.0 | 13,000 | OOM |" in table
    assert "| 2.7B | 128 | fwd | fp32 | 39.100 | 32 | `cs336_basics/model.py:77 forward` |" in table
    assert "![fwd fp32 active memory](timelines/2p7B_ctx128_fwd_fp32.png)" in table
