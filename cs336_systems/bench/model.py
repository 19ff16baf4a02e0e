"""benchmarking_script / torch_compile(b): end-to-end BasicsTransformerLM timing and memory.

Random weights and data (vocab 10,000, batch 4). For every model size x context length x attention
impl x {eager, compiled}: `--warmup` untimed steps, then `--steps` timed steps (device synchronized
after each) of each mode:
  fwd      forward + loss
  bwd      backward of the loss only (the forward runs untimed before each step)
  fwd_bwd  forward + loss + backward
  step     forward + loss + backward + AdamW step (zero_grad included)
Rows record mean +- std ms, tokens/s and peak memory (max_memory_allocated since a reset). With
`--attention flash` the model's module-global `scaled_dot_product_attention` is swapped for the
Triton `flash_attention(q, k, v, is_causal=True)`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from cs336_systems.bench.record import (
    Recorder,
    add_compile_backend_arg,
    default_compile_backend,
    progress,
    resolve,
    time_calls,
)

NAME = "model"
HELP = "end-to-end Transformer LM fwd / bwd / fwd_bwd / train-step timing and memory, eager vs compiled"
MODES = ("fwd", "bwd", "fwd_bwd", "step")
SIZES = ("small", "medium", "large", "xl", "2.7B")
ATTENTION_IMPLS = {"naive": "naive", "flash": "flash_triton"}
COMPILE_CHOICES = {"both": (False, True), "eager": (False,), "compiled": (True,)}
SMOKE_SIZE = "smoke"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", nargs="+", choices=[*SIZES, SMOKE_SIZE], default=None, help="model sizes (default all)")
    p.add_argument("--context", type=int, nargs="+", default=None, help="context lengths (default 512)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 4)")
    p.add_argument("--vocab", type=int, default=10_000, help="vocabulary size")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="what one timed step does")
    p.add_argument("--compile", choices=list(COMPILE_CHOICES), default="both", help="eager, compiled, or both")
    p.add_argument(
        "--attention", nargs="+", choices=list(ATTENTION_IMPLS), default=["naive"], help="attention impl(s) used"
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps per mode (default 5)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 10)")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="fp32 weights; bf16 = torch.autocast(bfloat16) around forward and loss",
    )
    add_compile_backend_arg(p)


@contextmanager
def attention_impl(name: str) -> Iterator[None]:
    """Swap `cs336_basics.model.scaled_dot_product_attention` (looked up at call time) for the duration."""
    import cs336_basics.model as basics_model

    original = basics_model.scaled_dot_product_attention
    if name == "flash":
        from cs336_systems.flash_triton import flash_attention

        def flash_sdpa(Q, K, V, mask=None):
            # The model only ever passes its causal mask.
            return flash_attention(Q, K, V, is_causal=mask is not None)

        basics_model.scaled_dot_product_attention = flash_sdpa
    try:
        yield
    finally:
        basics_model.scaled_dot_product_attention = original


def model_config(size: str):
    from cs336_basics.model import MODEL_CONFIGS, ModelConfig

    if size == SMOKE_SIZE:
        return ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=2)
    return MODEL_CONFIGS[size]


def run(args: argparse.Namespace, rec: Recorder) -> int:
    from cs336_basics.model import BasicsTransformerLM
    from cs336_basics.nn_utils import cross_entropy
    from cs336_basics.optimizer import AdamW

    device = rec.device
    sizes = resolve(args, "sizes", list(SIZES), [SMOKE_SIZE])
    contexts = resolve(args, "context", [512], [32])
    batch = resolve(args, "batch", 4, 2)
    warmup = resolve(args, "warmup", 5, 1)
    steps = resolve(args, "steps", 10, 2)
    backend = default_compile_backend(args, device)
    autocast = (
        torch.autocast(device_type=device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext()
    )

    combos = [
        (size, ctx, attn, compiled)
        for size in sizes
        for ctx in contexts
        for attn in args.attention
        for compiled in COMPILE_CHOICES[args.compile]
    ]
    for size, ctx, attn, compiled in progress(combos, args, NAME):
        config = model_config(size)
        fields = {
            mode: dict(
                impl=ATTENTION_IMPLS[attn],
                mode=mode,
                dtype=args.dtype,
                batch=batch,
                n_heads=config.num_heads,
                seq_len=ctx,
                d_head=config.d_model // config.num_heads,
                is_causal=True,
                model_size=size,
                context_length=ctx,
                compiled=compiled,
                warmup_steps=warmup,
                steps=steps,
                d_model=config.d_model,
                num_layers=config.num_layers,
                **({"compile_backend": backend} if compiled else {}),
            )
            for mode in args.modes
        }
        todo = [m for m in args.modes if not rec.is_done(fields[m])]
        if not todo:
            continue
        if compiled and attn == "flash" and device.type != "cuda":
            for mode in todo:
                rec.skip(fields[mode], "unsupported", error="dynamo cannot trace Triton-interpreter kernels (CPU)")
            continue

        state: dict = {}

        def setup() -> dict:
            """Model (+ compile wrapper) and data, built on first use and shared by this combo's modes."""
            if "model" not in state:
                model = BasicsTransformerLM.from_config(
                    config, vocab_size=args.vocab, context_length=ctx, device=device
                )
                if compiled:
                    torch._dynamo.reset()
                    model = torch.compile(model, backend=backend, dynamic=False)
                state.update(
                    model=model,
                    n_params=sum(p.numel() for p in model.parameters()),
                    x=torch.randint(0, args.vocab, (batch, ctx), device=device),
                    y=torch.randint(0, args.vocab, (batch, ctx), device=device),
                )
            return state

        def loss_fn():
            with autocast:
                return cross_entropy(state["model"](state["x"]), state["y"])

        def zero_grad():
            state["model"].zero_grad(set_to_none=True)

        def time_mode(mode: str) -> dict:
            if mode == "fwd":
                return time_calls(loss_fn, device, iters=steps, warmup=warmup)
            if mode == "bwd":

                def forward():
                    zero_grad()
                    state["loss"] = loss_fn()

                return time_calls(lambda: state["loss"].backward(), device, iters=steps, warmup=warmup, before=forward)
            if mode == "fwd_bwd":
                return time_calls(lambda: loss_fn().backward(), device, iters=steps, warmup=warmup, before=zero_grad)
            if "optimizer" not in state:
                state["optimizer"] = AdamW(state["model"].parameters(), lr=1e-4)
            optimizer = state["optimizer"]

            def train_step():
                optimizer.zero_grad(set_to_none=True)
                loss_fn().backward()
                optimizer.step()

            return time_calls(train_step, device, iters=steps, warmup=warmup)

        def measure(mode: str) -> dict:
            setup()
            try:
                stats = time_mode(mode)
            finally:  # drop this mode's graph and grads even after an OOM, before the next mode
                state.pop("loss", None)
                zero_grad()
            return {
                **stats,
                "n_params": state["n_params"],
                "tokens_per_s": batch * ctx / (stats["ms_mean"] * 1e-3),
            }

        with attention_impl(attn):
            for mode in todo:
                rec.measure(fields[mode], lambda: measure(mode))
        state.clear()
    return 0
