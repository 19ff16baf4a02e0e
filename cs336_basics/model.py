"""Transformer LM building blocks (pre-norm, RoPE, SwiGLU), CS336 assignment 1 style."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn

INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

VOCAB_SIZE = 10_000
BATCH_SIZE = 4
CONTEXT_LENGTH = 1024


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int


MODEL_CONFIGS: dict[str, ModelConfig] = {
    "small": ModelConfig(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": ModelConfig(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": ModelConfig(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": ModelConfig(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "2.7B": ModelConfig(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
}


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Numerically stable softmax along `dim`."""
    exp = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return exp / exp.sum(dim=dim, keepdim=True)


def causal_mask(n_queries: int, n_keys: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool (n_queries, n_keys) mask, True where query i may attend to key j (i >= j)."""
    q_idx = torch.arange(n_queries, device=device)[:, None]  # (Nq, 1)
    k_idx = torch.arange(n_keys, device=device)[None, :]  # (1, Nk)
    return q_idx >= k_idx  # (Nq, Nk)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim of the scores that `mask` (bool, broadcastable, True = keep) keeps; a row that keeps
    none gives zeros (and zero gradients), as F.scaled_dot_product_attention's rows do."""
    if mask is None:
        return softmax(scores, dim=-1)
    scores = torch.where(mask, scores, float("-inf"))
    # the row max and sum guarded (row-sized tensors, no extra full-size pass): a row of -inf exponentiates to zeros
    peak = scores.amax(dim=-1, keepdim=True)  # (..., 1)
    exp = torch.exp(scores - torch.where(peak == float("-inf"), 0.0, peak))
    total = exp.sum(dim=-1, keepdim=True)
    return exp / torch.where(total > 0, total, 1.0)


def scaled_dot_product_attention(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Materialized softmax(Q K^T / sqrt(d)) V; `mask` is bool, True = keep (`masked_softmax`: a query that keeps no
    key gets zeros).

    Q: (..., Nq, d), K: (..., Nk, d), V: (..., Nk, dv), mask broadcastable to (..., Nq, Nk).
    Returns (..., Nq, dv).
    """
    d = Q.shape[-1]
    scores = Q @ K.transpose(-2, -1) / math.sqrt(d)  # (..., Nq, Nk)
    probs = masked_softmax(scores, mask)  # (..., Nq, Nk)
    return probs @ V  # (..., Nq, dv)


class Linear(nn.Module):
    """Bias-free linear layer, y = x W^T with W of shape (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        std = math.sqrt(2.0 / (in_features + out_features))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T  # (..., in) -> (..., out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Embedding(nn.Module):
    """Lookup table of shape (num_embeddings, embedding_dim)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # a negative id would index from the end (id -1: the last token's row); asserted on the device, no sync
        torch._assert_async((token_ids >= 0).all(), "token ids must be non-negative")
        return self.weight[token_ids]  # (...) -> (..., embedding_dim)


class RMSNorm(nn.Module):
    """RMS normalization over the last dim, computed in float32 (float64 for float64 inputs) and cast back."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype, dtype = x.dtype, torch.promote_types(x.dtype, torch.float32)
        x = x.to(dtype)  # (..., d_model)
        rms = torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return (x / rms * self.weight.to(dtype)).to(in_dtype)


class RotaryEmbedding(nn.Module):
    """RoPE: rotates each pair (2i, 2i+1) of the last dim by angle pos * theta^(-2i/d_k)."""

    def __init__(self, theta: float, d_k: int, max_seq_len: int, device=None) -> None:
        super().__init__()
        if d_k % 2 != 0:
            raise ValueError(f"RoPE needs an even head dimension, got d_k={d_k}")
        self.d_k = d_k
        self.max_seq_len = max_seq_len
        # float64 tables: float32 angles are off by ~position·2^-24 rad (1e-3 at 16k), which a float64 model would
        # inherit; each call casts to its input's dtype
        inv_freq = theta ** (-torch.arange(0, d_k, 2, device=device, dtype=torch.float64) / d_k)  # (d_k/2,)
        positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)  # (max_seq_len,)
        angles = positions[:, None] * inv_freq[None, :]  # (max_seq_len, d_k/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor) -> torch.Tensor:
        # x: (..., seq, d_k), token_positions: broadcastable to (..., seq)
        cos = self.cos[token_positions].to(x.dtype)  # (..., seq, d_k/2)
        sin = self.sin[token_positions].to(x.dtype)
        x_even, x_odd = x[..., 0::2], x[..., 1::2]  # (..., seq, d_k/2) each
        out_even = x_even * cos - x_odd * sin
        out_odd = x_even * sin + x_odd * cos
        return torch.stack((out_even, out_odd), dim=-1).flatten(-2)  # (..., seq, d_k)


class SwiGLU(nn.Module):
    """Position-wise FFN: w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None) -> None:
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)  # (..., d_ff)
        return self.w2(gate * torch.sigmoid(gate) * self.w3(x))  # (..., d_model)


ATTENTION_IMPLS = ("reference", "flash")


class CausalMultiHeadSelfAttention(nn.Module):
    """Causal MHSA. attention="reference" goes through the module-level `scaled_dot_product_attention`
    (materialized scores, swappable); "flash" through `cs336_systems.flash_attention` (FlashAttention-2
    in Triton, a custom op under torch.compile; the tiled PyTorch version on a CPU)."""

    def __init__(
        self, d_model: int, num_heads: int, rope: RotaryEmbedding | None = None, device=None, dtype=None,
        attention: str = "reference",
    ) -> None:
        super().__init__()
        if num_heads <= 0 or d_model % num_heads != 0:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention {attention!r}; choose from {ATTENTION_IMPLS}")
        self.attention = attention
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_head = d_model // num_heads
        if rope is not None and rope.d_k != self.d_head:
            raise ValueError(f"RoPE d_k={rope.d_k} does not match head dim d_model/num_heads={self.d_head}")
        self.rope = rope
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None,
                documents: PackedDocuments | None = None) -> torch.Tensor:
        # x: (batch, seq, d_model); with `documents` its batch·seq tokens are packed documents
        if documents is not None:
            return self._forward_packed(x, documents)
        seq_len = x.shape[-2]
        q, k, v = (
            rearrange(proj(x), "... s (h d) -> ... h s d", h=self.num_heads)  # (batch, heads, seq, d_head)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.rope is not None:
            if token_positions is None:
                token_positions = torch.arange(seq_len, device=x.device)  # (seq,)
            elif token_positions.ndim > 1:
                token_positions = token_positions.unsqueeze(-2)  # (batch, 1, seq): broadcast over heads
            q = self.rope(q, token_positions)
            k = self.rope(k, token_positions)
        if self.attention == "flash":
            from cs336_systems.flash_triton import flash_attention

            out = flash_attention(q, k, v, is_causal=True)  # (batch, heads, seq, d_head)
        else:
            mask = causal_mask(seq_len, seq_len, device=x.device)  # (seq, seq)
            out = scaled_dot_product_attention(q, k, v, mask=mask)  # (batch, heads, seq, d_head)
        return self.output_proj(rearrange(out, "... h s d -> ... s (h d)"))  # (batch, seq, d_model)

    def _forward_packed(self, x: torch.Tensor, documents: PackedDocuments) -> torch.Tensor:
        """Causal attention within each document of the batch·seq tokens of x, RoPE positions from each document's
        start: `flash_attention_varlen` ("flash"), or a block-diagonal causal mask ("reference")."""
        batch = x.shape[0]
        # (tokens, heads, d_head), the packed layout: views of the projections' outputs and RoPE's new tensors, all
        # contiguous, so the kernels take q, k, v without a copy (the Gluon backward takes only contiguous ones)
        q, k, v = (
            rearrange(proj(x), "b s (h d) -> (b s) h d", h=self.num_heads)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.rope is not None:
            positions = documents.positions[:, None]  # (tokens, 1): one position per token, for every head
            q = self.rope(q, positions)
            k = self.rope(k, positions)
        if self.attention == "flash":
            from cs336_systems.flash_triton import flash_attention_varlen

            cu = documents.cu_seqlens
            out = flash_attention_varlen(q, k, v, cu, cu, documents.max_seqlen, documents.max_seqlen,
                                         is_causal=True)  # (tokens, heads, d_head)
        else:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (heads, tokens, d_head)
            out = scaled_dot_product_attention(q, k, v, mask=documents.mask()).transpose(0, 1)
        out = rearrange(out, "(b s) h d -> b s (h d)", b=batch)
        return self.output_proj(out)  # (batch, seq, d_model)


@dataclass(frozen=True)
class PackedDocuments:
    """Documents packed into the batch·seq tokens of a batch, in order: document i is tokens cu_seqlens[i]:[i + 1]
    (int32 (documents + 1,) offsets, as `flash_attention_varlen` takes them); positions: each token's index within
    its document (RoPE restarts at each document); max_seqlen: the longest document."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions: torch.Tensor

    @classmethod
    def from_offsets(cls, cu_seqlens: torch.Tensor) -> PackedDocuments:
        """From offsets: integers, 1-D, 0 first, non-decreasing (read on the host once, which max_seqlen needs)."""
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in INTEGER_DTYPES:
            raise TypeError(f"cu_seqlens must be a tensor of integers, got "
                            f"{cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be 1-D with at least one offset, got shape {tuple(cu_seqlens.shape)}")
        values = cu_seqlens.tolist()
        if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and not decrease, got {values[:8]}"
                             f"{' ...' if len(values) > 8 else ''}")
        cu_seqlens = cu_seqlens.to(torch.int32)
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=values[-1])
        positions = torch.arange(values[-1], device=cu_seqlens.device) - starts
        return cls(cu_seqlens, max((b - a for a, b in zip(values, values[1:])), default=0), positions)

    @classmethod
    def from_eos(cls, in_indices: torch.Tensor, eos_token_id: int) -> PackedDocuments:
        """The documents of (batch, seq) token ids: each ends after an eos token or at the end of its row."""
        batch, seq_len = in_indices.shape
        ends = (in_indices == eos_token_id)
        ends[:, -1] = True
        stops = ends.flatten().nonzero().flatten() + 1
        zero = torch.zeros(1, dtype=stops.dtype, device=stops.device)
        return cls.from_offsets(torch.cat((zero, stops)))

    def mask(self) -> torch.Tensor:
        """(tokens, tokens) bool: causal within each document (the materialized attention's mask)."""
        total = self.positions.shape[0]
        doc = torch.repeat_interleave(torch.arange(self.cu_seqlens.shape[0] - 1, device=self.positions.device),
                                      self.cu_seqlens[1:] - self.cu_seqlens[:-1], output_size=total)
        return (doc[:, None] == doc[None, :]) & causal_mask(total, total, device=self.positions.device)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + ffn(ln2(x))."""

    def __init__(
        self, d_model: int, num_heads: int, d_ff: int, rope: RotaryEmbedding | None = None, device=None, dtype=None,
        attention: str = "reference",
    ) -> None:
        super().__init__()
        self.ln1 = RMSNorm(d_model, device=device, dtype=dtype)
        self.attn = CausalMultiHeadSelfAttention(d_model, num_heads, rope, device=device, dtype=dtype,
                                                 attention=attention)
        self.ln2 = RMSNorm(d_model, device=device, dtype=dtype)
        self.ffn = SwiGLU(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None,
                documents: PackedDocuments | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), token_positions, documents)  # (batch, seq, d_model)
        return x + self.ffn(self.ln2(x))


class BasicsTransformerLM(nn.Module):
    """Decoder-only Transformer LM: embeddings -> blocks -> RMSNorm -> lm_head."""

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        rope_theta: float = 10000.0,
        device=None,
        dtype=None,
        attention: str = "reference",
    ) -> None:
        super().__init__()
        for name, value in [
            ("vocab_size", vocab_size),
            ("context_length", context_length),
            ("d_model", d_model),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("d_ff", d_ff),
        ]:
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if d_model % num_heads != 0:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        d_head = d_model // num_heads
        if d_head % 2 != 0:
            raise ValueError(f"RoPE needs an even head dim, got d_model/num_heads={d_model}/{num_heads}={d_head}")
        self.vocab_size = vocab_size
        self.context_length = context_length
        rope = RotaryEmbedding(rope_theta, d_head, context_length, device=device)  # shared by all layers
        self.token_embeddings = Embedding(vocab_size, d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, num_heads, d_ff, rope, device=device, dtype=dtype, attention=attention)
            for _ in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model, device=device, dtype=dtype)
        self.lm_head = Linear(d_model, vocab_size, device=device, dtype=dtype)

    @classmethod
    def from_config(
        cls,
        name_or_config: str | ModelConfig,
        vocab_size: int = VOCAB_SIZE,
        context_length: int = CONTEXT_LENGTH,
        rope_theta: float = 10000.0,
        device=None,
        dtype=None,
        attention: str = "reference",
    ) -> BasicsTransformerLM:
        """Build from a `MODEL_CONFIGS` name (e.g. "small") or a `ModelConfig`."""
        if isinstance(name_or_config, str):
            if name_or_config not in MODEL_CONFIGS:
                raise ValueError(f"unknown model size {name_or_config!r}; choose from {list(MODEL_CONFIGS)}")
            config = MODEL_CONFIGS[name_or_config]
        else:
            config = name_or_config
        return cls(
            vocab_size=vocab_size,
            context_length=context_length,
            d_model=config.d_model,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            d_ff=config.d_ff,
            rope_theta=rope_theta,
            device=device,
            dtype=dtype,
            attention=attention,
        )

    def forward(self, in_indices: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                eos_token_id: int | None = None) -> torch.Tensor:
        """in_indices: (batch, seq) int64 -> logits (batch, seq, vocab).

        Packed documents: with `cu_seqlens` (int32 offsets of documents over the batch·seq tokens in order, as
        `flash_attention_varlen` takes them) or `eos_token_id` (a document ends after each eos token and at the end
        of each row), a token attends only to the tokens of its own document before it, and RoPE positions restart
        at each document (`PackedDocuments`): a packed batch computes what its documents would one by one."""
        seq_len = in_indices.shape[-1]
        if seq_len > self.context_length:
            raise ValueError(f"sequence length {seq_len} exceeds context_length={self.context_length}")
        documents = None
        if cu_seqlens is not None and eos_token_id is not None:
            raise ValueError("give cu_seqlens or eos_token_id, not both")
        if cu_seqlens is not None:
            documents = PackedDocuments.from_offsets(cu_seqlens)
        elif eos_token_id is not None:
            documents = PackedDocuments.from_eos(in_indices, eos_token_id)
        if documents is not None and documents.positions.shape[0] != in_indices.numel():
            raise ValueError(f"cu_seqlens cover {documents.positions.shape[0]} tokens, the batch has {in_indices.numel()}")
        positions = torch.arange(seq_len, device=in_indices.device)  # (seq,)
        x = self.token_embeddings(in_indices)  # (batch, seq, d_model)
        for layer in self.layers:
            x = layer(x, positions, documents)
        return self.lm_head(self.ln_final(x))  # (batch, seq, vocab)
