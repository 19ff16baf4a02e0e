"""precision: mixed_precision_accumulation and benchmarking_mixed_precision (a): sums and dtypes, nothing timed.

Cases (`--cases`):
  accumulation  the handout's four loops of 1000 additions of 0.01: fp32 into an fp32 sum, fp16 into an fp16
                sum, an fp16 tensor into an fp32 sum, and fp16 converted to fp32 explicitly before the add. One
                row each: the sum (`value`), its distance from 10 (`abs_error`), the accumulator's dtype. They
                run on the CPU whatever the device: the handout's snippet names none, and each step is one
                correctly rounded IEEE addition, so a GPU gives the same sums.
  toy           the handout's ToyModel (fp32 parameters) under torch.autocast on the device: fp16 on CUDA (as
                the handout asks), bf16 on the CPU (CPU autocast's lower-precision type). One row with the
                dtypes of the parameters inside the context, fc1's and the layer norm's outputs (forward hooks),
                the logits, the cross-entropy loss against random targets (computed inside the context, as a
                training step would) and the parameters' gradients after backward.
The accumulation case alone needs no device (its rows then say gpu "none").
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import TYPE_CHECKING

from cs336_systems.bench import options, report
from cs336_systems.bench.report import Output, Row

if TYPE_CHECKING:
    import torch

    from cs336_systems.bench.record import Recorder

NAME = "precision"
HELP = "mixed_precision_accumulation's four sums and the ToyModel's dtypes under autocast (nothing timed)"
CASES = ("accumulation", "toy")
FIELDS = {"variant": str, "mode": str}
OK_FIELDS = {"label": str}
EXACT = 10.0  # 1000 × 0.01
# mode -> (accumulator dtype, addend dtype, addend converted to fp32 before the +=, label): the handout's order
LOOPS = {
    "fp32": ("float32", "float32", False, "fp32 += fp32"),
    "fp16": ("float16", "float16", False, "fp16 += fp16"),
    "fp16_into_fp32": ("float32", "float16", False, "fp32 += fp16 (type promotion converts the addend)"),
    "fp16_cast_fp32": ("float32", "float16", True, "fp32 += fp16.type(torch.float32)"),
}
DTYPE_FIELDS = ("params", "fc1_out", "ln_out", "logits", "loss", "grads")
TOY_SHAPE = {"batch": 4, "in_features": 20, "out_features": 5}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="cases to run")


def needs_device(args: argparse.Namespace) -> bool:
    return "toy" in args.cases


def accumulate(accumulator: str, addend: str, convert: bool) -> torch.Tensor:
    """One of the handout's loops (on the CPU): 1000 additions of 0.01 in `addend` into a zero `accumulator`."""
    import torch

    s = torch.tensor(0, dtype=getattr(torch, accumulator))
    for _ in range(1000):
        x = torch.tensor(0.01, dtype=getattr(torch, addend))
        s += x.type(torch.float32) if convert else x
    return s


def toy_model(in_features: int, out_features: int):
    """The handout's ToyModel, verbatim; the class is built here so that importing this module imports no torch."""
    from torch import nn

    class ToyModel(nn.Module):
        def __init__(self, in_features: int, out_features: int):
            super().__init__()
            self.fc1 = nn.Linear(in_features, 10, bias=False)
            self.ln = nn.LayerNorm(10)
            self.fc2 = nn.Linear(10, out_features, bias=False)
            self.relu = nn.ReLU()

        def forward(self, x):
            x = self.relu(self.fc1(x))
            x = self.ln(x)
            x = self.fc2(x)
            return x

    return ToyModel(in_features, out_features)


def dtype_names(dtypes) -> str:
    """"float32", or "bfloat16, float32" when tensors differ."""
    return ", ".join(sorted(str(t).removeprefix("torch.") for t in set(dtypes)))


