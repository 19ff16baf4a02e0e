"""nsys_profile with torch.profiler: where the Transformer LM's forward, backward and AdamW step spend time.

Nsight Systems cannot finish reports on our GPU machines; `torch.profiler` (CPU and CUDA activities) records
the same kernels and ranges. Random weights and data as in `model`; per model size x context length x mode
  fwd   forward + loss under torch.no_grad (inference)
  step  forward + loss, backward, the repo's AdamW step (zero_grad included)
`--warmup` unprofiled steps, then `--steps` profiled ones, in `record_function` ranges "forward", and in
step mode "train step" (all of it), "backward" and "optimizer step"; each phase synchronizes the device
before its range closes, so a range lasts the phase's wall time. The model's naive attention is swapped
for a copy in the handout's ranges "attention scores" (QK^T / sqrt(d)), "softmax" (the causal mask with it) and "final
matmul" (forward kernels only: autograd runs the backward outside them). A kernel belongs to a range when
the CPU op that launched it (kineto's correlation: `FunctionEvent.kernels`) started inside an instance of
the range, on any thread (autograd's backward thread too). Per range a row records its kernels' ms per
step, their matmul share (`is_matmul`) and the top kernels (name, calls and ms per step, share); phases
also their wall ms. On the CPU (--smoke) the same tables hold the ops' self CPU time (`kernel_time` says
which). `--trace` profiles one more step and gzips its Chrome trace (Perfetto, chrome://tracing) into
<out>/profile/traces/<size>_<context>_<mode>_<dtype>.json.gz (its row's `trace`; where an earlier row's file has
that name, the run id goes before the suffix: no file a row points to is overwritten).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import math
import re
import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

from cs336_systems.bench import options, report
from cs336_systems.bench import model as model_problem
from cs336_systems.bench.options import add_sized, nonnegative_int, positive_int
from cs336_systems.bench.report import Output, Row

if TYPE_CHECKING:
    from cs336_systems.bench.record import Recorder

NAME = "profile"
HELP = "torch.profiler kernel tables of the LM's forward, backward and optimizer step (the nsys_profile problem)"
MODES = ("fwd", "step")
TRAIN_STEP, FORWARD, BACKWARD, OPTIMIZER = "train step", "forward", "backward", "optimizer step"
SUB_RANGES = ("attention scores", "softmax", "final matmul")
PHASES = {"fwd": (FORWARD,), "step": (TRAIN_STEP, FORWARD, BACKWARD, OPTIMIZER)}  # first: the whole step
TOP_KERNELS = 8
NAME_CHARS = 160  # kernel names in rows: C++ template names run to thousands of characters
# Matmul kernels: cuBLAS / cuBLASLt / CUTLASS GEMM and GEMV families (nvjet: cuBLASLt's Hopper GEMMs;
# sm90_xmma, ampere_sgemm, cutlass_80_*gemm all match), and on the CPU the aten matrix-product ops.
MATMUL_PATTERN = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|matmul|^aten::(mm|bmm|addmm|baddbmm|mv|dot)$",
                            re.IGNORECASE)
FIELDS = {"mode": str, "dtype": str, "batch": int, "model_size": str, "context_length": int}
OK_FIELDS = {"ms": (int, float), "kernel_time": str, "forward_ms": (int, float),
             "forward_kernel_ms": (int, float), "forward_kernels": list}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sized(p, "--sizes", full=list(model_problem.SIZES), smoke=[model_problem.SMOKE_SIZE], help="model sizes",
              nargs="+", choices=[*model_problem.SIZES, model_problem.SMOKE_SIZE])
    add_sized(p, "--context", full=[128, 256, 512, 1024], smoke=[32], help="context lengths", type=positive_int,
              nargs="+")
    add_sized(p, "--batch", full=4, smoke=2, help="batch size", type=positive_int)
    add_sized(p, "--warmup", full=5, smoke=1, help="unprofiled warm-up steps per mode", type=nonnegative_int)
    add_sized(p, "--steps", full=3, smoke=1, help="profiled steps per mode", type=positive_int)
    p.add_argument("--vocab", type=positive_int, default=10_000, help="vocabulary size")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="what one profiled step does")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="fp32 weights; bf16 = torch.autocast(bfloat16) around forward and loss")
    p.add_argument("--trace", action="store_true",
                   help="also profile one more step per row and write its gzipped Chrome trace under traces/")


def slug(range_name: str) -> str:
    """The row-field prefix of a range: "optimizer step" -> "optimizer_step"."""
    return range_name.replace(" ", "_")


def is_matmul(name: str) -> bool:
    return MATMUL_PATTERN.search(name) is not None


def short_name(name: str) -> str:
    """A demangled kernel name without `void`, its parameter list and anonymous namespaces, capped."""
    if name.startswith("void ") and name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, 4, -1):  # the parameter list: the parentheses closing the name
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[5:i]
                break
    name = name.replace("(anonymous namespace)::", "")
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"


def annotated_attention(Q, K, V, mask=None):
    """`cs336_basics.model.scaled_dot_product_attention` line for line, inside the handout's three ranges."""
    from torch.profiler import record_function

    from cs336_basics.model import masked_softmax

    d = Q.shape[-1]
    with record_function(SUB_RANGES[0]):
        scores = Q @ K.transpose(-2, -1) / math.sqrt(d)  # (..., Nq, Nk)
    with record_function(SUB_RANGES[1]):
        probs = masked_softmax(scores, mask)  # (..., Nq, Nk)
    with record_function(SUB_RANGES[2]):
        return probs @ V  # (..., Nq, dv)


