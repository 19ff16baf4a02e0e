"""Tests for the assignment-1 building blocks in cs336_basics."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import cs336_basics.model as model_mod
from cs336_basics import (
    MODEL_CONFIGS,
    AdamW,
    BasicsTransformerLM,
    ModelConfig,
    causal_mask,
    clip_gradient,
    cross_entropy,
    scaled_dot_product_attention,
    softmax,
)
from cs336_basics.model import (
    CausalMultiHeadSelfAttention,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
)

TINY = {
    "vocab_size": 32,
    "context_length": 16,
    "d_model": 32,
    "num_layers": 2,
    "num_heads": 4,
    "d_ff": 64,
    "rope_theta": 10000.0,
}


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item()


# ---------------------------------------------------------------- softmax


@pytest.mark.parametrize("scale", [1.0, 1e4])
@pytest.mark.parametrize("dim", [0, -1])
def test_softmax_matches_torch(scale: float, dim: int) -> None:
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * scale
    out = softmax(x, dim=dim)
    ref = torch.softmax(x, dim=dim)
    assert torch.isfinite(out).all(), f"softmax produced non-finite values at scale {scale}"
    assert torch.allclose(out, ref, atol=1e-6), f"softmax off by {max_err(out, ref):.3e} (scale={scale}, dim={dim})"


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize(("n_queries", "n_keys"), [(1, 1), (4, 4), (3, 5), (6, 2)])
def test_causal_mask_semantics(n_queries: int, n_keys: int) -> None:
    mask = causal_mask(n_queries, n_keys)
    assert mask.dtype == torch.bool and mask.shape == (n_queries, n_keys), f"got {mask.dtype} {tuple(mask.shape)}"
    for i in range(n_queries):
        for j in range(n_keys):
            assert mask[i, j].item() == (i >= j), f"mask[{i}, {j}]={mask[i, j].item()}, expected {i >= j}"


@pytest.mark.parametrize(("n_queries", "n_keys"), [(8, 8), (5, 11), (11, 5)])
@pytest.mark.parametrize("d_v", [16, 8])
def test_attention_unmasked_matches_torch(n_queries: int, n_keys: int, d_v: int) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, n_queries, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, n_keys, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, n_keys, d_v, generator=g, dtype=torch.float64)
    out = scaled_dot_product_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 3, n_queries, d_v), f"shape {tuple(out.shape)}"
    assert torch.allclose(out, ref, atol=1e-12), f"unmasked attention off by {max_err(out, ref):.3e}"


@pytest.mark.parametrize("seq_len", [1, 7, 32])
def test_attention_causal_matches_torch(seq_len: int) -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, seq_len, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = scaled_dot_product_attention(q, k, v, mask=causal_mask(seq_len, seq_len))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(out, ref, atol=1e-12), f"causal attention off by {max_err(out, ref):.3e} (seq={seq_len})"


@pytest.mark.parametrize(("n_queries", "n_keys"), [(3, 5), (6, 4)])
def test_attention_rectangular_mask_matches_torch(n_queries: int, n_keys: int) -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, n_queries, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, n_keys, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, n_keys, 8, generator=g, dtype=torch.float64)
    mask = causal_mask(n_queries, n_keys)
    out = scaled_dot_product_attention(q, k, v, mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(out, ref, atol=1e-12), f"rectangular masked attention off by {max_err(out, ref):.3e}"


def test_attention_rows_that_keep_no_key_are_zero_as_torchs() -> None:
    """A mask row of no key: zeros and zero gradients (F.scaled_dot_product_attention's answer), not the mean of V
    that a large finite fill gives; the other rows as before."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = causal_mask(5, 5)
    mask[1] = False  # query 1 keeps no key
    mask[3, :2] = False
    out = scaled_dot_product_attention(q, k, v, mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(out, ref, atol=1e-12), f"masked attention off by {max_err(out, ref):.3e}"
    assert torch.equal(out[..., 1, :], torch.zeros_like(out[..., 1, :]))
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-12), (
            f"d{name} off by {max_err(got, want):.3e}")


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2), (torch.float16, 1e-2)])
def test_attention_low_precision_masked_is_finite(dtype: torch.dtype, atol: float) -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = causal_mask(16, 16)
    out = scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask)
    ref = scaled_dot_product_attention(q, k, v, mask=mask)
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected {dtype}"
    assert torch.isfinite(out).all(), f"{dtype} attention produced non-finite values"
    assert max_err(out, ref) < atol, f"{dtype} attention off by {max_err(out, ref):.3e} (atol {atol})"


