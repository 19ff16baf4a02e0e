"""FlashAttention-2 on the GPU only: long bf16 sequences, compile and CUDA graphs, GQA, precision.

These sizes are far past what Triton's interpreter can run, so without CUDA they are skipped
(`gpu` marker); tests/test_attention.py runs the same kernels through the interpreter on small sizes.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from .adapters import get_flashattention_autograd_function_triton
from .helpers import band_mask, check_against_float64, randn_cuda, rel_err, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seq_len", [4096, 16384])
@pytest.mark.parametrize("d_head", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic"])
def test_flash_triton_bf16_long_sequences_meet_2x_rule(seq_len, d_head, is_causal, deterministic):
    """Error vs float64 at most 2x PyTorch's bf16 attention, for O, dQ, dK, dV (B=1, H=2)."""
    from cs336_systems.flash_triton import flash_attention

    q, k, v, do = (randn_cuda(1, 2, seq_len, d_head, seed=seq_len + d_head + i) for i in range(4))
    ours = run(lambda *a: flash_attention(*a, deterministic=deterministic), q, k, v, do, is_causal)
    check_against_float64(ours, q, k, v, do, is_causal, ("x_torch", 2.0))


@pytest.mark.parametrize("d_head,is_causal", [(64, False), (64, True), (128, True)],
                         ids=["d64-full", "d64-causal", "d128-causal"])
def test_flash_split_short_grid_meets_2x_rule(d_head, is_causal):
    """One head of 16k tokens is a short grid: the two-pass backward (deterministic=True; the default may run the
    Gluon single pass here) and the forward split their reductions into chunks (split_rows > 0 on this GPU). The
    bf16 2x rule holds and the backward is bitwise repeatable."""
    from cs336_systems.flash_triton import flash_attention, split_rows

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert split_rows(1, 16384, 16384, is_causal, sms, 2 if d_head <= 64 else 1) > 0, (
        "this shape no longer splits: pick another")
    q, k, v, do = (randn_cuda(1, 1, 16384, d_head, seed=60 + d_head + i) for i in range(4))
    two_pass = functools.partial(flash_attention, deterministic=True)
    ours = run(two_pass, q, k, v, do, is_causal)
    check_against_float64(ours, q, k, v, do, is_causal, ("x_torch", 2.0))
    again = run(two_pass, q, k, v, do, is_causal)
    for name, x, y in zip(("O", "dQ", "dK", "dV"), ours, again):
        assert torch.equal(x, y), f"{name} differs between two runs"


@pytest.mark.parametrize("d_head", [192, 256])
def test_flash_triton_large_head_dims_meet_2x_rule(d_head):
    q, k, v, do = (randn_cuda(1, 2, 2048, d_head, seed=d_head + i) for i in range(4))
    ours = run(get_flashattention_autograd_function_triton().apply, q, k, v, do, True)
    check_against_float64(ours, q, k, v, do, True, ("x_torch", 2.0))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_flash_triton_under_torch_compile_meets_2x_rule(is_causal):
    """The leaderboard's torch.compile(FlashAttention2Triton.apply), fullgraph: no graph break. Inductor launches
    the flat kernels of a short call and tunes them itself, so its configs (and rounding) may differ from the
    eager launchers': both meet the bf16 2x rule."""
    fn = get_flashattention_autograd_function_triton()
    q, k, v, do = (randn_cuda(4, 1024, 64, seed=7 + i) for i in range(4))
    torch._dynamo.reset()
    for f in (fn.apply, torch.compile(fn.apply, fullgraph=True)):
        check_against_float64(run(f, q, k, v, do, is_causal), q, k, v, do, is_causal, ("x_torch", 2.0))


def _compiled_code(q, k, v, do):
    """The code Inductor generates for a fullgraph-compiled forward and backward of flash_attention, and the
    outputs and gradients of that call."""
    from torch._inductor.utils import run_and_get_code

    from cs336_systems.flash_triton import flash_attention

    torch._dynamo.reset()
    step = torch.compile(lambda a, b, c: flash_attention(a, b, c, True), fullgraph=True)
    ours, code = run_and_get_code(run, step, q, k, v, do)
    return ours, "\n".join(code)


def test_flash_compiled_short_call_is_launched_by_inductor():
    """Short calls: the triton_ops' bodies are traced, and Inductor launches the flat entry kernels (forward, dQ
    pass, dK/dV pass) from its generated code, with no opaque op of ours left in the graph."""
    q, k, v, do = (randn_cuda(1, 16, 1024, 64, seed=50 + i) for i in range(4))
    ours, code = _compiled_code(q, k, v, do)
    for kernel in ("flash_fwd_flat_kernel", "flash_bwd_dq_flat_kernel", "flash_bwd_kv_flat_kernel"):
        assert kernel in code, f"{kernel} is not launched by the compiled graphs"
    assert "flash_attn_fwd_launch" not in code and "flash_attn_bwd_launch" not in code
    check_against_float64(ours, q, k, v, do, True, ("x_torch", 2.0))