def range_spans(events: list, names: list[str]) -> dict[str, list[tuple[float, float]]]:
    """Per record_function range, the sorted host-side (start, end) µs of its instances (not kineto's GPU-side
    copies)."""
    from torch.profiler import DeviceType

    return {name: sorted((e.time_range.start, e.time_range.end) for e in events
                         if e.is_user_annotation and e.name == name and e.device_type == DeviceType.CPU)
            for name in names}


def kernel_tables(events: list, spans: dict[str, list], on_cuda: bool) -> dict[str, dict[str, list]]:
    """Per range of `spans` {kernel name: [calls, µs]} summed over every instance of the range.

    On CUDA the kernels kineto correlated with each CPU op; on the CPU each op's self CPU time (user
    annotations left out: their self time is Python between the ops)."""
    from torch.profiler import DeviceType

    tables: dict[str, dict[str, list]] = {name: {} for name in spans}
    for e in events:
        if e.device_type != DeviceType.CPU or e.is_async:
            continue
        if on_cuda:
            items = [(k.name, k.duration) for k in e.kernels]
        else:
            items = [] if e.is_user_annotation else [(e.name, e.self_cpu_time_total)]
        for name, spans_of_range in spans.items() if items else ():
            i = bisect.bisect_right(spans_of_range, (e.time_range.start, math.inf)) - 1  # instances never overlap
            if i < 0 or e.time_range.start > spans_of_range[i][1]:
                continue
            for kernel, us in items:
                entry = tables[name].setdefault(kernel, [0, 0.0])
                entry[0] += 1
                entry[1] += us
    return tables