# ---------------------------------------------------------------- loss / grad utils


@pytest.mark.parametrize("scale", [1.0, 1e4])
@pytest.mark.parametrize("batch_shape", [(6,), (2, 5)])
def test_cross_entropy_matches_torch(scale: float, batch_shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(*batch_shape, 11, generator=g) * scale
    targets = torch.randint(0, 11, batch_shape, generator=g)
    loss = cross_entropy(logits, targets)
    ref = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    assert torch.isfinite(loss), f"cross_entropy not finite at scale {scale}"
    assert math.isclose(loss.item(), ref.item(), rel_tol=1e-5, abs_tol=1e-5), (
        f"cross_entropy {loss.item():.6f} vs torch {ref.item():.6f} (diff {abs(loss.item() - ref.item()):.3e})"
    )


@pytest.mark.parametrize("max_norm", [1e-2, 1e4])
def test_clip_gradient_matches_torch(max_norm: float) -> None:
    g = torch.Generator().manual_seed(6)
    ours = [torch.nn.Parameter(torch.randn(4, 3, generator=g)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=g)
        b.grad = a.grad.clone()
    clip_gradient(ours, max_norm)
    torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), f"clipped grads off by {max_err(a.grad, b.grad):.3e}"


# ---------------------------------------------------------------- optimizer


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95)])
def test_adamw_matches_torch(weight_decay: float, betas: tuple[float, float]) -> None:
    torch.manual_seed(7)
    ours = torch.nn.Linear(5, 3, dtype=torch.float64)
    theirs = torch.nn.Linear(5, 3, dtype=torch.float64)
    theirs.load_state_dict(ours.state_dict())
    hp = {"lr": 1e-2, "betas": betas, "eps": 1e-8, "weight_decay": weight_decay}
    opt_ours, opt_theirs = AdamW(ours.parameters(), **hp), torch.optim.AdamW(theirs.parameters(), **hp)
    x = torch.randn(8, 5, dtype=torch.float64)
    for step in range(10):
        for m, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            (m(x) ** 2).sum().backward()
            opt.step()
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.allclose(a, b, rtol=0, atol=1e-12), f"step {step}: {name} off by {max_err(a, b):.3e}"


@pytest.mark.parametrize(
    "kwargs", [{"lr": -1.0}, {"betas": (1.0, 0.999)}, {"betas": (0.9, -0.1)}, {"eps": -1e-8}, {"weight_decay": -1},
               {"lr": math.nan}, {"eps": math.nan}, {"weight_decay": math.nan}, {"betas": (math.nan, 0.9)}]
)
def test_adamw_rejects_bad_hyperparameters(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        AdamW([torch.nn.Parameter(torch.zeros(1))], **kwargs)


def test_adamw_complex_parameters_and_a_torch_state_match_torch() -> None:
    """Complex parameters step per real component (|g|², as torch); a state loaded from torch.optim.AdamW (its
    `step` a float32 tensor) continues exactly as torch's own."""
    torch.manual_seed(3)
    start = torch.randn(4, dtype=torch.complex128)
    ours, theirs = (torch.nn.Parameter(start.clone()) for _ in range(2))
    opt_ours, opt_theirs = AdamW([ours], lr=0.1), torch.optim.AdamW([theirs], lr=0.1)
    for step in range(6):
        if step == 3:  # hand torch's state to ours half way
            opt_ours.load_state_dict(copy.deepcopy(opt_theirs.state_dict()))  # (a loaded state shares tensors)
            ours.data.copy_(theirs.data)
        for p, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            (p * torch.tensor(1.5 - 2j)).abs().square().sum().backward()
            opt.step()
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-12), max_err(ours, theirs)


