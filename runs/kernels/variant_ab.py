"""A/B of kernel builds that live in different copies of the package (e.g. `git archive` of two commits),
each timed in its own process, the copies interleaved over several rounds, so that a build compares with
the other under the same machine state. Per (copy, round): the leaderboard's call (bf16, causal,
16 × 16384 × 64 by default, dO random) through `flash_attention`: forward, backward
(`torch.autograd.grad` of a kept graph) and fwd+bwd by do_bench medians, and SDPA cuDNN's and flash's
fwd+bwd in the same process; then one float64 check at a smaller shape (ours and SDPA flash in bf16
against float64, relative errors of O, dQ, dK, dV: the tests' 2× rule).

    python3 runs/kernels/variant_ab.py --copy A=/path/to/a --copy B=/path/to/b \
        --copy B3=/path/to/b:single_pass=128,128,8,3 --rounds 3 --out $OUT/ab.jsonl

`NAME=PATH[:single_pass=BM,BN,W,S]` names a copy and optionally sets the config of its default single pass at the
shape's head dim for the whole process (`flash_gluon.SINGLE_PASS_KEYS_CONFIGS[d]` in copies whose default is the
keys-on-rows single pass, from the twenty-first session on, whose shared memory takes two stages only;
`SINGLE_PASS_CONFIGS[d]`, the queries-on-rows one, before, e.g. the three stages above; until session 23 the
override always went to d 64: a d-128 A/B would have ignored it; no recorded row did so). Rows carry the copy's
name, its path's commit (`CS336_BENCH_COMMIT` of the copy if given as PATH@COMMIT) and the round.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time


def worker(spec: dict) -> dict:
    import torch
    import triton
    from triton.testing import do_bench

    from cs336_systems import flash_attention, flash_gluon
    from cs336_systems.bench import impls

    b, h, n, d = spec["shape"]
    if spec.get("single_pass"):
        from cs336_systems.flash_triton import KernelOptions

        keys = not getattr(KernelOptions(), "single_qrows", True)  # (the option came with the keys-on-rows kernel)
        (flash_gluon.SINGLE_PASS_KEYS_CONFIGS if keys else flash_gluon.SINGLE_PASS_CONFIGS)[d] = tuple(
            spec["single_pass"])
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def fwd_bwd(fn):
        def step():
            o = fn(q, k, v)
            torch.autograd.grad(o, (q, k, v), do)
        return step

    ours = lambda q, k, v: flash_attention(q, k, v, is_causal=True)  # noqa: E731
    setup = impls.Setup(torch.device("cuda"), "bf16", n)
    sdpa = {name: functools.partial(impls.build(name, setup), is_causal=True)
            for name in ("sdpa_cudnn", "sdpa_flash", "sdpa_math")}
    row = {"copy": spec["name"], "commit": spec["commit"], "round": spec["round"], "shape": [b, h, n, d],
           "single_pass": spec.get("single_pass"), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__}
    with torch.no_grad():
        row["fwd_ms"] = do_bench(lambda: ours(q, k, v))
    o = ours(q, k, v)
    row["bwd_ms"] = do_bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    row["fwd_bwd_ms"] = do_bench(fwd_bwd(ours))
    row["cudnn_fwd_bwd_ms"] = do_bench(fwd_bwd(sdpa["sdpa_cudnn"]))
    row["sdpa_flash_fwd_bwd_ms"] = do_bench(fwd_bwd(sdpa["sdpa_flash"]))

    # float64 check at a shape the single pass takes (batch·heads·Nq·Nk at GLUON_MIN_WORK)
    cb, ch, cn = spec["check_shape"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    cq, ck, cv, cdo = (torch.randn(cb, ch, cn, d, device="cuda", generator=gen, dtype=torch.bfloat16)
                       for _ in range(4))

    def grads(fn, *xs):
        xs = [x.detach().requires_grad_(True) for x in xs[:3]] + [xs[3]]
        out = fn(*xs[:3])
        return (out, *torch.autograd.grad(out, xs[:3], xs[3]))

    ref, theirs = [], []
    for i in range(ch):  # one head at a time: float64 scores of a whole head fit, of all heads not
        sl = [t[:, i:i + 1] for t in (cq, ck, cv, cdo)]
        ref.append(grads(sdpa["sdpa_math"], *(t.double() for t in sl)))
        theirs.append(grads(sdpa["sdpa_flash"], *sl))
    mine_all = grads(ours, cq, ck, cv, cdo)
    for j, name in enumerate(("o", "dq", "dk", "dv")):
        r = torch.cat([x[j] for x in ref], 1)
        err = lambda x: ((x.double() - r).norm() / r.norm()).item()  # noqa: E731
        row[f"err_{name}"] = err(mine_all[j])
        row[f"sdpa_err_{name}"] = err(torch.cat([x[j] for x in theirs], 1))
    row["within_2x"] = all(row[f"err_{x}"] <= 2 * row[f"sdpa_err_{x}"] + 1e-6 for x in ("o", "dq", "dk", "dv"))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copy", action="append", required=True, help="NAME=PATH[@COMMIT][:single_pass=BM,BN,W,S]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", default="1,16,16384,64", help="B,H,N,D")
    ap.add_argument("--check-shape", default="1,16,8192", help="B,H,N of the float64 check")
    ap.add_argument("--out", required=True)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    specs = []
    for c in args.copy:
        name, _, rest = c.partition("=")
        path, _, opt = rest.partition(":")
        path, _, commit = path.partition("@")
        if not name or not os.path.isdir(path):
            ap.error(f"--copy {c!r}: want NAME=PATH with PATH a directory")
        spec = dict(name=name, path=os.path.abspath(path), commit=commit or "?",
                    shape=[int(x) for x in args.shape.split(",")],
                    check_shape=[int(x) for x in args.check_shape.split(",")])
        if opt:
            key, _, val = opt.partition("=")
            if key != "single_pass":
                ap.error(f"--copy {c!r}: unknown option {key!r}")
            spec["single_pass"] = [int(x) for x in val.split(",")]
        specs.append(spec)
    with open(args.out, "a") as f:
        for r in range(args.rounds):
            for spec in specs:
                spec = dict(spec, round=r)
                env = dict(os.environ, PYTHONPATH=spec["path"])
                t0 = time.time()
                p = subprocess.run([sys.executable, os.path.abspath(__file__), "--out", args.out, "--copy", "x=.",
                                    "--worker", json.dumps(spec)], env=env, cwd=spec["path"],
                                   capture_output=True, text=True)
                if p.returncode:
                    print(f"{spec['name']} round {r}: failed\n{p.stderr[-3000:]}", flush=True)
                    continue
                row = json.loads(p.stdout.strip().splitlines()[-1])
                row["wall_s"] = round(time.time() - t0, 1)
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                               if k not in ("gpu", "torch", "triton", "shape")), flush=True)


if __name__ == "__main__":
    main()
