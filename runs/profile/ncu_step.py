"""One forward and one backward of ours and of SDPA cuDNN at the leaderboard shape, for Nsight Compute to read the
hardware counters of their kernels: a diagnostic, not a benchmark (issue 8). Each implementation runs once untimed
first (compiling, autotuning), then once more between `torch.cuda.profiler` start/stop marks, so that ncu with
`--profile-from-start off` sees only the second call's kernels:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python3 runs/profile/ncu_step.py > $OUT/ncu.txt

The ncu report (text) is the record; this script prints only what ran.
"""

from __future__ import annotations

import argparse

import torch

from cs336_systems import flash_attention
from cs336_systems.bench import impls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,16,16384,64", help="B,H,N,D")
    ap.add_argument("--impls", nargs="+", default=["ours", "cudnn"], choices=["ours", "cudnn"])
    args = ap.parse_args()
    b, h, n, d = (int(x) for x in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    cudnn = impls.build("sdpa_cudnn", impls.Setup(torch.device("cuda"), "bf16", n))
    fns = {"ours": lambda q, k, v: flash_attention(q, k, v, is_causal=True),
           "cudnn": lambda q, k, v: cudnn(q, k, v, True)}
    for name in args.impls:
        fn = fns[name]
        for profiled in (False, True):
            if profiled:
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
            o = fn(q, k, v)
            torch.autograd.grad(o, (q, k, v), do)
            torch.cuda.synchronize()
            if profiled:
                torch.cuda.profiler.stop()
        print(f"{name}: {b}x{h}x{n}x{d} bf16 causal, forward + backward profiled once", flush=True)


if __name__ == "__main__":
    main()
