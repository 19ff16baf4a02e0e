"""The compiled short call with and without Inductor launching our kernels (issue 9), in one process: a diagnostic.

The course's harness at batch 1, 16 heads, seq 1024, d 64, bf16, causal (`torch.compile(FlashAttention2Triton.apply)`,
`o.sum().backward()`, do_bench), for:
  inductor  the triton_ops' bodies traced: Inductor launches the flat entry kernels (what ships);
  opaque    the same ops with `_inlined` patched to refuse every call: the compiled graphs call the opaque launch
            ops, as they all did before the triton_ops;
and SDPA's flash backend eager (the harness's reference) and compiled, beside. Per row: do_bench mean and median of
the step (ms), host µs per step and per compiled forward (the GPU drained before each call).

    python3 runs/profile/inductor_ab.py --out $OUT/inductor_ab.txt
"""

from __future__ import annotations

import argparse

import torch
import torch._functorch.config
import torch._inductor.config
import triton

from cs336_systems import flash_triton as ft
from cs336_systems.bench import impls
from cs336_systems.bench.timing import harness_bench, host_times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rep-ms", type=float, default=2000)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    # no compiled graph reused from a cache: the two rows of ours trace the same graph, to different code
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    device = torch.device("cuda")
    q, k, v = torch.randn(3, 16, args.seq, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    sdpa_flash = impls.build("sdpa_flash", impls.Setup(device, "bf16", args.seq))  # (H, S, D) inputs as (1, H, S, D)
    inlined = ft._inlined
    rows = {
        "ours compiled, Inductor launches": (lambda: torch.compile(ft.FlashAttention2Triton.apply), inlined),
        "ours compiled, opaque launch ops": (lambda: torch.compile(ft.FlashAttention2Triton.apply),
                                             lambda *a: False),
        "SDPA flash eager": (lambda: sdpa_flash, inlined),
        "SDPA flash compiled": (lambda: torch.compile(sdpa_flash), inlined),
    }
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}",
             f"shape (1, 16, {args.seq}, 64) bf16 causal; harness step = fn(q, k, v, True).sum().backward()",
             f"{'row':<36} {'mean ms':>8} {'median ms':>10} {'host µs/step':>13} {'host µs fwd':>12}"]
    for name, (make, rule) in rows.items():
        ft._inlined = rule
        torch._dynamo.reset()
        fn = make()

        def step():
            fn(q, k, v, True).sum().backward()

        def forward():
            fn(q, k, v, True)

        for _ in range(5):  # compile, tune
            step()
        timed = harness_bench(step, device, warmup_ms=200, rep_ms=args.rep_ms)
        host_step = host_times(step, device, iters=args.iters, warmup=10)["host_us"]
        host_fwd = host_times(forward, device, iters=args.iters, warmup=10)["host_us"]
        lines.append(f"{name:<36} {timed['ms_mean']:8.3f} {timed['ms']:10.3f} {host_step:13.1f} {host_fwd:12.1f}")
        print(lines[-1], flush=True)
    ft._inlined = inlined
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
