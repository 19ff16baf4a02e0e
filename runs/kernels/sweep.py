"""Kernel design sweep of our FlashAttention-2 kernels on one GPU (bf16, causal), per plan (`PLANS`).

One call times every (design, config) of a plan with fixed configs (no autotuner), beside PyTorch
SDPA's flash and cuDNN backends in the same process:
  fwd/<tma|ptr>[-gluon]    the forward, TMA descriptors or block pointers; -gluon: the forward of
                           cs336_systems/flash_gluon.py (gluon_fwd);
  bwd/atomic-<tma|ptr>     the single-pass backward with fp32 atomic dQ (TMA bulk reduce or atom.add);
  bwd/det-<tma|ptr>[-prep][-gluon]
                           the deterministic two-pass backward (kv configs run with the plan's fixed
                           dq config, then dq configs with the best kv config); -prep: with the
                           delta pre-pass kernel instead of the dQ pass computing delta (fused_prep);
                           -gluon: the keys-on-rows dK/dV pass of cs336_systems/flash_gluon.py (gluon_kv,
                           kv_qrows=False); -gluon-qrows: its queries-on-rows pass (the shipped one);
                           with atomic-, -gluon is the keys-on-rows single pass (the shipped one at d 64),
                           -gluon-qrows the queries-on-rows single pass (single_qrows).
Backward times are the whole `flash_backward_triton` call (prep + kv [+ dq | cast]).
Every config is first compiled in parallel worker processes (Triton's on-disk cache), then timed
with `triton.testing.do_bench` (median) in this process. The best config of each design is checked
against float64 at 2 x 2048 x d (causal and not) and against SDPA cuDNN at the plan's shape, and its
per-kernel CUDA times are read with torch.profiler. Rows (JSONL, with GPU, versions, commit and
plan) go to --out; a table is printed last.

    CS336_BENCH_COMMIT=<commit> python3 runs/kernels/sweep.py --plan tune64 tune128 --out $OUT/sweep.jsonl
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import multiprocessing as mp
import os
import time

SHAPE = (1, 16, 16384, 64)
WARPS = (4, 8)
STAGES = (2, 3)
BASE_FWD = (128, 64, 4, 3)


def _grid(tiles, warps, stages):
    return [(q, k, w, s) for (q, k), w, s in itertools.product(tiles, warps, stages)]


# A plan: the shape, then per design the configs to time. "kv" configs of the two-pass designs run
# with the plan's dq_fixed; then "dq" configs run with the best kv config found.
PLANS = {
    # run 1: the four backward designs and both forward load paths, a broad grid
    "designs": dict(
        shape=SHAPE,
        fwd={f"fwd/{m}": _grid(((128, 64), (128, 128), (64, 64), (64, 128)), WARPS, STAGES) for m in ("tma", "ptr")},
        kv={**{f"bwd/atomic-{m}": _grid(((128, 64), (64, 128), (64, 64), (128, 128), (32, 128)), WARPS, STAGES)
               for m in ("tma", "ptr")},
            **{f"bwd/det-{m}": _grid(((128, 64), (64, 128), (64, 64), (128, 128), (32, 128)), WARPS, (3,))
               for m in ("tma", "ptr")}},
        dq=_grid(((128, 64), (128, 32), (64, 64), (128, 128)), WARPS, STAGES),
        dq_fixed=(128, 64, 4, 3),
    ),
    # run 2: around the winners of run 1 (TMA), deeper pipelines, 16- and 256-row tiles
    "tune64": dict(
        shape=SHAPE,
        fwd={"fwd/tma": _grid(((128, 64), (128, 128), (64, 128), (64, 64)), (4,), (2, 3, 4, 5))
             + _grid(((128, 128), (256, 64)), (8,), (2, 3))},
        kv={"bwd/det-tma": _grid(((32, 128), (16, 128), (32, 64), (64, 128), (16, 64)), (4,), (2, 3, 4, 5))
            + _grid(((32, 256), (64, 256), (32, 128), (16, 128)), (8,), (2, 3)),
            "bwd/atomic-tma": _grid(((64, 64), (32, 64), (64, 32)), (4,), (2, 3, 4, 5))},
        dq=_grid(((128, 64), (128, 32), (64, 64), (64, 32)), (4,), (2, 3, 4, 5))
        + _grid(((256, 64), (256, 32), (128, 64)), (8,), (2, 3)),
        dq_fixed=(128, 64, 4, 3),
    ),
    # run 2: head dim 128 (issue 8 target 4: 1 x 1 x 65536 x 128, causal)
    "tune128": dict(
        shape=(1, 1, 65536, 128),
        fwd={"fwd/tma": _grid(((128, 64), (128, 128), (64, 64), (64, 128)), WARPS, (2, 3))},
        kv={"bwd/det-tma": _grid(((32, 64), (64, 64), (16, 128), (32, 128), (64, 128)), WARPS, (2, 3))},
        dq=_grid(((128, 64), (64, 64), (128, 32), (64, 32), (128, 128)), WARPS, (2, 3)),
        dq_fixed=(64, 64, 4, 3),
    ),
    # run 5: the atomic design with dQ's matmul issued before dV's and dK's (commit 717a776; it lost and
    # was reverted, so this plan now times the atomic design as shipped), beside the shipped two-pass
    "atomic_order": dict(
        shape=SHAPE,
        fwd={},
        kv={"bwd/det-tma": [(32, 128, 4, 3)],
            "bwd/atomic-tma": [(64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 3)]},
        dq=[(128, 64, 4, 3)],
        dq_fixed=(128, 64, 4, 3),
    ),
    # run 8: delta (and the expanded dO's copy) in the dQ pass against the pre-pass kernel
    "fused_prep": dict(
        shape=SHAPE,
        fwd={},
        kv={"bwd/det-tma": [(32, 128, 4, 3)], "bwd/det-tma-prep": [(32, 128, 4, 3)]},
        dq=[(128, 64, 8, 3), (128, 64, 4, 3)],
        dq_fixed=(128, 64, 8, 3),
    ),
    # run 9: the dK/dV pass in Gluon (cs336_systems/flash_gluon.py) against the shipped Triton pass.
    # Runs 9a-9c timed builds with flags since removed (configs (..., KV_IN_REGISTERS, EARLY_S,
    # PREFETCH_ROWS) in their rows, commits 3f6cf2d and d7855a0); the pass now always prefetches.
    # Run 10 (plans gluon_ws, gluon_ws128 of commit 768d525) timed a warp-specialized kernel, selected
    # by 8-warp configs; it lost and was removed (its code is in that commit). Run 11 (plan gluon_atomic of
    # commit 34c5a8e) timed the single pass with atomic dQ in Gluon (design bwd/atomic-tma-gluon), run 12
    # (plan single_pass of commit 1c8ee71) its warp-specialized build; both lost and were removed likewise.
    # run 13: the forward in Gluon (flash_gluon.flash_fwd_gluon_kernel; configs (BLOCK_M rows per consumer
    # warpgroup, BLOCK_N keys, consumer warps: 8 or 12 for 2 or 3 warpgroups, STAGES)) against the shipped
    # Triton forward. Run 13a (commit 73c5a65) had two warpgroups only, written (64, BLOCK_N, 4, STAGES).
    "gluon_fwd": dict(
        shape=SHAPE,
        fwd={"fwd/tma": [(128, 64, 4, 3), (128, 128, 4, 3)],
             "fwd/tma-gluon": [(64, 128, 8, 2), (64, 128, 12, 2), (64, 128, 12, 3), (64, 64, 12, 3),
                               (64, 64, 12, 4)]},
        kv={},
        dq=[],
        dq_fixed=(128, 64, 8, 3),
    ),
    "gluon_fwd128": dict(
        shape=(1, 1, 65536, 128),
        fwd={"fwd/tma": [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 8, 2)],
             "fwd/tma-gluon": [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 12, 2), (64, 64, 12, 3)]},
        kv={},
        dq=[],
        dq_fixed=(128, 64, 8, 3),
    ),
    "gluon_kv": dict(
        shape=SHAPE,
        fwd={},
        kv={"bwd/det-tma": [(32, 128, 4, 3)],
            "bwd/det-tma-gluon": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4)]},
        dq=[(128, 64, 8, 3)],
        dq_fixed=(128, 64, 8, 3),
    ),
    "gluon_kv128": dict(
        shape=(1, 1, 65536, 128),
        fwd={},
        kv={"bwd/det-tma": [(64, 128, 8, 3)],
            "bwd/det-tma-gluon": [(32, 64, 4, 4), (32, 64, 4, 3)]},
        dq=[(128, 64, 8, 3)],
        dq_fixed=(128, 64, 8, 3),
    ),
    # run 15: the dK/dV pass with the queries on rows (FlashAttention-3's layout, kv_qrows) in Gluon (BLOCK_M =
    # BLOCK_N = 16·warps) against the Triton pass; run 15 (commit 4a99fa6) also timed it in Triton, design
    # bwd/det-tma-qrows at (64, 128, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3): it lost and was removed
    "qrows": dict(
        shape=SHAPE,
        fwd={},
        kv={"bwd/det-tma": [(32, 128, 4, 3)],
            "bwd/det-tma-gluon-qrows": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2)]},
        dq=[(128, 64, 8, 3)],
        dq_fixed=(128, 64, 8, 3),
    ),
    # run 16: the Gluon build with the diagonal tile's mask out of the loop (one masked tile per query head,
    # then unmasked ones), at more stages
    "qrows2": dict(
        shape=SHAPE,
        fwd={},
        kv={"bwd/det-tma": [(32, 128, 4, 3)],
            "bwd/det-tma-gluon-qrows": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 2)]},
        dq=[(128, 64, 8, 3)],
        dq_fixed=(128, 64, 8, 3),
    ),
    "qrows128": dict(
        shape=(1, 1, 65536, 128),
        fwd={},
        kv={"bwd/det-tma": [(32, 64, 4, 3)],
            "bwd/det-tma-gluon-qrows": [(64, 64, 4, 2), (64, 64, 4, 3)]},
        dq=[(128, 64, 8, 3)],
        dq_fixed=(128, 64, 8, 3),
    ),
    # runs 17-19: the queries-on-rows pass as the single-pass backward (dQ = dS·K added in fp32: red.global in
    # run 17 (commit 97b0bd9), TMA bulk reductions after), against the shipped two-pass design and the Triton
    # single pass
    "single_qrows": dict(
        shape=SHAPE,
        fwd={},
        kv={"bwd/det-tma-gluon-qrows": [(64, 64, 4, 2)], "bwd/atomic-tma": [(64, 64, 4, 3)],
            "bwd/atomic-tma-gluon-qrows": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2)]},
        dq=[(128, 64, 8, 3)],
        dq_fixed=(128, 64, 8, 3),
    ),
    "single_qrows128": dict(
        shape=(1, 1, 65536, 128),
        fwd={},
        kv={"bwd/det-tma-gluon-qrows": [(64, 64, 4, 2)],
            "bwd/atomic-tma-gluon-qrows": [(64, 64, 4, 2)]},
        dq=[(128, 64, 8, 3)],
        dq_fixed=(128, 64, 8, 3),
    ),
}


def flops(mode: str, shape=SHAPE) -> float:
    b, h, s, d = shape
    fwd = 4 * b * h * s * s * d * 0.5
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]


def options(design: str, configs: dict):
    from cs336_systems.flash_triton import KernelOptions

    kind, mode = design.split("/")
    parts = mode.split("-")  # [det|atomic-]<tma|ptr>[-prep][-gluon[-qrows]]
    gluon = "gluon" in parts
    if "qrows" in parts and not gluon:
        raise ValueError(f"{design}: the queries-on-rows Triton pass was removed after run 15 (commit 4a99fa6 has it)")
    return KernelOptions(autotune=False, tma="tma" in parts, deterministic=parts[0] == "det",
                         fused_prep="prep" not in parts, gluon_kv=gluon and kind == "bwd", kv_qrows="qrows" in parts,
                         single_qrows="qrows" in parts, gluon_fwd=gluon and kind == "fwd",
                         configs=tuple(sorted(configs.items())))


def inputs(seed: int = 0, shape=SHAPE):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    return q, k, v, do


def run_once(design: str, configs: dict, tensors):
    from cs336_systems.flash_triton import flash_backward_triton, flash_forward_triton

    q, k, v, do = tensors
    opts = options(design, configs)
    o, lse = flash_forward_triton(q, k, v, True, opts)
    if design.startswith("bwd"):
        return (o, *flash_backward_triton(q, k, v, o, lse, do, True, opts))
    return (o,)


def compile_job(job):
    """Worker: compile (and run once) one design/config at the real shape; report failures."""
    design, configs, shape = job
    import torch

    try:
        run_once(design, configs, inputs(0, shape))
        torch.cuda.synchronize()
        return job, None
    except Exception as e:  # a config that cannot compile or launch is recorded, not fatal
        return job, f"{type(e).__name__}: {str(e)[:300]}"


def jobs(plan):
    out = [(design, {"fwd": c}) for design, grid in plan["fwd"].items() for c in grid]
    for design, grid in plan["kv"].items():
        fixed = {"dq": plan["dq_fixed"]} if "/det" in design else {}
        out += [(design, {"fwd": BASE_FWD, "kv": c, **fixed}) for c in grid]
    return out


def dq_jobs(plan, best_kv: dict):
    return [(design, {"fwd": BASE_FWD, "kv": kv, "dq": c})
            for design, kv in best_kv.items() if "/det" in design for c in plan["dq"]]


def precompile(job_list, shape, workers: int):
    failed = {}
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for (design, configs, _), err in pool.map(compile_job, [(d, c, shape) for d, c in job_list]):
            if err:
                failed[(design, json.dumps(configs, sort_keys=True))] = err
    return failed


def time_job(design, configs, tensors, rep_ms, warmup_ms):
    import torch
    import triton.testing

    from cs336_systems.flash_triton import flash_backward_triton, flash_forward_triton

    q, k, v, do = tensors
    opts = options(design, configs)
    if design.startswith("fwd"):
        fn = lambda: flash_forward_triton(q, k, v, True, opts)  # noqa: E731
    else:
        o, lse = flash_forward_triton(q, k, v, True, opts)
        fn = lambda: flash_backward_triton(q, k, v, o, lse, do, True, opts)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def check_design(design, configs, d=64):
    """Float64 reference at 2 x 2048 x d (causal and not)."""
    import torch.nn.functional as F

    from cs336_systems.flash_triton import flash_backward_triton, flash_forward_triton

    opts = options(design, configs)
    result = {}
    for causal in (False, True):
        q, k, v, do = inputs(1, (1, 2, 2048, d))
        o, lse = flash_forward_triton(q, k, v, causal, opts)
        ours = [o]
        if design.startswith("bwd"):
            ours += list(flash_backward_triton(q, k, v, o, lse, do, causal, opts))
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        ref.backward(do.double())
        refs = [ref.detach(), *(t.grad for t in leaves)]
        lv = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        base = F.scaled_dot_product_attention(*lv, is_causal=causal)
        base.backward(do)
        bases = [base.detach(), *(t.grad for t in lv)]
        for name, x, r, b in zip(("o", "dq", "dk", "dv"), ours, refs, bases):
            err = ((x.double() - r).norm() / r.norm()).item()
            berr = ((b.double() - r).norm() / r.norm()).item()
            result[f"{'causal' if causal else 'full'}_{name}_rel_err"] = err
            result[f"{'causal' if causal else 'full'}_{name}_torch_bf16_rel_err"] = berr
    return result


def profile_kernels(design, configs, tensors):
    """CUDA time per kernel (µs, mean of 10 calls) of one design, from torch.profiler."""
    from cs336_systems.bench.timing import kernel_times_us

    run_once(design, configs, tensors)
    return kernel_times_us(lambda: run_once(design, configs, tensors))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plan", nargs="+", choices=list(PLANS), default=["designs"])
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--rep-ms", type=float, default=200)
    ap.add_argument("--warmup-ms", type=float, default=50)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    import triton
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t0 = time.time()
    out = open(args.out, "a")
    summary = []
    for plan_name in args.plan:
        plan = PLANS[plan_name]
        shape = plan["shape"]
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    commit=os.environ.get("CS336_BENCH_COMMIT", "unknown"), plan=plan_name,
                    run_id=time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), shape=list(shape), dtype="bf16",
                    is_causal=True, rep_ms=args.rep_ms, warmup_ms=args.warmup_ms)

        def write(row):
            row = {**meta, **row}
            out.write(json.dumps(row) + "\n")
            out.flush()
            return row

        job_list = jobs(plan)
        failed = precompile(job_list, shape, args.workers)
        print(f"{plan_name}: precompiled {len(job_list)} jobs, {len(failed)} failed ({time.time() - t0:.0f} s)",
              flush=True)
        tensors = inputs(0, shape)
        q, k, v, do = tensors
        for backend, name in ((SDPBackend.FLASH_ATTENTION, "sdpa_flash"), (SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn")):
            with sdpa_kernel(backend):
                fq, fk, fv = (t.detach().clone().requires_grad_() for t in (q, k, v))
                fwd = lambda: F.scaled_dot_product_attention(fq, fk, fv, is_causal=True)  # noqa: E731
                o = fwd()
                bwd = lambda: torch.autograd.grad(o, (fq, fk, fv), do, retain_graph=True)  # noqa: E731
                ms_f = triton.testing.do_bench(fwd, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
                ms_b = triton.testing.do_bench(bwd, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
            for kernel, ms in (("fwd", ms_f), ("bwd", ms_b)):
                write(dict(design=name, kernel=kernel, ms=ms, tflops=flops(kernel, shape) / ms / 1e9, status="ok"))
                summary.append((plan_name, f"{name}/{kernel}", ms, flops(kernel, shape) / ms / 1e9, ""))

        best: dict[str, tuple[float, dict]] = {}

        def time_all(job_list):
            for design, configs in job_list:
                key = (design, json.dumps(configs, sort_keys=True))
                kernel = design.split("/")[0]
                row = dict(design=design, kernel=kernel, configs=configs)
                if key in failed:
                    write({**row, "status": "error: " + failed[key]})
                    continue
                try:
                    ms = time_job(design, configs, tensors, args.rep_ms, args.warmup_ms)
                except Exception as e:  # recorded as the row's status; the sweep goes on
                    write({**row, "status": f"error: {type(e).__name__}: {str(e)[:300]}"})
                    continue
                write({**row, "ms": ms, "tflops": flops(kernel, shape) / ms / 1e9, "status": "ok"})
                if design not in best or ms < best[design][0]:
                    best[design] = (ms, configs)

        time_all(job_list)
        extra = dq_jobs(plan, {d: c["kv"] for d, (_, c) in best.items() if "kv" in c})
        failed.update(precompile(extra, shape, args.workers))
        time_all(extra)

        for design, (ms, configs) in sorted(best.items()):
            try:
                errs, status = check_design(design, configs, shape[-1]), "ok"
            except Exception as e:  # recorded as the row's status
                errs, status = {}, f"error: {type(e).__name__}: {str(e)[:300]}"
            write(dict(design=design, kernel="check", configs=configs, status=status, **errs))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                lv = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                ref = F.scaled_dot_product_attention(*lv, is_causal=True)
                ref.backward(do)
            ours = run_once(design, configs, tensors)
            refs = [ref.detach(), *(t.grad for t in lv)][: len(ours)]
            diffs = {f"full_size_{n}_rel_diff_vs_cudnn": ((x.float() - r.float()).norm() / r.float().norm()).item()
                     for n, x, r in zip(("o", "dq", "dk", "dv"), ours, refs)}
            write(dict(design=design, kernel="check_full_size", configs=configs, status="ok", **diffs))
            write(dict(design=design, kernel="profile_us", configs=configs, status="ok",
                       kernels=profile_kernels(design, configs, tensors)))
            kernel = design.split("/")[0]
            summary.append((plan_name, design, ms, flops(kernel, shape) / ms / 1e9, configs))

    print(f"\n{'plan':<8} {'design':<26} {'ms':>8} {'TFLOP/s':>8}  config  (total {time.time() - t0:.0f} s)")
    for plan_name, design, ms, tf, configs in summary:
        print(f"{plan_name:<8} {design:<26} {ms:8.3f} {tf:8.1f}  {configs}")


if __name__ == "__main__":
    main()