def test_flash_compiled_long_call_keeps_the_launchers():
    """From the Gluon kernels' work up the compiled graphs call the opaque ops (the launchers: Gluon kernels, splits)."""
    from cs336_systems.flash.chooser import GLUON_BWD_MIN_WORK, GLUON_FWD_MIN_WORK

    heads, seq = 4, 16384
    assert heads * seq * seq >= max(GLUON_FWD_MIN_WORK, *GLUON_BWD_MIN_WORK.values())
    q, k, v, do = (randn_cuda(1, heads, seq, 64, seed=55 + i) for i in range(4))
    ours, code = _compiled_code(q, k, v, do)
    assert "flash_attn_fwd_launch" in code and "flash_attn_bwd_launch" in code
    assert "flash_fwd_flat_kernel" not in code
    check_against_float64(ours, q, k, v, do, True, ("x_torch", 2.0), by_kv_heads=True)


def test_flash_cuda_graphs_capture_the_op():
    """torch.compile(mode="reduce-overhead") captures forward and backward in CUDA graphs; replays meet the bf16
    2x rule and repeat each other bitwise."""
    from cs336_systems.flash_triton import flash_attention

    q, k, v, do = (randn_cuda(1, 16, 1024, 64, seed=20 + i) for i in range(4))
    torch._dynamo.reset()
    step = torch.compile(lambda a, b, c: flash_attention(a, b, c, True), mode="reduce-overhead", fullgraph=True)
    # warm-up, record, replays; each copied out before the next replay overwrites the graphs' outputs
    replays = [tuple(t.clone() for t in run(step, q, k, v, do)) for _ in range(4)]
    check_against_float64(replays[-1], q, k, v, do, True, ("x_torch", 2.0))
    for name, x, y in zip(("O", "dQ", "dK", "dV"), replays[-2], replays[-1]):
        assert torch.equal(x, y), f"{name}: two CUDA-graph replays differ by {(x - y).abs().max():.3g}"


def test_flash_compiled_dynamic_shapes_serve_several_lengths():
    """torch.compile(dynamic=True, fullgraph=True): one compiled frame (symbolic sizes through the triton_ops' traced
    bodies) serves three sequence lengths, none a multiple of the tiles' 128 rows; every call meets the bf16 2x
    rule. (The frames are counted by the backend's calls: dynamo's `unique_graphs` counter also counts cached and
    restarted graphs.)"""
    from torch._dynamo.testing import CompileCounterWithBackend

    from cs336_systems.flash_triton import flash_attention

    torch._dynamo.reset()
    compiles = CompileCounterWithBackend("inductor")
    step = torch.compile(lambda a, b, c: flash_attention(a, b, c, True), backend=compiles, dynamic=True,
                         fullgraph=True)
    for i, seq in enumerate((520, 776, 1096)):
        q, k, v, do = (randn_cuda(1, 4, seq, 64, seed=90 + 4 * i + j) for j in range(4))
        check_against_float64(run(step, q, k, v, do), q, k, v, do, True, ("x_torch", 2.0))
    assert compiles.frame_count == 1, f"{compiles.frame_count} compiled frames for three lengths"


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_flash_gqa_matches_sdpa_enable_gqa(is_causal):
    """8 query heads over 2 K/V heads against SDPA(enable_gqa=True), both against float64."""
    from cs336_systems.flash_triton import flash_attention

    q, do = (randn_cuda(2, 8, 2048, 64, seed=30 + i) for i in range(2))
    k, v = (randn_cuda(2, 2, 2048, 64, seed=32 + i) for i in range(2))
    def sdpa(q, k, v, causal):  # is_causal by keyword: SDPA's fourth positional parameter is attn_mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    ours = run(lambda *a: flash_attention(*a, enable_gqa=True), q, k, v, do, is_causal)
    theirs = run(sdpa, q, k, v, do, is_causal)
    exact = run(sdpa, *(t.double() for t in (q, k, v, do)), is_causal)
    for name, x, s, ref in zip(("O", "dQ", "dK", "dV"), ours, theirs, exact):
        assert x.shape == ref.shape
        assert rel_err(x, ref) <= 2 * rel_err(s, ref) + 1e-6, (
            f"{name}: relative error {rel_err(x, ref):.3g} vs SDPA's {rel_err(s, ref):.3g}")


