"""FlashAttention-2 tests: the course's four, then an extension against a float64 reference.

Without a GPU the Triton tests run through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so they are executed, never skipped. `uv run pytest -k test_flash` (the course's
command) selects the course's tests and the core cases (`test_flash_*`: one shape per dtype, causal and
not, bad input, GQA, the op's contracts), a couple of minutes on two CPU cores; the deeper matrix (more
shapes, split passes, the inlined kernels, host plans, designs: `test_attention_*`) runs in the full suite.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from cs336_systems.flash import triton_kernels

from .adapters import get_flashattention_autograd_function_pytorch, get_flashattention_autograd_function_triton
from .helpers import (
    DEVICE, band_reference, check_against_float64, make_inputs, max_err, reference_attention, rel_err, run,
)


# ---------------------------------------------------------------------------------------------
# The course's tests: (batch 4, 128 queries, 128 keys, D 64), fp32, tolerance 1e-2.
# ---------------------------------------------------------------------------------------------


def _make_attn_inputs(device=None):
    torch.random.manual_seed(0)
    batch_size, n_queries, n_keys, D = 4, 128, 128, 64
    q = torch.randn(batch_size, n_queries, D, device=device, requires_grad=True)
    k = torch.randn(batch_size, n_keys, D, device=device, requires_grad=True)
    v = torch.randn(batch_size, n_keys, D, device=device, requires_grad=True)
    do = torch.randn(batch_size, n_queries, D, device=device)
    return q, k, v, do


def _test_flash_forward_pass(impl, device="cpu", is_causal=False):
    q, k, v, _do = _make_attn_inputs(device)
    o = impl(q, k, v, is_causal)
    assert o.grad_fn.saved_tensors is not None, "no saved tensors: forward must use ctx.save_for_backward"
    maybe_ls = [t for t in o.grad_fn.saved_tensors if t.shape == (q.shape[0], q.shape[1])]
    assert len(maybe_ls) == 1, f"expected exactly one saved tensor of shape {(q.shape[0], q.shape[1])}, found {len(maybe_ls)}"
    lse = maybe_ls[0]
    o_ref, l_ref = reference_attention(q, k, v, is_causal)
    torch.testing.assert_close(o, o_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, l_ref, rtol=1e-2, atol=1e-2)


def _flash_backward_results(impl, is_causal, device=None):
    q, k, v, do = _make_attn_inputs(device)
    reference_attention(q, k, v, is_causal)[0].backward(do)
    q_ref, k_ref, v_ref = q.grad, k.grad, v.grad
    q.grad, k.grad, v.grad = None, None, None
    impl(q, k, v, is_causal).backward(do)
    return q.grad, k.grad, v.grad, q_ref, k_ref, v_ref


def test_flash_forward_pass_pytorch():
    _test_flash_forward_pass(get_flashattention_autograd_function_pytorch().apply)


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_forward_pass_triton(is_causal):
    _test_flash_forward_pass(get_flashattention_autograd_function_triton().apply, device=DEVICE, is_causal=is_causal)


def test_flash_backward_pytorch():
    dq, dk, dv, dq_ref, dk_ref, dv_ref = _flash_backward_results(
        get_flashattention_autograd_function_pytorch().apply, False)
    torch.testing.assert_close(dq, dq_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dk, dk_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dv, dv_ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_backward_triton(is_causal):
    dq, dk, dv, dq_ref, dk_ref, dv_ref = _flash_backward_results(
        get_flashattention_autograd_function_triton().apply, is_causal, device=DEVICE)
    torch.testing.assert_close(dq, dq_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dk, dk_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dv, dv_ref, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# Extension: against float64, odd sizes, every dtype and head dim, strides, bad input.
# ---------------------------------------------------------------------------------------------

IMPLS = {
    "pytorch": get_flashattention_autograd_function_pytorch,
    "triton": get_flashattention_autograd_function_triton,
}
IMPL_DEVICE = {"pytorch": "cpu", "triton": DEVICE}

# (dtype, rule): fp32 must land within the course's 1e-2 (IEEE dots at the default "highest" matmul
# precision, TF32 at "high"); bf16 and fp16 follow the flash-attention rule, error <= 2x PyTorch's.
FP32_RULE = ("abs", 1e-2)
DTYPE_CASES = [
    pytest.param(torch.float32, FP32_RULE, id="fp32"),
    pytest.param(torch.bfloat16, ("x_torch", 2.0), id="bf16"),
    pytest.param(torch.float16, ("x_torch", 2.0), id="fp16"),
]
SHAPES = [  # (batch, Nq, Nk, D)
    pytest.param((1, 97, 97, 64), id="97x97d64"),
    pytest.param((2, 200, 130, 32), id="200x130d32"),
    pytest.param((1, 130, 200, 16), id="130x200d16"),
    pytest.param((1, 64, 48, 80), id="64x48d80"),
    pytest.param((1, 40, 72, 128), id="40x72d128"),
]
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]


def _matches_float64(impl, shape, is_causal, dtype, rule):
    q, k, v, do = make_inputs(shape, dtype, IMPL_DEVICE[impl])
    ours = run(IMPLS[impl]().apply, q, k, v, do, is_causal)
    check_against_float64(ours, q, k, v, do, is_causal, rule)


@pytest.mark.parametrize("impl", ["pytorch", "triton"])
@pytest.mark.parametrize("shape", SHAPES[:1])
@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("dtype,rule", DTYPE_CASES)
def test_flash_matches_float64(impl, shape, is_causal, dtype, rule):
    _matches_float64(impl, shape, is_causal, dtype, rule)


@pytest.mark.parametrize("impl", ["pytorch", "triton"])
@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("dtype,rule", DTYPE_CASES)
def test_attention_matrix_matches_float64(impl, shape, is_causal, dtype, rule):
    _matches_float64(impl, shape, is_causal, dtype, rule)


@pytest.mark.parametrize("is_causal", CAUSAL)
def test_flash_triton_peaked_logits(is_causal):
    """Scores with a spread of ~30 (q scaled 30x): the online softmax must not overflow or lose the peak."""
    q, k, v, do = make_inputs((1, 100, 90, 64), torch.bfloat16, DEVICE, scale=30.0, seed=1)
    ours = run(IMPLS["triton"]().apply, q, k, v, do, is_causal)
    check_against_float64(ours, q, k, v, do, is_causal, ("x_torch", 2.0))


@pytest.mark.parametrize("is_causal", CAUSAL)
def test_flash_triton_strided_inputs_and_expanded_grad(is_causal):
    """q from a (B, S, H, D) layout, k a strided slice, v a column slice; dO from o.sum() (stride 0)."""
    gen = torch.Generator().manual_seed(2)
    b, h, s, d = 2, 3, 50, 32
    q_bshd = torch.randn(b, s, h, d, generator=gen).to(DEVICE)
    k_big = torch.randn(b, h, 2 * s, d, generator=gen).to(DEVICE)
    v_wide = torch.randn(b, h, s, 2 * d, generator=gen).to(DEVICE)
    q, k, v = q_bshd.transpose(1, 2), k_big[:, :, ::2], v_wide[..., :d]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    do = torch.ones(b, h, s, d, device=DEVICE)
    ours = run(IMPLS["triton"]().apply, q, k, v, do.expand_as(q), is_causal)
    # through o.sum().backward(), which hands the kernel an expanded dO
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    IMPLS["triton"]().apply(*leaves, is_causal).sum().backward()
    for name, x, y in zip(("dQ", "dK", "dV"), ours[1:], (t.grad for t in leaves)):
        # the stride-0 dO compiles to its own kernel specialization: equal up to tf32 rounding
        assert max_err(x, y) <= 1e-3, f"{name} from o.sum().backward() differs by {max_err(x, y):.3g}"
    check_against_float64(ours, q, k, v, do, is_causal, FP32_RULE)


@pytest.mark.parametrize("is_causal", CAUSAL)
def test_flash_triton_tma_path_with_expanded_grad(is_causal):
    """The TMA path (forced on, as on a Hopper GPU) with dO from o.sum(): expanded, copied for TMA."""
    from cs336_systems.flash_triton import KernelOptions, autograd_function

    fn = autograd_function("FlashTma", KernelOptions(tma=True))
    q, k, v, _ = make_inputs((2, 50, 50, 32), torch.float32, DEVICE, seed=15)
    expanded = torch.ones(1, 1, 1, device=DEVICE).expand(2, 50, 32)  # what o.sum().backward() hands over
    assert expanded.stride() == (0, 0, 0)
    ours = run(fn.apply, q, k, v, expanded, is_causal)
    check_against_float64(ours, q, k, v, torch.ones(2, 50, 32, device=DEVICE), is_causal, FP32_RULE)


@pytest.mark.parametrize("is_causal", CAUSAL)
def test_flash_triton_backward_is_deterministic(is_causal):
    """deterministic=True (the two-pass backward): bitwise repeatable."""
    from cs336_systems.flash_triton import flash_attention

    q, k, v, do = make_inputs((2, 96, 80, 32), torch.bfloat16, DEVICE, seed=3)
    first = run(lambda *a: flash_attention(*a, deterministic=True), q, k, v, do, is_causal)
    second = run(lambda *a: flash_attention(*a, deterministic=True), q, k, v, do, is_causal)
    for name, x, y in zip(("O", "dQ", "dK", "dV"), first, second):
        assert torch.equal(x, y), f"{name} differs between two identical runs: max diff {max_err(x, y):.3g}"


@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("shape", SHAPES[:2])
@pytest.mark.parametrize("dtype,rule", DTYPE_CASES[:2])
def test_attention_atomic_backward_matches_float64(shape, is_causal, dtype, rule):
    """deterministic=False: the single-pass backward that adds dQ with fp32 atomics."""
    from cs336_systems.flash_triton import flash_attention

    q, k, v, do = make_inputs(shape, dtype, DEVICE, seed=14)
    ours = run(lambda *a: flash_attention(*a, deterministic=False), q, k, v, do, is_causal)
    check_against_float64(ours, q, k, v, do, is_causal, rule)


@pytest.mark.parametrize("leading", [(), (2,), (2, 3), (2, 2, 2)], ids=["2d", "3d", "4d", "5d"])
def test_flash_functional_api_any_leading_dims(leading):
    from cs336_systems.flash_triton import flash_attention

    gen = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(*leading, n, 16, generator=gen).to(DEVICE) for n in (33, 40, 40, 33))
    ours = run(flash_attention, q, k, v, do, True)
    assert ours[0].shape == q.shape, f"output shape {tuple(ours[0].shape)} != {tuple(q.shape)}"
    check_against_float64(ours, q, k, v, do, True, FP32_RULE)


def test_attention_ablation_variants_compute_the_same_function():
    from cs336_systems.flash_ablation import ABLATION_VARIANTS

    q, k, v, do = make_inputs((1, 70, 70, 32), torch.float32, DEVICE, seed=5)
    for name, fn in ABLATION_VARIANTS.items():
        ours = run(fn.apply, q, k, v, do, True)
        try:
            check_against_float64(ours, q, k, v, do, True, FP32_RULE)
        except AssertionError as e:
            raise AssertionError(f"variant {name}: {e}") from e


def _bad_inputs():
    ok = torch.randn(2, 8, 16)
    return [
        pytest.param((ok, torch.randn(3, 8, 16), torch.randn(3, 8, 16), False), ValueError, "batch", id="batch"),
        pytest.param((ok, torch.randn(2, 8, 32), torch.randn(2, 8, 32), False), ValueError, "head dim", id="head-dim"),
        pytest.param((ok, torch.randn(2, 8, 16), torch.randn(2, 9, 16), False), ValueError, "lengths", id="kv-len"),
        pytest.param((ok, ok, torch.randn(8, 16), False), ValueError, "dimensions", id="ndim"),
        pytest.param((ok.double(), ok.double(), ok.double(), False), TypeError, "dtype", id="float64"),
        pytest.param((ok, ok.half(), ok, False), TypeError, "dtype", id="mixed-dtype"),
        pytest.param((ok.long(), ok.long(), ok.long(), False), TypeError, "dtype", id="int"),
        pytest.param((ok, ok.to("meta"), ok, False), ValueError, "device", id="device"),
        pytest.param((ok.numpy(), ok, ok, False), TypeError, "Tensor", id="not-tensor"),
        pytest.param((ok, ok, ok, 1), TypeError, "is_causal", id="causal-not-bool"),
        pytest.param((ok[:, :0], ok, ok, False), ValueError, "at least 1", id="empty"),
    ]


@pytest.mark.parametrize("impl", ["pytorch", "triton"])
@pytest.mark.parametrize("args,error,words", _bad_inputs())
def test_flash_bad_input_raises(impl, args, error, words):
    with pytest.raises(error, match=words):
        IMPLS[impl]().apply(*args)


def test_flash_triton_falls_back_to_pytorch_on_cpu_without_the_interpreter(monkeypatch):
    """Without CUDA and without the interpreter the op runs the tiled PyTorch implementation."""
    import cs336_systems.flash.launch as launch
    import cs336_systems.flash_triton as ft

    monkeypatch.setattr(launch, "INTERPRET", False)
    q, k, v, do = make_inputs((2, 40, 40, 16), torch.float32, "cpu", seed=6)
    ours = run(ft.flash_attention, q, k, v, do, True)
    check_against_float64(ours, q, k, v, do, True, FP32_RULE)
    with pytest.raises(ValueError, match="CUDA"):  # the launchers themselves still refuse
        ft.flash_forward_triton(q, k, v, True)


@pytest.fixture
def fresh_plans(monkeypatch):
    """Empty host-plan caches for a test that monkeypatches what flash_triton decides its plans from: the plans made
    under the patches go when the test ends, with the patches."""
    import cs336_systems.flash.launch as launch

    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    monkeypatch.setattr(launch, "_BACKWARD_PLANS", {})


@pytest.fixture
def cpu_decisions(monkeypatch):
    """For a test that records which kernels flash_triton would launch on CPU tensors, every launch patched: the
    launch path as it runs under the interpreter (no device index, no prewarm, CPU tensors accepted), on a machine
    with a GPU too, where TRITON_INTERPRET is off (the course's `pytest -k test_flash` runs these there)."""
    import cs336_systems.flash.launch as launch

    monkeypatch.setattr(launch, "INTERPRET", True)


@pytest.mark.parametrize("opts,min_work,gluon_config", [
    ({}, 1 << 30, "triton"),                                   # default: only calls of 2^30+ work
    ({}, 1, None),                                             # ... which this one is, with the threshold at 1
    ({"gluon_fwd": False}, 1, "triton"),
    ({"gluon_fwd": True}, 1 << 30, None),                      # wherever it applies, its own config
    ({"gluon_fwd": True, "autotune": False, "configs": (("fwd", (64, 128, 12, 3)),)}, 1 << 30, (64, 128, 12, 3)),
    # a Triton config in the options (a sweep's fixed configs) is not handed to the Gluon kernel
    ({"autotune": False, "configs": (("fwd", (128, 64, 4, 3)),)}, 1, None),
], ids=["default-small", "default-large", "off", "on", "on-with-config", "auto-keeps-triton-config"])
@pytest.mark.usefixtures("cpu_decisions")
def test_flash_forward_chooses_the_gluon_kernel(monkeypatch, fresh_plans, opts, min_work, gluon_config):
    """Which forward `flash_forward_triton` launches (the launches recorded, not run): the Gluon kernel
    where KernelOptions.gluon_fwd asks for it and it applies, with its config; else the Triton kernel."""
    from cs336_systems.flash import background, chooser, launch

    calls = []
    triton = lambda *a, **kw: calls.append(("triton", None))  # noqa: E731
    monkeypatch.setattr(launch, "tma_wanted", lambda o, q: True)
    monkeypatch.setattr(chooser, "GLUON_FWD_MIN_WORK", min_work)
    monkeypatch.setattr(launch.gluon, "fwd_supported", lambda q4, k4, v4, config=None: True)
    monkeypatch.setattr(launch.gluon, "forward_launch", lambda is_causal, config, cached, band: (
        lambda tensors, scale: calls.append(("gluon", config))))
    monkeypatch.setitem(launch._TILED, "fwd", (triton, triton))
    q = torch.zeros(1, 2, 128, 64)
    launch.flash_forward_triton(q, q, q, True, chooser.KernelOptions(**opts))
    assert calls == ([("triton", None)] if gluon_config == "triton" else [("gluon", gluon_config)])


@pytest.mark.parametrize("opts,min_work,single,expected", [
    ({}, 1 << 30, True, ("triton",)),                          # default: only calls of 2^30+ work ...
    ({}, 1, True, ("gluon", False, None, True)),               # ... take the Gluon single pass (keys on rows)
    ({}, 1, False, ("gluon", True, None, False)),              # where it applies, else the queries-on-rows two-pass
    ({"single_qrows": True}, 1, True, ("gluon", True, None, True)),  # the queries-on-rows single pass
    ({"deterministic": True}, 1, True, ("gluon", True, None, False)),
    ({"deterministic": True, "kv_qrows": False}, 1, True, ("gluon", False, None, False)),
    ({"gluon_kv": False}, 1, True, ("triton",)),
    ({"gluon_kv": True, "deterministic": True}, 1 << 30, True, ("gluon", True, None, False)),  # wherever it applies
    ({"gluon_kv": True, "autotune": False, "configs": (("kv", (128, 128, 8, 2)),)}, 1 << 30, False,
     ("gluon", True, (128, 128, 8, 2), False)),
    # a Triton config in the options (a sweep's fixed configs) is not handed to the Gluon kernel
    ({"autotune": False, "configs": (("kv", (32, 128, 4, 3)),)}, 1, False, ("gluon", True, None, False)),
    ({"deterministic": False}, 1, True, ("gluon", False, None, True)),
    ({"deterministic": False}, 1, False, ("triton",)),         # the Triton single pass where Gluon's does not apply
    ({"deterministic": False}, 1 << 30, True, ("triton",)),
], ids=["default-small", "default-large", "default-large-two-pass", "single-qrows", "deterministic",
        "deterministic-keys-on-rows", "off", "on", "on-with-config", "auto-keeps-triton-config", "atomic",
        "atomic-triton", "atomic-small"])
@pytest.mark.usefixtures("cpu_decisions")
def test_flash_backward_chooses_the_kv_pass(monkeypatch, fresh_plans, opts, min_work, single, expected):
    """Which dK/dV pass `flash_backward_triton` launches (recorded, not run): the Gluon single pass with a dQ
    accumulator (keys on rows unless single_qrows) where its config applies (`single`) and deterministic is
    not True, else the Gluon two-pass dK/dV pass (queries on rows unless kv_qrows=False), where
    KernelOptions.gluon_kv asks for it and it applies, else the Triton pass."""
    from cs336_systems.flash import background, chooser, launch

    calls = []
    nothing = lambda *a, **kw: None  # noqa: E731
    triton = lambda *a, **kw: calls.append(("triton",))  # noqa: E731
    monkeypatch.setattr(launch, "tma_wanted", lambda o, q: True)
    monkeypatch.setattr(launch, "tma_ok", lambda *tensors: True)
    monkeypatch.setitem(chooser.GLUON_BWD_MIN_WORK, (64, True), min_work)
    monkeypatch.setitem(chooser.GLUON_KV_MIN_WORK, 64, min_work // 2)
    monkeypatch.setattr(launch.gluon, "supported", lambda *a, single_pass=False, **kw: single or not single_pass)
    monkeypatch.setattr(launch.gluon, "kv_launch", lambda is_causal, config, cached, qrows, band: (
        lambda tensors, scale: calls.append(("gluon", qrows, config, tensors[8] is not None))))
    monkeypatch.setitem(launch._TILED, "kv", (triton, triton))
    monkeypatch.setitem(launch._TILED, "dq", (nothing, nothing))
    for launcher in ("_prep_launch", "_cast_launch"):
        monkeypatch.setattr(launch, launcher, nothing)
    q = torch.zeros(1, 2, 128, 64)
    lse = torch.zeros(1, 2, 128)
    launch.flash_backward_triton(q, q, q, q, lse, q, True, chooser.KernelOptions(split_rows=0, **opts))
    assert calls == [expected]


@pytest.mark.parametrize("window", [(-1, -1), (100, 0)], ids=["dense", "window"])
@pytest.mark.usefixtures("cpu_decisions")
def test_flash_gluon_plans_hand_the_compiles_ahead_what_they_would_launch(monkeypatch, fresh_plans, window):
    """A call collected for the background compiles (`warm`, launching nothing) whose plans run the Gluon forward
    and single pass hands over those kernels with the constexprs and scalar arguments that the Gluon launches
    (`gluon.forward_launch`, `gluon.kv_launch`) hand ahead for tensors of the call's layout and its window's band."""
    from cs336_systems.flash import chooser, gluon, launch

    monkeypatch.setattr(launch, "tma_wanted", lambda o, q: True)
    monkeypatch.setattr(launch, "tma_ok", lambda *tensors: True)
    monkeypatch.setattr(chooser, "GLUON_FWD_MIN_WORK", 1)
    for causal in (True, False):  # (a window's threshold is the non-causal one)
        monkeypatch.setitem(chooser.GLUON_BWD_MIN_WORK, (64, causal), 1)
    monkeypatch.setattr(gluon, "fwd_supported", lambda *a, **kw: True)
    monkeypatch.setattr(gluon, "supported", lambda *a, **kw: True)
    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 256)
    band = launch.call_band(q, q, True, window)

    def scalars(args):
        return [a for a in args if type(a) in (int, float)]

    forward: list = []
    launch.flash_forward_triton(q, q, q, True, chooser.DEFAULT_OPTIONS, warm=forward, window=window)
    expected = gluon.forward_launch(True, band=band).ahead((q, q, q, q, lse), 0.125)
    assert [(a.name, scalars(args), constexprs) for a, args, constexprs in forward] == [
        (expected[0].name, scalars(expected[1]), expected[2])]
    backward: list = []
    launch.flash_backward_triton(q, q, q, q, lse, q, True, chooser.DEFAULT_OPTIONS, warm=backward, window=window)
    ahead = [(a.name, scalars(args), constexprs) for a, args, constexprs in backward
             if "gluon" in getattr(a, "name", "")]
    rows = lse.flatten(0, 1)
    expected = gluon.kv_launch(True, band=band).ahead((q, q, q, q, rows, rows, q, q, torch.zeros(2, 256, 64)), 0.125)
    assert ahead == [(expected[0].name, scalars(expected[1]), expected[2])]


@pytest.mark.parametrize("flag,torch_deterministic,expected", [
    (None, False, None), (None, True, True), (True, False, True), (False, False, False), (False, True, False),
])
def test_flash_deterministic_flag_picks_the_backward(monkeypatch, flag, torch_deterministic, expected):
    """deterministic=None follows torch.are_deterministic_algorithms_enabled() (True: the two-pass backward;
    off: None, the faster design for the call); a bool forces a design. The options reaching the backward
    are recorded, not run."""
    import cs336_systems.flash.ops as ops

    seen = []

    def backward(do, q, k, v, o, lse, is_causal, scale, opts, window):
        seen.append(opts.deterministic)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(ops, "attention_backward", backward)
    q = torch.randn(1, 2, 32, 16, device=DEVICE, requires_grad=True)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(torch_deterministic)
    try:
        ops.flash_attention(q, q, q, True, deterministic=flag).sum().backward()
    finally:
        torch.use_deterministic_algorithms(before)
    assert seen == [expected]


def test_flash_deterministic_flag_rejects_non_bools():
    from cs336_systems.flash_triton import flash_attention

    x = torch.randn(1, 2, 32, 16, device=DEVICE)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attention(x, x, x, True, deterministic="yes")


def test_flash_triton_rejects_too_large_head_dim():
    x = torch.randn(1, 8, 512, device=DEVICE)
    with pytest.raises(ValueError, match="head dim"):
        IMPLS["triton"]().apply(x, x, x, False)


# ---------------------------------------------------------------------------------------------
# The op: SDPA-style API, GQA, scale, fp32 precision, custom-op registration, exact masking.
# ---------------------------------------------------------------------------------------------


def _sdpa64(q, k, v, is_causal, scale=None, group=1):
    """F.scaled_dot_product_attention in float64 with K/V heads repeated for GQA."""
    k, v = (t.double().repeat_interleave(group, dim=-3) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k, v, is_causal=is_causal, scale=scale)


@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic"])
def test_flash_gqa_matches_sdpa_float64(is_causal, deterministic):
    """4 query heads share 2 K/V heads (the kernel indexes the K/V head; dK, dV sum their group)."""
    from cs336_systems.flash_triton import flash_attention

    gen = torch.Generator().manual_seed(7)
    q, do = (torch.randn(2, 4, 40, 32, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, 56, 32, generator=gen) for _ in range(2))
    q, k, v, do = (t.to(DEVICE) for t in (q, k, v, do))
    ours = run(lambda *a: flash_attention(*a, enable_gqa=True, deterministic=deterministic), q, k, v, do, is_causal)
    exact = run(lambda *a: _sdpa64(*a, group=2), *(t.double() for t in (q, k, v, do)), is_causal)
    for name, x, ref in zip(("O", "dQ", "dK", "dV"), ours, exact):
        assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
        assert rel_err(x, ref) <= 1e-5, f"{name}: relative error {rel_err(x, ref):.3g} vs float64 SDPA"


@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("fused_prep", [True, False], ids=["delta-in-dq-pass", "pre-pass-kernel"])
def test_attention_backward_delta_designs_with_gqa_and_expanded_grad(is_causal, fused_prep):
    """delta computed by the dQ pass (and the expanded dO copied by it for the TMA loads of the dK/dV
    pass) or by the pre-pass kernel: both match float64 with GQA and dO from o.sum()."""
    from cs336_systems.flash_triton import KernelOptions, flash_backward_triton, flash_forward_triton

    gen = torch.Generator().manual_seed(17)
    q = torch.randn(2, 4, 40, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 2, 56, 32, generator=gen).to(DEVICE) for _ in range(2))
    opts = KernelOptions(tma=True, fused_prep=fused_prep)  # TMA as on a Hopper GPU (forced)
    o, lse = flash_forward_triton(q, k, v, is_causal, opts)
    do = torch.ones(1, 1, 1, 1, device=DEVICE).expand_as(o)  # what o.sum().backward() hands over
    grads = flash_backward_triton(q, k, v, o, lse, do, is_causal, opts)
    exact = run(lambda *a: _sdpa64(*a, group=2), *(t.double() for t in (q, k, v, torch.ones_like(o))), is_causal)
    for name, x, ref in zip(("dQ", "dK", "dV"), grads, exact[1:]):
        assert rel_err(x, ref) <= 1e-5, f"{name}: relative error {rel_err(x, ref):.3g} vs float64 SDPA"