def test_clip_gradient_rejects_nan() -> None:
    with pytest.raises(ValueError, match="max_l2_norm"):
        clip_gradient([torch.nn.Parameter(torch.zeros(1))], math.nan)


# ---------------------------------------------------------------- layers


def test_linear_and_embedding_init() -> None:
    torch.manual_seed(8)
    lin = Linear(256, 128)
    std = math.sqrt(2 / (256 + 128))
    assert lin.weight.shape == (128, 256), f"Linear weight shape {tuple(lin.weight.shape)}, expected (out, in)"
    assert lin.weight.abs().max() <= 3 * std + 1e-6, f"Linear init exceeds 3 std: {lin.weight.abs().max():.4f}"
    assert abs(lin.weight.std().item() - std) < 0.1 * std, f"Linear init std {lin.weight.std():.4f}, want ~{std:.4f}"
    assert lin(torch.randn(2, 3, 256)).shape == (2, 3, 128)
    emb = Embedding(10, 4)
    ids = torch.tensor([[1, 9], [0, 1]])
    assert torch.equal(emb(ids), emb.weight[ids]), "Embedding lookup does not index rows of the weight"
    assert emb.weight.abs().max() <= 3.0, f"Embedding init exceeds 3: {emb.weight.abs().max():.4f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_normalizes_and_keeps_dtype(dtype: torch.dtype) -> None:
    norm = RMSNorm(64)
    x = (torch.randn(3, 5, 64) * 7).to(dtype)
    out = norm(x)
    assert out.dtype == dtype and out.shape == x.shape, f"got {out.dtype} {tuple(out.shape)}"
    rms = out.float().pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-2), f"output RMS off from 1 by {max_err(rms, 1.0):.3e}"


def test_rmsnorm_keeps_float64_precision() -> None:
    """A float64 model's RMSNorm is float64-accurate (a float64 cross-check has no float32 floor)."""
    x = torch.randn(3, 5, 64, dtype=torch.float64) * 7
    exact = x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    assert max_err(RMSNorm(64, dtype=torch.float64)(x), exact) <= 1e-14


def test_embedding_refuses_negative_token_ids() -> None:
    """Token -1 must not read the last row (PyTorch indexing counts from the end)."""
    embedding = Embedding(10, 4)
    assert torch.equal(embedding(torch.tensor([0, 9])), embedding.weight[[0, 9]])
    with pytest.raises(RuntimeError, match="non-negative"):
        embedding(torch.tensor([3, -1]))


def test_swiglu_matches_formula() -> None:
    ffn = SwiGLU(16, 48)
    x = torch.randn(2, 5, 16)
    out = ffn(x)
    ref = (F.silu(x @ ffn.w1.weight.T) * (x @ ffn.w3.weight.T)) @ ffn.w2.weight.T
    assert out.shape == (2, 5, 16), f"shape {tuple(out.shape)}"
    assert torch.allclose(out, ref, atol=1e-6), f"SwiGLU off by {max_err(out, ref):.3e}"


@pytest.mark.parametrize("d_k", [2, 16])
def test_rope_properties(d_k: int) -> None:
    rope = RotaryEmbedding(theta=10000.0, d_k=d_k, max_seq_len=32)
    x = torch.randn(3, 8, d_k, dtype=torch.float64)
    positions = torch.arange(8)
    out = rope(x, positions)
    assert out.shape == x.shape, f"shape {tuple(out.shape)}"
    norm_err = max_err(out.norm(dim=-1), x.norm(dim=-1))
    assert norm_err < 1e-5, f"RoPE changed vector norms by up to {norm_err:.3e}"
    assert torch.allclose(out[:, 0], x[:, 0]), f"position 0 is not identity (off by {max_err(out[:, 0], x[:, 0]):.3e})"
    # dot products depend only on the relative offset: <R_m q, R_n k> == <R_{m+s} q, R_{n+s} k>
    q, k = torch.randn(2, d_k, dtype=torch.float64)
    a = rope(q[None], torch.tensor([5])) @ rope(k[None], torch.tensor([2])).T
    b = rope(q[None], torch.tensor([20])) @ rope(k[None], torch.tensor([17])).T
    assert torch.allclose(a, b, atol=1e-5), f"RoPE not relative: {a.item():.6f} vs {b.item():.6f}"


