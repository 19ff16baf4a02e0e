"""FlashAttention-2 in plain PyTorch: tiled forward (Algorithm 1), backward by recomputation.

The forward walks query tiles and, inside, key tiles with an online softmax (fp32 running max m,
denominator l and accumulator), skipping key tiles wholly above the causal diagonal. It saves
exactly one (..., Nq) fp32 tensor, the logsumexp L, beside Q, K, V and O.

The backward is one plain function (equations 13-19 of the handout, D = rowsum(dO * O)), walked
over blocks of queries so that its memory stays O(block × Nk). On CUDA it runs under `torch.compile`
(the handout's deliverable); on the CPU it runs eagerly: Inductor's C++ compile would cost 20-70 s on
the first call and recompile per shape, for a function of a few large matmuls that eager PyTorch
already runs at SDPA's speed. It also serves the Triton op's fallback on a CPU without the
interpreter. Causally hidden scores are excluded exactly (-inf), as SDPA does. The backward is not
itself differentiable (double backward raises).

Both take an optional sliding-window `band` (left, right) as `chooser.band` gives it: query i sees keys
[i - left, i + right]; key tiles outside the band are skipped, those its edges cut are masked, and a row that
sees no key gets O = 0, L = -inf and zero gradients.
"""

from __future__ import annotations

import functools

import torch

from cs336_systems.validation import check_attention_inputs, refuse_double_backward

Q_TILE_SIZE = 64
K_TILE_SIZE = 64


LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453