@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("tma", [False, True], ids=["block-pointers", "tma"])
@pytest.mark.parametrize("do_layout", ["contiguous", "expanded"])
def test_attention_inlined_kernels_match_float64(monkeypatch, is_causal, tma, do_layout):
    """The op bodies Inductor traces on a GPU (`forward_inlined`, `backward_inlined`: the flat entry kernels, each
    stride its own argument) compute the same function, here through the interpreter: GQA, ragged Nq != Nk, dO
    contiguous or o.sum()'s expand (copied by the dQ pass where the passes load through TMA)."""
    import cs336_systems.flash_triton as ft
    from cs336_systems.flash import chooser, ops

    monkeypatch.setattr(chooser, "tma_default", lambda index: tma)  # TMA where the GPU has it: forced either way
    gen = torch.Generator().manual_seed(19)
    q = torch.randn(2, 4, 40, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 2, 56, 32, generator=gen).to(DEVICE) for _ in range(2))
    do = torch.randn(q.shape, generator=gen) if do_layout == "contiguous" else torch.ones(1, 1, 1, 1).expand(q.shape)
    do = do.to(DEVICE)
    o, lse = ops.forward_inlined(q, k, v, is_causal, 0.3)
    grads = ops.backward_inlined(do, q, k, v, o, lse, is_causal, 0.3)
    exact = run(lambda *a: _sdpa64(*a, scale=0.3, group=2), *(t.double() for t in (q, k, v, do)), is_causal)
    for name, x, ref in zip(("O", "dQ", "dK", "dV"), (o, *grads), exact):
        assert x.shape == ref.shape and x.is_contiguous(), f"{name}: shape {tuple(x.shape)}, strides {x.stride()}"
        assert rel_err(x, ref) <= 1e-5, f"{name}: relative error {rel_err(x, ref):.3g} vs float64 SDPA"
    lse_launchers = ft.flash_forward_triton(q, k, v, is_causal, ft.KernelOptions(tma=tma), 0.3)[1]
    assert torch.allclose(lse, lse_launchers, rtol=1e-6, atol=1e-6), "L differs from the launchers' (natural log)"


