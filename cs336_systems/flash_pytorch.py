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
"""

from __future__ import annotations

import torch

from cs336_systems.validation import check_attention_inputs, refuse_double_backward

Q_TILE_SIZE = 64
K_TILE_SIZE = 64


def _causal_keep(q_start: int, n_q: int, k_start: int, n_k: int, device: torch.device) -> torch.Tensor:
    """(n_q, n_k) bool: query q_start+i may see key k_start+j iff q_start+i >= k_start+j."""
    rows = torch.arange(q_start, q_start + n_q, device=device)
    cols = torch.arange(k_start, k_start + n_k, device=device)
    return rows[:, None] >= cols[None, :]


def flash_forward_tiled(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool,
    q_tile: int = Q_TILE_SIZE, k_tile: int = K_TILE_SIZE, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward. Q (..., Nq, D), K/V (..., Nk, D) -> O (..., Nq, D) in Q's dtype, L (..., Nq) fp32."""
    n_q, d = Q.shape[-2], Q.shape[-1]
    n_k = K.shape[-2]
    scale = d ** -0.5 if scale is None else scale
    O = torch.empty(Q.shape, device=Q.device, dtype=Q.dtype)  # contiguous whatever Q's strides, as the op promises
    L = torch.empty(Q.shape[:-1], device=Q.device, dtype=torch.float32)
    for q_start in range(0, n_q, q_tile):
        q = Q[..., q_start:q_start + q_tile, :].float()                 # (..., Bq, D)
        bq = q.shape[-2]
        m = torch.full(q.shape[:-1], float("-inf"), device=Q.device)    # (..., Bq)
        l = torch.zeros(q.shape[:-1], device=Q.device)                  # (..., Bq)
        acc = torch.zeros_like(q)                                       # (..., Bq, D)
        k_stop = min(n_k, q_start + bq) if is_causal else n_k           # tiles past the diagonal are skipped
        for k_start in range(0, k_stop, k_tile):
            k = K[..., k_start:k_start + k_tile, :].float()             # (..., Bk, D)
            v = V[..., k_start:k_start + k_tile, :].float()
            s = q @ k.transpose(-1, -2) * scale                         # (..., Bq, Bk)
            if is_causal and k_start + k.shape[-2] - 1 > q_start:       # tile crosses the diagonal
                keep = _causal_keep(q_start, bq, k_start, k.shape[-2], Q.device)
                s = torch.where(keep, s, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])                         # (..., Bq, Bk)
            alpha = torch.exp(m - m_new)
            l = alpha * l + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p.to(V.dtype).float() @ v
            m = m_new
        O[..., q_start:q_start + bq, :] = (acc / l[..., None]).to(Q.dtype)
        L[..., q_start:q_start + bq] = m + torch.log(l)
    return O, L


BACKWARD_ROWS = 128  # queries per block of the backward: bounds the (rows, Nk) fp32 score blocks it holds


def flash_backward(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, O: torch.Tensor, dO: torch.Tensor,
    L: torch.Tensor, is_causal: bool, scale: float | None = None, rows: int | None = BACKWARD_ROWS,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward by recomputation (handout eqs. 13-19) in fp32, a block of `rows` queries at a time (None: all at
    once, as compiled). Gradients in the inputs' dtypes, or in `grad_dtype` (fp32 for a caller that sums them
    further before rounding)."""
    scale = Q.shape[-1] ** -0.5 if scale is None else scale
    n_q, n_k = Q.shape[-2], K.shape[-2]
    k, v = K.float(), V.float()
    dQ = torch.empty(Q.shape, device=Q.device, dtype=torch.float32)
    dK = torch.zeros(K.shape, device=K.device, dtype=torch.float32)
    dV = torch.zeros(V.shape, device=V.device, dtype=torch.float32)
    blocks = [(0, n_q)] if rows is None else [(start, min(n_q, start + rows)) for start in range(0, n_q, rows)]
    for start, stop in blocks:
        keys = min(n_k, stop) if is_causal else n_k                     # keys past the block's last row: hidden
        q = Q[..., start:stop, :].float()
        do = dO[..., start:stop, :].float()
        kb, vb = k[..., :keys, :], v[..., :keys, :]
        S = q @ kb.transpose(-1, -2) * scale                            # (..., rows, keys)
        if is_causal:
            S = torch.where(_causal_keep(start, stop - start, 0, keys, Q.device), S, float("-inf"))
        P = torch.exp(S - L[..., start:stop, None])
        D = (do * O[..., start:stop, :].float()).sum(dim=-1, keepdim=True)
        dV[..., :keys, :] += P.transpose(-1, -2) @ do
        dS = P * (do @ vb.transpose(-1, -2) - D)
        dQ[..., start:stop, :] = dS @ kb * scale
        dK[..., :keys, :] += dS.transpose(-1, -2) @ q * scale
    if grad_dtype is not None:
        return dQ.to(grad_dtype), dK.to(grad_dtype), dV.to(grad_dtype)
    return dQ.to(Q.dtype), dK.to(K.dtype), dV.to(V.dtype)


def _whole_backward(Q, K, V, O, dO, L, is_causal, scale=None, grad_dtype=None):
    return flash_backward(Q, K, V, O, dO, L, is_causal, scale, None, grad_dtype)


flash_backward_compiled = torch.compile(_whole_backward, dynamic=True)


def backward_for(device: torch.device):
    """The backward a device runs: compiled on CUDA, eager elsewhere (see the module)."""
    return flash_backward_compiled if device.type == "cuda" else flash_backward


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
