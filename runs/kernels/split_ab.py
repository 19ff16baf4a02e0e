"""Split on (the default rule) against off (KernelOptions(split_rows=0)) in one process: one head, bf16,
causal; do_bench of the launch functions, host µs per call, kernel µs by the profiler, and the autograd
step (forward + backward) beside SDPA flash and cuDNN. Session 10 (NOTES.md).

    OUT=<dir> COMMIT=<commit> python3 runs/kernels/split_ab.py [--shapes 16384x64 32768x128 ...]

writes <dir>/split_ab.jsonl. Run 1 (commit 343a3c7) used --shapes 4096x64 4096x128 8192x64 8192x128
16384x64 16384x128 32768x64; run 2 (9709a43) the default list. Both runs timed host µs and kernel µs
with local copies of `bench.timing.host_times` and `kernel_times_us` (the same measurements; their rows
show the upper of the two middle host samples, and kernel names cut to 40 characters, µs rounded to 0.1).
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from cs336_systems.bench.timing import host_times, kernel_times_us
from cs336_systems.flash_triton import (FlashAttention2Triton, KernelOptions, autograd_function,
                                        flash_backward_triton, flash_forward_triton, split_rows)

OUT = os.environ["OUT"]
DEVICE = torch.device("cuda")
NOSPLIT = KernelOptions(split_rows=0)
NoSplit = autograd_function("FlashNoSplit", NOSPLIT)
SMS = torch.cuda.get_device_properties(0).multi_processor_count
commit = os.environ.get("COMMIT", "?")


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--shapes", nargs="+", default=["8192x64", "16384x64", "16384x128", "32768x64", "32768x128"],
                    help="SEQxD pairs")
shapes = [tuple(int(x) for x in s.split("x")) for s in parser.parse_args().shapes]
rows = []
for n, d in shapes:
    gen = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v, do = (torch.randn(1, 1, n, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(4))
    chunk = split_rows(1, n, n, True, SMS, 2 if d <= 64 else 1)
    res = {}
    for name, opts in (("split", KernelOptions()), ("nosplit", NOSPLIT)):
        fwd = lambda: flash_forward_triton(q, k, v, True, opts)  # noqa: E731
        o, lse = fwd()
        bwd = lambda: flash_backward_triton(q, k, v, o, lse, do, True, opts)  # noqa: E731
        grads = bwd()
        res[name] = dict(
            fwd_ms=do_bench(fwd, warmup=50, rep=300), bwd_ms=do_bench(bwd, warmup=50, rep=300),
            fwd_host_us=host_times(fwd, DEVICE, iters=60, warmup=0)["host_us"],
            bwd_host_us=host_times(bwd, DEVICE, iters=60, warmup=0)["host_us"],
            fwd_kernels=kernel_times_us(fwd), bwd_kernels=kernel_times_us(bwd), outputs=(o, *grads))
    diff = max((a.float() - b.float()).abs().max().item()
               for a, b in zip(res["split"].pop("outputs"), res["nosplit"].pop("outputs")))
    step = {}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    for name, f in (("ours", FlashAttention2Triton.apply), ("ours_nosplit", NoSplit.apply)):
        step[name] = do_bench(lambda: f(*leaves, True).backward(do), warmup=50, rep=300, grad_to_none=leaves)
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def sdpa():
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(*leaves, is_causal=True).backward(do)
        step[name] = do_bench(sdpa, warmup=50, rep=300, grad_to_none=leaves)
    row = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit, seq_len=n, d_head=d,
               batch=1, n_heads=1, dtype="bf16", is_causal=True, split_rows=chunk, max_abs_diff_split_vs_not=diff,
               **{f"{name}_{k}": v for name, r in res.items() for k, v in r.items()},
               **{f"fwd_bwd_ms_{k}": v for k, v in step.items()})
    rows.append(row)
    print(json.dumps(row), flush=True)
with open(os.path.join(OUT, "split_ab.jsonl"), "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