@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("tma", [None, True], ids=["default", "tma-forced"])
def test_attention_split_passes_match_float64(is_causal, tma):
    """Short grids split each pass's reduction into chunks (forced here: 128 rows, so 3 chunks), merged
    by the combine and sum kernels: the same function as unsplit (GQA, ragged Nq != Nk; with TMA forced
    the dO of o.sum(), which the dQ pass's chunk 0 copies), and a bitwise-repeatable backward."""
    from cs336_systems.flash_triton import KernelOptions, flash_backward_triton, flash_forward_triton

    gen = torch.Generator().manual_seed(23)
    q = torch.randn(1, 4, 300, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 2, 270, 32, generator=gen).to(DEVICE) for _ in range(2))
    opts = KernelOptions(tma=tma, split_rows=128)
    o, lse = flash_forward_triton(q, k, v, is_causal, opts)
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    if tma:
        do = torch.ones(1, 1, 1, 1, device=DEVICE).expand_as(o)
    grads = flash_backward_triton(q, k, v, o, lse, do, is_causal, opts)
    exact = run(lambda *a: _sdpa64(*a, group=2), *(t.double() for t in (q, k, v, do)), is_causal)
    for name, x, ref in zip(("O", "dQ", "dK", "dV"), (o, *grads), exact):
        assert rel_err(x, ref) <= 1e-5, f"{name}: relative error {rel_err(x, ref):.3g} vs float64 SDPA"
    _, l_ref = reference_attention(q.double(), k.double().repeat_interleave(2, 1),
                                   v.double().repeat_interleave(2, 1), is_causal)
    assert max_err(lse, l_ref) <= 1e-4, f"L: max error {max_err(lse, l_ref):.3g}"
    again = flash_backward_triton(q, k, v, o, lse, do, is_causal, opts)
    for name, x, y in zip(("dQ", "dK", "dV"), grads, again):
        assert torch.equal(x, y), f"{name} differs between two runs of the split backward"


