"""Diagnostic of session 15 (run 17): where the single pass with red.global dQ loses its time.

Times the backward by do_bench (median) and its kernels by torch.profiler, two-pass (deterministic) and
single pass, at the leaderboard shape and at 1 x 1 x 65536 x 128, with one process per build of the
package. The builds are copies of commit 97b0bd9 (`git archive 97b0bd9 cs336_systems | tar -x -C <dir>`):
"pkg97" as committed, "pkg97off" with its one atomic line given a run-time mask that is always false,

    gl.atomic_add(dq_ptr + row * D + dq_offs, dq, mask=(dq_offs * 0 + first_head) < 0, sem="relaxed")

so that the dQ matmul, its wait and the REDG instructions stay (ptxas cannot prove the mask false) but
nothing reaches the L2. Rows: `single_diag.jsonl` (the results of the "pkg97off" single pass are wrong;
only its time is read).

    PYTHONPATH=<dir>/pkg97 python3 runs/kernels/single_diag.py pkg97 >> single_diag.jsonl
"""

import json
import sys

import torch
import triton.testing

from cs336_systems.bench.timing import kernel_times_us
from cs336_systems.flash_triton import KernelOptions, flash_backward_triton, flash_forward_triton

tag = sys.argv[1]
for shape in ((1, 16, 16384, 64), (1, 1, 65536, 128)):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    cfg = (("dq", (128, 64, 8, 3)), ("fwd", (128, 64, 4, 3)), ("kv", (64, 64, 4, 2)))
    for det in (True, False):
        opts = KernelOptions(autotune=False, tma=True, gluon_kv=True, kv_qrows=True, deterministic=det, configs=cfg)
        o, lse = flash_forward_triton(q, k, v, True, opts)

        def fn():
            return flash_backward_triton(q, k, v, o, lse, do, True, opts)

        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
        print(json.dumps(dict(tag=tag, shape=shape, deterministic=det, bwd_ms=ms, kernels_us=kernel_times_us(fn))),
              flush=True)
