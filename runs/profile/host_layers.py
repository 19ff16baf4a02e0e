"""Host µs of each layer between a Python call and our kernels' launches, on the GPU (issue 9): a diagnostic.

Batch 1, 16 heads, seq 1024, d 64, bf16, causal. Each layer is timed two ways: `synced`, the median over calls
of one call with the GPU drained before it (as `cs336-bench overhead` times host_us), and `b2b`, the median of
--rounds rounds of --calls back-to-back calls (the GPU drained before each round) divided by --calls: the
steady-state host cost. Stand-ins: a trivial `autograd.Function` and a trivial `torch.library.custom_op`
(each allocating one output like q; the Function's backward hands dO back with no kernel), so the layers PyTorch
adds, the autograd engine's among them, can be told apart from ours; SDPA beside.
A third column, `busy`, times one call with the GPU kept busy by a sleep kernel (~1 ms) queued before it, as in
a training step, where the host runs ahead of the GPU: a layer that waits on the GPU, or whose driver calls
cost more while it runs, shows there.

    python3 runs/profile/host_layers.py --out $OUT/host_layers.txt
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cs336_systems import flash_triton as ft
from cs336_systems.validation import check_attention_inputs


@triton.jit
def noop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    """A Triton kernel that does next to nothing (reads and writes back x): the cost of a launch alone."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


class _Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, do):
        return do, do, do, None


@torch.library.custom_op("cs336_profile::trivial", mutates_args=(), device_types=None)
def _trivial_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


@_trivial_op.register_fake
def _(q, k, v, is_causal, scale):
    return torch.empty_like(q)


def synced_us(fn, iters: int, sleep_cycles: int = 0) -> float:
    """Median µs of one call of fn, the GPU drained before each; with sleep_cycles, a sleep kernel of that many
    cycles queued first (the GPU busy while the call runs)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def b2b_us(fn, calls: int, rounds: int) -> float:
    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t) * 1e6 / calls)
    torch.cuda.synchronize()
    return statistics.median(per_call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--busy-iters", type=int, default=60)
    args = ap.parse_args()
    q, k, v, do = (torch.randn(1, 16, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = ft.flash_forward_triton(q, k, v, True)
    scale = 0.125
    og = ft.FlashAttention2Triton.apply(qg, kg, vg, True)
    tg = _Trivial.apply(qg, kg, vg, True)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        sg = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    x = torch.zeros(1024, device="cuda")
    layers = {
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "x.add_(1) (one PyTorch kernel)": lambda: x.add_(1),
        "triton noop kernel (JIT launch)": lambda: noop_kernel[(1,)](x, 1024, BLOCK=1024),
        "check_attention_inputs": lambda: check_attention_inputs(q, k, v, True),
        "trivial autograd.Function, no grad": lambda: _Trivial.apply(q, k, v, True),
        "trivial autograd.Function, requires_grad": lambda: _Trivial.apply(qg, kg, vg, True),
        "trivial custom op": lambda: _trivial_op(q, k, v, True, scale),
        "flash_forward_triton": lambda: ft.flash_forward_triton(q, k, v, True),
        "attention_forward (scale given)": lambda: ft.attention_forward(q, k, v, True, scale),
        "torch.ops.cs336.flash_attn_fwd": lambda: torch.ops.cs336.flash_attn_fwd(q, k, v, True, scale),
        "FlashAttention2Triton.apply, no grad": lambda: ft.FlashAttention2Triton.apply(q, k, v, True),
        "FlashAttention2Triton.apply, requires_grad": lambda: ft.FlashAttention2Triton.apply(qg, kg, vg, True),
        "SDPA flash, no grad": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "SDPA flash, requires_grad": lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True),
        "flash_backward_triton": lambda: ft.flash_backward_triton(q, k, v, o, lse, do, True),
        "torch.ops.cs336.flash_attn_bwd": lambda: torch.ops.cs336.flash_attn_bwd(do, q, k, v, o, lse, True, scale,
                                                                                  None),
        "ours: torch.autograd.grad (retain_graph)": lambda: torch.autograd.grad(og, (qg, kg, vg), do,
                                                                                 retain_graph=True),
        "SDPA flash: torch.autograd.grad (retain_graph)": lambda: torch.autograd.grad(sg, (qg, kg, vg), do,
                                                                                     retain_graph=True),
        "trivial autograd.Function: torch.autograd.grad": lambda: torch.autograd.grad(tg, (qg, kg, vg), do,
                                                                                      retain_graph=True),
        "ours: apply + autograd.grad (one step)": lambda: torch.autograd.grad(
            ft.FlashAttention2Triton.apply(qg, kg, vg, True), (qg, kg, vg), do),
        "SDPA flash: sdpa + autograd.grad (one step)": lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=True), (qg, kg, vg), do),
        "trivial: apply + autograd.grad (one step)": lambda: torch.autograd.grad(
            _Trivial.apply(qg, kg, vg, True), (qg, kg, vg), do),
    }
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}",
             f"shape (1, 16, 1024, 64) bf16 causal; synced: median of {args.iters} calls; b2b: median of "
             f"{args.rounds} rounds of {args.calls} back-to-back calls, per call",
             f"busy: median of {args.busy_iters} calls, each after a ~1 ms sleep kernel",
             f"{'layer':<48} {'synced µs':>10} {'b2b µs':>10} {'busy µs':>10}"]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        for name, fn in layers.items():
            for _ in range(20):
                fn()
            lines.append(f"{name:<48} {synced_us(fn, args.iters):10.1f} {b2b_us(fn, args.calls, args.rounds):10.1f} "
                         f"{synced_us(fn, args.busy_iters, 2_000_000):10.1f}")
            print(lines[-1], flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