def test_rope_rotates_adjacent_pairs() -> None:
    rope = RotaryEmbedding(theta=10000.0, d_k=4, max_seq_len=8)
    x = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    out = rope(x, torch.tensor([3]))[0]
    expected = torch.tensor([math.cos(3), math.sin(3), math.cos(3e-2), math.sin(3e-2)])
    assert torch.allclose(out, expected, atol=1e-5), f"pair rotation off by {max_err(out, expected):.3e}: {out}"


def test_rope_in_float64_is_exact_at_long_positions() -> None:
    """A float64 call rotates by float64 angles: at position 16,000 float32 tables were off by ~1e-3 rad."""
    rope = RotaryEmbedding(theta=10000.0, d_k=4, max_seq_len=16384)
    x = torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    out = rope(x, torch.tensor([16000]))[0]
    expected = torch.tensor([math.cos(16000), math.sin(16000), math.cos(160.0), math.sin(160.0)], dtype=torch.float64)
    assert max_err(out, expected) < 1e-12, f"off by {max_err(out, expected):.3e}"
    assert rope(x.float(), torch.tensor([16000])).dtype == torch.float32


# ---------------------------------------------------------------- model


def test_model_forward_shape() -> None:
    torch.manual_seed(9)
    model = BasicsTransformerLM(**TINY)
    ids = torch.randint(0, TINY["vocab_size"], (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, TINY["vocab_size"]), f"logits shape {tuple(logits.shape)}"
    assert torch.isfinite(logits).all(), "logits contain non-finite values"


def test_model_is_causal() -> None:
    torch.manual_seed(10)
    model = BasicsTransformerLM(**TINY)
    ids = torch.randint(0, TINY["vocab_size"], (1, 12))
    changed = ids.clone()
    changed[0, 8] = (ids[0, 8] + 1) % TINY["vocab_size"]
    a, b = model(ids), model(changed)
    assert torch.allclose(a[:, :8], b[:, :8]), f"earlier logits changed by {max_err(a[:, :8], b[:, :8]):.3e}"
    assert not torch.allclose(a[:, 8:], b[:, 8:]), "changing a token did not affect its own logits"


def test_training_steps_lower_loss() -> None:
    torch.manual_seed(11)
    model = BasicsTransformerLM(**TINY)
    opt = AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, TINY["vocab_size"], (4, 16))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = cross_entropy(model(inputs), targets)
        loss.backward()
        clip_gradient(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], f"loss only went {losses[0]:.4f} -> {losses[-1]:.4f} in 10 steps"


def test_model_uses_swapped_module_level_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = model_mod.scaled_dot_product_attention

    def counting(q, k, v, mask=None):
        calls.append((q.shape, mask.shape, mask.dtype))
        return original(q, k, v, mask=mask)

    torch.manual_seed(12)
    model = BasicsTransformerLM(**TINY)
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    expected = model(ids)
    monkeypatch.setattr(model_mod, "scaled_dot_product_attention", counting)
    out = model(ids)
    head_dim = TINY["d_model"] // TINY["num_heads"]
    assert len(calls) == TINY["num_layers"], f"swapped attention called {len(calls)}x, want {TINY['num_layers']}"
    assert calls[0] == ((2, TINY["num_heads"], 9, head_dim), (9, 9), torch.bool), f"unexpected call args {calls[0]}"
    assert torch.allclose(out, expected), f"output changed by {max_err(out, expected):.3e} through the wrapper"


def _loss(model, inputs, targets):
    return cross_entropy(model(inputs), targets)