def summarize(table: dict[str, list], steps: int, prefix: str) -> Row:
    """`<prefix>_kernel_ms`, `_matmul_share` and `_kernels` (the top kernels) of one range, per step."""
    total = sum(us for _, us in table.values())

    def share(us: float) -> float | None:
        return us / total if total else None  # a range without kernels (or ops) has no shares

    top = sorted(table.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    return {
        f"{prefix}_kernel_ms": total / steps / 1e3,
        f"{prefix}_matmul_share": share(sum(us for name, (_, us) in table.items() if is_matmul(name))),
        f"{prefix}_kernels": [[short_name(name), calls / steps, us / steps / 1e3, share(us)]
                              for name, (calls, us) in top],
    }


def profiled(step: Callable[[], None], on_cuda: bool, steps: int):
    """A finished `torch.profiler.profile` of `steps` calls of `step`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    with profile(activities=activities, acc_events=True) as prof:  # (one cycle: only silences a warning)
        for _ in range(steps):
            step()
    return prof


def write_trace(prof, path: Path) -> None:
    """The profile's Chrome trace, gzipped (the JSON is ~10x larger)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cs336-profile-") as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        path.write_bytes(gzip.compress(raw.read_bytes()))


def run(args: argparse.Namespace, rec: Recorder) -> int:
    import torch
    from torch.profiler import record_function

    import cs336_basics.model as basics_model
    from cs336_basics.nn_utils import cross_entropy
    from cs336_basics.optimizer import AdamW
    from cs336_systems.bench.timing import summarize_ms, synchronize

    device = rec.device
    on_cuda = device.type == "cuda"
    bf16 = args.dtype == "bf16"
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    combos = [(size, ctx) for size in args.sizes for ctx in args.context]
    for size, ctx in options.progress(combos, args, NAME):
        config = model_problem.model_config(size)
        fields = {mode: dict(impl="naive", mode=mode, dtype=args.dtype, batch=args.batch, n_heads=config.num_heads,
                             seq_len=ctx, d_head=config.d_model // config.num_heads, is_causal=True, model_size=size,
                             context_length=ctx, warmup_steps=args.warmup, steps=args.steps, d_model=config.d_model,
                             num_layers=config.num_layers, vocab_size=args.vocab)
                  for mode in args.modes}
        state: dict[str, Any] = {}

        def step(mode: str) -> None:
            """One step inside its ranges; each phase synchronizes before its range closes."""
            with record_function(TRAIN_STEP) if mode == "step" else nullcontext():
                with record_function(FORWARD), torch.no_grad() if mode == "fwd" else nullcontext():
                    with autocast:
                        loss = cross_entropy(state["model"](state["x"]), state["y"])
                    synchronize(device)
                if mode == "fwd":
                    return
                with record_function(BACKWARD):
                    loss.backward()
                    synchronize(device)
                with record_function(OPTIMIZER):
                    state["optimizer"].step()
                    state["optimizer"].zero_grad(set_to_none=True)
                    synchronize(device)

        def measure(mode: str) -> Row:
            if "model" not in state:
                model, x, y = model_problem.random_lm(config, args.vocab, ctx, args.batch, device)
                state.update(model=model, optimizer=AdamW(model.parameters(), lr=1e-4), x=x, y=y)
            try:
                for _ in range(args.warmup):
                    step(mode)
                prof = profiled(lambda: step(mode), on_cuda, args.steps)
                trace = None
                if args.trace:
                    path = rec.new_file(f"traces/{size}_{ctx}_{mode}_{args.dtype}.json.gz")
                    write_trace(profiled(lambda: step(mode), on_cuda, 1), path)
                    trace = path.relative_to(rec.dir).as_posix()
            finally:  # drop grads even after an OOM, before the next mode
                state["optimizer"].zero_grad(set_to_none=True)
            events = prof.events()
            spans = range_spans(events, [*PHASES[mode], *SUB_RANGES])
            row: Row = {"kernel_time": "cuda_kernels" if on_cuda else "cpu_ops_self", "trace": trace,
                        "n_params": sum(p.numel() for p in state["model"].parameters())}
            for name, table in kernel_tables(events, spans, on_cuda).items():
                row.update(summarize(table, args.steps, slug(name)))
            for name in PHASES[mode]:
                walls = [(end - start) / 1e3 for start, end in spans[name]]
                row[f"{slug(name)}_ms"] = sum(walls) / args.steps
                if name == PHASES[mode][0]:
                    row.update(summarize_ms(walls))
            return row

        with mock.patch.object(basics_model, "scaled_dot_product_attention", annotated_attention):
            for mode in args.modes:
                if not rec.is_done(fields[mode]):
                    rec.measure(fields[mode], lambda: measure(mode))
        state.clear()
    return 0


def render(rows: list[Row], out: Output) -> list[str]:
    rows = report.latest(rows)
    sections = []
    for mode in MODES:
        selected = report.sort_rows([r for r in rows if r["mode"] == mode],
                                    ("dtype", "batch", "model_size", "context_length"))
        if not selected:
            continue
        phases = PHASES[mode]
        headers = ["model_size", "context_length", "dtype", "batch", *(f"{p} ms" for p in phases),
                   f"{phases[0]} matmul share", *(f"{s} ms" for s in SUB_RANGES)]
        body = [[r["model_size"], r["context_length"], r["dtype"], r["batch"], *_time_cells(r, phases)]
                for r in selected]
        sections.append(
            f"## Time per step, mode {mode} ({' + '.join(phases[1:] or phases)})\n\n"
            "phase cells: wall ms of the synchronized range (its kernels' ms); attention sub-ranges: their "
            "kernels' ms, forward only; kernel time is CUDA kernel time on a GPU, the ops' self CPU time on the "
            "CPU\n\n" + report.markdown(headers, body)
        )
    return sections + _top_kernel_sections([r for r in rows if report.ok(r)])


def _time_cells(r: Row, phases: tuple[str, ...]) -> list[str]:
    status = report.status_cell(r)
    if status:
        return [status] * (len(phases) + 1 + len(SUB_RANGES))
    return [*(f"{report.fmt_num(r[f'{slug(p)}_ms'])} ({report.fmt_num(r[f'{slug(p)}_kernel_ms'])})" for p in phases),
            _percent(r.get(f"{slug(phases[0])}_matmul_share")),
            *(report.fmt_num(r.get(f"{slug(s)}_kernel_ms")) for s in SUB_RANGES)]


def _percent(share: float | None) -> str:
    return "–" if share is None else f"{100 * share:.1f}%"


def _top_kernel_sections(rows: list[Row]) -> list[str]:
    """Per dtype: the top kernels of the forward (mode fwd) and of the whole train step, side by side, per
    size, at the context most sizes completed (the longest of those)."""
    sections = []
    for (dtype, batch, kind), group in report.group_by(rows, ("dtype", "batch", "kernel_time")):
        contexts = report.distinct(group, "context_length")
        context = max(contexts, key=lambda c: (len({r["model_size"] for r in group if r["context_length"] == c}), c))
        body = []
        for size in report.distinct(group, "model_size"):
            picked = [report.pick(group, model_size=size, context_length=context, mode=m) for m in MODES]
            tables = [r[f"{slug(PHASES[r['mode']][0])}_kernels"] if r else [] for r in picked]
            for i in range(max(map(len, tables))):
                body.append([size, i + 1, *(cell for table in tables for cell in _kernel_cells(table, i))])
        headers = ["model_size", "rank",
                   *(h for m in MODES for h in (f"{PHASES[m][0]} kernel", "calls", "ms", "share"))]
        sections.append(f"## Top kernels per step, context {context}, {dtype}, batch {batch} ({kind})\n\n"
                        + report.markdown(headers, body))
    return sections


def _kernel_cells(table: list, i: int) -> list[str]:
    if i >= len(table):
        return ["", "", "", ""]
    name, calls, ms, share = table[i]
    shown = name if len(name) <= 90 else name[:89] + "…"
    return [f"`{shown}`".replace("|", "\\|"), f"{calls:g}", report.fmt_num(ms), _percent(share)]
