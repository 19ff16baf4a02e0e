"""Packed sequences (`flash_attention_varlen`): against a float64 reference run sequence by sequence (SDPA with an
explicit boolean mask), the CPU fallback, checks, the ops under torch.compile and opcheck; GPU-only cases (bf16,
fp16: the 2x rule) are skipped without CUDA.

On the CPU the kernels run through Triton's interpreter: sizes stay tiny.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .helpers import DEVICE, band_mask, grads_of, max_err

FP32_BOUND = 1e-4  # fp32 (IEEE dots in the interpreter) against float64


def cu_seqlens(lengths, device=DEVICE) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def packed_inputs(lengths_q, lengths_k, heads, kv_heads, d, dtype, device=DEVICE, seed=0):
    """q (total_q, heads, d), k, v (total_k, kv_heads, d), dO like q, drawn in fp32 and cast."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads, d, generator=gen)
    k, v = (torch.randn(sum(lengths_k), kv_heads, d, generator=gen) for _ in range(2))
    do = torch.randn(sum(lengths_q), heads, d, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, do)]


def reference_packed(q, k, v, lengths_q, lengths_k, is_causal, window):
    """O of packed inputs, sequence by sequence: SDPA in q's dtype with an explicit boolean mask (the band and the
    causal triangle, top-left aligned) on (1, H, n, D) tensors, the 4-dim call of the dense tests, which on a GPU runs
    a fused kernel in q's dtype (3-dim tensors would run the math backend, which computes in fp32 and rounds once);
    a query that sees no key gets 0 (its mask row opened, its output zeroed, so that no NaN reaches the gradients)."""
    group = q.shape[1] // k.shape[1]
    outs, q0, k0 = [], 0, 0
    for n_q, n_k in zip(lengths_q, lengths_k):
        qs = q[q0:q0 + n_q].transpose(0, 1)
        ks, vs = (t[k0:k0 + n_k].transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))
        if n_q and n_k:
            keep = band_mask(n_q, n_k, window, is_causal, q.device)
            sees = keep.any(-1, keepdim=True)
            o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=keep | ~sees)[0]
            outs.append(torch.where(sees, o, 0.0).transpose(0, 1))
        else:
            outs.append(q.new_zeros(n_q, q.shape[1], q.shape[2]) + 0 * qs.sum())
        q0, k0 = q0 + n_q, k0 + n_k
    return torch.cat(outs)


def ours_packed(q, k, v, do, lengths_q, lengths_k, is_causal, window, **keywords):
    from cs336_systems import flash_attention_varlen

    cu_q, cu_k = cu_seqlens(lengths_q, q.device), cu_seqlens(lengths_k, q.device)
    return grads_of(lambda a, b, c: flash_attention_varlen(a, b, c, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                           is_causal=is_causal, window=window, **keywords),
                    q, k, v, do)


def reference_grads(q, k, v, do, lengths_q, lengths_k, is_causal, window, dtype):
    return grads_of(lambda a, b, c: reference_packed(a, b, c, lengths_q, lengths_k, is_causal, window),
                    *(t.to(dtype) for t in (q, k, v, do)))


def assert_close_to_float64(ours, q, k, v, do, lengths_q, lengths_k, is_causal, window, rule):
    """rule ("abs", bound), or ("x_torch", factor): at most factor x the error of the reference in q's dtype."""
    exact = reference_grads(q, k, v, do, lengths_q, lengths_k, is_causal, window, torch.float64)
    same_dtype = reference_grads(q, k, v, do, lengths_q, lengths_k, is_causal, window, q.dtype) \
        if rule[0] == "x_torch" else exact
    for name, x, ref, base in zip(("O", "dQ", "dK", "dV"), ours, exact, same_dtype):
        assert torch.isfinite(x).all(), f"{name} has non-finite values"
        err = max_err(x, ref)
        bound = rule[1] if rule[0] == "abs" else rule[1] * max_err(base, ref) + 1e-5
        assert err <= bound, f"{name}: max |ours - fp64| = {err:.3g} > {bound:.3g}"