@functools.lru_cache(maxsize=32)
def _above_diagonal(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """(rows, cols) fp32: -inf where column j > row i, else 0."""
    upper = torch.ones(rows, cols, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(rows, cols, device=device).masked_fill_(upper, float("-inf"))


def _mask_above_diagonal(s: torch.Tensor, q_start: int, k_start: int) -> None:
    """Set to -inf, in place, the scores of s (..., Bq, Bk) (queries from q_start, keys from k_start) whose key is
    past its query: only the columns from q_start on can be, and there the hidden ones form the same triangle
    for every tile, added as a bias (a vectorized add; a masked fill costs several times more on a CPU)."""
    first = max(q_start - k_start, 0)
    if first >= s.shape[-1]:
        return
    diagonal = s[..., first:]
    diagonal.add_(_above_diagonal(diagonal.shape[-2], diagonal.shape[-1], s.device))


def _band_keys(band: tuple[int, int] | None, first: int, last: int, n_k: int) -> tuple[int, int]:
    """[lo, hi): the keys that queries first..last see under the band (all of them without one)."""
    if band is None:
        return 0, n_k
    left, right = band
    return min(max(first - left, 0), n_k), min(max(last + right + 1, 0), n_k)


def _mask_outside_band(s: torch.Tensor, band: tuple[int, int], q_start: int, k_start: int) -> torch.Tensor:
    """s (..., Bq, Bk) (queries from q_start, keys from k_start) with -inf where the key is outside the query's
    window; s itself where the band cuts no score of it."""
    rows, cols = s.shape[-2:]
    left, right = band
    if k_start >= q_start + rows - 1 - left and k_start + cols - 1 <= q_start + right:
        return s
    i = torch.arange(q_start, q_start + rows, device=s.device)[:, None]
    j = torch.arange(k_start, k_start + cols, device=s.device)[None, :]
    return s.masked_fill((j < i - left) | (j > i + right), float("-inf"))


def flash_forward_tiled(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool,
    q_tile: int = Q_TILE_SIZE, k_tile: int = K_TILE_SIZE, scale: float | None = None,
    band: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward. Q (..., Nq, D), K/V (..., Nk, D) -> O (..., Nq, D) in Q's dtype, L (..., Nq) fp32.
    Scores are kept in base 2 (the scale times log2 e folded into the query tile; exp2 is several times cheaper
    than exp on a CPU) and L is converted back to natural log."""
    n_q, d = Q.shape[-2], Q.shape[-1]
    n_k = K.shape[-2]
    qk_scale = (d ** -0.5 if scale is None else scale) * LOG2E
    O = torch.empty(Q.shape, device=Q.device, dtype=Q.dtype)  # contiguous whatever Q's strides, as the op promises
    L = torch.empty(Q.shape[:-1], device=Q.device, dtype=torch.float32)
    for q_start in range(0, n_q, q_tile):
        q = Q[..., q_start:q_start + q_tile, :].float() * qk_scale      # (..., Bq, D)
        bq = q.shape[-2]
        m = torch.full(q.shape[:-1], float("-inf"), device=Q.device)    # (..., Bq) running max, base 2
        l = torch.zeros(q.shape[:-1], device=Q.device)                  # (..., Bq)
        acc = torch.zeros_like(q)                                       # (..., Bq, D)
        k_lo, k_stop = _band_keys(band, q_start, q_start + bq - 1, n_k)
        if is_causal:
            k_stop = min(k_stop, q_start + bq)                          # tiles past the diagonal are skipped
        for k_start in range(k_lo, k_stop, k_tile):
            k = K[..., k_start:k_start + k_tile, :].float()             # (..., Bk, D)
            v = V[..., k_start:k_start + k_tile, :].float()
            s = q @ k.transpose(-1, -2)                                 # (..., Bq, Bk)
            if is_causal:
                _mask_above_diagonal(s, q_start, k_start)
            if band is not None:
                s = _mask_outside_band(s, band, q_start, k_start)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_use = m_new
            if band is not None:  # a row that sees no key yet keeps m = -inf; its exponentials are then 0, not NaN
                m_use = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = s.sub_(m_use[..., None]).exp2_()                        # (..., Bq, Bk), in place of s
            alpha = torch.exp2(m - m_use)
            l = alpha * l + p.sum(dim=-1)
            acc = acc.mul_(alpha[..., None]).add_(p.to(V.dtype).float() @ v)
            m = m_new
        if band is not None:  # a row whose window holds no key: O = 0, L = -inf
            l = l.masked_fill(l == 0, 1.0)
        O[..., q_start:q_start + bq, :] = (acc / l[..., None]).to(Q.dtype)
        L[..., q_start:q_start + bq] = (m + torch.log2(l)) * LN2
    return O, L


# queries per block of the backward (eager, on a CPU): bounds the (rows, Nk) fp32 score blocks it holds; 64 ran
# 1.4x faster than 128 on 2 CPU cores at 1 x 8 x 1024 x 64 (blocks that stay in cache, less causal waste)
BACKWARD_ROWS = 64


def flash_backward(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, O: torch.Tensor, dO: torch.Tensor,
    L: torch.Tensor, is_causal: bool, scale: float | None = None, rows: int | None = BACKWARD_ROWS,
    grad_dtype: torch.dtype | None = None, band: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward by recomputation (handout eqs. 13-19) in fp32, a block of `rows` queries at a time (None: all at
    once, as compiled). Gradients in the inputs' dtypes, or in `grad_dtype` (fp32 for a caller that sums them
    further before rounding). P is recomputed in base 2, as the forward computed it."""
    scale = Q.shape[-1] ** -0.5 if scale is None else scale
    n_q, n_k = Q.shape[-2], K.shape[-2]
    k, v = K.float(), V.float()
    dQ = torch.empty(Q.shape, device=Q.device, dtype=torch.float32)
    dK = torch.zeros(K.shape, device=K.device, dtype=torch.float32)
    dV = torch.zeros(V.shape, device=V.device, dtype=torch.float32)
    blocks = [(0, n_q)] if rows is None else [(start, min(n_q, start + rows)) for start in range(0, n_q, rows)]
    for start, stop in blocks:
        first, keys = _band_keys(band, start, stop - 1, n_k)
        if is_causal:
            keys = min(keys, stop)                                      # keys past the block's last row: hidden
        first = min(first, keys)
        q = Q[..., start:stop, :].float() * scale                       # (the scale folded in: dK takes it too)
        do = dO[..., start:stop, :].float()
        kb, vb = k[..., first:keys, :], v[..., first:keys, :]
        S = (q * LOG2E) @ kb.transpose(-1, -2)                          # (..., rows, keys), base 2
        if is_causal:
            _mask_above_diagonal(S, start, first)
        lse = L[..., start:stop, None]
        if band is not None:  # a row that sees no key has L = -inf: 0 instead, so that its P is 0, not NaN
            S = _mask_outside_band(S, band, start, first)
            lse = lse.masked_fill(lse == float("-inf"), 0.0)
        P = S.sub_(lse * LOG2E).exp2_()
        D = (do * O[..., start:stop, :].float()).sum(dim=-1, keepdim=True)
        dV[..., first:keys, :] += P.transpose(-1, -2) @ do
        dS = (do @ vb.transpose(-1, -2)).sub_(D).mul_(P)
        dQ[..., start:stop, :] = (dS @ kb).mul_(scale)
        dK[..., first:keys, :] += dS.transpose(-1, -2) @ q
    if grad_dtype is not None:
        return dQ.to(grad_dtype), dK.to(grad_dtype), dV.to(grad_dtype)
    return dQ.to(Q.dtype), dK.to(K.dtype), dV.to(V.dtype)


def _whole_backward(Q, K, V, O, dO, L, is_causal, scale=None, grad_dtype=None, band=None):
    return flash_backward(Q, K, V, O, dO, L, is_causal, scale, None, grad_dtype, band)


@functools.cache
def flash_backward_compiled():
    """The whole backward under torch.compile, made at its first use: `torch.compile` imports Dynamo and Inductor,
    seconds that a process running only the kernels, or only the CPU, should not pay at import."""
    return torch.compile(_whole_backward, dynamic=True)


def backward_for(device: torch.device):
    """The backward a device runs: compiled on CUDA, eager elsewhere (see the module)."""
    return flash_backward_compiled() if device.type == "cuda" else flash_backward


class FlashAttention2Pytorch(torch.autograd.Function):
    """FlashAttention-2 with a tiled PyTorch forward and a recomputing backward (compiled on CUDA)."""

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        is_causal = check_attention_inputs(Q, K, V, is_causal)
        O, L = flash_forward_tiled(Q, K, V, is_causal)
        ctx.save_for_backward(L, Q, K, V, O)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO):
        refuse_double_backward("FlashAttention2Pytorch")
        L, Q, K, V, O = ctx.saved_tensors
        dQ, dK, dV = backward_for(Q.device)(Q, K, V, O, dO, L, ctx.is_causal)
        return dQ, dK, dV, None


flash_attention_pytorch = FlashAttention2Pytorch.apply
