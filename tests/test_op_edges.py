"""The Triton op's edges on the CPU: autocast, torch.compile with strided inputs and symbolic scales, empty and meta
inputs, torch.func transforms.

"interpreter" runs the kernels through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a
GPU); "pytorch" is the fallback of a CPU without the interpreter (`launch.INTERPRET` patched to False).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import cs336_systems.flash.launch as launch
from cs336_systems.flash_triton import FlashAttention2Triton, flash_attention, flash_attn_bwd, flash_attn_fwd

from .helpers import reference_attention, rel_err, run


@pytest.fixture(params=["interpreter", "pytorch"])
def cpu_path(request, monkeypatch):
    """Each way the op runs CPU tensors."""
    if request.param == "interpreter" and not launch.INTERPRET:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET is set only without a GPU)")
    if request.param == "pytorch":
        monkeypatch.setattr(launch, "INTERPRET", False)
    return request.param


@pytest.fixture
def pytorch_path(monkeypatch):
    """The CPU fallback alone (torch.compile cannot trace Triton kernels under the interpreter)."""
    monkeypatch.setattr(launch, "INTERPRET", False)


def _inputs(seed: int) -> list[torch.Tensor]:
    """q, k, v, dO of (batch 1, 2 heads, 24 positions, d 16)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, 24, 16, generator=gen) for _ in range(4)]


# ---------------------------------------------------------------------------------------------------------------
# Autocast
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_follows_autocast_as_sdpa_does(cpu_path, dtype):
    """Under autocast q, k, v are cast to its dtype, as SDPA's are: the output is in that dtype and is what the op
    computes from the cast inputs; fp32 inputs get fp32 gradients, those of the cast run."""
    q, k, v, do = _inputs(seed=1)
    with torch.autocast("cpu", dtype=dtype):
        ours = run(flash_attention, q, k, v, do.to(dtype), True)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert ours[0].dtype == sdpa.dtype == dtype
    cast = run(flash_attention, *(t.to(dtype) for t in (q, k, v, do)), True)
    for name, x, y in zip(("O", "dQ", "dK", "dV"), ours, cast):
        assert x.dtype == (dtype if name == "O" else torch.float32), f"{name} in {x.dtype}"
        assert torch.equal(x, y.to(x.dtype)), f"{name} differs from the op on inputs cast to {dtype}"


