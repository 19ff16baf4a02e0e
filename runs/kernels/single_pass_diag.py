"""Diagnostic of session 11, second build: where the warp-specialized Gluon single pass spends its time.

Runs against commit 1c8ee71 (`flash_gluon.flash_bwd_single_pass_kernel`): textual variants of the
kernel, each timed as the whole `flash_backward_triton` call (do_bench median) and per kernel
(torch.profiler), in one process beside the shipped two-pass design at the leaderboard shape. Results
of the variants that skip work are wrong; only time is read.

    PYTHONPATH=$PWD CS336_BENCH_COMMIT=1c8ee71 python3 runs/kernels/single_pass_diag.py out.jsonl
"""
import importlib.util
import json
import os
import sys
import tempfile
import time

import torch
import triton
import triton.testing

from cs336_systems import flash_triton as ft
from cs336_systems.bench.timing import kernel_times_us

SRC = open("cs336_systems/flash_gluon.py").read()
REDUCE = "            _tma_reduce_add(dq_desc, [row, c * (D // 2)], dq_smem.index(2 * b + c))\n"
STORE = "        dq_smem.index(2 * b + ROLE).store(dq)\n"
DQ_MMA = ("        dq = warpgroup_mma(ds_smem.permute((1, 0)), kc_smem.index(ROLE), zero_dq, use_acc=False, "
          "is_async=True)\n")
DQ_WAIT = "        dq = warpgroup_mma_wait(1, deps=(dq, ))\n"
DS_WAITS = [("        mbarrier.wait(ds_empty, (t & 1) ^ 1)\n", ""), ("        mbarrier.wait(ds_full, t & 1)\n", "")]
VARIANTS = {
    "as_built": [],
    "no_reduce": [(REDUCE, "            pass\n")],             # the writer frees buffers without reducing
    "no_dq_store": [(STORE, "")],                             # dQ computed, not stored; barriers kept
    "no_dq": [(STORE, ""), (DQ_WAIT, ""), (DQ_MMA, "")],      # no dQ matmul; the dSᵀ exchange kept
    "no_ds_waits": DS_WAITS,                                  # consumers do not wait for each other's dSᵀ
}

shape = (1, 16, 16384, 64)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
out = open(sys.argv[1], "a")
o, lse = ft.flash_forward_triton(q, k, v, True)
real = ft.flash_gluon
shipped = ft.KernelOptions(autotune=False, configs=(("fwd", (128, 64, 4, 3)), ("kv", (32, 128, 4, 3)),
                                                    ("dq", (128, 64, 8, 3))))
single = ft.KernelOptions(autotune=False, deterministic=False, gluon_kv=True, configs=(("kv", (64, 128, 4, 2)),))
runs = [("two_pass_shipped", None, shipped)] + [(name, edits, single) for name, edits in VARIANTS.items()]
for name, edits, opts in runs:
    mod = real
    if edits is not None:
        s = SRC
        for a, b in edits:
            assert s.count(a) == 1, (name, a)
            s = s.replace(a, b)
        path = os.path.join(tempfile.mkdtemp(), f"fg_{name}.py")
        open(path, "w").write(s)
        spec = importlib.util.spec_from_file_location(f"fg_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    ft.flash_gluon = mod
    fn = lambda: ft.flash_backward_triton(q, k, v, o, lse, do, True, opts)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    kernels = kernel_times_us(fn)
    row = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               commit=os.environ.get("CS336_BENCH_COMMIT"), shape=list(shape), variant=name, bwd_ms=ms,
               kernels_us=kernels, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    out.write(json.dumps(row) + "\n")
    out.flush()
    print(f"{name:<18} {ms:7.3f} ms  " + "  ".join(f"{n}={us:.0f}" for n, us in kernels.items()), flush=True)
ft.flash_gluon = real
