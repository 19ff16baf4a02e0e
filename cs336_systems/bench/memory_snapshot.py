"""Reading a `torch.cuda.memory._snapshot()` dict: the active-memory timeline, its peak, the largest
allocations with their code location, and a PNG of the timeline.

Pure functions of the dict (no torch, no CUDA), so the CPU tests drive them with a synthetic snapshot.
The format (torch 2.11, `torch/cuda/memory.py::_snapshot`): `device_traces[device]` lists the allocator's
events in order, each with `action`, `addr`, `size`, `time_us` (epoch microseconds) and `frames`
(innermost first: `filename`, `line`, `name`); `segments` hold the blocks live when the snapshot was
taken (`device`, `blocks` of `address`, `size`, `requested_size`, `state`). An allocation is active from
its `alloc` to its `free_completed` event (sizes are the requested bytes, as memory_viz shows them).
Allocations made before recording started appear only through their free event or as a block still live
at the end; they form the timeline's "allocated before recording" baseline, as in memory_viz.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import Any

OUR_PACKAGES = ("cs336_basics", "cs336_systems")
BEFORE = "allocated before recording"
# autograd nodes in C++ frames: backward runs on the engine's thread, which has no Python stack
AUTOGRAD_NODE = re.compile(r"\w+Backward\d*|AccumulateGrad")
MIB = 2**20
MAX_POINTS = 4000  # x points drawn; more only make the PNG larger
PHASE_STRIP = 0.04  # of the axes' height, at the top: the phases
PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868"}

Snapshot = dict[str, Any]
Phase = tuple[str, int, int]  # (name, start, end) in the trace's epoch microseconds


def where(frames: list[dict]) -> str:
    """The short code location of an allocation: its innermost frame in our packages
    ("cs336_basics/model.py:77 forward"), else the autograd node of a backward allocation, else its
    innermost Python frame."""
    for f in frames:
        path = "/" + f["filename"].replace("\\", "/")
        for package in OUR_PACKAGES:
            _, found, inside = path.rpartition(f"/{package}/")
            if found:
                return f"{package}/{inside}:{f['line']} {f['name']}"
    for f in frames:
        node = AUTOGRAD_NODE.search(f["name"])
        if node:
            return f"{node.group(0)} (autograd)"
    for f in frames:
        if f["filename"].endswith(".py"):
            return f"{Path(f['filename']).name}:{f['line']} {f['name']}"
    return "no frame of ours, autograd's or Python's" if frames else "no stack recorded"


@dataclass
class Timeline:
    """Active bytes after each alloc / free_completed event of one device's trace."""

    baseline: int  # bytes allocated before recording that were live during it
    steps: list[tuple[int, int, str]]  # (time_us, +size or -size, location of the allocation)

    @property
    def active(self) -> list[int]:
        total, out = self.baseline, []
        for _, delta, _ in self.steps:
            total += delta
            out.append(total)
        return out

    @property
    def peak(self) -> int:
        return max([self.baseline, *self.active])


def replay(snapshot: Snapshot, device: int = 0) -> Timeline:
    """The timeline of `device`'s trace; ValueError when the snapshot has no trace for it."""
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list) or not 0 <= device < len(traces):
        raise ValueError(f"the snapshot has no device_traces entry for device {device}")
    live: dict[int, tuple[int, str]] = {}  # addr -> (bytes, location) of allocations made while recording
    steps, freed_before = [], 0
    for e in traces[device]:
        if e["action"] == "alloc":
            location = where(e.get("frames", []))
            live[e["addr"]] = (e["size"], location)
            steps.append((e["time_us"], e["size"], location))
        elif e["action"] == "free_completed":
            size, location = live.pop(e["addr"], (e["size"], BEFORE))
            if location == BEFORE:
                freed_before += size
            steps.append((e["time_us"], -size, location))
    still_live = sum(
        b.get("requested_size", b["size"])
        for seg in snapshot.get("segments", []) if seg.get("device", device) == device
        for b in seg["blocks"] if b["state"].startswith("active") and b["address"] not in live
    )
    return Timeline(freed_before + still_live, steps)


