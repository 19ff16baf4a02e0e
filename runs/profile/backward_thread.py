"""Where an eager backward's host time goes around our Python backward: a diagnostic, not a benchmark (issue 9).

Session 13 (`host_step_dd08e31.txt`) found the autograd engine's device thread adds ~116 µs per harness step to
ours and ~54 µs to SDPA flash's (whose backward is C++). This splits one `torch.autograd.grad(o, (q, k, v), dO)`
of `flash_attention` on (1, 16, --seq, 64) bf16, causal, with the engine's device thread (the default) and
without it (`torch.autograd.set_multithreading_enabled(False)`):
  before  from the call of autograd.grad to the entry of our backward (`flash_triton._backward`)
  probe   sum(range(2000)) at the entry of our backward: pure Python, the same work on either thread
  inside  our backward, entry to return (the launches included; after the probe)
  after   from its return to autograd.grad's return (the engine's output checks, the hand-back)
medians over --iters calls, each after a synchronize; SDPA flash's whole autograd.grad beside it; and the CUDA
synchronizations our step makes (`torch.cuda.set_sync_debug_mode("warn")`, the backward on the calling thread).
Text to --out.

    python3 runs/profile/backward_thread.py --out $OUT/backward_thread.txt
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import warnings

import torch
import triton

from cs336_systems import flash_triton as ft
from cs336_systems.bench import impls

PROBE = 2000  # sum(range(PROBE)) at the entry of our backward, timed apart from it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}",
             f"autograd.grad of one call, (1, 16, {args.seq}, 64) bf16 causal; medians of {args.iters} calls, "
             "each after a synchronize; µs"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 16, args.seq, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    marks: dict[str, float] = {}
    inner = ft._backward

    def timed_backward(ctx, dO):
        marks["in"] = time.perf_counter()
        marks["thread"] = threading.get_ident()
        sum(range(PROBE))  # a fixed piece of pure Python: is the thread slow, or the CUDA calls on it?
        marks["probe"] = time.perf_counter()
        out = inner(ctx, dO)
        marks["out"] = time.perf_counter()
        return out

    sdpa_flash = impls.build("sdpa_flash", impls.Setup(torch.device("cuda"), "bf16", args.seq))

    ft._backward = timed_backward
    try:
        for threaded in (True, False):
            torch.autograd.set_multithreading_enabled(threaded)
            before, probe, inside, after, total, sdpa_total, same_thread = [], [], [], [], [], [], 0
            for i in range(args.iters + 20):
                o = ft.flash_attention(q, k, v, is_causal=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                torch.autograd.grad(o, (q, k, v), do)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                o = sdpa_flash(q, k, v, True)
                torch.cuda.synchronize()
                s0 = time.perf_counter()
                torch.autograd.grad(o, (q, k, v), do)
                s1 = time.perf_counter()
                torch.cuda.synchronize()
                if i >= 20:
                    before.append(marks["in"] - t0)
                    probe.append(marks["probe"] - marks["in"])
                    inside.append(marks["out"] - marks["probe"])
                    after.append(t1 - marks["out"])
                    total.append(t1 - t0)
                    sdpa_total.append(s1 - s0)
                    same_thread += marks["thread"] == threading.get_ident()
            med = lambda xs: 1e6 * statistics.median(xs)  # noqa: E731
            lines.append(f"device thread {threaded!s:5}: ours before {med(before):7.1f}  probe {med(probe):6.1f}  "
                         f"inside {med(inside):7.1f}  "
                         f"after {med(after):7.1f}  total {med(total):7.1f}  | SDPA flash total {med(sdpa_total):7.1f}"
                         f"  (our backward on the calling thread in {same_thread} of {args.iters})")
    finally:
        ft._backward = inner
        torch.autograd.set_multithreading_enabled(True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.autograd.set_multithreading_enabled(False)  # the backward on this thread, whose warnings we catch
        try:
            o = ft.flash_attention(q, k, v, is_causal=True)
            torch.autograd.grad(o, (q, k, v), do)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.autograd.set_multithreading_enabled(True)
    # (the mode's own notice, "Synchronization debug mode is a prototype feature", is not a synchronization)
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchronizing CUDA operation" in str(w.message)]
    lines.append(f"CUDA synchronizations in one forward + autograd.grad of ours: {len(syncs)}")
    lines += [f"  {s}" for s in syncs[:10]]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
