"""leaderboard: the course's FlashAttention-2 timing harness, over our variants and PyTorch SDPA.

Exactly the course's test, per implementation:
    q, k, v = torch.randn(3, 16, 16384, 64, device='cuda', dtype=torch.bfloat16, requires_grad=True)
    flash = torch.compile(Impl.apply)
    def f(): o = flash(q, k, v, True); o.sum().backward()
    triton.testing.do_bench(f, rep=10000, warmup=1000)
The harness prints do_bench's mean, recorded as `ms_mean`; `ms` is the median of the same samples.
Mode fwd_bwd is the harness; mode fwd times `flash(q, k, v, True)` alone. The same harness (not
compiled) runs SDPA's flash and cuDNN backends on the (1, 16, 16384, 64) view of the same tensors,
and the ratios ours/theirs are printed at the end.
Variants: the keys of `cs336_systems.flash_ablation.ABLATION_VARIANTS` (rows: impl=flash_triton), plus
"naive" (materialized reference) and "flash_pytorch" (tiled PyTorch forward; run uncompiled, since
dynamo would unroll its Python tile loops), or "all". CPU smoke runs call our Triton variants uncompiled
too (dynamo cannot trace Triton-interpreter kernels); every row records `compiled`.
"""

from __future__ import annotations

import argparse

import torch

from cs336_systems.bench.record import (
    DTYPES,
    Recorder,
    add_compile_backend_arg,
    attention_flops,
    default_compile_backend,
    dtype_from_name,
    progress,
    summarize_ms,
    time_calls,
)

NAME = "leaderboard"
HELP = "the course's leaderboard harness (B=1, H=16, S=16384, D=64, bf16, causal) over variants and SDPA"
MODES = ("fwd_bwd", "fwd")
EXTRA_VARIANTS = ("naive", "flash_pytorch")
SDPA_REFERENCES = ("sdpa_flash", "sdpa_cudnn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--variant",
        action="append",
        default=None,
        help="ABLATION_VARIANTS key, naive, flash_pytorch, or all (repeatable; default the final variant)",
    )
    p.add_argument("--no-sdpa", action="store_true", help="skip the SDPA flash / cuDNN reference rows")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="harness (fwd_bwd) and forward only")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench rep (default 10000, the course's)")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warmup (default 1000, the course's)")
    p.add_argument("--n-heads", type=int, default=None, help="default 16")
    p.add_argument("--seq", type=int, default=None, help="default 16384")
    p.add_argument("--d", type=int, default=None, help="default 64")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 (fp32 in CPU smoke runs)")
    add_compile_backend_arg(p)


def resolve_variants(requested: list[str] | None, available: list[str]) -> list[str]:
    """Variant names in a stable order; the default is the final (shipped) ablation variant."""
    choices = [*available, *EXTRA_VARIANTS]
    if not requested:
        return [available[-1]]
    if "all" in requested:
        return choices
    unknown = [v for v in requested if v not in choices]
    if unknown:
        raise SystemExit(f"leaderboard: unknown variant(s) {unknown}; choose from {choices} or 'all'")
    return list(dict.fromkeys(requested))