def test_attention_op_backward_splits_into_unshared_outputs(monkeypatch, fresh_plans):
    """The backward op (what torch.compile runs) where its passes split, as short grids do on the GPU (forced
    here): the op's outputs must not share storage (torch.library checks it on every call; dK and dV were once
    one allocation there) and must match float64."""
    import cs336_systems.flash_triton as ft
    from cs336_systems.flash import chooser

    monkeypatch.setattr(chooser, "_split", lambda opts, call, n_rows, n_reduce: 128)
    gen = torch.Generator().manual_seed(29)
    q = torch.randn(1, 2, 260, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 1, 200, 16, generator=gen).to(DEVICE) for _ in range(2))
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    o, lse = ft.flash_attn_fwd(q, k, v, True, 0.25)
    grads = ft.flash_attn_bwd(do, q, k, v, o, lse, True, 0.25, True)
    exact = run(lambda *a: _sdpa64(*a, scale=0.25, group=2), *(t.double() for t in (q, k, v, do)), True)
    for name, x, ref in zip(("O", "dQ", "dK", "dV"), (o, *grads), exact):
        assert rel_err(x, ref) <= 1e-5, f"{name}: relative error {rel_err(x, ref):.3g} vs float64 SDPA"


def _plan_call(batch=1, dtype=torch.float32, is_causal=True, scale=None, opts="default", do="contiguous", offset=0,
               precision="highest"):
    """flash_forward_triton and flash_backward_triton on (batch, 2 heads, 24, 16) inputs: q at `offset` elements
    into its buffer (1: not 16-byte aligned), dO "contiguous", "transposed" (from a (B, S, H, D) layout) or
    "expanded" (o.sum()'s), fp32 dots at `precision`. Gives (O, dQ, dK, dV) and float64 SDPA's."""
    import cs336_systems.flash_triton as ft
    from cs336_systems.flash import chooser

    options = {"default": chooser.DEFAULT_OPTIONS, "tma": ft.KernelOptions(tma=True),  # TMA forced, as on Hopper
               "deterministic": chooser.DETERMINISTIC_OPTIONS, "atomic": chooser.ATOMIC_OPTIONS}[opts]
    gen = torch.Generator().manual_seed(31)
    shape = (batch, 2, 24, 16)
    n = batch * 2 * 24 * 16
    q = torch.randn(offset + n, generator=gen).to(DEVICE)[offset:].view(shape).to(dtype)
    k, v = (torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in range(2))
    # each layout made on the device (moved to another device, an expanded tensor comes out contiguous)
    dos = {"contiguous": lambda: torch.randn(shape, generator=gen).to(DEVICE, dtype),
           "transposed": lambda: torch.randn(batch, 24, 2, 16, generator=gen).to(DEVICE, dtype).transpose(1, 2),
           "expanded": lambda: torch.ones(1, 1, 1, 1, device=DEVICE, dtype=dtype).expand(shape)}
    d_o = dos[do]()
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        o, lse = ft.flash_forward_triton(q, k, v, is_causal, options, scale)
        ours = (o, *ft.flash_backward_triton(q, k, v, o, lse, d_o, is_causal, options, scale))
    finally:
        torch.set_float32_matmul_precision(previous)
    exact = run(lambda *a: _sdpa64(*a, scale=scale), *(t.double() for t in (q, k, v, d_o)), is_causal)
    return ours, exact