# (queries, keys) per sequence: lengths 0 and 1 inside the batch, Nq != Nk, a sequence with queries but no keys and
# one with keys but no queries, ragged tiles (the interpreter runs 16 x 16 tiles)
LENGTHS_Q = [5, 0, 1, 33, 9, 4, 20]
LENGTHS_K = [7, 3, 1, 18, 0, 4, 20]
WINDOWS = [(-1, -1), (3, 1), (0, 0), (100, 100), (-1, 2)]  # (100, 100): wider than every sequence


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_varlen_matches_float64_per_sequence(is_causal, window):
    """GQA (4 query heads over 2), fp32, forward and gradients, against float64 sequence by sequence."""
    q, k, v, do = packed_inputs(LENGTHS_Q, LENGTHS_K, 4, 2, 16, torch.float32, seed=1)
    ours = ours_packed(q, k, v, do, LENGTHS_Q, LENGTHS_K, is_causal, window)
    assert_close_to_float64(ours, q, k, v, do, LENGTHS_Q, LENGTHS_K, is_causal, window, ("abs", FP32_BOUND))


@pytest.mark.parametrize("is_causal,window", [(True, (-1, -1)), (False, (3, 1))], ids=["causal", "window"])
def test_varlen_tma_descriptors_bound_each_sequence(monkeypatch, is_causal, window):
    """With TMA (forced, as on a Hopper GPU) each program's descriptors end at its sequence: ragged last tiles load
    zeros and store nothing past it; an expanded dO (o.sum()'s) is copied once for the passes' descriptors."""
    from cs336_systems.flash import chooser, launch

    original, calls = launch.varlen_call, []

    def spy(*args, **keywords):
        calls.append(original(*args, **keywords))
        return calls[-1]

    monkeypatch.setattr(chooser, "tma_default", lambda index: True)
    monkeypatch.setattr(launch, "varlen_call", spy)
    q, k, v, do = packed_inputs(LENGTHS_Q, LENGTHS_K, 4, 2, 16, torch.float32, seed=5)
    for grad in (do, q.new_ones(()).expand(q.shape)):
        ours = ours_packed(q, k, v, grad, LENGTHS_Q, LENGTHS_K, is_causal, window)
        assert_close_to_float64(ours, q, k, v, grad, LENGTHS_Q, LENGTHS_K, is_causal, window, ("abs", FP32_BOUND))
    assert len(calls) == 4 and all(call.tma for call in calls)


def test_varlen_plain_heads_odd_head_dim_and_strided_inputs():
    """H = Hkv, a head dim that is not a power of two, q, k, v as views of one fused projection (strided)."""
    lengths = [17, 1, 0, 40]
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(sum(lengths), 3, 2, 12, generator=gen).to(DEVICE)
    q, k, v = qkv.unbind(1)
    do = torch.randn(sum(lengths), 2, 12, generator=gen).to(DEVICE)
    ours = ours_packed(q, k, v, do, lengths, lengths, True, (-1, -1), scale=None)
    assert_close_to_float64(ours, q, k, v, do, lengths, lengths, True, (-1, -1), ("abs", FP32_BOUND))


def test_varlen_one_sequence_matches_the_dense_op():
    """A batch of one sequence gives what `flash_attention` gives on the same (1, H, S, D) tensors."""
    from cs336_systems import flash_attention

    q, k, v, do = packed_inputs([37], [29], 2, 2, 16, torch.float32, seed=3)
    ours = ours_packed(q, k, v, do, [37], [29], True, (5, -1))
    dense = grads_of(lambda a, b, c: flash_attention(*(t.transpose(0, 1) for t in (a, b, c)), is_causal=True,
                                                     window=(5, -1)).transpose(0, 1), q, k, v, do)
    for name, x, y in zip(("O", "dQ", "dK", "dV"), ours, dense):
        assert max_err(x, y) <= 1e-5, f"{name}: packed and dense differ by {max_err(x, y):.3g}"


def test_varlen_cpu_fallback_matches_float64(monkeypatch):
    """Without CUDA and without the interpreter: the tiled PyTorch path, sequence by sequence."""
    import cs336_systems.flash.launch as launch

    monkeypatch.setattr(launch, "INTERPRET", False)
    q, k, v, do = packed_inputs(LENGTHS_Q, LENGTHS_K, 4, 2, 16, torch.float32, device="cpu", seed=4)
    for is_causal, window in [(False, (-1, -1)), (True, (-1, -1)), (True, (3, 1)), (False, (0, 0))]:
        ours = ours_packed(q, k, v, do, LENGTHS_Q, LENGTHS_K, is_causal, window)
        assert_close_to_float64(ours, q, k, v, do, LENGTHS_Q, LENGTHS_K, is_causal, window, ("abs", FP32_BOUND))