def test_op_backward_under_autocast_computes_as_outside_it(cpu_path):
    """A backward run inside the autocast region (allowed, if not advised) gives the gradients of one run outside:
    the recomputing backward's fp32 math is not lowered by autocast."""
    q, k, v, do = _inputs(seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = run(flash_attention, q, k, v, do.bfloat16(), True)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = flash_attention(q, k, v, True)
    o.backward(do.bfloat16())
    for name, x, y in zip(("dQ", "dK", "dV"), inside[1:], (q.grad, k.grad, v.grad)):
        assert torch.equal(x, y), f"{name} differs when the backward runs under autocast"


def test_op_ops_follow_autocast(cpu_path):
    """The ops called directly: the forward casts q, k, v to the autocast dtype; neither lets autocast lower the
    computation inside."""
    q, k, v, do = _inputs(seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, lse = flash_attn_fwd(q, k, v, True, 0.25)
    bf = [t.bfloat16() for t in (q, k, v, do)]
    o_ref, lse_ref = flash_attn_fwd(*bf[:3], True, 0.25)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads = flash_attn_bwd(bf[3], *bf[:3], o, lse, True, 0.25, True)
    for name, x, y in zip(("dQ", "dK", "dV"), grads, flash_attn_bwd(bf[3], *bf[:3], o, lse, True, 0.25, True)):
        assert torch.equal(x, y), f"{name} differs under autocast"


def test_op_compiled_follows_autocast(pytorch_path):
    """torch.compile traces the autocast cast: a compiled call under autocast returns what the eager one does."""
    q, k, v, do = _inputs(seed=4)
    torch._dynamo.reset()
    compiled = torch.compile(flash_attention, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = run(flash_attention, q, k, v, do.bfloat16(), True)
        traced = run(compiled, q, k, v, do.bfloat16(), True)
    assert traced[0].dtype == torch.bfloat16
    for name, x, y in zip(("O", "dQ", "dK", "dV"), eager, traced):
        assert torch.equal(x, y), f"{name}: compiled differs from eager under autocast"


@pytest.mark.gpu
def test_op_follows_cuda_autocast():
    q, k, v, _ = (t.cuda() for t in _inputs(seed=5))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        o = flash_attention(q, k, v, True)
        assert o.dtype == F.scaled_dot_product_attention(q, k, v, is_causal=True).dtype == torch.bfloat16
    assert torch.equal(o, flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), True))


# ---------------------------------------------------------------------------------------------------------------
# Strided inputs: fake and real kernels agree; torch.compile
# ---------------------------------------------------------------------------------------------------------------


def _strided_qkv(batch=2, seq=24, heads=2, d=16, seed=6):
    """q, k, v as a fused projection gives them: (batch, heads, seq, d) views of one (batch, seq, 3·heads·d)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, seq, 3 * heads * d, generator=gen)
    return [t.transpose(1, 2) for t in qkv.view(batch, seq, 3, heads, d).unbind(2)]


def _layouts(outputs) -> list[tuple]:
    return [(tuple(t.shape), t.stride(), t.dtype) for t in outputs]


def _fake_layouts(op, args) -> list[tuple]:
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        return _layouts(op(*fake))


def test_op_ops_real_outputs_have_the_fake_kernels_strides(cpu_path):
    """Strided inputs: every op's real outputs have the shapes, strides and dtypes its fake kernel promises
    (torch.compile's Inductor asserts them), and opcheck passes on them."""
    from cs336_systems.flash.ops import flash_attn_bwd_launch, flash_attn_fwd_launch

    q, k, v = _strided_qkv()
    assert not q.is_contiguous()
    fwd_args = (q, k, v, True, 0.25)
    o, lse = flash_attn_fwd(*fwd_args)
    do = torch.randn_like(o).transpose(-1, -2).contiguous().transpose(-1, -2)  # strided too
    bwd_args = (do, q, k, v, o, lse, True, 0.25, True)
    for op, args in ((flash_attn_fwd, fwd_args), (flash_attn_fwd_launch, fwd_args), (flash_attn_bwd, bwd_args),
                     (flash_attn_bwd_launch, bwd_args)):
        assert _layouts(op(*args)) == _fake_layouts(op, args), f"{op}: real and fake outputs differ"
    torch.library.opcheck(flash_attn_fwd, fwd_args)
    torch.library.opcheck(flash_attn_bwd, bwd_args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_op_outputs_and_grads_keep_a_bshd_layout(cpu_path):
    """q, k, v as separate projections give them ((B, H, S, D) views of (B, S, H, D) memory): O and the gradients
    come back in that layout (reshaping O to (B, S, H·D) is a view, as with SDPA), the real ops' strides match their
    fake kernels', and the values match a float64 reference."""
    from cs336_systems.flash.ops import flash_attn_bwd_launch, flash_attn_fwd_launch

    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 24, 2, 16, generator=gen).transpose(1, 2) for _ in range(3))
    bshd = (2 * 24 * 16, 16, 2 * 16, 1)
    assert q.stride() == bshd and not q.is_contiguous()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = flash_attention(*leaves, is_causal=True)
    do = torch.randn(2, 24, 2 * 16, generator=gen)
    o.transpose(1, 2).reshape(2, 24, 2 * 16).backward(do)  # the model's reshape: a view, no copy
    for name, t in (("O", o), *zip(("dQ", "dK", "dV"), (x.grad for x in leaves))):
        assert t.stride() == bshd, f"{name}: strides {t.stride()}, not q's (B, S, H, D) layout"
    do4 = do.view(2, 24, 2, 16).transpose(1, 2)
    exact = run(lambda *a: reference_attention(*a)[0], *(t.double() for t in (q, k, v, do4)), True)
    for name, x, ref in zip(("O", "dQ", "dK", "dV"), (o, *(t.grad for t in leaves)), exact):
        assert rel_err(x, ref) <= 1e-5, f"{name}: relative error {rel_err(x, ref):.3g} vs float64 SDPA"
    o, lse = flash_attn_fwd(q, k, v, True, 0.25)
    bwd_args = (o.detach().clone(), q, k, v, o, lse, True, 0.25, True)
    for op, args in ((flash_attn_fwd, (q, k, v, True, 0.25)), (flash_attn_fwd_launch, (q, k, v, True, 0.25)),
                     (flash_attn_bwd, bwd_args), (flash_attn_bwd_launch, bwd_args)):
        assert _layouts(op(*args)) == _fake_layouts(op, args), f"{op}: real and fake outputs differ"


def test_op_outputs_of_fused_qkv_slices_take_the_bshd_layout(cpu_path):
    """q, k, v as slices of one fused projection ((B, H, S, D) views whose rows are 3·H·D apart): O comes back as a
    (B, H, S, D) view of (B, S, H, D) memory (reshaping it to (B, S, H·D) is a view), its real and fake strides
    agree, and the values match a float64 reference."""
    from cs336_systems.flash.ops import flash_attn_fwd_launch

    q, k, v = _strided_qkv(seed=10)
    assert q.stride() == (24 * 96, 16, 96, 1)
    o = flash_attention(q, k, v, is_causal=True)
    assert o.stride() == (24 * 32, 16, 32, 1) and o.transpose(1, 2).reshape(2, 24, 32).data_ptr() == o.data_ptr()
    exact = reference_attention(*(t.double() for t in (q, k, v)), True)[0]
    assert rel_err(o, exact) <= 1e-5
    for op in (flash_attn_fwd, flash_attn_fwd_launch):
        args = (q, k, v, True, 0.25)
        assert _layouts(op(*args)) == _fake_layouts(op, args), f"{op}: real and fake outputs differ"


# Each op revision's outputs (ops.OP_REVISION): a digest of `_op_outputs_table()`. Outputs that change need a new
# revision, or torch.compile's on-disk caches would serve graphs compiled against the old ones: raise OP_REVISION and
# record its digest here; never edit a recorded one.
OUTPUTS_BY_REVISION = {1: "5fd84ed7c528ac6b"}


def _op_outputs_table() -> list[tuple]:
    """(op, input layout, dtype, [(shape, strides, dtype) of each output]) of every cs336 op's fake kernel over the
    input layouts the ops take: contiguous (B, H, S, D), (B, S, H, D) memory, fused QKV slices, grouped and
    cross-length K/V, no batch dimension; packed (total, H, D) rows alone or as fused slices."""
    from cs336_systems.flash import ops

    def dense(*shape, dtype, perm=None):
        t = torch.empty(shape, dtype=dtype, device="meta")
        return t if perm is None else t.permute(perm)

    def fused(b, s, h, hkv, d, dtype):
        qkv = torch.empty(b, s, (h + 2 * hkv) * d, dtype=dtype, device="meta").view(b, s, h + 2 * hkv, d)
        return [t.transpose(1, 2) for t in qkv.split((h, hkv, hkv), dim=2)]

    table = []
    for dtype in (torch.bfloat16, torch.float32):
        layouts = {
            "bhsd": [dense(2, 4, 24, 16, dtype=dtype) for _ in range(3)],
            "bshd": [dense(2, 24, 4, 16, dtype=dtype, perm=(0, 2, 1, 3)) for _ in range(3)],
            "fused": fused(2, 24, 4, 4, 16, dtype),
            "fused_gqa": fused(2, 24, 4, 2, 16, dtype),
            "gqa_cross": [dense(2, 4, 24, 16, dtype=dtype), *(dense(2, 2, 40, 16, dtype=dtype) for _ in range(2))],
            "hsd": [dense(4, 24, 16, dtype=dtype) for _ in range(3)],
        }
        for name, (q, k, v) in layouts.items():
            o, lse = ops.flash_attn_fwd_launch(q, k, v, True, 0.25)
            table.append(("fwd", name, str(dtype), _layouts((o, lse))))
            table.append(("bwd", name, str(dtype), _layouts(ops.flash_attn_bwd_launch(o, q, k, v, o, lse, True,
                                                                                     0.25, None))))
        cu = torch.tensor([0, 10, 24], device="meta")
        packed = {"rows": [dense(24, 4, 16, dtype=dtype) for _ in range(3)],
                  "fused": list(dense(24, 12, 16, dtype=dtype).view(24, 3, 4, 16).unbind(1))}
        for name, (q, k, v) in packed.items():
            o, lse = ops.flash_attn_varlen_fwd(q, k, v, cu, cu, 14, 14, True, 0.25)
            table.append(("varlen_fwd", name, str(dtype), _layouts((o, lse))))
            table.append(("varlen_bwd", name, str(dtype), _layouts(ops.flash_attn_varlen_bwd(
                o, q, k, v, o, lse, cu, cu, 14, 14, True, 0.25))))
    return table


def test_op_outputs_match_the_op_revision():
    """The ops' outputs (shapes, strides, dtypes from their fake kernels) are the ones recorded for OP_REVISION:
    changing them without a new revision would let torch.compile's caches (keyed on the graph's op names) serve a
    graph compiled against the old outputs, which fails Inductor's stride asserts after an upgrade."""
    import hashlib

    from cs336_systems.flash import ops

    table = _op_outputs_table()
    digest = hashlib.sha256(repr(table).encode()).hexdigest()[:16]
    shown = "\n".join(map(str, table))
    assert OUTPUTS_BY_REVISION.get(ops.OP_REVISION) == digest, (
        f"the ops' outputs are not revision {ops.OP_REVISION}'s (digest {digest}): if they changed on purpose, raise "
        f"OP_REVISION in cs336_systems/flash/ops.py and record the digest in OUTPUTS_BY_REVISION\n{shown}")
    for name in ("flash_attn_fwd_launch", "flash_attn_bwd_launch", "flash_attn_varlen_fwd", "flash_attn_varlen_bwd"):
        assert getattr(torch.ops.cs336, name).overloads() == [f"r{ops.OP_REVISION}"], name


def test_op_compiles_with_strided_inputs(pytorch_path):
    """torch.compile over a fused projection's strided q, k, v: Inductor (which checks the op's output strides
    against its fake kernel's) and aot_eager, forward and backward, equal to eager."""
    q, k, v = _strided_qkv(seed=7)
    torch._dynamo.reset()
    with torch.no_grad():
        inductor = torch.compile(flash_attention, backend="inductor", fullgraph=True)(q, k, v, True)
    assert torch.equal(inductor, flash_attention(q, k, v, True))

    def attend(qkv):
        b, s = qkv.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in qkv.view(b, s, 3, 2, 16).unbind(2))
        return flash_attention(q, k, v, True)

    qkv = torch.randn(2, 24, 96, generator=torch.Generator().manual_seed(8))
    do = torch.randn(2, 2, 24, 16, generator=torch.Generator().manual_seed(9))
    results = []
    for fn in (attend, torch.compile(attend, backend="aot_eager", fullgraph=True)):
        x = qkv.clone().requires_grad_()
        o = fn(x)
        o.backward(do)
        results.append((o.detach(), x.grad))
    for name, a, b in zip(("O", "dqkv"), *results):
        assert torch.equal(a, b), f"{name}: compiled differs from eager"


