"""varlen: packed documents and a sliding window, ours against FlexAttention (and padded cuDNN) in the same run.

Section "packed": a packed batch of --tokens tokens (65,536) of long-tailed, seeded document lengths
(`document_lengths`: --long-docs documents of --longest/2 to --longest tokens, 8k-16k by default, the rest short:
log-normal, median 256, 1 to 4096 tokens), --n-heads heads (16), d 64 and 128, causal within each document, bf16.
  flash_triton   ours: `flash_attention_varlen` on q, k, v (tokens, heads, d), eager (its check of the offsets'
                 values, one host read of cu_seqlens per call, included)
  flex           torch.compile(flex_attention) on (1, heads, tokens, d) with a document-causal block mask built once,
                 outside the timing
  sdpa_cudnn     every document padded to the longest: (documents, heads, longest, d), padded outside the timing,
                 SDPA under sdpa_kernel(CUDNN_ATTENTION), is_causal (padding at the end: causal keeps real rows exact)
Section "window": 1 x heads x --window-seq (65,536) x d 64, causal, bf16, a window of --window keys (4096: query i
sees keys i - 4096 .. i):
  flash_triton, variant window   ours, `flash_attention(q, k, v, is_causal=True, window=(window, -1))`
  flex, variant window           compiled flex_attention with a sliding-window causal block mask built once
  flash_triton, variant causal   ours without a window (the dense causal call)
Modes: fwd, and fwd_bwd (forward, then backward(dO), gradients set to None first), do_bench medians. References run
first at each point; ours then carries ratios to them from the same run: x_flex, x_padded (packed); x_flex,
x_causal and x_band = ms / (causal ms x band_share) (window), where band_share is the share of the causal call's
(128 x 128) tiles that the band meets: x_band 1 means the window costs exactly its share of the dense call's tiles.
TFLOP/s count the useful work only (each document's causal triangle; the band's scores), also for the padded call.
The padded cuDNN call computes every document as long as the longest (tens of times the useful work at these
lengths): seconds per call; leave it out with --impls flash_triton flex.
`--smoke`: tiny fp32 sizes on the CPU, our kernels through the Triton interpreter; Flex runs uncompiled there (its
forward; its backward has no CPU kernel: an 'unsupported' row), cuDNN gives 'unsupported' rows.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from cs336_systems.bench import options, report
from cs336_systems.bench.options import add_sized, nonnegative_int, positive_int
from cs336_systems.bench.report import Output, Row

if TYPE_CHECKING:
    import torch

    from cs336_systems.bench.record import Recorder

NAME = "varlen"
HELP = "packed documents (ours vs Flex document mask vs padded cuDNN) and a sliding window (ours vs Flex vs causal)"
SECTIONS = ("packed", "window")
MODES = ("fwd", "fwd_bwd")
OURS, FLEX, CUDNN = "flash_triton", "flex", "sdpa_cudnn"
IMPLS = (OURS, FLEX, CUDNN)
TILE = 128  # the tile edge band_share counts in
SHORT_MEDIAN, SHORT_SIGMA, SHORT_MAX = 256, 1.5, 4096
FIELDS = {"section": str, "variant": str, "mode": str, "dtype": str, "batch": int, "n_heads": int, "seq_len": int,
          "d_head": int, "is_causal": bool}
OK_FIELDS = {"ms": (int, float)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to measure")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                   help=f"implementations ({CUDNN}: the padded batch, packed section only)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="passes to time")
    add_sized(p, "--d", full=[64, 128], smoke=[16], help="packed section: head dims", type=positive_int, nargs="+")
    add_sized(p, "--window-d", full=64, smoke=16, help="window section: head dim", type=positive_int)
    add_sized(p, "--dtype", full="bf16", smoke="fp32", help="Q/K/V dtype", choices=options.DTYPE_NAMES)
    add_sized(p, "--n-heads", full=16, smoke=2, help="heads", type=positive_int)
    add_sized(p, "--tokens", full=65536, smoke=96, help="packed section: tokens in the batch", type=positive_int)
    add_sized(p, "--longest", full=16384, smoke=40, help="packed section: the longest documents' length",
              type=positive_int)
    add_sized(p, "--long-docs", full=3, smoke=2, help="packed section: documents of longest/2 to longest tokens",
              type=nonnegative_int)
    p.add_argument("--seed", type=nonnegative_int, default=0, help="packed section: the lengths' seed")
    add_sized(p, "--window-seq", full=65536, smoke=64, help="window section: sequence length", type=positive_int)
    add_sized(p, "--window", full=4096, smoke=8, help="window section: keys left of each query", type=positive_int)
    options.add_do_bench_args(p)


def check(args: argparse.Namespace) -> None:
    options.check_kernel_head_dims("--d", [*args.d, args.window_d])
    if args.long_docs * (args.longest // 2) > args.tokens:
        raise ValueError(f"--long-docs {args.long_docs} of at least {args.longest // 2} tokens exceed --tokens "
                         f"{args.tokens}")


def largest_inputs(args: argparse.Namespace, device: torch.device) -> tuple[int, str]:
    from cs336_systems.bench.timing import inputs_bytes

    tokens = max(args.tokens if "packed" in args.sections else 0, args.window_seq if "window" in args.sections else 0)
    return inputs_bytes(("q", "k", "v", "dO"), args.dtype, (1, args.n_heads, tokens, max(*args.d, args.window_d)))


def document_lengths(tokens: int, longest: int, long_docs: int, seed: int) -> list[int]:
    """Seeded long-tailed lengths summing to `tokens`: `long_docs` of longest/2 to longest tokens, the rest short
    (log-normal, median SHORT_MEDIAN, SHORT_SIGMA, 1 to min(SHORT_MAX, longest) tokens), in shuffled order."""
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(max(1, longest // 2), longest) for _ in range(long_docs)]
    lengths[-1:] = [min(n, tokens - sum(lengths[:-1])) for n in lengths[-1:]]
    while sum(lengths) < tokens:
        short = int(rng.lognormvariate(math.log(SHORT_MEDIAN), SHORT_SIGMA))
        lengths.append(max(1, min(short, SHORT_MAX, longest, tokens - sum(lengths))))
    rng.shuffle(lengths)
    return lengths


def band_share(n: int, window: int, tile: int = TILE) -> float:
    """The share of a causal n x n call's (tile x tile) tiles (those on or below the diagonal) that the band of
    `window` keys left of each query meets."""
    tiles = -(-n // tile)
    band = sum(min(i, (window + tile - 1) // tile) + 1 for i in range(tiles))
    return band / (tiles * (tiles + 1) / 2)


def causal_flops(mode: str, heads: int, d: int, keys_seen: int) -> float:
    """4·H·D per (query, key) score of the forward, 3.5x for forward+backward (`timing.attention_flops`)."""
    return 4.0 * heads * d * keys_seen * {"fwd": 1.0, "fwd_bwd": 3.5}[mode]


def run(args: argparse.Namespace, rec: Recorder) -> int:
    work = [("packed", d) for d in args.d if "packed" in args.sections]
    work += [("window", args.window_d)] if "window" in args.sections else []
    for section, d in options.progress(work, args, NAME):
        (measure_packed if section == "packed" else measure_window)(d, args, rec)
    return 0


def _timed(rec: Recorder, fields: Row, build, mode: str, flops: float, args: argparse.Namespace,
           ratios: dict[str, tuple[Row | None, float]] | None = None) -> Row:
    """Record one measurement: `build(mode)` gives the call to time (raising Unsupported where it cannot run);
    `ratios`: {field: (a reference's row, factor)}: the field is ms / (that row's ms x factor), None unless that
    row completed."""
    from cs336_systems.bench.timing import bench

    def measure() -> Row:
        result = bench(build(mode), rec.device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
        for field, (ref, factor) in (ratios or {}).items():
            result[field] = result["ms"] / (ref["ms"] * factor) if report.ok(ref) else None
        return result

    return rec.measure(fields, measure, flops=flops)


def _step(attn, tensors: list, dout, mode: str):
    """The timed call: attn() (fwd), or attn().backward(dout) with the tensors' gradients set to None first."""
    if mode == "fwd":
        return attn

    def call():
        for t in tensors:
            t.grad = None
        attn().backward(dout)

    return call


def _flex(device: torch.device):
    """flex_attention: compiled on CUDA, as it is (its reference path) on the CPU."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if device.type == "cuda" else flex_attention


def _flex_call(q, k, v, block_mask, dout, mode: str):
    from cs336_systems.bench.record import Unsupported

    if q.device.type == "cpu":  # (no backward there, and its forward refuses inputs that require gradients)
        if mode == "fwd_bwd":
            raise Unsupported("FlexAttention has no backward on the CPU")
        q, k, v = (t.detach() for t in (q, k, v))
    flex = _flex(q.device)
    return _step(lambda: flex(q, k, v, block_mask=block_mask), [q, k, v], dout, mode)


def measure_packed(d: int, args: argparse.Namespace, rec: Recorder) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    from cs336_systems import flash_attention_varlen
    from cs336_systems.bench.record import Unsupported
    from cs336_systems.bench.timing import torch_dtype

    device, dtype, heads = rec.device, torch_dtype(args.dtype), args.n_heads
    lengths = document_lengths(args.tokens, args.longest, args.long_docs, args.seed)
    longest, tokens = max(lengths), sum(lengths)
    base = dict(section="packed", variant="packed", dtype=args.dtype, batch=len(lengths), n_heads=heads,
                seq_len=tokens, d_head=d, is_causal=True, max_seqlen=longest, long_docs=args.long_docs,
                lengths_seed=args.seed, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    fields = {(impl, mode): {**base, "impl": impl, "mode": mode} for impl in args.impls for mode in args.modes}
    if all(rec.is_done(f) for f in fields.values()):
        return
    gen = torch.Generator(device=device).manual_seed(args.seed + d)
    q, k, v, dout = (torch.randn(tokens, heads, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    seen = sum(n * (n + 1) // 2 for n in lengths)  # each document's causal triangle

    def ours(mode: str):
        return _step(lambda: flash_attention_varlen(q, k, v, cu, cu, longest, longest, is_causal=True),
                     [q, k, v], dout, mode)

    def flex(mode: str):
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        mask = create_block_mask(document_causal, None, None, tokens, tokens, device=device,
                                 _compile=device.type == "cuda")
        q1, k1, v1 = (t.detach().transpose(0, 1)[None].contiguous().requires_grad_() for t in (q, k, v))
        return _flex_call(q1, k1, v1, mask, dout.transpose(0, 1)[None], mode)

    def padded(mode: str):
        if device.type != "cuda":
            raise Unsupported("cuDNN attention needs CUDA")

        def pad(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(len(lengths), heads, longest, d)
            for i, (first, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
                out[i, :, :n] = t[first:first + n].transpose(0, 1)
            return out

        qp, kp, vp = (pad(t.detach()).requires_grad_() for t in (q, k, v))
        dp = pad(dout)

        def attn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)

        return _step(attn, [qp, kp, vp], dp, mode)

    builds = {OURS: ours, FLEX: flex, CUDNN: padded}
    for mode in args.modes:
        done: dict[str, Row | None] = {}
        # the references first; measured again under --resume when ours is measured (its ratios are same-run)
        again = OURS in args.impls and not rec.is_done(fields[OURS, mode])
        for impl in (CUDNN, FLEX, OURS):
            if impl not in args.impls or (rec.is_done(fields[impl, mode]) and not again):
                continue
            ratios = dict(x_flex=(done.get(FLEX), 1.0), x_padded=(done.get(CUDNN), 1.0)) if impl == OURS else None
            done[impl] = _timed(rec, fields[impl, mode], builds[impl], mode, causal_flops(mode, heads, d, seen), args,
                                ratios)


def measure_window(d: int, args: argparse.Namespace, rec: Recorder) -> None:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from cs336_systems import flash_attention
    from cs336_systems.bench.timing import torch_dtype

    device, dtype, heads, n, window = rec.device, torch_dtype(args.dtype), args.n_heads, args.window_seq, args.window
    share = band_share(n, window)
    base = dict(section="window", dtype=args.dtype, batch=1, n_heads=heads, seq_len=n, d_head=d, is_causal=True,
                window=window, band_share=share, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    runs = [(impl, variant) for impl, variant in ((OURS, "causal"), (FLEX, "window"), (OURS, "window"))
            if impl in args.impls]
    fields = {(impl, variant, mode): {**base, "impl": impl, "variant": variant, "mode": mode}
              for impl, variant in runs for mode in args.modes}
    if all(rec.is_done(f) for f in fields.values()):
        return
    gen = torch.Generator(device=device).manual_seed(args.seed + n)
    q, k, v, dout = (torch.randn(1, heads, n, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    seen = sum(min(i + 1, window + 1) for i in range(n))

    def ours(variant: str):
        keywords = dict(window=(window, -1)) if variant == "window" else {}
        return lambda mode: _step(lambda: flash_attention(q, k, v, is_causal=True, **keywords), [q, k, v], dout, mode)

    def flex(mode: str):
        def sliding_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

        mask = create_block_mask(sliding_causal, None, None, n, n, device=device, _compile=device.type == "cuda")
        return _flex_call(q, k, v, mask, dout, mode)

    for mode in args.modes:
        done: dict[str, Row | None] = {}
        # the causal call and Flex first; measured again under --resume when the window is (same-run ratios)
        again = (OURS, "window") in runs and not rec.is_done(fields[OURS, "window", mode])
        for impl, variant in runs:
            key = (impl, variant, mode)
            if rec.is_done(fields[key]) and not again:
                continue
            ratios = None
            if (impl, variant) == (OURS, "window"):
                causal = done.get("causal")
                ratios = dict(x_flex=(done.get(FLEX), 1.0), x_causal=(causal, 1.0), x_band=(causal, share))
            flops = causal_flops(mode, heads, d, n * (n + 1) // 2 if variant == "causal" else seen)
            row = _timed(rec, fields[key], flex if impl == FLEX else ours(variant), mode, flops, args, ratios)
            done[FLEX if impl == FLEX else variant] = row


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _ratio(r: Row | None, field: str) -> str:
    return report.fmt_num(r.get(field)) if report.ok(r) and r.get(field) is not None else "–"


def render(rows: list[Row], out: Output) -> list[str]:
    rows = report.latest(rows)
    sections = []
    packed = [r for r in rows if r["section"] == "packed"]
    for (d, mode), group in report.group_by(packed, ("d_head", "mode")):
        first = group[0]
        body = [[report.impl_label(r["impl"]), report.ms_cell(r), report.field_cell("tflops")(r),
                 _ratio(r, "x_flex"), _ratio(r, "x_padded")] for r in report.sort_rows(group, ("impl",))]
        sections.append(
            f"## Packed documents, d {d}, {first['dtype']}, {'fwd+bwd' if mode == 'fwd_bwd' else mode}\n\n"
            f"{first['batch']} documents, {first['seq_len']} tokens (longest {first.get('max_seqlen')}), "
            f"{first['n_heads']} heads, causal within each document; do_bench medians; TFLOP/s of the useful work; "
            "ratios: ours ms / the reference's ms in the same run\n\n"
            + report.markdown(["implementation", "ms", "TFLOP/s", "/ Flex", "/ padded cuDNN"], body))
    window = [r for r in rows if r["section"] == "window"]
    for (mode,), group in report.group_by(window, ("mode",)):
        first = group[0]
        body = [[f"{report.impl_label(r['impl'])}, {r['variant']}", report.ms_cell(r), report.field_cell("tflops")(r),
                 _ratio(r, "x_flex"), _ratio(r, "x_causal"), _ratio(r, "x_band")]
                for r in report.sort_rows(group, ("impl", "variant"))]
        sections.append(
            f"## Sliding window {first['window']}, 1 × {first['n_heads']} × {first['seq_len']} × d {first['d_head']}, "
            f"causal, {first['dtype']}, {'fwd+bwd' if mode == 'fwd_bwd' else mode}\n\n"
            f"band share of the causal call's {TILE} × {TILE} tiles: {first['band_share']:.4f}; "
            "ms / (causal ms × share) = 1: the window costs exactly its tiles\n\n"
            + report.markdown(["implementation", "ms", "TFLOP/s", "/ Flex", "/ causal", "/ (causal × share)"], body))
    return sections
