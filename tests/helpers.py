"""Shared test helpers: the attention tests' float64 reference, inputs and error checks; the toy model
of the distributed tests."""

from __future__ import annotations

import torch
from torch import nn

from cs336_basics.model import causal_mask, scaled_dot_product_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton's interpreter


def reference_attention(q, k, v, is_causal=False):
    """The materialized reference (cs336_basics) and its logsumexp, masked scores at -1e6."""
    mask = causal_mask(q.shape[-2], k.shape[-2], device=q.device) if is_causal else None
    o = scaled_dot_product_attention(q, k, v, mask=mask)
    s = q.to(torch.promote_types(q.dtype, torch.float32))  # -1e6 overflows fp16
    s = s @ k.to(s.dtype).transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        s = torch.where(mask, s, -1e6)
    return o, torch.logsumexp(s, dim=-1)


def band_mask(n_q, n_k, window, is_causal=False, device=None):
    """(n_q, n_k) bool: True where query i sees key j under window (left, right) (-1: unbounded), i - left <= j <=
    i + right, and with is_causal also j <= i (top-left aligned)."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    left, right = window
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    if is_causal:
        keep &= j <= i
    return keep


def band_reference(q, k, v, is_causal, window):
    """Attention materialized in q's dtype with an explicit band mask (scores -inf outside it); a row whose window
    holds no key gives 0 (SDPA would give NaN). k, v with fewer heads than q are repeated (GQA)."""
    if q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s.masked_fill(~band_mask(q.shape[-2], k.shape[-2], window, is_causal, q.device), float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def randn_cuda(*shape, seed, dtype=torch.bfloat16):
    """A standard-normal CUDA tensor of `shape`, drawn in fp32 from its own generator and cast."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float32).to(dtype)


def make_inputs(shape, dtype, device, scale=1.0, seed=0):
    """q, k, v, dO for (batch, Nq, Nk, D), drawn in float64 and cast."""
    gen = torch.Generator().manual_seed(seed)
    b, nq, nk, d = shape
    q = torch.randn(b, nq, d, generator=gen, dtype=torch.float64) * scale
    k = torch.randn(b, nk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, nk, d, generator=gen, dtype=torch.float64)
    do = torch.randn(b, nq, d, generator=gen, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, do)]


def grads_of(fn, q, k, v, do):
    """fn(q, k, v) and dQ, dK, dV for dO (leaf copies of q, k, v; zeros for an input the output does not reach)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do, allow_unused=True)
    return [o.detach()] + [torch.zeros_like(t) if g is None else g for t, g in zip((q, k, v), grads)]


def run(fn, q, k, v, do, *args):
    """Output and grads of fn(q, k, v, *args) on leaf copies of q, k, v (`grads_of`)."""
    return tuple(grads_of(lambda q, k, v: fn(q, k, v, *args), q, k, v, do))


def max_err(x, ref):
    return (x.double() - ref.double()).abs().max().item()


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def run_by_kv_heads(fn, q, k, v, do, *args):
    """`run` one kv head (with its query heads) at a time, outputs and grads joined along the heads: the same
    results, a kv head's share of the memory (a float64 reference over long sequences needs tens of GB at once)."""
    group = q.shape[1] // k.shape[1]
    parts = [run(fn, q[:, h * group:(h + 1) * group], k[:, h:h + 1], v[:, h:h + 1], do[:, h * group:(h + 1) * group],
                 *args) for h in range(k.shape[1])]
    return tuple(torch.cat(x, dim=1) for x in zip(*parts))


def check_against_float64(ours, q, k, v, do, is_causal, rule, reference=None, by_kv_heads=False):
    """ours = (o, dq, dk, dv) computed in q's dtype; compare with float64 per the dtype's rule.

    rule: ("abs", bound) on the max error, ("rel", bound) on the relative Frobenius error, or
    ("x_torch", factor): at most factor x the error of the reference computed in q's dtype.
    by_kv_heads: the references run a kv head at a time (`run_by_kv_heads`; (B, H, N, D) tensors).
    """
    reference = reference or (lambda *a: reference_attention(*a)[0])
    runner = run_by_kv_heads if by_kv_heads else run
    exact = runner(reference, *(t.double() for t in (q, k, v, do)), is_causal)
    torch_same_dtype = runner(reference, q, k, v, do, is_causal)
    kind, bound = rule
    for name, x, ref, base in zip(("O", "dQ", "dK", "dV"), ours, exact, torch_same_dtype):
        assert torch.isfinite(x).all(), f"{name} has non-finite values"
        if kind == "abs":
            err = max_err(x, ref)
            assert err <= bound, f"{name}: max |ours - fp64| = {err:.3g} > {bound:g}"
        elif kind == "rel":
            err = rel_err(x, ref)
            assert err <= bound, f"{name}: relative error vs fp64 {err:.3g} > {bound:g}"
        else:
            err, base_err = max_err(x, ref), max_err(base, ref)
            assert err <= bound * base_err + 1e-5, (
                f"{name}: max |ours - fp64| = {err:.3g} > {bound:g} x PyTorch {q.dtype} error {base_err:.3g}")


class ToyModel(nn.Module):
    """Linear layers with biases, a LayerNorm and a frozen parameter; with `extras` also an unused
    parameter and a buffer (what a DDP wrapper must skip or broadcast)."""

    def __init__(self, out_features: int = 8, extras: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, out_features, bias=False)
        self.frozen = nn.Parameter(torch.randn(out_features), requires_grad=False)
        if extras:
            self.unused = nn.Linear(3, 3)  # trainable, never in the graph: its grad stays None
        self.register_buffer("scale", torch.rand(out_features) + 0.5 if extras else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(self.norm(torch.relu(self.fc1(x))))
        if self.scale is not None:
            out = out * self.scale
        return out + self.frozen

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()
