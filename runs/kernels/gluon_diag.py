"""Session 11's diagnostics of the Gluon single-pass backward (atomic dQ): where its time goes.

Each variant is a textual edit of `cs336_systems/flash_gluon.py` as it stood at the build's commit
(the kernels were removed after these runs), timed as the whole `flash_backward_triton` call (do_bench
median) and per kernel (torch.profiler), in one process beside the shipped two-pass design at the
leaderboard shape. Results of the variants that skip work are wrong; only time is read. Check the SASS
of a variant before reading it: ptxas drops a matmul whose result is never stored.

    git worktree add /tmp/build <commit> && cd /tmp/build && \\
    PYTHONPATH=$PWD CS336_BENCH_COMMIT=<commit> python3 <this script> --build <build> --out rows.jsonl

Builds: `atomic` (commit 34c5a8e, one warpgroup of 64 keys; rows in `atomic_diag.jsonl`),
`single_pass` (commit 1c8ee71, warp-specialized, 128 keys; rows in `single_pass_diag.jsonl`) and
`qrows_red` (commit 97b0bd9, the queries-on-rows kernel as a single pass, 64 keys, dQ added with
`red.global`; its "reds_off" variant predicates the reds off with a run-time mask that is always false,
meant to keep the dQ matmul and its wait while nothing reaches the L2, but ptxas proves the mask false and
drops the reds and the dQ matmul: SASS 16 HGMMAs and a placeholder per tile, so it times a four-matmul
kernel, as "no_store" above does). The rows of the first
two were taken with two separate copies of this script (same variants, same timing), merged here
afterwards; those of `qrows_red` (`single_diag.jsonl`, session 15) by a device-side script that timed the
same two variants with do_bench rep 200 over copies of the package at 97b0bd9, beside the two-pass design
with the Gluon queries-on-rows pass (64 × 64 / 4 / 2) instead of the row below, and also at
1 × 1 × 65536 × 128.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time

_REDUCE_1WG = "    _tma_reduce_add(dq_desc, [_tile_row(t, n_vis, first_head, q_first, N_QUERIES, BLOCK_M), 0], buf)\n"
_CALL_1WG = "            _reduce_dq(dq_desc, dq_smem, dq, t, n_vis, first_head, q_first, N_QUERIES, BLOCK_M)\n"
_WAIT_1WG = "            dq = warpgroup_mma_wait(1, deps=(dq, ))\n"
_REDUCE_WS = "            _tma_reduce_add(dq_desc, [row, c * (D // 2)], dq_smem.index(2 * b + c))\n"
_STORE_WS = "        dq_smem.index(2 * b + ROLE).store(dq)\n"
_MMA_WS = ("        dq = warpgroup_mma(ds_smem.permute((1, 0)), kc_smem.index(ROLE), zero_dq, use_acc=False, "
           "is_async=True)\n")
_WAIT_WS = "        dq = warpgroup_mma_wait(1, deps=(dq, ))\n"
_RED_QROWS = '        gl.atomic_add(dq_ptr + row * D + dq_offs, dq, sem="relaxed")\n'
_RED_OFF_QROWS = ('        gl.atomic_add(dq_ptr + row * D + dq_offs, dq, mask=(dq_offs * 0 + first_head) < 0, '
                  'sem="relaxed")\n')
_DS_WAITS_WS = [("        mbarrier.wait(ds_empty, (t & 1) ^ 1)\n", ""), ("        mbarrier.wait(ds_full, t & 1)\n", "")]

# build -> (kv config of the single pass, {variant: [(text, replacement), ...]})
BUILDS = {
    "atomic": ((64, 64, 4, 2), {
        "as_built": [],
        "no_reduce": [(_REDUCE_1WG, "")],                     # dQ stored to shared memory, never added
        "no_store": [(_CALL_1WG, "")],                        # dQ not stored: ptxas then drops its matmul
        "no_dq_wait": [(_CALL_1WG, ""), (_WAIT_1WG, "")],     # dQ never read: its matmul dropped
    }),
    "single_pass": ((64, 128, 4, 2), {
        "as_built": [],
        "no_reduce": [(_REDUCE_WS, "            pass\n")],   # the writer frees buffers without reducing
        "no_dq_store": [(_STORE_WS, "")],                     # dQ not stored: ptxas then drops its matmul
        "no_dq": [(_STORE_WS, ""), (_WAIT_WS, ""), (_MMA_WS, "")],  # no dQ matmul (ptxas serializes: C7512)
        "no_ds_waits": _DS_WAITS_WS,                          # consumers do not wait for each other's dSᵀ
    }),
    "qrows_red": ((64, 64, 4, 2), {
        "as_built": [],
        "reds_off": [(_RED_QROWS, _RED_OFF_QROWS)],          # reds off: ptxas then drops the dQ matmul too
    }),
}


def load_variant(src: str, name: str, edits):
    """The module flash_gluon with `edits` applied (each text must occur exactly once)."""
    for old, new in edits:
        if src.count(old) != 1:
            raise ValueError(f"variant {name}: the text to edit occurs {src.count(old)} times: {old!r}")
        src = src.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(), f"flash_gluon_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"flash_gluon_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", choices=list(BUILDS), required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    import triton
    import triton.testing

    from cs336_systems import flash_triton as ft
    from cs336_systems.bench.timing import kernel_times_us

    config, variants = BUILDS[args.build]
    with open("cs336_systems/flash_gluon.py") as f:
        src = f.read()
    shape = (1, 16, 16384, 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    o, lse = ft.flash_forward_triton(q, k, v, True)
    shipped = ft.KernelOptions(autotune=False, configs=(("fwd", (128, 64, 4, 3)), ("kv", (32, 128, 4, 3)),
                                                        ("dq", (128, 64, 8, 3))))
    single = ft.KernelOptions(autotune=False, deterministic=False, gluon_kv=True, configs=(("kv", config),))
    real = ft.flash_gluon
    runs = [("two_pass_shipped", None, shipped)] + [(name, edits, single) for name, edits in variants.items()]
    with open(args.out, "a") as out:
        for name, edits, opts in runs:
            ft.flash_gluon = real if edits is None else load_variant(src, name, edits)
            fn = lambda: ft.flash_backward_triton(q, k, v, o, lse, do, True, opts)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
            kernels = kernel_times_us(fn)
            row = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       commit=os.environ.get("CS336_BENCH_COMMIT"), build=args.build, shape=list(shape),
                       variant=name, bwd_ms=ms, kernels_us=kernels,
                       time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"{name:<18} {ms:7.3f} ms  " + "  ".join(f"{n}={us:.0f}" for n, us in kernels.items()), flush=True)
    ft.flash_gluon = real


if __name__ == "__main__":
    main()