def test_varlen_empty_batch_and_no_queries():
    """cu_seqlens [0] (no sequence) and sequences without queries: empty or zero outputs, zero gradients."""
    from cs336_systems import flash_attention_varlen

    for lengths_q, lengths_k in [([], []), ([0, 0], [3, 2])]:
        q, k, v, _ = packed_inputs(lengths_q, lengths_k, 2, 1, 16, torch.float32, seed=5)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o = flash_attention_varlen(q, k, v, cu_seqlens(lengths_q), cu_seqlens(lengths_k), max(lengths_q, default=0),
                                   max(lengths_k, default=0), is_causal=True)
        assert o.shape == q.shape
        o.sum().backward()
        assert not k.grad.abs().any() and not v.grad.abs().any()


def _args(lengths_q=(3, 4), lengths_k=(3, 4), heads=2, kv_heads=2, d=8, dtype=torch.float32):
    q, k, v, _ = packed_inputs(list(lengths_q), list(lengths_k), heads, kv_heads, d, dtype, device="cpu")
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens(lengths_q, "cpu"), cu_seqlens_k=cu_seqlens(lengths_k, "cpu"),
                max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))


def _with(**changes):
    args = _args()
    args.update(changes)
    return args


@pytest.mark.parametrize("args,error,words", [
    (_with(cu_seqlens_q=torch.tensor([0, 3, 7])), TypeError, "int32"),
    (_with(cu_seqlens_q=torch.tensor([[0, 3, 7]], dtype=torch.int32)), ValueError, "1-D"),
    (_with(cu_seqlens_k=torch.tensor([0, 3, 7], dtype=torch.int32, device="meta")), ValueError, "device"),
    (_with(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)), ValueError, "one length"),
    (_with(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32)), ValueError, "start at 0"),
    (_with(cu_seqlens_q=torch.tensor([0, 5, 3, 7], dtype=torch.int32),
           cu_seqlens_k=torch.tensor([0, 1, 3, 7], dtype=torch.int32)), ValueError, "non-decreasing"),
    (_with(cu_seqlens_k=torch.tensor([0, 3, 6], dtype=torch.int32)), ValueError, "packed length 7"),
    (_with(max_seqlen_q=3), ValueError, "max_seqlen_q is 3"),
    (_with(max_seqlen_k=-1), ValueError, "max_seqlen_k"),
    (_with(max_seqlen_k=True), TypeError, "max_seqlen_k"),
    (_args(heads=3, kv_heads=2), ValueError, "must divide"),
    (_with(k=torch.zeros(7, 2, 16), v=torch.zeros(7, 2, 16)), ValueError, "head dims"),
    (_with(k=torch.zeros(7, 2, 8, dtype=torch.float16)), TypeError, "one dtype"),
    (_with(q=torch.zeros(7, 2, 8, dtype=torch.float64)), TypeError, "unsupported dtype"),
    (_with(q=torch.zeros(1, 7, 2, 8)), ValueError, "(total, heads, d)"),
    (_with(v=torch.zeros(6, 2, 8)), ValueError, "k and v shapes"),
], ids=["cu-dtype", "cu-2d", "cu-device", "cu-lengths", "cu-start", "cu-decreasing", "cu-total", "max-short",
        "max-negative", "max-bool", "gqa-heads", "head-dim", "dtype-mixed", "dtype-float64", "q-4d", "kv-shapes"])
def test_varlen_bad_input_raises_before_any_work(args, error, words):
    from cs336_systems import flash_attention_varlen

    with pytest.raises(error, match=__import__("re").escape(words)):
        flash_attention_varlen(**args)