def test_op_compiles_a_bshd_model_block_with_dynamic_lengths(pytorch_path):
    """A model's attention (separate projections: q, k, v as (B, H, S, D) views of (B, S, H, D), O reshaped back) under
    torch.compile(dynamic=True): one graph serves two lengths, O's reshape stays a view (the op's fake O has the
    (B, S, H, D) layout), and forward and gradients equal eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    weights = [torch.randn(32, 32, generator=torch.Generator().manual_seed(10 + i)) for i in range(4)]

    def block(x):
        b, s, _ = x.shape
        q, k, v = ((x @ w).view(b, s, 2, 16).transpose(1, 2) for w in weights[:3])
        o = flash_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b, s, 32) @ weights[3]

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    for seq in (24, 40):
        x = torch.randn(2, seq, 32, generator=torch.Generator().manual_seed(seq))
        results = []
        for fn in (block, compiled):
            leaf = x.clone().requires_grad_()
            out = fn(leaf)
            out.square().sum().backward()
            results.append((out.detach(), leaf.grad))
        for name, a, b in zip(("out", "dx"), *results):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{name} at {seq}: compiled differs from eager"
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for two lengths"
    # Inductor checks the op's real output strides against its fake kernel's: O in the (B, S, H, D) layout
    q, k, v = (torch.randn(2, 24, 2, 16, generator=torch.Generator().manual_seed(i)).transpose(1, 2) for i in range(3))
    torch._dynamo.reset()
    with torch.no_grad():
        o = torch.compile(lambda *a: flash_attention(*a, is_causal=True), backend="inductor", fullgraph=True)(q, k, v)
    assert o.stride() == q.stride() and torch.equal(o, flash_attention(q, k, v, is_causal=True))


# ---------------------------------------------------------------------------------------------------------------
# A scale that torch.compile traces as a symbolic float
# ---------------------------------------------------------------------------------------------------------------


def test_op_fullgraph_compile_with_a_changing_scale(pytorch_path):
    """A Python-float scale that changes between calls reaches the scale check as a SymFloat: still no graph
    break, and each call uses its own scale."""
    q, k, v, do = _inputs(seed=10)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c, s: flash_attention(a, b, c, True, scale=s), backend="aot_eager",
                             fullgraph=True)
    for scale in (0.5, 0.3, 0.2):
        ours = run(compiled, q, k, v, do, scale)
        eager = run(lambda *a: flash_attention(*a, True, scale=scale), q, k, v, do)
        for name, x, y in zip(("O", "dQ", "dK", "dV"), ours, eager):
            assert torch.equal(x, y), f"{name} at scale {scale}: compiled differs from eager"


# ---------------------------------------------------------------------------------------------------------------
# Empty inputs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_shape,kv_shape,gqa", [
    ((1, 0, 8, 16), (1, 0, 8, 16), False),   # no heads
    ((0, 2, 8, 16), (0, 2, 8, 16), False),   # no batch
    ((1, 0, 8, 16), (1, 2, 8, 16), True),    # no query heads: K and V get zero gradients
    ((2, 0, 8, 16), (2, 0, 8, 16), False),
], ids=["no-heads", "no-batch", "gqa-no-q-heads", "no-heads-batch-2"])
@pytest.mark.parametrize("entry", ["function", "flash_attention"])
def test_op_empty_batch_or_heads_give_empty_outputs(cpu_path, q_shape, kv_shape, gqa, entry):
    q = torch.randn(q_shape, requires_grad=True)
    k, v = (torch.randn(kv_shape, requires_grad=True) for _ in range(2))
    if entry == "function":
        o = FlashAttention2Triton.apply(q, k, v, True, None, gqa)
    else:
        o = flash_attention(q, k, v, True, enable_gqa=gqa)
    assert o.shape == q_shape and o.dtype == q.dtype
    o.sum().backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.grad.shape == t.shape and not t.grad.any(), f"d{name}: {t.grad}"


@pytest.mark.parametrize("q_len,kv_len", [(0, 8), (8, 0)])
def test_op_empty_sequences_are_value_errors(q_len, kv_len):
    q, k = torch.randn(1, 2, q_len, 16), torch.randn(1, 2, kv_len, 16)
    with pytest.raises(ValueError, match="sequence lengths must be at least 1"):
        flash_attention(q, k, k)


# ---------------------------------------------------------------------------------------------------------------
# Meta tensors and torch.func transforms
# ---------------------------------------------------------------------------------------------------------------


def test_op_meta_tensors_give_outputs_of_the_right_shapes():
    """Meta tensors (shape inference; the kernels under the interpreter would copy them out): outputs and
    gradients of the right shapes on the meta device, for the function and for the ops."""
    q = torch.randn(2, 4, 24, 16, device="meta", requires_grad=True)
    k, v = (torch.randn(2, 2, 40, 16, device="meta", requires_grad=True) for _ in range(2))
    o = flash_attention(q, k, v, True, enable_gqa=True)
    assert o.shape == q.shape and o.device.type == "meta"
    o.sum().backward()
    assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]
    q, k, v = (t.detach() for t in (q, k, v))
    o, lse = flash_attn_fwd(q, k, v, True, 0.25)
    assert (o.shape, lse.shape, lse.dtype, o.device.type) == (q.shape, q.shape[:-1], torch.float32, "meta")
    grads = flash_attn_bwd(o, q, k, v, o, lse, True, 0.25, None)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("transform", ["vmap", "grad", "jvp"])
def test_op_refuses_torch_func_transforms_by_name(transform):
    q = torch.randn(2, 2, 8, 16)
    calls = {
        "vmap": lambda: torch.func.vmap(lambda x: flash_attention(x, x, x))(q),
        "grad": lambda: torch.func.grad(lambda x: flash_attention(x, x, x).sum())(q),
        "jvp": lambda: torch.func.jvp(lambda x: flash_attention(x, x, x), (q,), (q,)),
    }
    with pytest.raises(RuntimeError, match=r"does not support torch.func transforms \(vmap, grad, jvp"):
        calls[transform]()


# ---------------------------------------------------------------------------------------------------------------
# Grouped-query heads on the PyTorch path
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_op_pytorch_path_sums_a_gqa_group_in_fp32(pytorch_path, is_causal):
    """bf16, 16 query heads over 1 K/V head: the group's dK and dV are summed in fp32 and rounded once, so they are
    as close to float64 as bf16 can hold them (rounding each query head's share before the sum was 1.4-1.7 times
    further)."""
    gen = torch.Generator().manual_seed(41)
    q = torch.randn(1, 16, 128, 32, generator=gen).bfloat16()
    k, v = (torch.randn(1, 1, 128, 32, generator=gen).bfloat16() for _ in range(2))
    do = torch.randn(q.shape, generator=gen).bfloat16()

    def sdpa(q, k, v, causal):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    exact = run(sdpa, *(t.double() for t in (q, k, v, do)), is_causal)
    ours = run(lambda q, k, v, causal: flash_attention(q, k, v, causal, enable_gqa=True), q, k, v, do, is_causal)
    for name, x, ref in zip(("dK", "dV"), ours[2:], exact[2:]):
        err, rounding = ((t.double() - ref).abs().max().item() for t in (x, ref.bfloat16()))
        assert err <= 1.1 * rounding, f"{name}: {err:.3g} from float64, one bf16 rounding is {rounding:.3g}"


# ---------------------------------------------------------------------------------------------------------------
# A sliding window through the ops and torch.compile
# ---------------------------------------------------------------------------------------------------------------


def test_op_ops_take_a_window(cpu_path):
    """The ops' window_left/window_right: fake and real outputs agree and opcheck passes (schema, fake, autograd)."""
    q, k, v = _strided_qkv()
    fwd_args = (q, k, v, False, 0.25, 3, 1)
    o, lse = flash_attn_fwd(*fwd_args)
    assert _layouts((o, lse)) == _fake_layouts(flash_attn_fwd, fwd_args)
    do = torch.randn_like(o)
    bwd_args = (do, q, k, v, o, lse, False, 0.25, True, 3, 1)
    assert _layouts(flash_attn_bwd(*bwd_args)) == _fake_layouts(flash_attn_bwd, bwd_args)
    torch.library.opcheck(flash_attn_fwd, fwd_args)
    torch.library.opcheck(flash_attn_bwd, bwd_args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_op_fullgraph_compile_with_a_window(pytorch_path, backend):
    """torch.compile(fullgraph=True) over flash_attention with a window (causal and not): no graph break, the
    eager results, forward and backward."""
    q, k, v, do = _inputs(seed=11)
    for is_causal, window in ((False, (4, 2)), (True, (5, -1))):
        torch._dynamo.reset()
        compiled = torch.compile(lambda a, b, c: flash_attention(a, b, c, is_causal, window=window), backend=backend,
                                 fullgraph=True)
        ours = run(compiled, q, k, v, do)
        eager = run(lambda *a: flash_attention(*a, is_causal, window=window), q, k, v, do)
        for name, x, y in zip(("O", "dQ", "dK", "dV"), ours, eager):
            assert torch.equal(x, y), f"{name} with window {window}: compiled differs from eager"


def test_op_op_import_leaves_dynamo_and_inductor_unloaded():
    """Importing the op costs no Inductor (3-7 s): its traced ops are registered when torch._dynamo loads, in either
    order of loading Inductor, and before anything is compiled."""
    import subprocess
    import sys

    code = """
import sys
import torch
from cs336_systems import flash_attention
assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules, "the import loaded dynamo"
assert not hasattr(torch.ops.cs336, "flash_attn_fwd"), "the traced ops were registered at import"
import torch._inductor  # loads torch._dynamo, half way through its own import
from cs336_systems.flash import ops
assert isinstance(ops.flash_attn_fwd, torch._library.custom_ops.CustomOpDef), ops.flash_attn_fwd
assert hasattr(torch.ops.cs336, "flash_attn_bwd")
q = torch.randn(1, 2, 24, 16, requires_grad=True)
step = torch.compile(lambda a: flash_attention(a, a, a, True), fullgraph=True, backend="aot_eager")
step(q).sum().backward()
assert q.grad is not None and q.grad.isfinite().all()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_tma_descriptors_are_not_built_over_stride_zero_rows():
    """Expanded tensors (k or v broadcast over positions, the dO of a sum over them) are read through pointers, not
    TMA descriptors, whose encoding does not promise to take a stride of 0; their values stay right."""
    k = torch.randn(2, 4, 1, 16).expand(2, 4, 24, 16)
    do = torch.randn(2, 4, 16)[:, :, None].expand(2, 4, 24, 16)  # autograd's dO for o.sum(dim=-2)
    assert not launch.tma_strides_ok(k) and not launch.tma_strides_ok(do)
    assert launch.tma_strides_ok(torch.randn(2, 4, 24, 16)) and launch.tma_strides_ok(k.contiguous())