def harness_bench(fn, device: torch.device, warmup_ms: float, rep_ms: float) -> dict[str, float]:
    """do_bench(fn, rep, warmup) as the course calls it (no grad_to_none), keeping every sample."""
    if device.type != "cuda":
        return time_calls(fn, device, iters=1, warmup=1)
    import triton.testing

    return summarize_ms(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"))


def run(args: argparse.Namespace, rec: Recorder) -> int:
    from cs336_systems.flash_ablation import ABLATION_VARIANTS

    device = rec.device
    smoke_cpu = device.type != "cuda"
    n_heads = args.n_heads or (2 if args.smoke else 16)
    seq = args.seq or (64 if args.smoke else 16384)
    d = args.d or (16 if args.smoke else 64)
    dtype_name = args.dtype or ("fp32" if smoke_cpu else "bf16")
    rep_ms = args.rep_ms if args.rep_ms is not None else (100 if args.smoke else 10000)
    warmup_ms = args.warmup_ms if args.warmup_ms is not None else (25 if args.smoke else 1000)
    backend = default_compile_backend(args, device)
    dtype = dtype_from_name(dtype_name)

    variants = resolve_variants(args.variant, list(ABLATION_VARIANTS))
    entries = [(v, "flash_triton" if v in ABLATION_VARIANTS else v) for v in variants]
    if not args.no_sdpa:
        entries += [(ref, ref) for ref in SDPA_REFERENCES]

    combos = [(variant, impl, mode) for variant, impl in entries for mode in args.modes]
    rows = []
    built: dict[str, object] = {}  # the current variant's callable, compiled once for all its modes

    def harness_fn(variant: str, impl: str, compiled: bool):
        if variant not in built:
            built.clear()
            built[variant] = attention_fn(variant, impl, compiled, seq, dtype_name, device, backend)
        return built[variant]

    for variant, impl, mode in progress(combos, args, NAME):
        # Dynamo cannot trace Triton-interpreter kernels, so CPU smoke runs call our variants uncompiled.
        compiled = impl == "naive" or (impl == "flash_triton" and not smoke_cpu)
        fields = dict(
            impl=impl, variant=variant, mode=mode, dtype=dtype_name, batch=1, n_heads=n_heads, seq_len=seq,
            d_head=d, is_causal=True, compiled=compiled, rep_ms=rep_ms, warmup_ms=warmup_ms,
            **({"compile_backend": backend} if compiled else {}),
        )
        if rec.is_done(fields):
            continue

        def measure() -> dict[str, float]:
            q, k, v = torch.randn(3, n_heads, seq, d, device=device, dtype=dtype, requires_grad=True)
            fn = harness_fn(variant, impl, compiled)
            if mode == "fwd_bwd":

                def f():
                    o = fn(q, k, v, True)
                    loss = o.sum()
                    loss.backward()

            else:

                def f():
                    fn(q, k, v, True)

            return harness_bench(f, device, warmup_ms, rep_ms)

        flops = attention_flops(mode, 1, n_heads, seq, d, True)
        rows.append(rec.measure(fields, measure, flops=flops))
    print_ratios(rows)
    return 0


def attention_fn(variant: str, impl: str, compiled: bool, seq: int, dtype_name: str, device, backend: str):
    """The callable fn(q, k, v, is_causal) -> o the harness times, on (H, S, D) tensors."""
    from cs336_systems.bench.flash import make_sdpa

    if impl in SDPA_REFERENCES:
        sdpa = make_sdpa(impl, dtype_name, device, is_causal=True)
        return lambda q, k, v, is_causal: sdpa(q[None], k[None], v[None])[0]
    if impl == "naive":
        import cs336_basics.model as basics_model

        mask = basics_model.causal_mask(seq, seq, device=device)

        def apply(q, k, v, is_causal):
            return basics_model.scaled_dot_product_attention(q, k, v, mask=mask if is_causal else None)

    elif impl == "flash_pytorch":
        from cs336_systems.flash_pytorch import FlashAttention2Pytorch

        apply = FlashAttention2Pytorch.apply
    else:
        from cs336_systems.flash_ablation import ABLATION_VARIANTS

        apply = ABLATION_VARIANTS[variant].apply
    if not compiled:
        return apply
    torch._dynamo.reset()
    return torch.compile(apply, backend=backend)


def print_ratios(rows: list[dict]) -> None:
    """Print ms (median), harness mean and ours/theirs ratios of this run's ok rows."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return
    print(f"\n{'variant':<28} {'mode':<8} {'median ms':>10} {'mean ms':>10}  ratios (mean / reference mean)")
    refs = {(r["variant"], r["mode"]): r for r in ok if r["impl"] in SDPA_REFERENCES}
    for r in ok:
        ratios = [
            f"/{ref}={r['ms_mean'] / refs[(ref, r['mode'])]['ms_mean']:.2f}x"
            for ref in SDPA_REFERENCES
            if (ref, r["mode"]) in refs and r["impl"] not in SDPA_REFERENCES
        ]
        print(f"{r['variant']:<28} {r['mode']:<8} {r['ms']:>10.3f} {r['ms_mean']:>10.3f}  {' '.join(ratios)}")