PLAN_PAIRS = {  # a call, then one that differs from it in one thing that flash_triton's host plans are decided from
    "batch": ({}, {"batch": 2}),  # contiguous: the batch is in no stride, only in the shape
    "dtype": ({"dtype": torch.bfloat16}, {"dtype": torch.float16}),  # (fp32 would differ in its precision too)
    "causal": ({}, {"is_causal": False}),
    "dO-strides": ({"opts": "tma"}, {"opts": "tma", "do": "transposed"}),
    "dO-expanded": ({"opts": "tma"}, {"opts": "tma", "do": "expanded"}),
    "alignment": ({"opts": "tma"}, {"opts": "tma", "offset": 1}),
    "deterministic": ({"opts": "deterministic"}, {"opts": "atomic"}),
    "options": ({}, {"opts": "tma"}),
    "fp32-precision": ({}, {"precision": "high"}),
}


@pytest.mark.parametrize("change", list(PLAN_PAIRS))
def test_attention_host_plans_keep_apart_calls_that_differ(monkeypatch, fresh_plans, change):
    """flash_triton decides once per signature (a host plan) what it launches. A call right after one that differs
    from it in one thing those decisions read must still match float64, launch just what it launches with no plan
    made before it (each planned launch recorded: kernel, grid, arguments other than tensors, constexprs), and
    reuse a planned launch only with the launcher signature it was planned for (on the GPU its compiled kernel is
    then called directly, with no signature taken)."""
    import cs336_systems.flash.launch as launch

    if not torch.cuda.is_available():  # the launcher's signature starts with the current CUDA device
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launches, signatures = [], {}
    planned = launch._PlannedLaunch.__call__

    def record(self, buffer, *tensors, scale=None):
        args = self.arguments(tensors, scale)
        launches.append((self.launcher.name, self.grid, [a for a in args if not isinstance(a, torch.Tensor)],
                         self.constexprs))
        signatures.setdefault(self, set()).add(self.launcher._key(self.grid, args, self.constexprs))
        return planned(self, buffer, *tensors, scale=scale)

    monkeypatch.setattr(launch._PlannedLaunch, "__call__", record)
    first, second = PLAN_PAIRS[change]
    _plan_call(**first)
    launches.clear()
    ours, exact = _plan_call(**second)
    after_another = launches.copy()
    ieee = second.get("dtype", torch.float32) == torch.float32 and second.get("precision", "highest") == "highest"
    for name, x, ref in zip(("O", "dQ", "dK", "dV"), ours, exact):
        assert x.dtype == second.get("dtype", torch.float32), f"{name} is {x.dtype}"
        bound = 1e-5 if ieee else 1e-2  # (TF32 dots on the GPU at "high")
        assert rel_err(x, ref) <= bound, f"{name}: relative error {rel_err(x, ref):.3g} vs float64 SDPA"
    assert all(len(seen) == 1 for seen in signatures.values()), "a planned launch served two launcher signatures"
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    monkeypatch.setattr(launch, "_BACKWARD_PLANS", {})
    launches.clear()
    _plan_call(**second)
    assert after_another == launches


def test_attention_host_plans_take_the_scale_per_call(fresh_plans):
    """The scale is a kernel argument, in no plan's key: calls of varying scales share one plan per pass (a plan
    per scale would grow without bound under a schedule), and each gets its own scale."""
    import cs336_systems.flash.launch as launch

    for scale in (0.3, None, 0.7):
        ours, exact = _plan_call(scale=scale)
        for name, x, ref in zip(("O", "dQ", "dK", "dV"), ours, exact):
            assert rel_err(x, ref) <= 1e-5, f"scale {scale}, {name}: relative error {rel_err(x, ref):.3g}"
    assert len(launch._FORWARD_PLANS) == len(launch._BACKWARD_PLANS) == 1


@pytest.mark.parametrize("shape,expected", [
    ((16, 16384, 16384, True), 0),        # the leaderboard: ~8 waves of programs, never split
    ((1, 65536, 65536, True), 0),
    ((16, 1024, 1024, True), 0),          # short loops: host-bound, no merge launches added
    ((1, 4096, 4096, True), 0),           # 32 programs for 132 SMs, but host-bound on the H200
    ((1, 8192, 8192, True), 0),
    ((1, 16384, 16384, True), 4096),      # 128 programs: the longest loop cut 4x
    ((1, 32768, 32768, True), 16384),
    ((1, 16384, 16384, True, 1), 8192),   # one program per SM (head dim > 64): half the slots
    ((1, 32768, 32768, True, 1), 0),      # the longest program is as long as the SM's share
    ((1, 16384, 16384, False), 8192),     # 128 equal programs on 264 slots: 2 chunks each
    ((4, 16384, 16384, True), 0),         # 512 programs of 64 steps on average: long enough
])
def test_flash_split_rows_splits_only_short_grids(shape, expected):
    from cs336_systems.flash_triton import split_rows

    *shape, per_sm = shape if len(shape) == 5 else (*shape, 2)
    assert split_rows(*shape, sms=132, per_sm=per_sm) == expected