def test_varlen_offsets_are_read_once_per_tensor(monkeypatch):
    """Where a check is kept (CUDA offsets, whose read is a device sync; `_check_kept` patched here), the offsets'
    values are read once per tensor: again only for another tensor, other sizes, or after an in-place write, which a
    bad value then fails."""
    from cs336_systems import flash_attention_varlen
    from cs336_systems.flash import ops

    reads = []
    check = ops.check_varlen_offsets
    monkeypatch.setattr(ops, "check_varlen_offsets", lambda cu, *a: (reads.append(cu), check(cu, *a)))
    monkeypatch.setattr(ops, "_check_kept", lambda cu: True)
    args = _args()
    cu = args["cu_seqlens_k"] = args["cu_seqlens_q"]  # self-attention: one offsets tensor for both sides
    flash_attention_varlen(**args)
    flash_attention_varlen(**args)
    assert len(reads) == 1, f"{len(reads)} reads of one unchanged tensor over two calls"
    cu.add_(0)  # an in-place write: read again
    flash_attention_varlen(**args)
    flash_attention_varlen(**{**args, "cu_seqlens_q": cu.clone(), "cu_seqlens_k": cu.clone()})  # other tensors
    assert len(reads) == 4
    cu[1] = 5  # a sequence longer than max_seqlen now
    with pytest.raises(ValueError, match="max_seqlen_q is 4"):
        flash_attention_varlen(**args)


def test_varlen_cpu_and_inference_offsets_are_read_every_call():
    """CPU offsets are read every call (no sync to save): a write through NumPy, which PyTorch's version counter
    does not see, is caught. Inference tensors (no version counter) work, under inference_mode too."""
    from cs336_systems import flash_attention_varlen

    args = _args()
    cu = args["cu_seqlens_k"] = args["cu_seqlens_q"]
    flash_attention_varlen(**args)
    cu.numpy()[-1] = 5  # the packed length is 7
    with pytest.raises(ValueError, match="packed length 7"):
        flash_attention_varlen(**args)
    cu.numpy()[-1] = 7
    with torch.inference_mode():
        inference_cu = cu.clone()
        o = flash_attention_varlen(**{**args, "cu_seqlens_q": inference_cu, "cu_seqlens_k": inference_cu})
        assert torch.equal(o, flash_attention_varlen(**args))
        inference_cu[1] = 5  # a sequence longer than max_seqlen now
        with pytest.raises(ValueError, match="max_seqlen_q is 4"):
            flash_attention_varlen(**{**args, "cu_seqlens_q": inference_cu, "cu_seqlens_k": inference_cu})


@pytest.mark.parametrize("offsets,max_seqlen", [([0, 3, 7], 3), ([0, 5, 3, 7], 7), ([0, 3, 6], 7)],
                         ids=["longer-than-max", "decreasing", "short-total"])
def test_varlen_offsets_are_asserted_under_compile(offsets, max_seqlen):
    """Under torch.compile the host does not read the offsets: their conditions are asserted on the device before
    the kernels (a RuntimeError on the CPU), never rows left unwritten."""
    from cs336_systems import flash_attention_varlen

    q, k, v, _ = packed_inputs([3, 4], [3, 4], 2, 1, 16, torch.float32, seed=3)
    cu = torch.tensor(offsets, dtype=torch.int32)

    def attend(a, b, c, cu):
        return flash_attention_varlen(a, b, c, cu, cu, max_seqlen, max_seqlen, is_causal=True)

    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="cu_seqlens_q: offsets must start at 0"):
        torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v, cu)


def test_varlen_bad_window_and_flags_raise():
    from cs336_systems import flash_attention_varlen

    with pytest.raises(ValueError, match="window left"):
        flash_attention_varlen(**_args(), window=(-2, 0))
    with pytest.raises(TypeError, match="is_causal"):
        flash_attention_varlen(**_args(), is_causal=1)
    with pytest.raises(TypeError, match="deterministic"):
        flash_attention_varlen(**_args(), deterministic="yes")


def test_varlen_fullgraph_compile_aot_eager_matches_eager():
    """torch.compile(fullgraph=True) takes the call whole (opaque custom ops): aot_eager, forward and backward, equal
    to eager."""
    from cs336_systems import flash_attention_varlen

    lengths = [9, 1, 0, 21]
    q, k, v, do = packed_inputs(lengths, lengths, 2, 1, 16, torch.float32, seed=6)
    cu = cu_seqlens(lengths)

    def step(a, b, c):
        return flash_attention_varlen(a, b, c, cu, cu, 21, 21, is_causal=True, window=(4, -1))

    eager = grads_of(step, q, k, v, do)
    torch._dynamo.reset()
    compiled = grads_of(torch.compile(step, backend="aot_eager", fullgraph=True), q, k, v, do)
    for name, x, y in zip(("O", "dQ", "dK", "dV"), eager, compiled):
        assert torch.equal(x, y), f"{name}: compiled differs by {max_err(x, y):.3g}"