def toy_dtypes(device: torch.device, dtype: torch.dtype, batch: int, in_features: int,
               out_features: int) -> dict[str, str]:
    """The dtypes of one training step of the fp32 ToyModel under `torch.autocast(device.type, dtype)`."""
    import torch
    import torch.nn.functional as F

    model = toy_model(in_features, out_features).to(device)
    seen: dict[str, torch.dtype] = {}
    for name in ("fc1", "ln"):  # hooks see the outputs without touching the handout's forward
        getattr(model, name).register_forward_hook(lambda _m, _i, out, name=name: seen.update({name: out.dtype}))
    x = torch.randn(batch, in_features, device=device)
    targets = torch.randint(out_features, (batch,), device=device)
    with torch.autocast(device.type, dtype=dtype):
        params = [p.dtype for p in model.parameters()]
        logits = model(x)
        loss = F.cross_entropy(logits, targets)
    loss.backward()
    return {"params": dtype_names(params), "fc1_out": dtype_names([seen["fc1"]]), "ln_out": dtype_names([seen["ln"]]),
            "logits": dtype_names([logits.dtype]), "loss": dtype_names([loss.dtype]),
            "grads": dtype_names(p.grad.dtype for p in model.parameters())}


def run(args: argparse.Namespace, rec: Recorder) -> int:
    import torch

    for case in options.progress(dict.fromkeys(args.cases), args, NAME):
        if case == "accumulation":
            for mode, (accumulator, addend, convert, label) in LOOPS.items():
                fields = dict(impl="torch", variant=case, mode=mode, accumulator=accumulator, addend=addend,
                              ran_on="cpu")
                if not rec.is_done(fields):
                    rec.measure(fields, partial(_sum_row, accumulator, addend, convert, label))
            continue
        device = rec.device
        on_cuda = device.type == "cuda"
        dtype_name = "fp16" if on_cuda else "bf16"  # the CPU's autocast type is bf16 (its default)
        label = ("fp16 autocast on CUDA, as the handout asks" if on_cuda
                 else "bf16 autocast on the CPU (CPU autocast's lower-precision type; the handout asks fp16 on a GPU)")
        fields = dict(impl="torch", variant=case, mode="autocast", dtype=dtype_name, **TOY_SHAPE)
        if not rec.is_done(fields):
            rec.measure(fields, lambda: {"label": label, **toy_dtypes(
                device, torch.float16 if on_cuda else torch.bfloat16, **TOY_SHAPE)})
    return 0


def _sum_row(accumulator: str, addend: str, convert: bool, label: str) -> Row:
    value = accumulate(accumulator, addend, convert).item()  # the exact fp32/fp16 value as a Python float
    return {"label": label, "value": value, "abs_error": abs(value - EXACT)}


def _cell(r: Row, field: str, shown=str) -> str:
    return report.status_cell(r) or (shown(r[field]) if field in r else "–")


def render(rows: list[Row], out: Output) -> list[str]:
    rows = report.latest(rows)
    sections = []
    sums = [r for r in rows if r["variant"] == "accumulation"]
    if sums:
        body = [[r["mode"], r.get("label", "–"), r.get("accumulator", "–"), _cell(r, "value", repr),
                 _cell(r, "abs_error", lambda e: f"{e:.3g}")] for r in sums]
        sections.append("## mixed_precision_accumulation: 1000 additions of 0.01 (exactly 10)\n\n"
                        "run on the CPU (the handout's snippet names no device; each add is one correctly rounded "
                        "IEEE operation, so a GPU gives the same sums)\n\n"
                        + report.markdown(["loop", "what", "accumulator", "sum", "error (vs 10)"], body))
    toys = [r for r in rows if r["variant"] == "toy"]
    if toys:
        body = [[r.get("dtype", "–"), r.get("label", "–"), *(_cell(r, f) for f in DTYPE_FIELDS)] for r in toys]
        sections.append("## benchmarking_mixed_precision (a): ToyModel dtypes under autocast\n\n"
                        "fp32 parameters; outputs of fc1 and ln through forward hooks; cross-entropy computed inside "
                        "the autocast context; gradients after backward\n\n"
                        + report.markdown(["autocast", "what", "parameters", "fc1 output", "ln output", "logits",
                                           "loss", "gradients"], body))
    return sections