@pytest.mark.parametrize("precision,bound", [("highest", 1e-5), ("high", 1e-2)])
def test_flash_fp32_follows_matmul_precision(precision, bound):
    """fp32: "highest" runs IEEE fp32 dots (~1e-6 relative), "high" TF32 (~1e-3)."""
    from cs336_systems.flash_triton import flash_attention

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        q, k, v, do = (randn_cuda(1, 2, 1024, 64, seed=40 + i, dtype=torch.float32) for i in range(4))
        ours = run(flash_attention, q, k, v, do, True)
    finally:
        torch.set_float32_matmul_precision(previous)
    check_against_float64(ours, q, k, v, do, True, ("rel", bound))


def test_flash_fast_launch_path_keeps_specializations_apart():
    """Repeated calls reuse a compiled kernel per argument signature: an unaligned view and a
    different length right after an aligned one must still be right."""
    from cs336_systems.flash_triton import flash_attention, launch_cache_sizes

    base = randn_cuda(1, 2, 1024 * 64 + 8, seed=50).view(-1)
    for offset, seq in ((0, 512), (1, 512), (0, 512), (3, 500), (0, 512)):
        q = base[offset:offset + 2 * seq * 64].view(1, 2, seq, 64)
        ref = F.scaled_dot_product_attention(q.double(), q.double(), q.double(), is_causal=True)
        assert rel_err(flash_attention(q, q, q, True), ref) < 1e-2, (offset, seq)
    # the fast path ran: one entry per signature (aligned and not, 512 and 500), not zero
    assert launch_cache_sizes()["fwd"] >= 3, launch_cache_sizes()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_flash_runs_on_a_device_that_is_not_current():
    """Inputs on cuda:1 while cuda:0 is current: the kernels launch on the inputs' device (a guard makes it
    current), forward and backward, and match float64."""
    from cs336_systems.flash_triton import flash_attention

    q, k, v, do = (randn_cuda(1, 2, 1024, 64, seed=90 + i).to("cuda:1") for i in range(4))
    with torch.cuda.device(0):
        ours = run(flash_attention, q, k, v, do, True)
    exact = run(lambda a, b, c, causal: F.scaled_dot_product_attention(a, b, c, is_causal=causal),
                *(t.double() for t in (q, k, v, do)), True)
    for name, x, ref in zip(("O", "dQ", "dK", "dV"), ours, exact):
        assert x.device == q.device and rel_err(x, ref) < 1e-2, f"{name}: {x.device}, {rel_err(x, ref):.3g}"


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_flash_fast_launch_path_keys_on_the_batch(is_causal):
    """The batch is in no kernel argument (contiguous strides do not carry it), only in the grid:
    a cached launch must not reuse another batch size's grid (it did before the grid joined the key)."""
    from cs336_systems.flash_triton import flash_attention

    for batch in (1, 3, 2, 3):
        q, k, v, do = (randn_cuda(batch, 2, 1024, 64, seed=70 + batch + i) for i in range(4))
        ours = run(flash_attention, q, k, v, do, is_causal)
        exact = run(lambda a, b, c, causal: F.scaled_dot_product_attention(a, b, c, is_causal=causal),
                    *(t.double() for t in (q, k, v, do)), is_causal)
        for name, x, ref in zip(("O", "dQ", "dK", "dV"), ours, exact):
            assert rel_err(x, ref) < 1e-2, f"batch {batch}, {name}: relative error {rel_err(x, ref):.3g}"