def test_varlen_dynamic_compile_serves_several_batches():
    """torch.compile(dynamic=True, fullgraph=True): one frame for packed batches of other totals, offsets and
    max_seqlen (symbolic ints through the checks and the ops' fake kernels)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from cs336_systems import flash_attention_varlen

    torch._dynamo.reset()
    compiles = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda a, b, c, cu, n: flash_attention_varlen(a, b, c, cu, cu, n, n, is_causal=True),
                         backend=compiles, dynamic=True, fullgraph=True)
    for i, lengths in enumerate(([9, 1, 20], [3, 17, 0, 5])):
        q, k, v, do = packed_inputs(lengths, lengths, 2, 1, 16, torch.float32, seed=8 + i)
        ours = grads_of(lambda a, b, c: step(a, b, c, cu_seqlens(lengths), max(lengths)), q, k, v, do)
        assert_close_to_float64(ours, q, k, v, do, lengths, lengths, True, (-1, -1), ("abs", FP32_BOUND))
    assert compiles.frame_count == 1, f"{compiles.frame_count} compiled frames for two batches"


def test_varlen_ops_pass_opcheck():
    """torch.library.opcheck: schema, fake kernels, autograd registration of the varlen op pair."""
    from cs336_systems.flash.ops import flash_attn_varlen_bwd, flash_attn_varlen_fwd

    lengths_q, lengths_k = [5, 0, 12], [7, 2, 12]
    q, k, v, do = packed_inputs(lengths_q, lengths_k, 2, 1, 16, torch.float32, seed=7)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    fwd_args = (q, k, v, cu_q, cu_k, 12, 12, True, 0.25, 3, -1)
    torch.library.opcheck(flash_attn_varlen_fwd, fwd_args)
    o, lse = flash_attn_varlen_fwd(*fwd_args)
    torch.library.opcheck(flash_attn_varlen_bwd, (do, q, k, v, o, lse, cu_q, cu_k, 12, 12, True, 0.25, 3, -1),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


# ---------------------------------------------------------------------------------------------------------------
# GPU only: bf16 / fp16 against the 2x rule
# ---------------------------------------------------------------------------------------------------------------


def long_tailed_lengths(total: int, longest: int, seed: int) -> list[int]:
    """Sequence lengths summing to `total`: many short ones (a Pareto-like tail), a few up to `longest`, some 0 and 1."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [longest, longest // 2 + 7, 0, 1]
    while sum(lengths) < total:
        lengths.append(min(longest, int(8 / (torch.rand((), generator=gen).item() ** 1.2 + 1e-3))))
    lengths[-1] -= sum(lengths) - total
    return lengths


def count_gluon_launches(monkeypatch) -> list[str]:
    """The names of the packed Gluon launches (`packed_forward`, `packed_kv_pass`) the calls after this make."""
    from cs336_systems.flash import gluon

    launched = []
    for name in ("packed_forward", "packed_kv_pass"):
        original = getattr(gluon, name)
        monkeypatch.setattr(gluon, name, lambda *a, _f=original, _n=name, **kw: (launched.append(_n), _f(*a, **kw)))
    return launched