@pytest.mark.parametrize("rows", [100, -128, True, 1.5, "128"])
def test_flash_split_rows_option_is_checked(rows):
    from cs336_systems.flash_triton import KernelOptions

    with pytest.raises(ValueError, match="split_rows"):
        KernelOptions(split_rows=rows)


def test_flash_attention_is_exported_from_the_package():
    import cs336_systems
    from cs336_systems.flash_triton import flash_attention

    assert cs336_systems.flash_attention is flash_attention


def test_flash_gqa_needs_the_flag_and_dividing_heads():
    from cs336_systems.flash_triton import flash_attention

    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="head counts .*enable_gqa=True allows"):
        flash_attention(q, k, k)
    with pytest.raises(ValueError, match="divide"):
        flash_attention(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        flash_attention(q[0, 0], k[0, 0], k[0, 0], enable_gqa=True)


@pytest.mark.parametrize("is_causal", CAUSAL)
def test_flash_custom_scale_matches_sdpa(is_causal):
    from cs336_systems.flash_triton import flash_attention

    q, k, v, do = make_inputs((2, 33, 47, 16), torch.float32, DEVICE, seed=8)
    ours = run(lambda *a: flash_attention(*a, scale=0.9), q, k, v, do, is_causal)
    exact = run(lambda *a: _sdpa64(*a, scale=0.9), *(t.double() for t in (q, k, v, do)), is_causal)
    for name, x, ref in zip(("O", "dQ", "dK", "dV"), ours, exact):
        assert rel_err(x, ref) <= 1e-5, f"{name}: relative error {rel_err(x, ref):.3g}"


@pytest.mark.parametrize("scale,error", [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                         ("0.5", TypeError), (True, TypeError)])
def test_flash_bad_scale_raises(scale, error):
    from cs336_systems.flash_triton import flash_attention

    x = torch.randn(1, 8, 16)
    with pytest.raises(error, match="scale"):
        flash_attention(x, x, x, False, scale)


def test_flash_fp32_highest_precision_is_ieee(monkeypatch):
    """At torch's default "highest" fp32 matmul precision the dots are IEEE fp32: ~1e-6, not TF32's ~1e-3."""
    from cs336_systems.flash_triton import flash_attention

    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    q, k, v, do = make_inputs((1, 64, 64, 32), torch.float32, DEVICE, seed=9)
    ours = run(flash_attention, q, k, v, do, True)
    check_against_float64(ours, q, k, v, do, True, ("rel", 1e-5))


@pytest.mark.parametrize("impl", ["pytorch", "triton"])
@pytest.mark.parametrize("scores", [-2e6, -1e7], ids=["-2e6", "-1e7"])
def test_flash_causal_mask_is_exact_below_minus_1e6(impl, scores):
    """Query 0 sees only key 0, whose score is below -1e6: the output is v[0] (as SDPA), not a mix."""
    n, d = 20, 16
    q = torch.zeros(1, n, d)
    q[0, :, 0] = 1.0
    k = torch.zeros(1, n, d)
    k[0, :, 0] = scores * d ** 0.5  # q·k/sqrt(d) = scores for every pair
    v = torch.randn(1, n, d, generator=torch.Generator().manual_seed(10))
    q, k, v = (t.to(IMPL_DEVICE[impl]) for t in (q, k, v))
    o = IMPLS[impl]().apply(q, k, v, True)
    expected = torch.nn.functional.scaled_dot_product_attention(q.cpu().double(), k.cpu().double(),
                                                                v.cpu().double(), is_causal=True)
    assert torch.allclose(o.cpu().double(), expected, atol=1e-5), (o[0, :2, :4], expected[0, :2, :4])


@pytest.mark.parametrize("impl", ["pytorch", "triton"])
def test_flash_double_backward_raises_clearly(impl):
    q, k, v = (torch.randn(1, 16, 16, device=IMPL_DEVICE[impl], requires_grad=True) for _ in range(3))
    o = IMPLS[impl]().apply(q, k, v, True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(o.sum(), q, create_graph=True)


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU interpreter switch")
def test_attention_reads_triton_interpret_as_triton_does():
    """TRITON_INTERPRET=true (which Triton accepts) runs the kernels on the CPU, as =1 does."""
    import os
    import subprocess
    import sys

    code = ("import torch; import cs336_systems.flash_triton as ft; x = torch.randn(1, 8, 16); "
            "o = ft.flash_attention(x, x, x, True); assert ft.INTERPRET and o.shape == x.shape; print('ok')")
    env = {**os.environ, "TRITON_INTERPRET": "true"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


_MUTATIONS_CODE = """
import torch, triton
from triton.backends.compiler import GPUTarget
from torch._higher_order_ops.triton_kernel_wrap import identify_mutated_tensors


class Hopper:  # what TTIR generation asks of the active driver: the target (no GPU needed)
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(Hopper())
import cs336_systems.flash.triton_kernels as ft

tile = torch.empty(1, 4, 128, 64, dtype=torch.bfloat16)
rows = torch.empty(4, 128)
sizes = [4, 1, 128, 128, 0.125]  # N_HEADS, KV_GROUP, N_QUERIES, N_KEYS, scale
for use_tma in (True, False):
    constexprs = dict(D=64, D_TILE=64, Q_TILE_SIZE=64, K_TILE_SIZE=64, is_causal=True, SKIP_MASKED_TILES=True,
                      USE_TMA=use_tma, PRECISION="tf32", CHECK_Q=False, CHECK_K=False, CHECK_D=False,
                      DP_FIRST=True, COPY_DO=True)
    for kernel, n_tensors in ((ft.flash_fwd_flat_kernel, 5), (ft.flash_bwd_dq_flat_kernel, 9),
                              (ft.flash_bwd_kv_flat_kernel, 8)):
        names = kernel.arg_names
        tensors = [rows if n in ("L_ptr", "Delta_ptr") else tile for n in names[:n_tensors]]
        n_strides = sum(n[0] == "s" and n[-1].isdigit() for n in names)  # sq0 ... : four per tensor
        values = [*tensors, *tile.stride() * (n_strides // 4), *sizes]
        kwargs = {**dict(zip(names, values)), **{n: v for n, v in constexprs.items() if n in names}}
        print(kernel.__name__, use_tma, sorted(identify_mutated_tensors(kernel, kwargs, {})))
"""


def test_attention_flat_kernels_write_only_their_outputs():
    """Inductor's mutation analysis of the flat entry kernels (the TTIR torch.compile reads on a GPU, built here for
    sm_90 without one) finds each writing its outputs only: an input counted as written is cloned before every
    launch, and aliased inputs (the harness's q, k, v, views of one tensor) then crashed the compiled harness."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # jit functions, not the interpreter's
    out = subprocess.run([sys.executable, "-c", _MUTATIONS_CODE], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = {"flash_fwd_flat_kernel": ["L_ptr", "O_ptr"],
                "flash_bwd_dq_flat_kernel": ["Delta_ptr", "dOcopy_ptr", "dQ_ptr"],
                "flash_bwd_kv_flat_kernel": ["dK_ptr", "dV_ptr"]}
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 6, out.stdout
    for line in lines:
        name, use_tma, written = line.split(" ", 2)
        assert written == str(expected[name]), f"{name} (TMA {use_tma}) writes {written}, not only its outputs"


def test_flash_accepts_numpy_bool():
    x = torch.randn(1, 8, 16, device=DEVICE)
    o = IMPLS["triton"]().apply(x, x, x, np.bool_(True))
    assert torch.allclose(o, IMPLS["triton"]().apply(x, x, x, True))


def test_flash_ops_pass_opcheck():
    """torch.library.opcheck: schema, fake (meta) kernels, autograd registration of both ops."""
    from cs336_systems.flash_triton import flash_attn_bwd, flash_attn_fwd

    gen = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(1, 2, 24, 16, generator=gen).to(DEVICE) for _ in range(4))
    torch.library.opcheck(flash_attn_fwd, (q, k, v, True, 0.25))
    o, lse = flash_attn_fwd(q, k, v, True, 0.25)
    for deterministic in (True, False, None):
        torch.library.opcheck(flash_attn_bwd, (do, q, k, v, o, lse, True, 0.25, deterministic),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("is_causal", CAUSAL)
def test_flash_fullgraph_compile_matches_eager(is_causal):
    """torch.compile(fullgraph=True) traces the functional API and the adapters' class with no break (on a GPU,
    Inductor launches and tunes the kernels of this short call itself: float64's rule, not eager's bits)."""
    from cs336_systems.flash_triton import FlashAttention2Triton, flash_attention

    q, k, v, do = make_inputs((2, 48, 48, 16), torch.float32, DEVICE, seed=12)
    eager = run(flash_attention, q, k, v, do, is_causal)
    torch._dynamo.reset()
    for fn in (flash_attention, FlashAttention2Triton.apply):
        compiled = run(torch.compile(fn, fullgraph=True), q, k, v, do, is_causal)
        check_against_float64(compiled, q, k, v, do, is_causal, FP32_RULE)
        if DEVICE == "cpu":  # the interpreter: compiled graphs call the launch ops, as eager calls do
            for name, x, y in zip(("O", "dQ", "dK", "dV"), eager, compiled):
                assert torch.equal(x, y), f"{name}: compiled differs by {max_err(x, y):.3g}"


def test_flash_dynamic_compile_serves_several_lengths():
    """torch.compile(dynamic=True, fullgraph=True) compiles one frame for three sequence lengths (symbolic sizes
    through the checks and the ops' fake implementations: nothing on the path specializes on a length)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from cs336_systems.flash_triton import flash_attention

    torch._dynamo.reset()
    compiles = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda a, b, c: flash_attention(a, b, c, True), backend=compiles, dynamic=True,
                         fullgraph=True)
    for i, n in enumerate((20, 36, 52)):
        q, k, v, do = make_inputs((2, n, n, 16), torch.float32, DEVICE, seed=40 + i)
        check_against_float64(run(step, q, k, v, do), q, k, v, do, True, FP32_RULE)
    assert compiles.frame_count == 1, f"{compiles.frame_count} compiled frames for three lengths"


def test_attention_head_dim_256():
    q, k, v, do = make_inputs((1, 40, 40, 256), torch.float32, DEVICE, seed=13)
    ours = run(IMPLS["triton"]().apply, q, k, v, do, True)
    check_against_float64(ours, q, k, v, do, True, FP32_RULE)


def test_attention_prewarm_collects_a_signatures_launches_without_running_them(fresh_plans):
    """What a signature's first call hands the background compiles: its forward's launch, and its backward's for a
    contiguous and an expanded dO (with TMA the expanded one's dQ pass copies dO: another kernel), none run; and
    the lengths of the other integer class that Triton specializes on."""
    from cs336_systems.flash import background, chooser, launch

    q = torch.randn(1, 2, 40, 16, device=DEVICE)
    forward, backward = launch._collect(q, q, q, True, chooser.KernelOptions(tma=True), True)
    assert [l.name for l, _, _ in forward] == ["fwd"] and [l.name for l, _, _ in backward] == ["dq", "kv", "dq", "kv"]
    assert [c["COPY_DO"] for l, _, c in backward if l.name == "dq"] == [False, True]
    # one background compile per kernel Triton would compile: with TMA the expanded dO's dQ pass copies it, so both
    # layouts share the dK/dV pass; without, every pass reads dO's strides (1 and 0, specialized apart)
    assert len({background.specialization(l.name, a, c) for l, a, c in backward}) == 3
    _, plain = launch._collect(q, q, q, True, chooser.KernelOptions(tma=False), True)
    assert len({background.specialization(l.name, a, c) for l, a, c in plain}) == 4
    assert not launch._FORWARD_PLANS and not launch._BACKWARD_PLANS  # nothing kept that a real call would reuse
    assert [launch._sibling_length(n) for n in (16, 40, 1024, 1025)] == [15, 48, 1023, 1040]


@pytest.mark.parametrize("batch_heads, n, factor", [(32, 1024, 4), (32, 1000, 5), (256, 1024, 1), (32, 2048, 1),
                                                    (1, 64, 32768)])
def test_attention_prewarm_batch_of_the_one_warpgroup_forward(batch_heads, n, factor):
    """The batch factor at which a call's own length runs the Gluon forward over short keys (one consumer warpgroup,
    a config no longer length compiles, so `prewarm` compiles it there): the least that reaches GLUON_FWD_MIN_WORK;
    1 where the call reaches it itself or its keys are past ONE_WARPGROUP_MAX_KEYS."""
    from cs336_systems.flash import chooser, gluon, launch

    assert launch._larger_batch(batch_heads, n, n) == factor
    if n <= gluon.ONE_WARPGROUP_MAX_KEYS and factor > 1:
        assert factor * batch_heads * n * n >= chooser.GLUON_FWD_MIN_WORK > (factor - 1) * batch_heads * n * n
        assert gluon.fwd_config(64, n, False)[2] == 4  # (one warpgroup: 4 consumer warps)


# ---------------------------------------------------------------------------------------------
# Sliding window (`window=(left, right)`): against a float64 band-mask reference.
# ---------------------------------------------------------------------------------------------

WINDOWS = [(0, 0), (3, 0), (5, 7), (-1, 4), (2, -1), (300, 400)]  # the last wider than every sequence here
WINDOW_SHAPES = [pytest.param((1, 50, 37, 16), id="50x37"), pytest.param((1, 37, 50, 16), id="37x50")]


def _window_matches_float64(shape, is_causal, window, dtype, rule, **keywords):
    from cs336_systems.flash_triton import flash_attention

    q, k, v, do = make_inputs(shape, dtype, DEVICE, seed=70)
    ours = run(lambda *a: flash_attention(*a, window=window, **keywords), q, k, v, do, is_causal)
    check_against_float64(ours, q, k, v, do, is_causal, rule,
                          reference=lambda *a: band_reference(*a, window))


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("shape", WINDOW_SHAPES)
def test_flash_window_matches_float64(shape, is_causal, window):
    """Ragged Nq != Nk (rows past the keys see none under a short window: O 0, zero gradients)."""
    _window_matches_float64(shape, is_causal, window, torch.float32, FP32_RULE)


@pytest.mark.parametrize("window", [(5, 7), (-1, 4)], ids=str)
@pytest.mark.parametrize("is_causal", CAUSAL)
def test_attention_window_bf16_meets_2x_rule(is_causal, window):
    _window_matches_float64((1, 70, 70, 32), is_causal, window, torch.bfloat16, ("x_torch", 2.0))


@pytest.mark.parametrize("window", [(3, 0), (5, 7)], ids=str)
@pytest.mark.parametrize("is_causal", CAUSAL)
def test_attention_window_atomic_backward_matches_float64(is_causal, window):
    """deterministic=False: the single pass (dQ by atomics) over the band's tiles."""
    _window_matches_float64((1, 50, 37, 16), is_causal, window, torch.float32, FP32_RULE, deterministic=False)


@pytest.mark.parametrize("is_causal", CAUSAL)
def test_attention_window_with_gqa_matches_float64(is_causal):
    from cs336_systems.flash_triton import flash_attention

    gen = torch.Generator().manual_seed(71)
    q, do = (torch.randn(1, 4, 45, 16, generator=gen).to(DEVICE) for _ in range(2))
    k, v = (torch.randn(1, 2, 39, 16, generator=gen).to(DEVICE) for _ in range(2))
    ours = run(lambda *a: flash_attention(*a, enable_gqa=True, window=(6, 2)), q, k, v, do, is_causal)
    check_against_float64(ours, q, k, v, do, is_causal, FP32_RULE,
                          reference=lambda *a: band_reference(*a, (6, 2)))


def test_flash_window_rows_without_keys_give_zeros_and_minus_inf_lse():
    """Queries past the keys under a window (0, 0): O = 0, L = -inf, zero dQ; no NaN anywhere."""
    from cs336_systems.flash_triton import flash_attention, flash_forward_triton

    q, k, v, do = make_inputs((1, 40, 20, 16), torch.float32, DEVICE, seed=72)
    o, lse = flash_forward_triton(q, k, v, False, window=(0, 0))
    assert torch.equal(o[:, 20:], torch.zeros_like(o[:, 20:]))
    assert torch.isneginf(lse[:, 20:]).all() and torch.isfinite(lse[:, :20]).all()
    _, dq, dk, dv = run(lambda *a: flash_attention(*a, window=(0, 0)), q, k, v, do)
    assert torch.equal(dq[:, 20:], torch.zeros_like(dq[:, 20:])) and torch.isfinite(dk).all()


def test_flash_window_plans_key_on_the_window():
    """Calls of one shape with different windows (and none) each get their own result."""
    from cs336_systems.flash_triton import flash_attention

    q, k, v, _ = make_inputs((1, 40, 40, 16), torch.float32, DEVICE, seed=73)
    for window in [(2, 2), (9, 0), (-1, -1), (2, 2)]:
        ours = flash_attention(q, k, v, window=window)
        assert max_err(ours, band_reference(q.double(), k.double(), v.double(), False, window)) <= 1e-4, window


@pytest.mark.parametrize("window,error,words", [
    ((-2, 0), ValueError, "left"), ((0, -5), ValueError, "right"), ((1,), TypeError, "two ints"),
    ([1, 2, 3], TypeError, "two ints"), ((1.5, 2), TypeError, "left must be an int"),
    ((True, 0), TypeError, "left must be an int"), (None, TypeError, "two ints"), (3, TypeError, "two ints"),
], ids=["left-2", "right-5", "one", "three", "float", "bool", "none", "int"])
def test_flash_bad_window_raises(window, error, words):
    from cs336_systems.flash_triton import flash_attention

    q = torch.randn(1, 8, 16, device=DEVICE)
    with pytest.raises(error, match=words):
        flash_attention(q, q, q, window=window)


def test_flash_window_cpu_fallback_matches_float64(monkeypatch):
    """The CPU without the interpreter (the tiled PyTorch forward and backward): ragged tiles, Nq != Nk."""
    import cs336_systems.flash.launch as launch
    from cs336_systems.flash_triton import flash_attention

    monkeypatch.setattr(launch, "INTERPRET", False)
    q, k, v, do = make_inputs((2, 150, 700, 16), torch.float32, "cpu", seed=74)
    for is_causal in (False, True):
        for window in [(0, 0), (40, 3), (-1, 600), (3, -1), (900, 900)]:
            ours = run(lambda *a: flash_attention(*a, window=window), q, k, v, do, is_causal)
            check_against_float64(ours, q, k, v, do, is_causal, FP32_RULE,
                                  reference=lambda *a: band_reference(*a, window))


@pytest.mark.parametrize("window", [(0, 0), (5, 2), (-1, 3), (20, -1)], ids=str)
@pytest.mark.parametrize("is_causal", CAUSAL)
def test_attention_window_tiled_pytorch_small_tiles(is_causal, window):
    """The tiled PyTorch forward at 8 x 8 tiles (many skipped and cut) and the blocked backward, on its band."""
    from cs336_systems.flash import chooser
    from cs336_systems.flash_pytorch import flash_backward, flash_forward_tiled

    q, k, v, do = make_inputs((1, 45, 37, 16), torch.float32, "cpu", seed=75)
    band = chooser.band(window, is_causal, 45, 37)
    o, lse = flash_forward_tiled(q, k, v, is_causal, 8, 8, band=band)
    grads = flash_backward(q, k, v, o, do, lse, is_causal, rows=8, band=band)
    check_against_float64((o, *grads), q, k, v, do, is_causal, FP32_RULE,
                          reference=lambda *a: band_reference(*a, window))


def _visible(n_rows, n_cols, before, after):
    """(n_rows, n_cols) bool: row r sees column c iff r - before <= c <= r + after."""
    r = np.arange(n_rows)[:, None]
    c = np.arange(n_cols)[None, :]
    return (c >= r - before) & (c <= r + after)


@triton.jit
def _band_probe(out, N_ROWS, N_COLS, BEFORE, AFTER, ROW_TILE: tl.constexpr, COL_TILE: tl.constexpr,
                WHOLE_COLS: tl.constexpr):
    """Stores each row tile's `_band_ranges` (start, full_start, full_stop, stop)."""
    t = tl.program_id(0)
    start, full_start, full_stop, stop = triton_kernels._band_ranges(t * ROW_TILE, N_ROWS, N_COLS, BEFORE, AFTER,
                                                                     ROW_TILE, COL_TILE, WHOLE_COLS)
    tl.store(out + 4 * t, start)
    tl.store(out + 4 * t + 1, full_start)
    tl.store(out + 4 * t + 2, full_stop)
    tl.store(out + 4 * t + 3, stop)


def test_attention_band_ranges_visit_exactly_the_tiles_the_band_meets():
    """The kernels' loop bounds (`_band_ranges`, run through the interpreter in a probe kernel): per row tile, the
    column tiles visited are exactly those holding a pair the band shows (the others are skipped, never masked),
    and the unmasked ones exactly those wholly inside it (for the forward, also not ragged)."""
    rng = np.random.default_rng(0)
    for _ in range(150):
        n_rows, n_cols = (int(n) for n in rng.integers(1, 90, 2))
        before, after = (int(n) for n in rng.integers(0, 40, 2))
        row_tile, col_tile = (int(t) for t in rng.choice([8, 16], 2))
        whole = bool(rng.integers(2))
        tiles = -(-n_rows // row_tile)
        out = torch.zeros(tiles, 4, dtype=torch.int32)
        _band_probe[(tiles,)](out, n_rows, n_cols, before, after, row_tile, col_tile, whole)
        seen = _visible(n_rows, n_cols, before, after)
        for t, (start, full_start, full_stop, stop) in enumerate(out.tolist()):
            rows = seen[t * row_tile:(t + 1) * row_tile]
            visited = set(range(start, stop, col_tile)) if start < stop else set()
            unmasked = set(range(full_start, full_stop, col_tile))
            meets = {c0 for c0 in range(0, n_cols, col_tile) if rows[:, c0:c0 + col_tile].any()}
            inside = {c0 for c0 in range(0, n_cols, col_tile)
                      if _visible(n_rows, c0 + col_tile, before, after)[t * row_tile:(t + 1) * row_tile, c0:].all()
                      and not (whole and c0 + col_tile > n_cols)}
            case = (n_rows, n_cols, before, after, row_tile, col_tile, whole, t)
            assert visited == meets, case
            assert unmasked == inside and unmasked <= visited, case
            assert start <= full_start <= full_stop <= max(stop, start), case


def test_attention_band_keys_of_the_cpu_fallback():
    """The tiled PyTorch path's key range per query block: the band's keys only (all of them without one)."""
    from cs336_systems.flash_pytorch import _band_keys

    assert _band_keys(None, 10, 19, 50) == (0, 50)
    assert _band_keys((3, 2), 10, 19, 50) == (7, 22)
    assert _band_keys((3, 2), 60, 69, 50) == (50, 50)  # past the keys: none
    assert _band_keys((0, 0), 0, 7, 4) == (0, 4)
