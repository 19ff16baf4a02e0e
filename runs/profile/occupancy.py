"""Do two resident programs per SM overlap? A diagnostic of our kernels, not a benchmark.

Each pass runs its shipped config (autotuner off) on a non-causal problem whose programs all have the
same length, with exactly 132 × H programs (H = heads): one per SM at H = 1, two at H = 2 (what the
registers allow at 255 per thread and 4 warps), two waves of two at H = 4. If the two programs of
an SM overlapped perfectly (one's wgmmas under the other's exponentials), H = 2 would take as long as
H = 1; if they did not overlap at all, twice as long. Per kernel (torch.profiler, mean of 10 calls):
µs, and ns per (SM, inner iteration): the kernel time over the iterations one SM runs.
(The output of 2b93f7b had a column of SM clocks per iteration at the clock read before the run,
which was the idle clock, 345 MHz: a wrong scale. Its µs are right.)

    python3 runs/profile/occupancy.py --out $OUT/occupancy.txt
"""

from __future__ import annotations

import argparse

import torch
import triton

from cs336_systems import flash_triton as ft
from cs336_systems.bench.timing import kernel_times_us

SMS = 132
TILE = 128  # the programs' tile along the parallel axis: kv K_TILE_SIZE, dq and fwd Q_TILE_SIZE (shipped)
# per pass: its kernel's name and the tile its programs iterate over (the other one tiles the grid)
PASSES = {"fwd": ("flash_fwd_kernel", "K_TILE_SIZE"), "kv": ("flash_bwd_kv_kernel", "Q_TILE_SIZE"),
          "dq": ("flash_bwd_dq_kernel", "K_TILE_SIZE")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--inner", type=int, default=4096, help="length of the other axis (iterated inside a program)")
    args = ap.parse_args()
    shipped = {"fwd": ft.FWD_CONFIGS[0], "kv": ft.KV_CONFIGS[0], "dq": ft.DQ_CONFIGS[0]}
    opts = ft.KernelOptions(autotune=False, configs=tuple(
        (kind, (c.kwargs["Q_TILE_SIZE"], c.kwargs["K_TILE_SIZE"], c.num_warps, c.num_stages))
        for kind, c in shipped.items()))
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
             f"configs {dict(opts.configs)}"]
    lines.append(f"{'kernel':<22} {'heads':>5} {'programs':>8} {'µs':>9} {'ns/SM-iter':>10}")
    for heads in (1, 2, 4):
        wide = SMS * TILE
        # kv programs tile the keys: (Nq, Nk) = (inner, wide); dq and fwd programs tile the queries
        for nq, nk, kinds in ((args.inner, wide, ("kv",)), (wide, args.inner, ("fwd", "dq"))):
            q = torch.randn(1, heads, nq, 64, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, heads, nk, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            do = torch.randn_like(q)
            o, lse = ft.flash_forward_triton(q, k, v, False, opts)

            def call():
                ft.flash_forward_triton(q, k, v, False, opts)
                ft.flash_backward_triton(q, k, v, o, lse, do, False, opts)

            call()
            times = kernel_times_us(call)
            for kind in kinds:
                name, inner_tile = PASSES[kind]
                us = next(t for key, t in times.items() if key.startswith(name))
                iters = args.inner // shipped[kind].kwargs[inner_tile]
                ns = 1e3 * us / (iters * heads)  # 132 * heads programs over 132 SMs
                lines.append(f"{name:<22} {heads:>5} {SMS * heads:>8} {us:9.1f} {ns:10.1f}")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