@pytest.mark.gpu
@pytest.mark.parametrize("design", ["gluon", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_varlen_long_tailed_batch_meets_2x_rule(monkeypatch, dtype, d, is_causal, design):
    """A packed batch of 8192 tokens, lengths long-tailed (one of 2048, many short, 0 and 1), GQA 8 over 2 heads;
    the Gluon forward and single pass (the default on sm_90), and the Triton IS_VARLEN forward and two-pass passes
    (the Gluon forward declined, deterministic=True)."""
    from cs336_systems.flash import gluon

    if design == "triton":
        monkeypatch.setattr(gluon, "packed_fwd_supported", lambda *a: False)
    launched = count_gluon_launches(monkeypatch)
    lengths = long_tailed_lengths(8192, 2048, seed=d)
    q, k, v, do = packed_inputs(lengths, lengths, 8, 2, d, dtype, seed=20 + d)
    ours = ours_packed(q, k, v, do, lengths, lengths, is_causal, (-1, -1),
                       deterministic=True if design == "triton" else None)
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert launched == (["packed_forward", "packed_kv_pass"] if design == "gluon" and sm90 else [])
    assert_close_to_float64(ours, q, k, v, do, lengths, lengths, is_causal, (-1, -1), ("x_torch", 2.0))


@pytest.mark.gpu
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_varlen_gluon_edges_meet_2x_rule(monkeypatch, d, is_causal, window):
    """The Gluon forward and single pass (bf16, GQA 4 over 2) on the edge batch at the Gluon tiles' scale: lengths 0
    and 1, Nq != Nk, a sequence with queries but no keys (O = 0) and one with keys but no queries, ragged tiles;
    windows narrow, empty, wider than every sequence, one-sided."""
    launched = count_gluon_launches(monkeypatch)
    lengths_q, lengths_k = [300, 0, 1, 513, 129, 64, 200], [350, 3, 1, 260, 0, 64, 200]
    window = tuple(w * 16 if w > 1 else w for w in window)  # (the CPU sizes' windows, scaled as the lengths)
    q, k, v, do = packed_inputs(lengths_q, lengths_k, 4, 2, d, torch.bfloat16, seed=40 + d)
    ours = ours_packed(q, k, v, do, lengths_q, lengths_k, is_causal, window)
    if torch.cuda.get_device_capability() == (9, 0):
        assert launched == ["packed_forward", "packed_kv_pass"]
    assert_close_to_float64(ours, q, k, v, do, lengths_q, lengths_k, is_causal, window, ("x_torch", 2.0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_varlen_window_skips_tiles_and_meets_2x_rule(dtype):
    """A window of 256 keys on sequences of up to 4103 tokens (most key tiles outside the band, skipped), causal and
    not, Nq != Nk in one sequence."""
    lengths_q, lengths_k = [4103, 1, 700, 2000], [4103, 1, 650, 2000]
    q, k, v, do = packed_inputs(lengths_q, lengths_k, 4, 4, 64, dtype, seed=30)
    for is_causal, window in [(True, (256, -1)), (False, (200, 56))]:
        ours = ours_packed(q, k, v, do, lengths_q, lengths_k, is_causal, window)
        assert_close_to_float64(ours, q, k, v, do, lengths_q, lengths_k, is_causal, window, ("x_torch", 2.0))


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, None], ids=["deterministic", "default"])
def test_varlen_inductor_fullgraph_matches_eager(deterministic):
    """torch.compile(fullgraph=True) with Inductor on the GPU: the opaque ops, bitwise equal to eager; by default
    (the single pass, dQ summed in fp32 by reductions in no fixed order) dQ to its accumulation order: within two
    bf16 steps (2^-7 relative) of its largest value."""
    from cs336_systems import flash_attention_varlen

    lengths = long_tailed_lengths(2048, 1024, seed=3)
    q, k, v, do = packed_inputs(lengths, lengths, 4, 2, 64, torch.bfloat16, seed=31)
    cu = cu_seqlens(lengths)

    def step(a, b, c):
        return flash_attention_varlen(a, b, c, cu, cu, max(lengths), max(lengths), is_causal=True,
                                      deterministic=deterministic)

    eager = grads_of(step, q, k, v, do)
    compiled = grads_of(torch.compile(step, fullgraph=True), q, k, v, do)
    for name, x, y in zip(("O", "dQ", "dK", "dV"), eager, compiled):
        if name == "dQ" and not deterministic:
            assert max_err(x, y) <= 2**-7 * x.float().abs().max().item(), f"dQ: compiled differs by {max_err(x, y):.3g}"
        else:
            assert torch.equal(x, y), f"{name}: compiled differs by {max_err(x, y):.3g}"


# ---------------------------------------------------------------------------------------------------------------
# The course LM on packed documents
# ---------------------------------------------------------------------------------------------------------------


def _document_loss(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross entropy within one document, and its target count."""
    return F.cross_entropy(logits[:-1], tokens[1:], reduction="sum"), tokens.shape[0] - 1


@pytest.mark.parametrize("attention", ["flash", "reference"])
def test_lm_packed_documents_give_the_loss_of_documents_one_by_one(attention):
    """A (2, 12) batch holding four documents (one of a single token, one across the row boundary): the packed
    forward (cu_seqlens; attention within each document, RoPE from each document's start) gives each document's
    logits and the same loss as running the documents one by one (fp32, small model)."""
    from cs336_basics.model import BasicsTransformerLM

    torch.manual_seed(0)
    model = BasicsTransformerLM(vocab_size=50, context_length=32, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                                attention=attention).to(DEVICE)
    lengths = [5, 1, 12, 6]
    tokens = torch.randint(0, 50, (sum(lengths),), device=DEVICE)
    cu = cu_seqlens(lengths)
    packed = model(tokens.view(2, 12), cu_seqlens=cu).flatten(0, 1)
    packed_loss, one_by_one_loss, targets = 0.0, 0.0, 0
    for first, stop in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = model(tokens[first:stop][None])[0]
        assert max_err(packed[first:stop], alone) <= 1e-4, f"document at {first}: logits differ"
        packed_part, count = _document_loss(packed[first:stop], tokens[first:stop])
        packed_loss += packed_part
        one_by_one_loss += _document_loss(alone, tokens[first:stop])[0]
        targets += count
    assert abs(packed_loss.item() - one_by_one_loss.item()) / targets <= 1e-5
    (packed_loss / targets).backward()  # the packed step trains
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_lm_packed_attention_gets_contiguous_packed_tensors(monkeypatch):
    """The model hands the op q, k, v in the packed (tokens, heads, d_head) layout and contiguous (views of its
    projections, RoPE's outputs), so that no copy is made and the Gluon backward, which takes contiguous tensors
    only, can run the call."""
    from cs336_basics.model import BasicsTransformerLM
    from cs336_systems import flash_triton

    seen, original = [], flash_triton.flash_attention_varlen

    def spy(q, k, v, *args, **keywords):
        seen.append((q.shape, q.is_contiguous(), k.is_contiguous(), v.is_contiguous()))
        return original(q, k, v, *args, **keywords)

    monkeypatch.setattr(flash_triton, "flash_attention_varlen", spy)
    model = BasicsTransformerLM(vocab_size=50, context_length=32, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                                attention="flash").to(DEVICE)
    model(torch.randint(0, 50, (2, 12), device=DEVICE), cu_seqlens=cu_seqlens([5, 1, 12, 6]))
    assert seen == [(torch.Size([24, 2, 16]), True, True, True)] * 2


@pytest.mark.parametrize("offsets,error,words", [
    (torch.tensor([0.0, 7.9, 16.0]), TypeError, "integers"),
    (torch.tensor([1, 7, 16]), ValueError, "start at 0"),
    (torch.tensor([0, 9, 7, 16]), ValueError, "not decrease"),
    (torch.tensor([[0, 16]]), ValueError, "1-D"),
], ids=["float", "start", "decreasing", "2d"])
def test_lm_bad_offsets_are_named(offsets, error, words):
    """Offsets the model cannot pack by are refused naming the problem (not truncated, not an allocator error)."""
    from cs336_basics.model import PackedDocuments

    with pytest.raises(error, match=words):
        PackedDocuments.from_offsets(offsets)


def test_bench_attention_swap_refuses_packed_documents():
    """The benchmark's swapped attention (an impls callable in the model's place) takes only the causal mask: a
    packed forward through it raises instead of attending across documents."""
    from cs336_basics.model import BasicsTransformerLM
    from cs336_systems.bench.impls import Setup, build
    from cs336_systems.bench.model import attention_function, model_attention

    model = BasicsTransformerLM(vocab_size=50, context_length=32, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    tokens = torch.randint(0, 50, (2, 12))
    with attention_function(model_attention(build("sdpa", Setup(torch.device("cpu"), "fp32", 12)))):
        model(tokens)  # the causal path takes it
        with pytest.raises(ValueError, match="packed documents"):
            model(tokens, cu_seqlens=cu_seqlens([5, 7, 12], "cpu"))


def test_lm_eos_token_marks_documents():
    """eos_token_id: a document ends after each eos token and at each row's end; RoPE positions restart."""
    from cs336_basics.model import PackedDocuments

    tokens = torch.tensor([[3, 0, 4, 5, 0, 6], [7, 8, 0, 9, 9, 9]])
    documents = PackedDocuments.from_eos(tokens, eos_token_id=0)
    assert documents.cu_seqlens.tolist() == [0, 2, 5, 6, 9, 12]
    assert documents.cu_seqlens.dtype == torch.int32 and documents.max_seqlen == 3
    assert documents.positions.tolist() == [0, 1, 0, 1, 2, 0, 0, 1, 2, 0, 1, 2]
