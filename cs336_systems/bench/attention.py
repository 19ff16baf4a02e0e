"""pytorch_attention / torch_compile(a): naive (materialized) attention, eager and torch.compile'd.

Batch 8, no head dimension: Q, K, V of shape (batch, seq, d). For each (d, seq): time `--iters`
forward passes, then measure memory in use before the backward (one forward's saved activations)
and time `--iters` backward passes (retain_graph on one forward), synchronizing after every call.
"""

from __future__ import annotations

import argparse

import torch

from cs336_systems.bench.record import (
    DTYPES,
    Recorder,
    add_compile_backend_arg,
    allocated_memory_mb,
    attention_flops,
    default_compile_backend,
    dtype_from_name,
    progress,
    reset_peak_memory,
    resolve,
    synchronize,
    time_calls,
)

NAME = "attention"
HELP = "naive attention fwd/bwd latency and memory over d x seq (pytorch_attention, torch_compile a)"
DEFAULT_D = [16, 32, 64, 128]
DEFAULT_SEQ = [256, 1024, 4096, 8192, 16384]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d", type=int, nargs="+", default=None, help=f"head dims (default {DEFAULT_D})")
    p.add_argument("--seq", type=int, nargs="+", default=None, help=f"sequence lengths (default {DEFAULT_SEQ})")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 8)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="Q/K/V dtype")
    p.add_argument("--iters", type=int, default=None, help="timed forward and backward passes each (default 100)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up passes (default 10)")
    p.add_argument("--causal", action="store_true", help="apply a causal mask (default: no mask)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd naive attention (naive_compiled)")
    p.add_argument("--no-eager", action="store_true", help="skip the eager naive impl (e.g. with --compile)")
    add_compile_backend_arg(p)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The assignment-1 materialized attention, looked up at call time (the model module's global)."""
    import cs336_basics.model

    return cs336_basics.model.scaled_dot_product_attention(q, k, v, mask=mask)


def run(args: argparse.Namespace, rec: Recorder) -> int:
    from cs336_basics.model import causal_mask

    device = rec.device
    dims = resolve(args, "d", DEFAULT_D, [16])
    seqs = resolve(args, "seq", DEFAULT_SEQ, [32, 64])
    batch = resolve(args, "batch", 8, 2)
    iters = resolve(args, "iters", 100, 2)
    warmup = resolve(args, "warmup", 10, 1)
    dtype = dtype_from_name(args.dtype)
    backend = default_compile_backend(args, device)
    impls = ([] if args.no_eager else ["naive"]) + (["naive_compiled"] if args.compile else [])
    if not impls:
        print("attention: nothing to run (--no-eager without --compile)")
        return 2

    shapes = [(impl, d, s) for impl in impls for d in dims for s in seqs]
    for impl, d, seq in progress(shapes, args, NAME):
        base = dict(
            impl=impl, dtype=args.dtype, batch=batch, n_heads=1, seq_len=seq, d_head=d, is_causal=args.causal
        )
        fields = {m: {**base, "mode": m, "iters": iters, "warmup_iters": warmup} for m in ("fwd", "bwd")}
        if impl == "naive_compiled":
            for f in fields.values():
                f["compile_backend"] = backend
        todo = [m for m in ("fwd", "bwd") if not rec.is_done(fields[m])]
        if not todo:
            continue

        attn = naive_attention
        if impl == "naive_compiled":
            torch._dynamo.reset()  # fresh static-shape compile per shape; fwd and bwd rows share it
            attn = torch.compile(naive_attention, backend=backend, dynamic=False)

        def inputs():
            q, k, v = (
                torch.randn(batch, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
            )
            mask = causal_mask(seq, seq, device=device) if args.causal else None
            return q, k, v, mask

        def measure_fwd():
            q, k, v, mask = inputs()
            stats = time_calls(lambda: attn(q, k, v, mask), device, iters=iters, warmup=warmup)
            saved = attn(q, k, v, mask)  # one forward whose activations stay alive, as just before a backward
            synchronize(device)
            mem_before_bwd = allocated_memory_mb(device)
            del saved
            return {**stats, "mem_before_bwd_mb": mem_before_bwd}

        def measure_bwd():
            q, k, v, mask = inputs()
            out = attn(q, k, v, mask)
            dout = torch.randn_like(out)
            synchronize(device)
            mem_before_bwd = allocated_memory_mb(device)
            reset_peak_memory(device)

            def drop_grads():
                q.grad = k.grad = v.grad = None

            stats = time_calls(
                lambda: out.backward(dout, retain_graph=True), device, iters=iters, warmup=warmup, before=drop_grads
            )
            return {**stats, "mem_before_bwd_mb": mem_before_bwd}

        for mode, fn in (("fwd", measure_fwd), ("bwd", measure_bwd)):
            if mode in todo:
                flops = attention_flops(mode, batch, 1, seq, d, args.causal)
                rec.measure(fields[mode], fn, flops=flops)
    return 0
