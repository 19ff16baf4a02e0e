"""flash_benchmarking: FlashAttention-2 (Triton) vs materialized PyTorch attention, plus SDPA references.

Batch 1, causal, Q/K/V of shape (batch, seq, d). Timed with triton.testing.do_bench (median and
20th/80th percentiles) per mode:
  fwd      o = attn(q, k, v)
  bwd      o.backward(dO, retain_graph=True) on one precomputed output and a random dO
  fwd_bwd  attn(q, k, v).backward(dO)
Impls: naive (the materialized assignment-1 attention), flash_triton (ours), flash_pytorch (ours, tiled
PyTorch; opt-in), naive_compiled (opt-in), and PyTorch SDPA backends as reference rows (sdpa_flash,
sdpa_cudnn, sdpa_efficient; layout (B, H=1, S, D)); a backend that rejects a dtype gets an
"unsupported" row.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from cs336_systems.bench.record import (
    DTYPES,
    Recorder,
    Unsupported,
    add_compile_backend_arg,
    attention_flops,
    bench,
    default_compile_backend,
    dtype_from_name,
    progress,
    resolve,
)

NAME = "flash"
HELP = "FlashAttention-2 Triton vs naive vs SDPA: fwd / bwd / fwd_bwd latency (flash_benchmarking)"
MODES = ("fwd", "bwd", "fwd_bwd")
DEFAULT_IMPLS = ["naive", "flash_triton", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"]
IMPLS = [*DEFAULT_IMPLS, "flash_pytorch", "naive_compiled"]
DEFAULT_SEQ = [2**i for i in range(7, 17)]
DEFAULT_D = [16, 32, 64, 128]
SDPA_BACKENDS = {  # impl -> torch.nn.attention.SDPBackend member
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
}
SDPA_DTYPES = {  # dtypes each SDPA backend accepts on CUDA
    "sdpa_flash": {"bf16", "fp16"},
    "sdpa_cudnn": {"bf16", "fp16"},
    "sdpa_efficient": {"bf16", "fp16", "fp32"},
}
NO_KERNEL_MESSAGES = ("No available kernel", "No viable backend")  # SDPA on CUDA / on CPU

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths (default 128 ... 65536)")
    p.add_argument("--d", type=int, nargs="+", default=None, help=f"head dims (default {DEFAULT_D})")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=None, help="dtypes (default bf16 fp32)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=None, help=f"impls (default {DEFAULT_IMPLS})")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="passes to time")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal masking")
    p.add_argument("--warmup-ms", type=float, default=25, help="do_bench warm-up time (ms)")
    p.add_argument("--rep-ms", type=float, default=100, help="do_bench repetition time (ms)")
    add_compile_backend_arg(p)


def make_attention(
    impl: str, seq_len: int, dtype_name: str, device: torch.device, is_causal: bool, compile_backend: str = "inductor"
) -> Attention:
    """A callable attn(q, k, v) -> o for (..., seq, d) inputs; raises Unsupported for SDPA/dtype mismatches."""
    if impl in ("naive", "naive_compiled"):
        import cs336_basics.model as basics_model

        mask = basics_model.causal_mask(seq_len, seq_len, device=device) if is_causal else None

        def naive(q, k, v):
            return basics_model.scaled_dot_product_attention(q, k, v, mask=mask)

        if impl == "naive":
            return naive
        torch._dynamo.reset()
        return torch.compile(naive, backend=compile_backend, dynamic=False)
    if impl == "flash_triton":
        from cs336_systems.flash_triton import FlashAttention2Triton

        return lambda q, k, v: FlashAttention2Triton.apply(q, k, v, is_causal)
    if impl == "flash_pytorch":
        from cs336_systems.flash_pytorch import FlashAttention2Pytorch

        return lambda q, k, v: FlashAttention2Pytorch.apply(q, k, v, is_causal)
    if impl in SDPA_BACKENDS:
        return make_sdpa(impl, dtype_name, device, is_causal)
    raise ValueError(f"unknown impl {impl!r}")


def make_sdpa(impl: str, dtype_name: str, device: torch.device, is_causal: bool) -> Attention:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type == "cuda" and dtype_name not in SDPA_DTYPES[impl]:
        raise Unsupported(f"{impl} does not support {dtype_name}")
    backend = getattr(SDPBackend, SDPA_BACKENDS[impl])

    def sdpa(q, k, v):
        squeeze = q.ndim == 3  # (B, S, D) -> (B, H=1, S, D)
        if squeeze:
            q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        with sdpa_kernel(backend):
            try:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
            except RuntimeError as e:
                if any(m in str(e) for m in NO_KERNEL_MESSAGES):
                    raise Unsupported(f"{impl}: no kernel for {tuple(q.shape)} {q.dtype} on {q.device}") from e
                raise
        return o.squeeze(1) if squeeze else o

    return sdpa


def measure_mode(
    attn: Attention, mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device: torch.device, args
) -> dict[str, float]:
    timing = dict(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, grad_to_none=[q, k, v])
    if mode == "fwd":
        return bench(lambda: attn(q, k, v), device, **timing)
    dout = torch.randn_like(q)
    if mode == "bwd":
        out = attn(q, k, v)
        return bench(lambda: out.backward(dout, retain_graph=True), device, **timing)
    return bench(lambda: attn(q, k, v).backward(dout), device, **timing)


def run(args: argparse.Namespace, rec: Recorder) -> int:
    device = rec.device
    seqs = resolve(args, "seq", DEFAULT_SEQ, [64])
    dims = resolve(args, "d", DEFAULT_D, [16])
    dtypes = resolve(args, "dtype", ["bf16", "fp32"], ["fp32"])
    impls = resolve(args, "impls", DEFAULT_IMPLS, DEFAULT_IMPLS)
    backend = default_compile_backend(args, device)

    combos = [(dt, d, s, impl) for dt in dtypes for d in dims for s in seqs for impl in impls]
    for dtype_name, d, seq, impl in progress(combos, args, NAME):
        base = dict(
            impl=impl, dtype=dtype_name, batch=args.batch, n_heads=1, seq_len=seq, d_head=d, is_causal=args.causal,
            warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
        )
        if impl == "naive_compiled":
            base["compile_backend"] = backend
        todo = [m for m in args.modes if not rec.is_done({**base, "mode": m})]
        if not todo:
            continue
        state: dict = {}

        def measure(mode: str) -> dict[str, float]:
            if "attn" not in state:
                state["attn"] = make_attention(impl, seq, dtype_name, device, args.causal, backend)
            dtype = dtype_from_name(dtype_name)
            q, k, v = (
                torch.randn(args.batch, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
            )
            return measure_mode(state["attn"], mode, q, k, v, device, args)

        for mode in todo:
            flops = attention_flops(mode, args.batch, 1, seq, d, args.causal)
            rec.measure({**base, "mode": mode}, lambda: measure(mode), flops=flops)
        state.clear()
    return 0
