"""Where a one-head fwd+bwd step spends its host time (issue 8 target 4, issue 9): a diagnostic, not a benchmark.

`cs336-bench overhead` at one head (1 x 1 x 8192 x 32 and the like) gave our fwd_bwd step 300 µs more host time than
its forward and backward timed apart, where SDPA flash's step costs the sum of its parts. For each shape and each
of ours / SDPA flash this script times, over --iters steps `o = attn(q, k, v); torch.autograd.grad(o, (q, k, v),
dO)` with the GPU drained before each step, the host µs of the forward call and of the grad call within the step
(medians); runs one step under `torch.cuda.set_sync_debug_mode("error")` and prints where the first synchronizing
call is, if any; and prints torch.profiler's CPU-side table (self time, top rows) of --profiled steps, where
cudaMalloc/cudaFree and synchronizations show.

    python3 runs/profile/host_sync.py --out $OUT/host_sync.txt
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import torch
import torch.nn.functional as F
import triton

from cs336_systems import flash_triton as ft

SHAPES = ((1, 8192, 32), (1, 16384, 32), (1, 4096, 16), (16, 1024, 64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--profiled", type=int, default=5)
    args = ap.parse_args()
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}",
             f"bf16 causal, batch 1; host µs within a step (GPU drained before it), medians of {args.iters}"]

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    def sdpa(q, k, v, causal):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    impls = {"ours": ft.FlashAttention2Triton.apply, "sdpa_flash": sdpa}
    # SDPA's backend chosen once for the whole run (as host_layers.py does), not inside the timed calls
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        for heads, seq, d in SHAPES:
            measure(heads, seq, d, impls, args, say)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


def measure(heads: int, seq: int, d: int, impls: dict, args: argparse.Namespace, say) -> None:
    """One shape: per implementation, the step's host µs split, the sync check and the CPU-side profile."""
    q, k, v = (torch.randn(1, heads, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    for name, attn in impls.items():

        def step():
            return torch.autograd.grad(attn(q, k, v, True), (q, k, v), do)

        for _ in range(20):
            step()
        fwd, bwd, whole = [], [], []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o = attn(q, k, v, True)
            t1 = time.perf_counter()
            torch.autograd.grad(o, (q, k, v), do)
            t2 = time.perf_counter()
            fwd.append((t1 - t0) * 1e6)
            bwd.append((t2 - t1) * 1e6)
            whole.append((t2 - t0) * 1e6)
        torch.cuda.synchronize()
        say(f"\n=== {name}, (1, {heads}, {seq}, {d}): step {statistics.median(whole):.1f} µs = forward "
            f"{statistics.median(fwd):.1f} + grad {statistics.median(bwd):.1f} (medians)")
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            say("no synchronizing call under set_sync_debug_mode('error')")
        except RuntimeError:
            tb = traceback.format_exc().strip().splitlines()
            say("a synchronizing call: " + " | ".join(x.strip() for x in tb[-12:]))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profiled):
                torch.cuda.synchronize()
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60)
        say(table)


if __name__ == "__main__":
    main()