def _train_step(loss_fn, model, opt, inputs, targets):
    opt.zero_grad()
    loss = loss_fn(model, inputs, targets)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_model_flash_attention_compiled_fullgraph_training_step(device: str) -> None:
    """attention="flash": training steps whose forward + loss are compiled with fullgraph=True (no
    graph break at attention; the backward is the compiled graph's) match the reference model's
    (CPU: the kernels through Triton's interpreter; CUDA: the compiled kernels), in loss and in the
    weights after the steps."""
    torch.manual_seed(13)
    ref = BasicsTransformerLM(**TINY).to(device)
    flash = BasicsTransformerLM(**TINY, attention="flash").to(device)
    flash.load_state_dict(ref.state_dict())
    ids = torch.randint(0, TINY["vocab_size"], (2, 17), device=device)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    opts = [AdamW(m.parameters(), lr=1e-3) for m in (ref, flash)]
    torch._dynamo.reset()
    compiled_loss = torch.compile(_loss, fullgraph=True)
    for _ in range(2):
        ref_loss = _train_step(_loss, ref, opts[0], inputs, targets)
        flash_loss = _train_step(compiled_loss, flash, opts[1], inputs, targets)
        assert abs(ref_loss.item() - flash_loss.item()) < 1e-4, (ref_loss.item(), flash_loss.item())
    for (name, a), b in zip(ref.named_parameters(), flash.parameters()):
        assert max_err(a, b) < 1e-4, f"{name} differs by {max_err(a, b):.3g} after two steps"


def test_model_rejects_unknown_attention() -> None:
    with pytest.raises(ValueError, match="attention"):
        BasicsTransformerLM(**TINY, attention="sdpa")


@pytest.mark.parametrize(
    "overrides",
    [
        {"d_model": 30, "num_heads": 4},  # not divisible
        {"d_model": 12, "num_heads": 4},  # odd head dim for RoPE
        {"num_heads": 0},
        {"vocab_size": 0},
        {"context_length": -1},
    ],
)
def test_model_rejects_bad_args(overrides: dict) -> None:
    with pytest.raises(ValueError):
        BasicsTransformerLM(**{**TINY, **overrides})


def test_component_rejects_bad_args() -> None:
    with pytest.raises(ValueError):
        RotaryEmbedding(10000.0, d_k=3, max_seq_len=4)
    with pytest.raises(ValueError):
        CausalMultiHeadSelfAttention(32, 4, rope=RotaryEmbedding(10000.0, d_k=16, max_seq_len=4))
    with pytest.raises(ValueError):
        BasicsTransformerLM.from_config("tiny")


def test_model_rejects_too_long_sequence() -> None:
    model = BasicsTransformerLM(**TINY)
    with pytest.raises(ValueError, match="context_length"):
        model(torch.zeros(1, TINY["context_length"] + 1, dtype=torch.long))


def test_model_configs_are_exact() -> None:
    expected = {
        "small": (768, 3072, 12, 12),
        "medium": (1024, 4096, 24, 16),
        "large": (1280, 5120, 36, 20),
        "xl": (1600, 6400, 48, 25),
        "2.7B": (2560, 10240, 32, 32),
    }
    actual = {name: (c.d_model, c.d_ff, c.num_layers, c.num_heads) for name, c in MODEL_CONFIGS.items()}
    assert actual == expected, f"MODEL_CONFIGS differ: got {actual}"


@pytest.mark.parametrize("name", list(MODEL_CONFIGS))
def test_from_config_builds_named_sizes(name: str) -> None:
    config = MODEL_CONFIGS[name]
    model = BasicsTransformerLM.from_config(name, context_length=64, device="meta")
    assert len(model.layers) == config.num_layers, f"{name}: {len(model.layers)} layers, want {config.num_layers}"
    assert model.lm_head.weight.shape == (10_000, config.d_model), f"{name}: lm_head {model.lm_head.weight.shape}"
    assert model.layers[0].ffn.w1.weight.shape == (config.d_ff, config.d_model), f"{name}: wrong d_ff"


def test_from_config_accepts_model_config() -> None:
    config = ModelConfig(d_model=16, d_ff=32, num_layers=1, num_heads=2)
    model = BasicsTransformerLM.from_config(config, vocab_size=7, context_length=8)
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 7)
