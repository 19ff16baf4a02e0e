"""Diagnostic of session 11: where the Gluon single-pass backward (atomic dQ) spends its time.

Runs only against commit 34c5a8e, whose `cs336_systems/flash_gluon.py` has the kernel (removed after
this run): textual variants of its DQ_ATOMIC path, each timed as the whole `flash_backward_triton`
call (do_bench median) and per kernel (torch.profiler), in one process beside the shipped two-pass
design at the leaderboard shape. Results of the variants that skip work are wrong; only time is read.

    git worktree add /tmp/s11 34c5a8e && cd /tmp/s11 && \
    PYTHONPATH=$PWD CS336_BENCH_COMMIT=34c5a8e python3 <this script> atomic_diag.jsonl
"""
import importlib.util, json, os, sys, tempfile, time
import torch, triton, triton.testing
from cs336_systems import flash_triton as ft
from cs336_systems.bench.timing import kernel_times_us

SRC = open("cs336_systems/flash_gluon.py").read()
RED = "    _tma_reduce_add(dq_desc, [_tile_row(t, n_vis, first_head, q_first, N_QUERIES, BLOCK_M), 0], buf)\n"
CALL = "            _reduce_dq(dq_desc, dq_smem, dq, t, n_vis, first_head, q_first, N_QUERIES, BLOCK_M)\n"
WAIT = "            dq = warpgroup_mma_wait(1, deps=(dq, ))\n"
VARIANTS = {
    "as_built": [],
    "no_reduce": [(RED, "")],                                  # dQ stored to shared memory, never added
    "no_store": [(CALL, "")],                                  # dQ not stored: ptxas then drops its matmul
    "no_dq_wait": [(CALL, ""), (WAIT, "")],                    # dQ never read: the compiler drops its matmul
}
shape = (1, 16, 16384, 64)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
out = open(sys.argv[1], "a")
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            commit=os.environ.get("CS336_BENCH_COMMIT"), shape=list(shape), time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
o, lse = ft.flash_forward_triton(q, k, v, True)
real = ft.flash_gluon
runs = [("two_pass_shipped", None, ft.KernelOptions(autotune=False, configs=(("fwd", (128, 64, 4, 3)), ("kv", (32, 128, 4, 3)), ("dq", (128, 64, 8, 3)))))]
runs += [(name, edits, ft.KernelOptions(autotune=False, deterministic=False, gluon_kv=True, configs=(("kv", (64, 64, 4, 2)),))) for name, edits in VARIANTS.items()]
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
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    ft.flash_gluon = mod
    fn = lambda: ft.flash_backward_triton(q, k, v, o, lse, do, True, opts)
    fn(); torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    kern = kernel_times_us(fn)
    row = dict(meta, variant=name, bwd_ms=ms, kernels_us=kern)
    out.write(json.dumps(row) + "\n"); out.flush()
    print(f"{name:<18} {ms:7.3f} ms  " + "  ".join(f"{k2}={v2:.0f}" for k2, v2 in kern.items()), flush=True)
ft.flash_gluon = real