def _sdpa_band(window, is_causal, n_q, n_k):
    """SDPA with an explicit boolean band mask (causal folded in): the reference, in float64 and in the inputs'
    dtype. Every query here sees at least its own key, so no row is fully masked (where SDPA gives NaN)."""
    mask = band_mask(n_q, n_k, window, is_causal, "cuda")
    return lambda q, k, v, _causal: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("window", [(128, 0), (256, 256), (-1, 64), (1000, 17), (0, 0)], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic"])
def test_flash_window_bf16_meets_2x_rule(window, is_causal, deterministic):
    """A sliding window in bf16 (B=1, H=2, 4096 tokens, d 64): error vs float64 at most 2x SDPA's with the band as a
    boolean mask, for O, dQ, dK, dV."""
    from cs336_systems.flash_triton import flash_attention

    q, k, v, do = (randn_cuda(1, 2, 4096, 64, seed=80 + i) for i in range(4))
    ours = run(lambda *a: flash_attention(*a, deterministic=deterministic, window=window), q, k, v, do, is_causal)
    check_against_float64(ours, q, k, v, do, is_causal, ("x_torch", 2.0),
                          reference=_sdpa_band(window, is_causal, 4096, 4096))


@pytest.mark.parametrize("d_head", [64, 128])
def test_flash_window_on_a_gluon_sized_call_meets_2x_rule(d_head):
    """A call large enough for the Gluon kernels but with Nq != Nk (they take a window on self-attention only) runs
    the windowed Triton kernels, GQA included."""
    from cs336_systems.flash_triton import flash_attention

    q, do = (randn_cuda(1, 16, 8192, d_head, seed=90 + i) for i in range(2))
    k, v = (randn_cuda(1, 4, 8448, d_head, seed=92 + i) for i in range(2))
    ours = run(lambda *a: flash_attention(*a, enable_gqa=True, window=(1024, 0)), q, k, v, do, True)
    mask = band_mask(8192, 8448, (1024, 0), True, "cuda")
    reference = lambda q, k, v, _causal: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    check_against_float64(ours, q, k, v, do, True, ("x_torch", 2.0), reference=reference, by_kv_heads=True)


@pytest.mark.parametrize("d_head", [64, 128])
@pytest.mark.parametrize("window,is_causal", [((2048, 0), True), ((3000, 17), True), ((1500, 1000), False),
                                              ((4000, 4000), False)], ids=str)
def test_flash_window_gluon_kernels_meet_2x_rule(monkeypatch, window, is_causal, d_head):
    """A windowed self-attention call whose band holds the Gluon kernels' work (1 x 16 x 8192, GQA 16:4, band edges
    off the tiles) runs its forward and its backward (the single pass) there, the band passed to each kernel, and
    meets the 2x rule."""
    from cs336_systems.flash import launch
    from cs336_systems.flash_triton import flash_attention

    bands = []
    for name in ("forward_launch", "kv_launch"):
        def spy(*args, band=None, _plan=getattr(launch.gluon, name), _name=name, **keywords):
            planned = _plan(*args, band=band, **keywords)

            def launched(tensors, scale):  # (recorded at launch: plans made to compile other lengths launch nothing)
                bands.append((_name, band))
                planned(tensors, scale)

            launched.ahead = planned.ahead  # (the compiles ahead for other lengths, not recorded)
            return launched

        monkeypatch.setattr(launch.gluon, name, spy)
    q, do = (randn_cuda(1, 16, 8192, d_head, seed=94 + i) for i in range(2))
    k, v = (randn_cuda(1, 4, 8192, d_head, seed=96 + i) for i in range(2))
    # (a first call's backward runs the compiled Triton kernels while its Gluon kernel compiles in the background,
    # by design: the settled call, after those compiles, is the one that must run the Gluon kernels)
    run(lambda *a: flash_attention(*a, enable_gqa=True, window=window), q, k, v, do, is_causal)
    launch.wait_for_background_compiles()
    bands.clear()
    ours = run(lambda *a: flash_attention(*a, enable_gqa=True, window=window), q, k, v, do, is_causal)
    band = launch.chooser.band(window, is_causal, 8192, 8192)
    assert bands == [("forward_launch", band), ("kv_launch", band)]
    mask = band_mask(8192, 8192, window, is_causal, "cuda")
    reference = lambda q, k, v, _causal: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    check_against_float64(ours, q, k, v, do, is_causal, ("x_torch", 2.0), reference=reference, by_kv_heads=True)


def test_flash_window_skips_tiles_outside_the_band():
    """A 256-key window over 32768 tokens does about 1/60 of causal attention's work: the windowed forward and
    backward take well under a third of the causal ones' time (tiles outside the band are skipped, not masked). (At
    16384 tokens the windowed step's fixed time, about 0.6 ms, once came within 3% of the bound.)"""
    import triton

    from cs336_systems.flash import launch
    from cs336_systems.flash_triton import flash_attention

    q, k, v, do = (randn_cuda(1, 8, 32768, 64, seed=95 + i).requires_grad_(i < 3) for i in range(4))

    def step(window):
        o = flash_attention(q, k, v, True, window=window)
        o.backward(do)

    def seconds(window):
        step(window)  # compiles, and starts the background compiles of the other length class
        launch.wait_for_background_compiles()  # (their threads would hold the GIL through the timed steps)
        return triton.testing.do_bench(lambda: step(window))

    causal, windowed = seconds((-1, -1)), seconds((256, 0))
    assert windowed < causal / 3, f"window (256, 0): {windowed:.1f} ms vs causal {causal:.1f} ms"


def test_flash_window_compiles_fullgraph():
    """torch.compile(fullgraph=True) over a windowed call on the GPU (the launch op, not the inlined kernels):
    equal to eager."""
    from cs336_systems.flash_triton import flash_attention

    q, k, v, do = (randn_cuda(2, 4, 1024, 64, seed=97 + i) for i in range(4))
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: flash_attention(a, b, c, True, window=(100, 0)), fullgraph=True)
    ours = run(compiled, q, k, v, do)
    eager = run(lambda *a: flash_attention(*a, True, window=(100, 0)), q, k, v, do)
    for name, x, y in zip(("O", "dQ", "dK", "dV"), ours, eager):
        assert torch.equal(x, y), f"{name}: compiled differs from eager"