def largest_allocations(timeline: Timeline, top: int = 5) -> list[dict]:
    """The `top` largest allocations made while recording, one entry per (size, location) with its count."""
    counts = Counter((delta, location) for _, delta, location in timeline.steps if delta > 0)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[0][0], -kv[1], kv[0][1]))[:top]
    return [{"mb": size / MIB, "where": location, "count": n} for (size, location), n in ranked]


def phase_spans(timeline: Timeline, phases: Sequence[Phase]) -> list[tuple[str, int, int]]:
    """Each phase as a range of event indices [first, last) (events timed within [start, end])."""
    import numpy as np

    times = np.array([t for t, _, _ in timeline.steps], dtype=np.int64)
    return [(name, int(np.searchsorted(times, start, "left")), int(np.searchsorted(times, end, "right")))
            for name, start, end in phases]


def _unit(peak: int) -> tuple[str, float]:
    for name, scale in (("GiB", 2**30), ("MiB", MIB), ("KiB", 2**10)):
        if peak >= scale:
            return name, float(scale)
    return "bytes", 1.0


def _sample(total, max_points: int):
    """Indices of at most `max_points` events: each bucket's highest total, so every peak stays drawn."""
    import numpy as np

    if len(total) <= max_points:
        return np.arange(len(total))
    edges = np.linspace(0, len(total), max_points + 1).astype(int)
    return np.array([lo + int(np.argmax(total[lo:hi])) for lo, hi in zip(edges[:-1], edges[1:])])


def draw_timeline(snapshot: Snapshot, path: Path, title: str, phases: Sequence[Phase] = (), device: int = 0,
                  bands: int = 8) -> Path:
    """Write a PNG of `device`'s active memory over the trace's events: the baseline at the bottom, then
    the `bands` code locations that held the most memory at once, the rest grey on top; `phases` shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    timeline = replay(snapshot, device)
    ids: dict[str, int] = {}
    codes = np.array([ids.setdefault(loc, len(ids)) for _, _, loc in timeline.steps], dtype=np.int64)
    deltas = np.array([d for _, d, _ in timeline.steps], dtype=np.float64)
    total = timeline.baseline + np.cumsum(deltas)
    held: Counter = Counter()
    most: dict[str, int] = {}
    for _, delta, loc in timeline.steps:
        held[loc] += delta
        most[loc] = max(most.get(loc, 0), held[loc])
    shown = sorted((loc for loc in most if loc != BEFORE), key=lambda loc: -most[loc])[:bands]
    keep = _sample(total, MAX_POINTS)
    peak = timeline.peak
    unit, scale = _unit(peak)
    series, labels = [], []
    for loc in [BEFORE, *shown]:
        start = timeline.baseline if loc == BEFORE else 0
        mine = np.where(codes == ids.get(loc, -1), deltas, 0.0)
        series.append((start + np.cumsum(mine))[keep] / scale)
        labels.append(f"{loc} (max {(most.get(loc, 0) + start) / scale:,.3g} {unit})")
    series.append(total[keep] / scale - np.sum(series, axis=0))
    labels.append("other allocations")
    colors = ["#555555", *plt.get_cmap("tab10").colors[:len(shown)], "#c8c8c8"]

    fig, ax = plt.subplots(figsize=(10, 4.2))
    if len(keep):
        ax.stackplot(keep, np.clip(series, 0, None), labels=labels, colors=colors, linewidth=0)
    labelled = set()
    for name, lo, hi in phase_spans(timeline, phases):  # a strip above the peak, so the bands keep their colours
        color = PHASE_COLORS.get(name, "#999999")
        ax.axvspan(lo - 0.5, hi - 0.5, ymin=1 - PHASE_STRIP, ymax=1, color=color, lw=0,
                   label=None if name in labelled else f"phase: {name}")  # one legend entry per phase name
        ax.axvline(lo - 0.5, color=color, lw=0.8, ls=":")
        labelled.add(name)
    ax.axhline(peak / scale, color="black", lw=0.7, ls="--", label=f"peak {peak / scale:,.4g} {unit}")
    ax.set_xlabel("allocator event (alloc / free)")
    ax.set_ylabel(f"active memory ({unit})")
    ax.set_xlim(0, max(len(total) - 1, 1))
    ax.set_ylim(0, peak / scale / (1 - 2 * PHASE_STRIP) or 1)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=90, bbox_inches="tight")
    finally:  # an unwritable folder must not leave the figure open
        plt.close(fig)
    return path
