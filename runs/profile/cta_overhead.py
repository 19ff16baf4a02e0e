"""What each program (CTA) of our Gluon kernels costs beyond its tiles: a diagnostic, not a benchmark (issue 8).

The forward and the keys-on-rows single pass (causal, bf16) timed alone, kernel launches only, at shapes of the same
FLOPs that differ in the number of programs: B·H·N² fixed (16 × 16384², 4 × 32768², 1 × 65536², 64 × 8192² at d 64),
so the tiles are the same in count and in kind (a causal diagonal per program either way) and only the number of
programs, with their prologue (barriers, K/V or Q loads) and epilogue (dK/dV or O stores), changes. A linear fit
of time against programs per SM gives the cost of one program. Rounds interleave the shapes; do_bench medians.

    python3 runs/profile/cta_overhead.py --out $OUT/cta_overhead.txt

With --groups G,T ..., instead: the single pass at 16 × 16384 (d 64 and d 128), 64 × 8192 and 4 × 32768 (d 64) with
its programs run G heads at a time before a last group of T heads (`flash_gluon._grouped_program`), for each
(G, T) that fits the heads, and with the default (`flash_gluon.kv_head_groups`).
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import triton
from triton.testing import do_bench

from cs336_systems import flash_gluon

SHAPES = {64: ((1, 64, 8192), (1, 16, 16384), (1, 4, 32768), (1, 1, 65536)), 128: ((1, 16, 16384), (1, 1, 65536))}


def kernels(b: int, h: int, n: int, d: int):
    """(forward, single pass, programs of each) on random inputs of (b, h, n, d), bf16, causal; the single pass
    takes its programs' head groups (`flash_gluon.kv_pass`'s `groups`; None: its default)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    o = torch.empty_like(q)
    lse = torch.empty(b * h, n, device="cuda", dtype=torch.float32)
    scale = d ** -0.5
    flash_gluon.forward(q, k, v, o, lse, True, scale)
    delta = (o.float() * do.float()).sum(-1).view(b * h, n)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    acc = torch.zeros(b * h, n, d, device="cuda", dtype=torch.float32)
    fb_m, _, fw, _ = flash_gluon.FWD_CONFIGS[d]
    _, bb_n, _, _ = flash_gluon.SINGLE_PASS_KEYS_CONFIGS[d]
    return (lambda: flash_gluon.forward(q, k, v, o, lse, True, scale),
            lambda groups=None: flash_gluon.kv_pass(q, k, v, do, lse, delta, dk, dv, True, scale, dq_acc=acc,
                                                    groups=groups),
            b * h * -(-n // (fb_m * (fw // 4))), b * h * (n // bb_n))


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def head_group_pair(text: str) -> tuple[int, int]:
    """--groups' G,T: two positive integers."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"want G,T (two positive integers), got {text!r}")
    return int(parts[0]), int(parts[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=300, help="do_bench rep, ms")
    ap.add_argument("--groups", nargs="+", type=head_group_pair,
                    help="G,T: head groups to compare (instead of the fit)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; {sms} SMs; "
             f"bf16 causal, kernels alone, do_bench medians (rep {args.rep} ms), {args.rounds} interleaved rounds"]
    if args.groups:
        lines += groups(args.groups, args.rounds, args.rep)
    else:
        lines += programs(args.rounds, args.rep, sms)
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w") as f:
        f.write(text + "\n")


def groups(choices: list[tuple[int, int]], rounds: int, rep: int) -> list[str]:
    """Per shape: single-pass ms per round with each (HEAD_GROUP, TAIL) and the default."""
    lines = []
    for b, h, n, d in ((1, 16, 16384, 64), (1, 64, 8192, 64), (1, 4, 32768, 64), (1, 16, 16384, 128)):
        mine = [None, *(g for g in choices if g[1] <= b * h and (b * h - g[1]) % g[0] == 0)]
        bwd = kernels(b, h, n, d)[1]  # one set of inputs for every choice
        times = {g: [] for g in mine}
        for _ in range(rounds):
            for g in mine:
                times[g].append(do_bench(functools.partial(bwd, g), rep=rep))
        x = torch.empty(b, h, n, d, device="cuda", dtype=torch.bfloat16)
        block_m, block_n = flash_gluon.SINGLE_PASS_KEYS_CONFIGS[d][:2]
        default = flash_gluon.kv_head_groups(x, x, True, block_m, block_n, True)
        lines.append(f"\n{(b, h, n, d)}: single pass ms per round (median), (HEAD_GROUP, TAIL); default {default}")
        for g in mine:
            lines.append(f"  {'default' if g is None else str(g):>8}  {' '.join(f'{t:.4f}' for t in times[g])} "
                         f"({statistics.median(times[g]):.4f})")
        del bwd
        torch.cuda.empty_cache()
    return lines


def programs(rounds: int, rep: int, sms: int) -> list[str]:
    """The fit of time against programs per SM, per head dim."""
    lines = []
    for d, shapes in SHAPES.items():
        built = {s: kernels(*s, d) for s in shapes}
        times = {(s, p): [] for s in shapes for p in ("fwd", "bwd")}
        for _ in range(rounds):
            for s, (fwd, bwd, _, _) in built.items():
                times[(s, "fwd")].append(do_bench(fwd, rep=rep))
                times[(s, "bwd")].append(do_bench(bwd, rep=rep))
        lines.append(f"\nd {d}: shape  programs (fwd, bwd)  fwd ms per round  bwd ms per round")
        for s, (_, _, pf, pb) in built.items():
            f, b = times[(s, "fwd")], times[(s, "bwd")]
            lines.append(f"  {s}  {pf:5d} {pb:5d}  fwd {' '.join(f'{x:.4f}' for x in f)}  "
                         f"bwd {' '.join(f'{x:.4f}' for x in b)}")
        for p, i in (("fwd", 2), ("bwd", 3)):
            xs = [built[s][i] / sms for s in shapes]
            ys = [statistics.median(times[(s, p)]) * 1e3 for s in shapes]
            a, c = fit(xs, ys)
            lines.append(f"  {p}: time ≈ {a:.1f} µs + {c:.2f} µs per program per SM "
                         f"(programs per SM {', '.join(f'{x:.1f}' for x in xs)}; medians µs "
                         f"{', '.join(f'{y:.1f}' for y in ys)})")
        del built
        torch.cuda.empty_cache()
    return lines


if __name__ == "__main__":
    main()
