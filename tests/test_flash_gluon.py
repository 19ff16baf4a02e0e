"""The Gluon kernels (cs336_systems.flash.gluon) on the GPU (Gluon has no interpreter), and their host-side
checks on the CPU.

Each dK/dV-pass case runs the whole backward with `KernelOptions(gluon_kv=True)`, each forward case the
forward with `KernelOptions(gluon_fwd=True)`, and checks the outputs against float64 with the bf16/fp16
2x rule (SDPA in the same dtype is the baseline), and that the Gluon kernel was the one that ran (the
inputs are ones `flash_gluon.supported` / `fwd_supported` take).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .helpers import randn_cuda, rel_err, run

CASES = {  # (batch, heads, kv_heads, n_q, n_k, d, dtype)
    "d64": (1, 2, 2, 2048, 2048, 64, torch.bfloat16),
    "gqa": (2, 8, 2, 1024, 1024, 64, torch.bfloat16),
    "fp16_fewer_queries": (1, 4, 4, 1024, 2048, 64, torch.float16),
    "more_queries": (1, 4, 4, 2048, 1024, 64, torch.bfloat16),
    "d128": (1, 2, 2, 2048, 2048, 128, torch.bfloat16),
    "d128_gqa_fewer_queries": (1, 4, 2, 1024, 2048, 128, torch.bfloat16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["keys-on-rows", "queries-on-rows", "single-pass-qrows", "single-pass-keys"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_gluon_kv_pass_meets_2x_rule(case, is_causal, kernel):
    """The dK/dV kernels: keys on rows (`flash_bwd_kv_gluon_kernel`), queries on rows
    (`flash_bwd_kv_qrows_gluon_kernel`, KernelOptions.kv_qrows), and the single passes with dQ added in fp32
    by TMA bulk reductions (KernelOptions.deterministic=False): the latter with DQ_ATOMIC
    (KernelOptions.single_qrows) and `flash_bwd_single_keys_gluon_kernel`."""
    from cs336_systems.flash import gluon as flash_gluon
    from cs336_systems.flash_triton import KernelOptions, flash_backward_triton, flash_forward_triton

    b, h, h_kv, n_q, n_k, d, dtype = CASES[case]
    q, do = (randn_cuda(b, h, n_q, d, seed=50 + i, dtype=dtype) for i in range(2))
    k, v = (randn_cuda(b, h_kv, n_k, d, seed=52 + i, dtype=dtype) for i in range(2))
    qrows, single = kernel in ("queries-on-rows", "single-pass-qrows"), kernel.startswith("single")
    if single and d not in (flash_gluon.SINGLE_PASS_CONFIGS if qrows else flash_gluon.SINGLE_PASS_KEYS_CONFIGS):
        pytest.skip(f"no Gluon single pass at d {d}")
    assert flash_gluon.supported(q, k, v, do, qrows=qrows, single_pass=single), "the case must take the Gluon path"
    opts = KernelOptions(gluon_kv=True, kv_qrows=qrows, single_qrows=qrows, deterministic=not single)
    o, lse = flash_forward_triton(q, k, v, is_causal, opts)
    ours = flash_backward_triton(q, k, v, o, lse, do, is_causal, opts)

    def sdpa(q, k, v, causal):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=h != h_kv)

    exact = run(sdpa, *(t.double() for t in (q, k, v, do)), is_causal)[1:]
    theirs = run(sdpa, q, k, v, do, is_causal)[1:]
    for name, x, ref, base in zip(("dQ", "dK", "dV"), ours, exact, theirs):
        assert x.shape == ref.shape and x.dtype == dtype
        assert rel_err(x, ref) <= 2 * rel_err(base, ref) + 1e-6, (
            f"{name}: relative error {rel_err(x, ref):.3g} vs SDPA's {rel_err(base, ref):.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "single-pass"])
@pytest.mark.parametrize("config", [(128, 128, 8, 2), (64, 64, 4, 3)])
def test_gluon_kv_qrows_configs_meet_2x_rule(config, deterministic):
    """The queries-on-rows dK/dV pass (and the single pass built on it) at its other configs (two
    warpgroups of 64 rows; three stages), causal with GQA."""
    from cs336_systems.flash import gluon as flash_gluon
    from cs336_systems.flash_triton import KernelOptions, flash_backward_triton, flash_forward_triton

    q, do = (randn_cuda(2, 4, 1024, 64, seed=80 + i, dtype=torch.bfloat16) for i in range(2))
    k, v = (randn_cuda(2, 2, 1024, 64, seed=82 + i, dtype=torch.bfloat16) for i in range(2))
    assert flash_gluon.supported(q, k, v, do, config, qrows=True, single_pass=not deterministic)
    opts = KernelOptions(gluon_kv=True, kv_qrows=True, single_qrows=True, autotune=False, configs=(("kv", config),),
                         deterministic=deterministic)
    o, lse = flash_forward_triton(q, k, v, True, opts)
    ours = flash_backward_triton(q, k, v, o, lse, do, True, opts)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    exact = run(sdpa, *(t.double() for t in (q, k, v, do)))[1:]
    theirs = run(sdpa, q, k, v, do)[1:]
    for name, x, ref, base in zip(("dQ", "dK", "dV"), ours, exact, theirs):
        assert rel_err(x, ref) <= 2 * rel_err(base, ref) + 1e-6, (
            f"{name}: relative error {rel_err(x, ref):.3g} vs SDPA's {rel_err(base, ref):.3g}")


def test_gluon_kv_qrows_rejects_mismatched_tiles():
    """Checked before anything is built or launched (CPU tensors never reach a kernel)."""
    from cs336_systems.flash import gluon as flash_gluon

    x = torch.empty(1, 2, 256, 64, dtype=torch.bfloat16)
    lse = torch.empty(2, 256)
    with pytest.raises(ValueError, match="BLOCK_M = BLOCK_N"):
        flash_gluon.kv_pass(x, x, x, x, lse, lse, x, x, True, 0.125, (64, 128, 4, 2), qrows=True)


@pytest.mark.parametrize("d", [64, 128])
def test_gluon_single_pass_keys_launch_plan(d):
    """The keys-on-rows single pass's launch, built on the CPU (not run): its kernel, its warps (two compute
    warpgroups, a loader warp, a dQ warp), L and delta as one row of BLOCK_M values per query tile for the loader's
    TMA, dQ's accumulator reduced a whole query tile at a time."""
    from cs336_systems.flash import gluon as flash_gluon

    kernel, args, constexprs, warps, config = flash_gluon.example_launch(
        "flash_bwd_single_pass_keys_gluon", torch.bfloat16, 4, 1024, d, True)
    block_m, block_n, num_warps, _ = config
    assert kernel is flash_gluon.flash_bwd_single_keys_gluon_kernel
    assert block_n == 16 * num_warps == 128 and block_m == (128 if d == 64 else 64) and warps == num_warps + 2
    lse_desc, delta_desc, dq_desc = args[6:9]
    for desc in (lse_desc, delta_desc):
        assert list(desc.shape) == [4 * 1024 // block_m, block_m] and list(desc.block_shape) == [1, block_m]
    assert list(dq_desc.shape) == [4 * 1024, d] and list(dq_desc.block_shape) == [block_m, d]
    assert flash_gluon.supported(*(torch.empty(1, 4, 1024, d, dtype=torch.bfloat16),) * 4, single_pass=True) is False


def test_gluon_packed_rows_start_each_sequence_at_an_aligned_column():
    """L and delta of a packed call as the single pass's TMA reads them: each sequence from a multiple of 4 columns (a
    TMA box of fp32 at any other column is an illegal instruction on the H200), every packed row at its own column."""
    from cs336_systems.flash import gluon as flash_gluon

    lengths = [1000, 1, 0, 300, 77]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    starts, columns, width = flash_gluon.packed_rows(cu, sum(lengths))
    assert starts.tolist() == [0, 1000, 1004, 1004, 1304]
    expected = [*range(1000), 1000, *range(1004, 1304), *range(1304, 1381)]
    assert columns.tolist() == expected and width % 4 == 0 and width >= 1381


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gluon_packed_slots_hold_every_key_tile_once_longest_first(is_causal):
    """The packed single pass's slots: every key tile of every sequence once (none for a sequence without keys), with
    its sequence's first column in L and delta, ordered by the queries its program visits (causal: from its first
    key on), the spare slots (sequence index = batch) last."""
    from cs336_systems.flash import gluon as flash_gluon

    lengths_q, lengths_k = [1000, 1, 0, 300, 77], [900, 1, 5, 300, 0]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    starts, _, _ = flash_gluon.packed_rows(cu_q, sum(lengths_q))
    slots = flash_gluon.packed_key_tiles(cu_q, cu_k, sum(lengths_k), 128, is_causal, starts).tolist()
    assert len(slots) == -(-sum(lengths_k) // 128) + len(lengths_q)
    real = [s for s in slots if s[0] < len(lengths_q)]
    tiles = {(b, j) for b, n in enumerate(lengths_k) for j in range(-(-n // 128))}
    assert sorted((b, j) for b, j, _ in real) == sorted(tiles) and len(real) == len(tiles)
    assert all(col == starts[b] for b, _, col in real)
    assert slots[len(real):] == [[len(lengths_q), 0, 0]] * (len(slots) - len(real))
    work = [max(lengths_q[b] - j * 128, 0) if is_causal else lengths_q[b] for b, j, _ in real]
    assert work == sorted(work, reverse=True)


def test_gluon_packed_launch_plan():
    """The packed single pass's launch, built on the CPU (not run): the keys-on-rows kernel with IS_VARLEN, a grid of
    (kv heads, slots), one kv head at a time and the last quarter as one group, the descriptors over the packed
    (total, heads·D) views with a head's D columns per box, dK and dV passed as tensors (stored with a mask)."""
    from cs336_systems.flash import gluon as flash_gluon

    kernel, args, constexprs, warps, config = flash_gluon.example_launch(
        "flash_bwd_single_pass_keys_packed_gluon", torch.bfloat16, 8, 1024, 64, True)
    block_m, block_n, num_warps, _ = config
    assert kernel is flash_gluon.flash_bwd_single_keys_gluon_kernel and warps == num_warps + 2
    assert constexprs["IS_VARLEN"] is True and constexprs["HAS_WINDOW"] is False
    q_desc, k_desc = args[0], args[1]
    assert list(q_desc.shape) == [1024, 8 * 64] and list(q_desc.block_shape) == [block_m, 64]
    assert list(k_desc.block_shape) == [block_n, 64]
    assert isinstance(args[4], torch.Tensor) and args[4].shape == (1024, 8, 64)
    lse_desc = args[6]
    assert lse_desc.shape[0] == 8 and lse_desc.shape[1] % 4 == 0 and list(lse_desc.block_shape) == [1, block_m]
    assert args[14:16] == (1, 2)  # HEAD_GROUP, TAIL
    tiles, batch = args[-2], args[-1]
    assert batch == 2 and tiles.shape == (1024 // block_n + 2, 3)
    cpu = torch.empty(16, 2, 64, dtype=torch.bfloat16)
    assert flash_gluon.packed_supported(cpu, cpu, cpu, cpu, 2) is False


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gluon_packed_query_slots_hold_every_query_tile_once_longest_first(is_causal):
    """The packed forward's slots: every query tile of every sequence once (none for a sequence without queries),
    ordered by the keys its program visits (causal: those up to its last query), the spare slots last."""
    from cs336_systems.flash import gluon as flash_gluon

    lengths_q, lengths_k = [1000, 1, 0, 300, 77], [900, 1, 5, 300, 0]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    slots = flash_gluon.packed_query_tiles(cu_q, cu_k, sum(lengths_q), 128, is_causal).tolist()
    assert len(slots) == -(-sum(lengths_q) // 128) + len(lengths_q)
    real = [s for s in slots if s[0] < len(lengths_q)]
    tiles = [(b, j) for b, n in enumerate(lengths_q) for j in range(-(-n // 128))]
    assert sorted(map(tuple, real)) == sorted(tiles)
    assert slots[len(real):] == [[len(lengths_q), 0]] * (len(slots) - len(real))
    work = [min(lengths_k[b], (j + 1) * 128) if is_causal else lengths_k[b] for b, j in real]
    assert work == sorted(work, reverse=True)


def test_gluon_packed_forward_launch_plan():
    """The packed forward's launch, built on the CPU (not run): the forward kernel with IS_VARLEN, a grid of (heads,
    slots of WARPGROUPS·BLOCK_M queries), descriptors over the packed (total, heads·D) views with a head's D columns
    per box, O also as a tensor (a sequence's last rows are stored with a mask), the band unbounded on the left and
    causal on the right."""
    from cs336_systems.flash import gluon as flash_gluon

    kernel, args, constexprs, warps, config = flash_gluon.example_launch(
        "flash_fwd_packed_gluon", torch.bfloat16, 8, 1024, 128, True)
    block_m, block_n, num_warps, _ = config
    assert kernel is flash_gluon.flash_fwd_gluon_kernel and warps == num_warps + 1
    assert constexprs["IS_VARLEN"] is True and constexprs["HAS_WINDOW"] is False
    q_desc, k_desc, o_desc = args[0], args[1], args[3]
    assert list(q_desc.shape) == [1024, 8 * 128] and list(q_desc.block_shape) == [block_m, 128]
    assert list(k_desc.block_shape) == [block_n, 128] and list(o_desc.block_shape) == [block_m, 128]
    assert args[10:12] == (flash_gluon.UNBOUNDED, 0)
    assert isinstance(args[12], torch.Tensor) and args[12].shape == (1024, 8, 128)
    tiles, batch = args[15], args[16]  # (then the dense forward's head groups, unread)
    rows = block_m * num_warps // 4
    assert batch == 2 and tiles.shape == (1024 // rows + 2, 2) and len(args) == 19
    assert not any(constexprs[f"{n}_INSIDE"] for n in "QKV")
    cpu = torch.empty(16, 2, 128, dtype=torch.bfloat16)
    assert flash_gluon.packed_fwd_supported(cpu, cpu, cpu, cpu, 2) is False


def test_gluon_single_pass_keys_rejects_other_tiles():
    """Its tiles are fixed by its two warpgroups of 64 keys (and 64 or 128 queries), its stages by its dQ handoff
    (with three the kernel would hang): anything else is refused before anything is built or launched."""
    from cs336_systems.flash import gluon as flash_gluon

    x = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
    lse = torch.empty(2, 256)
    for config in ((128, 64, 4, 2), (32, 128, 8, 2), (64, 64, 4, 2), (64, 128, 8, 3)):
        with pytest.raises(ValueError, match="BLOCK_N = 16·num_warps = 128"):
            flash_gluon.kv_pass(x, x, x, x, lse, lse, x, x, True, 0.125, config, dq_acc=torch.empty(2, 256, 128))


def test_gluon_window_reaches_the_forward_and_the_single_pass_on_self_attention_only():
    """A window's band reaches the forward and the keys-on-rows single pass as two kernel arguments and HAS_WINDOW
    (built on the CPU, not run); the other dK/dV kernels, and Nq != Nk, refuse it before anything is built."""
    from cs336_systems.flash import gluon as flash_gluon

    x = torch.empty(1, 2, 1024, 64, dtype=torch.bfloat16)
    fewer = torch.empty(1, 2, 512, 64, dtype=torch.bfloat16)
    for band, has_window, tail in (((300, 0), True, (300, 0)), (None, False, (0, 0))):
        _, args, constexprs = flash_gluon.forward_launch(True, band=band).ahead((x, x, x, x, torch.empty(2, 1024)),
                                                                                0.125)
        assert args[10:12] == tail and constexprs["HAS_WINDOW"] is has_window  # (then the packed call's five)
    with pytest.raises(ValueError, match="a window on self-attention only"):
        flash_gluon.forward_launch(True, band=(300, 0)).ahead((fewer, x, x, fewer, torch.empty(2, 512)), 0.125)
    lse = torch.empty(2, 1024)
    acc = torch.empty(2, 1024, 64)
    _, args, constexprs = flash_gluon.kv_launch(True, band=(300, 0)).ahead((x, x, x, x, lse, lse, x, x, acc), 0.125)
    assert args[-6:-4] == (300, 0) and constexprs["HAS_WINDOW"] is True  # (then the packed call's four)
    _, args, constexprs = flash_gluon.kv_launch(True).ahead((x, x, x, x, lse, lse, x, x, acc), 0.125)
    assert args[-6:-4] == (0, 0) and constexprs["HAS_WINDOW"] is False and constexprs["IS_VARLEN"] is False
    for qrows, dq_acc, q in ((False, None, x), (True, None, x), (True, acc, x),
                             (False, torch.empty(2, 512, 64), fewer)):
        with pytest.raises(ValueError, match="a window runs only in the keys-on-rows single pass"):
            flash_gluon.kv_launch(True, qrows=qrows, band=(300, 0)).ahead((q, x, x, q, lse, lse, x, x, dq_acc), 0.125)


@pytest.mark.gpu
def test_gluon_kv_pass_declines_what_it_cannot_tile():
    """Lengths that do not divide into its tiles, other head dims, fp32, strided dO: the Triton pass (or, for the
    single pass, the two-pass design)."""
    from cs336_systems.flash import gluon as flash_gluon

    q, k, v, do = (randn_cuda(1, 2, 1024, 64, seed=60 + i, dtype=torch.bfloat16) for i in range(4))
    assert flash_gluon.supported(q, k, v, do)
    assert not flash_gluon.supported(q[:, :, :1000], k[:, :, :1000], v[:, :, :1000], do[:, :, :1000].contiguous())
    assert not flash_gluon.supported(*(t[..., :32].contiguous() for t in (q, k, v, do)))
    assert not flash_gluon.supported(*(t.float() for t in (q, k, v, do)))
    assert not flash_gluon.supported(q, k, v, do.transpose(2, 3).contiguous().transpose(2, 3))  # (D not innermost)
    assert flash_gluon.supported(q, k, v, do.transpose(1, 2).contiguous().transpose(1, 2))  # (read where it lies)
    # the keys-on-rows single pass at d 128 (64 queries × 128 keys): query lengths in whole key tiles only
    q, k = (randn_cuda(1, 2, 1024, 128, seed=64 + i, dtype=torch.bfloat16) for i in range(2))
    assert flash_gluon.supported(q, k, k, q, single_pass=True)
    q = q[:, :, :960].contiguous()  # 15 query tiles of 64
    assert flash_gluon.supported(q, k, k, q) and not flash_gluon.supported(q, k, k, q, single_pass=True)


@pytest.mark.gpu
def test_gluon_kv_pass_cached_launch_repeats_bitwise():
    """The second call of a signature goes through the launch cache and gives the same bits."""
    from cs336_systems.flash import gluon as flash_gluon
    from cs336_systems.flash_triton import KernelOptions, flash_backward_triton, flash_forward_triton

    q, k, v, do = (randn_cuda(1, 4, 1024, 64, seed=70 + i, dtype=torch.bfloat16) for i in range(4))
    opts = KernelOptions(gluon_kv=True, deterministic=True)  # (the single pass's reductions are unordered)
    o, lse = flash_forward_triton(q, k, v, True, opts)
    first = flash_backward_triton(q, k, v, o, lse, do, True, opts)
    cached = flash_gluon.launch_cache_size()
    assert cached >= 1
    again = flash_backward_triton(q, k, v, o, lse, do, True, opts)
    assert flash_gluon.launch_cache_size() == cached
    for x, y in zip(first, again):
        assert torch.equal(x, y)


FWD_CASES = {  # (batch, heads, kv_heads, n_q, n_k, d, dtype, config: None for the default)
    "d64": (1, 2, 2, 2048, 2048, 64, torch.bfloat16, None),
    "gqa": (2, 8, 2, 1024, 1024, 64, torch.bfloat16, None),
    "fp16_fewer_queries": (1, 4, 4, 1024, 2048, 64, torch.float16, None),
    "more_queries": (1, 4, 4, 2048, 1024, 64, torch.bfloat16, None),
    "one_key_tile": (1, 2, 2, 128, 128, 64, torch.bfloat16, None),
    "d128": (1, 2, 2, 2048, 2048, 128, torch.bfloat16, None),
    # three consumer warpgroups: 192-row query tiles, the last one ragged (2048 and 1024 are not multiples of 192)
    "three_groups": (1, 2, 2, 2048, 2048, 64, torch.bfloat16, (64, 128, 12, 2)),
    "three_groups_gqa_fewer_queries": (2, 4, 2, 1024, 2048, 64, torch.bfloat16, (64, 128, 12, 2)),
    "three_groups_d128": (1, 2, 2, 2048, 1024, 128, torch.bfloat16, (64, 64, 12, 2)),
    # one consumer warpgroup (64-row query tiles, the turn passed to itself), two programs an SM
    "one_group": (2, 4, 4, 512, 512, 64, torch.bfloat16, (64, 128, 4, 2)),
    "one_group_gqa_fewer_queries": (2, 4, 2, 256, 1024, 64, torch.float16, (64, 64, 4, 3)),
    "one_group_d128": (1, 2, 2, 1024, 2048, 128, torch.bfloat16, (64, 64, 4, 2)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(FWD_CASES))
def test_gluon_forward_meets_2x_rule(case, is_causal):
    """O against float64 by the 2x rule; L against float64's logsumexp (natural log)."""
    from cs336_systems.flash import gluon as flash_gluon
    from cs336_systems.flash_triton import KernelOptions, flash_forward_triton

    b, h, h_kv, n_q, n_k, d, dtype, config = FWD_CASES[case]
    q = randn_cuda(b, h, n_q, d, seed=80, dtype=dtype)
    k, v = (randn_cuda(b, h_kv, n_k, d, seed=81 + i, dtype=dtype) for i in range(2))
    assert flash_gluon.fwd_supported(q, k, v, config), "the case must take the Gluon path"
    opts = KernelOptions(gluon_fwd=True) if config is None else \
        KernelOptions(gluon_fwd=True, autotune=False, configs=(("fwd", config),))
    o, lse = flash_forward_triton(q, k, v, is_causal, opts)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=h != h_kv)

    exact = sdpa(*(t.double() for t in (q, k, v)))
    base = sdpa(q, k, v)
    assert o.shape == exact.shape and o.dtype == dtype
    assert rel_err(o, exact) <= 2 * rel_err(base, exact) + 1e-6, (
        f"O: relative error {rel_err(o, exact):.3g} vs SDPA's {rel_err(base, exact):.3g}")
    kd = k.double().repeat_interleave(h // h_kv, dim=1)
    scores = q.double() @ kd.transpose(-1, -2) * d ** -0.5
    if is_causal:
        scores = scores.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=2e-3, rtol=0)


@pytest.mark.gpu
def test_gluon_forward_declines_what_it_cannot_tile():
    """Query lengths not in 64-row tiles, key lengths not in key tiles, other head dims, fp32: Triton."""
    from cs336_systems.flash import gluon as flash_gluon

    q, k, v = (randn_cuda(1, 2, 1024, 64, seed=90 + i, dtype=torch.bfloat16) for i in range(3))
    assert flash_gluon.fwd_supported(q, k, v)
    assert not flash_gluon.fwd_supported(q[:, :, :1000].contiguous(), k, v)
    assert not flash_gluon.fwd_supported(q, k[:, :, :1000].contiguous(), v[:, :, :1000].contiguous())
    assert not flash_gluon.fwd_supported(*(t[..., :32].contiguous() for t in (q, k, v)))
    assert not flash_gluon.fwd_supported(*(t.float() for t in (q, k, v)))
    assert not flash_gluon.fwd_supported(q.transpose(2, 3).contiguous().transpose(2, 3), k, v)  # (D not innermost)
    assert flash_gluon.fwd_supported(q, k, v.transpose(1, 2).contiguous().transpose(1, 2))  # (a model's v)


def _in_layouts(tensors: dict, layouts: str) -> dict:
    """The named tensors as (B, H, S, D) views of (B, S, H, D) memory (a model's projection outputs), or with
    "fused", q, k and v as slices of one fused projection's (B, S, (H + 2·Hkv)·D) output (rows (H + 2·Hkv)·D apart)
    and the rest as projection outputs; the same values."""
    names = tensors if layouts == "fused" else layouts.split(",")
    out = {n: t.transpose(1, 2).contiguous().transpose(1, 2) if n in names else t for n, t in tensors.items()}
    if layouts == "fused":
        q, k, v = (tensors[n] for n in "qkv")
        (b, h, s, d), h_kv = q.shape, k.shape[1]
        rows = torch.cat([t.transpose(1, 2).reshape(b, s, -1) for t in (q, k, v)], dim=-1)
        widths = (h * d, h_kv * d, h_kv * d)
        for n, t, start in zip("qkv", (q, k, v), (0, widths[0], widths[0] + widths[1])):
            out[n] = rows[..., start:start + t.shape[1] * d].view(b, s, t.shape[1], d).transpose(1, 2)
    return out


def test_row_stride_reads_projection_and_fused_qkv_layouts():
    """`row_stride`: a (B, H, S, D) view whose rows hold its heads side by side, (B, S, H, D) memory or a slice of a
    fused QKV projection, is read as (B·S, H·D) with its own row stride; contiguous tensors, D or heads not in
    place, rows that overlap, and batches that do not follow their sequences are not."""
    from cs336_systems.flash.gluon import heads_inside, row_stride

    b, h, s, d = 2, 4, 8, 16
    proj = torch.empty(b, s, h, d).transpose(1, 2)
    assert row_stride(proj) == h * d and heads_inside(proj)
    fused = _in_layouts({"q": torch.zeros(b, h, s, d), "k": torch.zeros(b, 2, s, d), "v": torch.zeros(b, 2, s, d)},
                        "fused")
    assert [row_stride(fused[n]) for n in "qkv"] == [(h + 4) * d] * 3
    assert row_stride(torch.empty(b, h, s, d)) is None and not heads_inside(torch.empty(b, h, s, d))
    assert row_stride(torch.empty(b, s, d, h).permute(0, 3, 1, 2)) is None  # (D not innermost)
    assert row_stride(torch.empty(b, s, d, h).transpose(1, 3).transpose(2, 3)) is None  # (heads not D apart)
    assert row_stride(torch.empty(b, s * h * d).as_strided((b, h, s, d), (s * h * d, d, d, 1))) is None  # (overlap)
    assert row_stride(torch.empty(s, b, h, d).permute(1, 2, 0, 3)) is None  # (batches inside the rows)
    assert row_stride(torch.empty(1, 1, h, d).expand(b, s, h, d).transpose(1, 2)) is None  # (an expand)
    assert row_stride(torch.empty(b, 1, h, d).transpose(1, 2)) is None  # (one position of (B, S, H, D): contiguous)
    one = torch.empty(b, 1, 3 * h * d)[..., :h * d].view(b, 1, h, d).transpose(1, 2)  # (one position of a fused QKV)
    assert row_stride(one) == 3 * h * d


def test_gluon_plans_read_fused_qkv_slices_with_their_row_stride():
    """Slices of a fused QKV projection reach the forward and the dK/dV passes as descriptors over (B·S, H·D) with
    the projection's row stride, from each slice's own address; the keys tell them from (B, S, H, D) tensors. CPU
    placeholders: nothing is launched."""
    from cs336_systems.flash.gluon import interface

    b, h, h_kv, s, d = 2, 8, 2, 512, 64
    fused = _in_layouts({"q": torch.zeros(b, h, s, d, dtype=torch.bfloat16),
                         "k": torch.zeros(b, h_kv, s, d, dtype=torch.bfloat16),
                         "v": torch.zeros(b, h_kv, s, d, dtype=torch.bfloat16)}, "fused")
    q, k, v = (fused[n] for n in "qkv")
    plain = {n: t.transpose(1, 2).contiguous().transpose(1, 2) for n, t in fused.items()}
    o, lse = torch.empty_like(plain["q"]), torch.empty(b * h, s)
    width = (h + 2 * h_kv) * d
    _, _, template, _, key = interface._fwd_launch_plan((q, k, v, o, lse), True, None)
    args = interface._arguments(template, (q, k, v, o, lse), d ** -0.5)
    for i, t in enumerate((q, k, v)):
        assert list(args[i].strides) == [width, 1] and list(args[i].shape) == [b * s, t.shape[1] * d]
        assert args[i].base.data_ptr() == t.data_ptr()
    assert list(args[3].strides) == [h * d, 1]  # (O as a (B, S, H, D) tensor)
    _, _, _, _, plain_key = interface._fwd_launch_plan((*plain.values(), o, lse), True, None)
    assert key != plain_key
    do, acc = torch.empty_like(plain["q"]), torch.empty(b * h, s, d)
    tensors = (q, k, v, do, lse, lse, torch.empty_like(plain["k"]), torch.empty_like(plain["v"]), acc)
    _, _, template, constexprs, key = interface._kv_launch_plan(tensors, True, None)
    assert all(constexprs[f"{n}_INSIDE"] for n in ("Q", "K", "V", "DO"))
    args = interface._arguments(template, tensors, d ** -0.5)
    assert [list(args[i].strides) for i in range(6)] == [[width, 1]] * 3 + [[h * d, 1], [h_kv * d, 1], [h_kv * d, 1]]


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layouts", ["v", "q,k,v", "q", "k", "fused"])
@pytest.mark.parametrize("heads, kv_heads, d", [(4, 4, 64), (8, 2, 128)], ids=["mha-d64", "gqa-d128"])
def test_gluon_forward_reads_heads_inside_tensors_bitwise_as_contiguous_ones(heads, kv_heads, d, layouts, is_causal):
    """The named inputs as (B, H, S, D) views of (B, S, H, D) memory (as a model's projections give them), or slices
    of one fused QKV projection (`_in_layouts`), read where they lie: O and L bitwise those of the contiguous call,
    O in the (B, S, H, D) layout where q has its heads inside."""
    from cs336_systems.flash import gluon as flash_gluon
    from cs336_systems.flash.launch import empty_like
    from cs336_systems.flash_triton import KernelOptions, flash_forward_triton

    q = randn_cuda(2, heads, 1024, d, seed=70)
    k, v = (randn_cuda(2, kv_heads, 1024, d, seed=71 + i) for i in range(2))
    inside = _in_layouts({"q": q, "k": k, "v": v}, layouts)
    assert flash_gluon.fwd_supported(*inside.values()) and flash_gluon.fwd_supported(q, k, v)
    opts = KernelOptions(gluon_fwd=True)
    o, lse = flash_forward_triton(q, k, v, is_causal, opts)
    o_inside, lse_inside = flash_forward_triton(*inside.values(), is_causal, opts)
    assert o_inside.stride() == empty_like(inside["q"]).stride()
    assert torch.equal(o_inside, o) and torch.equal(lse_inside, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("design", ["single-pass", "kv-keys", "kv-qrows"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layouts", ["v,do", "q,k,v,do", "q", "k", "fused"])
@pytest.mark.parametrize("heads, kv_heads, d", [(4, 4, 64), (8, 2, 128)], ids=["mha-d64", "gqa-d128"])
def test_gluon_backward_reads_heads_inside_tensors_as_contiguous_ones(heads, kv_heads, d, layouts, is_causal, design):
    """The named tensors as (B, H, S, D) views of (B, S, H, D) memory (as a model's projections and its dO give
    them) run the Gluon single pass, or the two-pass design's Gluon dK/dV pass (keys or queries on rows), where they
    lie, nothing copied: dK and dV bitwise those of the contiguous call and in K's and V's layouts, dQ within its
    rounding (the single pass adds it in fp32 in an unordered sum)."""
    from cs336_systems.flash import chooser
    from cs336_systems.flash import gluon as flash_gluon
    from cs336_systems.flash.chooser import Backward
    from cs336_systems.flash.launch import call_facts, empty_like
    from cs336_systems.flash_triton import KernelOptions, flash_backward_triton, flash_forward_triton

    q, do = (randn_cuda(2, heads, 1024, d, seed=80 + i) for i in range(2))
    k, v = (randn_cuda(2, kv_heads, 1024, d, seed=82 + i) for i in range(2))
    inside = _in_layouts({"q": q, "k": k, "v": v, "do": do}, layouts)
    names = ("q", "k", "v", "do") if layouts == "fused" else layouts.split(",")
    assert all(flash_gluon.heads_inside(inside[name]) for name in names)
    qrows = design == "kv-qrows"
    assert flash_gluon.supported(*inside.values(), qrows=qrows, single_pass=design == "single-pass")
    opts = KernelOptions(gluon_kv=True, kv_qrows=qrows, deterministic=design != "single-pass", split_rows=0)
    choice = chooser.backward_design(call_facts(*(inside[n] for n in "qkv"), is_causal, opts, inside["do"]), opts)
    assert choice.design is Backward.GLUON_SINGLE if design == "single-pass" else choice.gluon_kv
    o, lse = flash_forward_triton(q, k, v, is_causal, opts)
    dq, dk, dv = flash_backward_triton(q, k, v, o, lse, do, is_causal, opts)
    dq_in, dk_in, dv_in = flash_backward_triton(inside["q"], inside["k"], inside["v"], o, lse, inside["do"],
                                                is_causal, opts)
    assert (dk_in.stride(), dv_in.stride()) == (empty_like(inside["k"]).stride(), empty_like(inside["v"]).stride())
    assert torch.equal(dk_in, dk) and torch.equal(dv_in, dv)
    torch.testing.assert_close(dq_in, dq, atol=2e-2, rtol=1e-2)
    assert rel_err(dq_in, dq) < 1e-3


@pytest.mark.gpu
def test_gluon_forward_cached_launch_repeats_bitwise():
    from cs336_systems.flash import gluon as flash_gluon
    from cs336_systems.flash_triton import KernelOptions, flash_forward_triton

    q, k, v = (randn_cuda(1, 4, 1024, 64, seed=95 + i, dtype=torch.bfloat16) for i in range(3))
    opts = KernelOptions(gluon_fwd=True)
    first = flash_forward_triton(q, k, v, True, opts)
    cached = flash_gluon.launch_cache_size()
    again = flash_forward_triton(q, k, v, True, opts)
    assert flash_gluon.launch_cache_size() == cached
    for x, y in zip(first, again):
        assert torch.equal(x, y)


@pytest.mark.parametrize("heads, per_head, work, longest, l2, want", [
    (16, 8_519_680, 8256, 128, 60 << 20, (3, 4)),   # 16 x 16384 x 64: 3 heads in half the L2, a last group of 4
    (16, 16_908_288, 16512, 256, 60 << 20, (1, 4)),  # 16 x 16384 x 128
    (64, 4_259_840, 2080, 64, 60 << 20, (7, 8)),    # 64 x 8192 x 64
    (1, 34_078_720, 131_328, 512, 60 << 20, (1, 1)),  # one head: one group
    (32, 532_480, 36, 8, 60 << 20, (32, 32)),       # 2 x 16 x 1024: every head fits, the order is the old one
    (5, 8_519_680, 8256, 128, 1 << 20, (1, 4)),     # nothing fits: one head at a time, the last 4 together
])
def test_head_groups_fit_the_l2_and_end_with_enough_work(monkeypatch, heads, per_head, work, longest, l2, want):
    """`head_groups`: (HEAD_GROUP, TAIL) with HEAD_GROUP heads' rows in L2_SHARE of the L2, HEAD_GROUP dividing
    heads - TAIL, and a last group of at least TAIL_WORK longest programs of work per SM (or all heads). The
    device's L2 and SM count come from a stand-in for `torch.cuda.get_device_properties` (CPU)."""
    from types import SimpleNamespace

    from cs336_systems.flash import gluon as flash_gluon

    props = SimpleNamespace(L2_cache_size=l2, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    group, tail = flash_gluon.head_groups(heads, per_head, work, longest, 0)
    assert (group, tail) == want
    assert 1 <= group <= tail <= heads and (heads - tail) % group == 0
    assert group == 1 or group * per_head <= flash_gluon.L2_SHARE * l2
    assert tail == heads or tail * work >= flash_gluon.TAIL_WORK * longest * 132
    assert flash_gluon.head_groups(heads, per_head, work, longest, None) == (heads, heads)


@pytest.mark.parametrize("lines,tiles,want", [
    (32, 16, (8, 8)),       # 8 x 4 kv heads x 2048: 8 lines of 16 key tiles fill 132 SMs once
    (20, 16, (8, 12)),      # the remainder joins the last group
    (128, 4, (33, 62)),     # 32 x 16 x 512 at d 64: groups of 33, the last 29 with the last group
    (4, 128, (1, 1)),       # 1 x 4 kv heads x 16384: a line fills more than a wave
    (3, 16, (3, 3)),        # fewer lines than a wave holds: one group
    (4, 0, (4, 4)),         # no key tiles (no keys): one group, no division by zero
])
def test_wave_groups_start_a_wave_of_lines_at_a_time(monkeypatch, lines, tiles, want):
    """`wave_groups`: (HEAD_GROUP, TAIL) with HEAD_GROUP = the lines whose programs fill the SMs once (at least one),
    HEAD_GROUP dividing lines - TAIL, the last group a whole group and the remainder; every line once without a
    device. A stand-in for `torch.cuda.get_device_properties` gives 132 SMs (CPU)."""
    from types import SimpleNamespace

    from cs336_systems.flash import gluon as flash_gluon

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(multi_processor_count=132))
    group, tail = flash_gluon.wave_groups(lines, tiles, 0)
    assert (group, tail) == want
    assert 1 <= group <= tail <= lines and (lines - tail) % group == 0 and (tail < 2 * group or tail == lines)
    assert flash_gluon.wave_groups(lines, tiles, None) == (lines, lines)


def test_kv_head_groups_wave_for_the_single_pass_l2_rule_for_the_grouped_two_pass(monkeypatch):
    """`kv_head_groups` at 8 x 16 x 2048 x 128 with 4 kv heads (32 lines of 16 key tiles of 128) on a stand-in
    device (132 SMs, 50 MiB of L2): the single pass in wave groups (8 lines, 8 in the last), the grouped-query
    two-pass dK/dV pass by the L2 rule (as many lines as fit their Q, dO, L and delta rows in L2_SHARE of the L2);
    with 16 kv heads at 32 x 512 x 64 (512 lines of 8 key tiles of 64) the two-pass pass in wave groups of 16 lines
    whose last group holds TAIL_WORK longest programs of work per SM."""
    from types import SimpleNamespace

    from cs336_systems.flash.gluon import heuristics

    props = SimpleNamespace(L2_cache_size=50 << 20, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    groups = heuristics._kv_head_groups.__wrapped__
    assert groups(8, 16, 4, 2048, 2048, 128, 2, True, 64, 128, True, 0) == (8, 8)
    group, tail = groups(8, 16, 4, 2048, 2048, 64, 2, True, 64, 64, False, 0)
    per_line = 4 * 2048 * (2 * 64 * 2 + 8)
    assert group * per_line <= heuristics.L2_SHARE * props.L2_cache_size < (group + 1) * per_line
    assert (32 - tail) % group == 0
    group, tail = groups(32, 16, 16, 512, 512, 64, 2, True, 64, 64, False, 0)
    steps = [(512 - j) // 64 for j in range(0, 512, 64)]  # a key tile's query tiles, causal
    assert group == 132 // 8 and (512 - tail) % group == 0
    assert tail * sum(steps) >= heuristics.TAIL_WORK * max(steps) * 132 > (tail - group) * sum(steps)
    assert groups(32, 16, 16, 512, 512, 64, 2, True, 64, 64, False, None) == (512, 512)


def test_gluon_launch_keys_hold_the_grid():
    """Two batches of one shape per head: the cached C launch is fixed to its grid, whose first axis is batch·heads
    and which no kernel argument carries, so their launch signatures must differ (keys without it reused the first
    batch's grid: programs missing or past the tensors). CPU placeholders: nothing is launched."""
    from cs336_systems.flash.gluon import interface

    keys = {}
    for batch in (1, 2):
        x = torch.empty(batch, 2, 256, 64, dtype=torch.bfloat16)
        lse = torch.empty(batch * 2, 256)
        _, grid, _, _, fwd_key = interface._fwd_launch_plan((x, x, x, x, lse), True, None)
        _, kv_grid, _, _, kv_key = interface._kv_launch_plan((x, x, x, x, lse, lse, x, x,
                                                              torch.empty(batch * 2, 256, 64)), True, None, True)
        assert grid[0] == kv_grid[0] == batch * 2
        keys[batch] = (fwd_key, kv_key)
    assert keys[1][0] != keys[2][0] and keys[1][1] != keys[2][1]


def test_gluon_forward_plans_heads_inside_tensors_where_they_lie():
    """A (B, H, S, D) view of (B, S, H, D) memory reaches the forward as a descriptor over its (B·S, H·D) view, a
    head's D columns per box, with a compile-time flag a tensor (the constexprs in the kernel's order: the cached
    launch passes them positionally); contiguous tensors as before; the key tells the layouts apart; O must lie as
    Q does. CPU placeholders: nothing is launched."""
    from cs336_systems.flash.gluon import interface

    b, h, h_kv, s, d = 2, 8, 2, 512, 64
    q, o = torch.empty(b, h, s, d, dtype=torch.bfloat16), torch.empty(b, h, s, d, dtype=torch.bfloat16)
    k = torch.empty(b, h_kv, s, d, dtype=torch.bfloat16)
    v = torch.empty(b, s, h_kv, d, dtype=torch.bfloat16).transpose(1, 2)
    lse = torch.empty(b * h, s)
    kernel, _, template, constexprs, key = interface._fwd_launch_plan((q, k, v, o, lse), True, None)
    assert [n for n in constexprs if n not in interface.COMPILE_OPTIONS] == [
        p.name for p in kernel.params if p.is_constexpr]
    assert {n: constexprs[f"{n}_INSIDE"] for n in "QKV"} == dict(Q=False, K=False, V=True)
    args = interface._arguments(template, (q, k, v, o, lse), d ** -0.5)
    assert list(args[2].shape) == [b * s, h_kv * d] and list(args[2].strides) == [h_kv * d, 1]
    assert list(args[1].shape) == [b * h_kv * s, d] and args[2].block_shape == args[1].block_shape
    _, _, _, _, contiguous_key = interface._fwd_launch_plan((q, k, v.contiguous(), o, lse), True, None)
    assert key != contiguous_key
    q_inside = torch.empty(b, s, h, d, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ValueError, match="o4 must have q4's layout"):
        interface._fwd_launch_plan((q_inside, k, v, o, lse), True, None)
    _, _, _, constexprs, _ = interface._fwd_launch_plan((q_inside, k, v, torch.empty_like(q_inside), lse), True, None)
    assert {n: constexprs[f"{n}_INSIDE"] for n in "QKV"} == dict(Q=True, K=False, V=True)


@pytest.mark.parametrize("config, programs, maxnreg", [((64, 128, 12, 3), 3, None), ((64, 128, 8, 2), 4, None),
                                                       ((64, 128, 4, 2), 8, 128)])
def test_gluon_forward_plans_one_to_three_consumer_warpgroups(config, programs, maxnreg):
    """Query tiles of warpgroups·BLOCK_M rows; one warpgroup launches at ONE_WARPGROUP_MAXNREG registers (a
    compile option the cached launch does not pass as an argument); other warp counts are refused. CPU placeholders."""
    from cs336_systems.flash.gluon import interface

    q = torch.empty(1, 2, 512, 64, dtype=torch.bfloat16)
    lse = torch.empty(2, 512)
    kernel, grid, _, constexprs, _ = interface._fwd_launch_plan((q, q, q, q, lse), True, config)
    assert grid == (2, programs, 1) and constexprs["WARPGROUPS"] == config[2] // 4
    assert constexprs.get("maxnreg") == maxnreg
    assert [n for n in constexprs if n not in interface.COMPILE_OPTIONS] == [
        p.name for p in kernel.params if p.is_constexpr]
    with pytest.raises(ValueError, match="4, 8 or 12 warps"):
        interface._fwd_launch_plan((q, q, q, q, lse), True, (64, 128, 6, 2))


@pytest.mark.parametrize("d, n_k, windowed, config", [
    (64, 512, False, (64, 128, 4, 2)), (64, 1024, False, (64, 128, 4, 2)), (64, 2048, False, (64, 128, 12, 3)),
    (64, 1024, True, (64, 128, 12, 3)), (128, 1024, False, (64, 64, 4, 2)), (128, 4096, False, (64, 128, 8, 2))])
def test_gluon_forward_runs_one_warpgroup_over_short_key_loops(d, n_k, windowed, config):
    """The dense forward's default config: one consumer warpgroup (two programs an SM) up to ONE_WARPGROUP_MAX_KEYS
    keys without a window, FWD_CONFIGS' beyond and under a window; the launch plan takes it when none is given. CPU
    placeholders."""
    from cs336_systems.flash.gluon import configs, interface

    assert configs.fwd_config(d, n_k, windowed) == config
    q = torch.empty(1, 2, n_k, d, dtype=torch.bfloat16)
    lse = torch.empty(2, n_k)
    band = (n_k // 8, 0) if windowed else None
    _, grid, _, constexprs, key = interface._fwd_launch_plan((q, q, q, q, lse), True, None, band)
    block_m, block_n, warps, stages = config
    assert (constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["WARPGROUPS"], constexprs["STAGES"]) == (
        block_m, block_n, warps // 4, stages)
    assert grid == (2, -(-n_k // (block_m * warps // 4)), 1) and (block_m, block_n, warps, stages) == key[5:9]
    assert (constexprs.get("maxnreg") == configs.ONE_WARPGROUP_MAXNREG) == (warps == 4)


# (batch, heads, kv heads, Nq, Nk, d, layouts): more tiles than resident programs, so that programs loop; GQA with
# fewer queries than keys; a model's layout and a fused projection's
PERSISTENT_CASES = {
    "d64": (8, 16, 16, 512, 512, 64, ""),
    "d128": (8, 16, 16, 512, 512, 128, ""),
    "gqa_fewer_queries": (4, 8, 2, 256, 1024, 64, ""),
    "more_queries": (2, 4, 4, 1024, 256, 128, ""),
    "model_layout": (16, 12, 12, 256, 256, 64, "q,k,v"),
    "fused_gqa": (4, 8, 2, 512, 512, 128, "fused"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(PERSISTENT_CASES))
def test_gluon_persistent_forward_meets_2x_rule(case, is_causal):
    """The persistent forward (immediate and deferred O-store waits) against float64 by the 2x rule, L against the
    shipped forward's; O where Q lies."""
    from cs336_systems.flash import gluon as flash_gluon
    from cs336_systems.flash.gluon import configs, interface
    from cs336_systems.flash.launch import empty_like
    from cs336_systems.flash_triton import flash_forward_triton

    b, h, h_kv, n_q, n_k, d, layouts = PERSISTENT_CASES[case]
    q = randn_cuda(b, h, n_q, d, seed=60, dtype=torch.bfloat16)
    k, v = (randn_cuda(b, h_kv, n_k, d, seed=61 + i, dtype=torch.bfloat16) for i in range(2))
    if layouts:
        q, k, v = _in_layouts({"q": q, "k": k, "v": v}, layouts).values()
    config = configs.ONE_WARPGROUP_FWD_CONFIGS[d]
    assert flash_gluon.fwd_supported(q, k, v, config)
    exact = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), is_causal=is_causal,
                                           enable_gqa=h != h_kv)
    base = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=h != h_kv)
    _, lse_ref = flash_forward_triton(q, k, v, is_causal)
    for defer in (False, True):
        o, lse = empty_like(q), torch.empty(b * h, n_q, device=q.device)
        interface.persistent_forward_launch(is_causal, config, defer_store=defer)((q, k, v, o, lse), d ** -0.5)
        assert o.stride() == empty_like(q).stride()
        assert rel_err(o, exact) <= 2 * rel_err(base, exact) + 1e-6, (
            f"defer {defer}: O relative error {rel_err(o, exact):.3g} vs SDPA's {rel_err(base, exact):.3g}")
        torch.testing.assert_close(lse.view_as(lse_ref), lse_ref, atol=2e-3, rtol=0)


@pytest.mark.parametrize("d", [64, 128])
def test_gluon_persistent_forward_plans_a_program_per_tile_without_a_device(d, monkeypatch):
    """The persistent forward's plan: one consumer warpgroup at ONE_WARPGROUP_MAXNREG, its constexprs in the kernel's
    order (the cached launch passes them positionally), a program per query tile where no device says how many SMs
    there are (a CPU compile), the work items' count and order (batch·heads, HEAD_GROUP, TAIL) as run-time arguments;
    other warp counts refused. CPU placeholders."""
    from cs336_systems.flash.gluon import configs, interface

    q = torch.empty(3, 2, 512, d, dtype=torch.bfloat16)
    lse = torch.empty(6, 512)
    config = configs.ONE_WARPGROUP_FWD_CONFIGS[d]
    kernel, grid, template, constexprs, key = interface._pfwd_launch_plan((q, q, q, q, lse), True, config)
    assert grid == (3 * 2 * 512 // config[0], 1, 1) and constexprs["maxnreg"] == configs.ONE_WARPGROUP_MAXNREG
    assert [n for n in constexprs if n not in interface.COMPILE_OPTIONS] == [
        p.name for p in kernel.params if p.is_constexpr]
    assert template[-3:] == (6, 6, 6) and key[0] == "pfwd"
    # a batch of another size on a device whose resident programs give both batches one grid: another key all the
    # same (the template's batch·heads argument is fixed per key: a shared key would run the first batch's items)
    monkeypatch.setattr(interface, "persistent_programs", lambda items, device_index: 264)
    monkeypatch.setattr(interface, "fwd_head_groups", lambda *args: (1, 1))
    other = torch.empty(4, 2, 512, d, dtype=torch.bfloat16)
    _, grid, _, _, key = interface._pfwd_launch_plan((q, q, q, q, lse), True, config)
    _, other_grid, other_template, _, other_key = interface._pfwd_launch_plan((other, other, other, other, lse),
                                                                               True, config)
    assert grid == other_grid and other_key != key and other_template[-3] == 8
    with pytest.raises(ValueError, match="one consumer warpgroup"):
        interface._pfwd_launch_plan((q, q, q, q, lse), True, (64, 128, 8, 2))


@pytest.mark.parametrize("qrows, single", [(False, True), (False, False), (True, False), (True, True)],
                         ids=["single-pass-keys", "kv-keys", "kv-qrows", "single-pass-qrows"])
def test_gluon_dk_dv_passes_plan_heads_inside_tensors_where_they_lie(qrows, single):
    """The dK/dV passes take each of Q, K, V and dO as a descriptor over its (B·S, H·D) view where it is a
    (B, H, S, D) view of (B, S, H, D) memory, a head's D columns per box, with a compile-time flag a tensor (the
    constexprs in the kernel's order: the cached launch passes them positionally); dK and dV must lie as K and V
    do. CPU placeholders: nothing is launched."""
    from cs336_systems.flash.gluon import interface

    b, h, h_kv, s, d = 2, 8, 2, 512, 64
    q = torch.empty(b, h, s, d, dtype=torch.bfloat16)
    k = torch.empty(b, h_kv, s, d, dtype=torch.bfloat16)
    v = torch.empty(b, s, h_kv, d, dtype=torch.bfloat16).transpose(1, 2)
    do = torch.empty(b, s, h, d, dtype=torch.bfloat16).transpose(1, 2)
    lse, acc = torch.empty(b * h, s), torch.empty(b * h, s, d) if single else None
    tensors = (q, k, v, do, lse, lse, torch.empty_like(k), torch.empty_like(v), acc)
    kernel, _, template, constexprs, key = interface._kv_launch_plan(tensors, True, None, qrows)
    assert list(constexprs) == [p.name for p in kernel.params if p.is_constexpr]
    assert {n: constexprs[f"{n}_INSIDE"] for n in ("Q", "K", "V", "DO")} == dict(Q=False, K=False, V=True, DO=True)
    args = interface._arguments(template, tensors, d ** -0.5)
    assert list(args[0].shape) == [b * h * s, d] and list(args[1].shape) == [b * h_kv * s, d]
    for i, width in ((2, h_kv * d), (3, h * d), (5, h_kv * d)):  # V, dO, dV
        assert list(args[i].shape) == [b * s, width] and list(args[i].strides) == [width, 1]
    assert args[2].block_shape == args[1].block_shape and args[3].block_shape == args[0].block_shape
    contiguous = (q, k, v.contiguous(), do.contiguous(), lse, lse, torch.empty_like(k), torch.empty_like(k), acc)
    _, _, _, contiguous_constexprs, contiguous_key = interface._kv_launch_plan(contiguous, True, None, qrows)
    assert key != contiguous_key and not any(contiguous_constexprs[f"{n}_INSIDE"] for n in ("Q", "K", "V", "DO"))
    with pytest.raises(ValueError, match="dk4, dv4 must have their layouts"):
        interface._kv_launch_plan((*tensors[:7], torch.empty_like(k), acc), True, None, qrows)


def test_gluon_band_split_leaves_the_unmasked_loop_only_uncut_tiles():
    """`_band_split`'s own code on Python ints (gl's scalar ops stood in for, C division): over windows, causal
    bands and packed sequences' ends, every tile it gives the unmasked loop is one `_single_keys_p` would not mask,
    both counts keep the buffers' parity, and at most two uncut tiles go to the masked runs."""
    import random
    import types

    from cs336_systems.flash.gluon import UNBOUNDED, flash_bwd_single_keys

    fn = flash_bwd_single_keys._band_split.fn
    stand_in = types.SimpleNamespace(minimum=min, maximum=max, cdiv=lambda x, y: int((x + y - 1) / y),
                                     where=lambda c, a, b: a if c else b)
    split = types.FunctionType(fn.__code__, {**fn.__globals__, "gl": stand_in})
    rng = random.Random(0)
    unbounded = UNBOUNDED
    for _ in range(20000):
        block_m, block_n = rng.choice(((64, 128), (128, 128)))
        n_q, n_k = rng.randint(1, 3000), rng.randint(1, 3000)
        left = rng.choice((unbounded, rng.randint(0, 3000)))
        right = rng.choice((0, unbounded, rng.randint(0, 3000)))
        k_start = rng.randrange(0, n_k, block_n)
        q_first = max(k_start - right, 0) // block_m * block_m  # (`_band_tiles`)
        n_vis = max(-(-(min(k_start + block_n + left, n_q) - q_first) // block_m), 0)
        a, m = split(q_first, n_vis, (k_start, left, right, n_q, n_k), block_m, block_n)
        cut = [q + block_m - 1 - left > k_start or k_start + block_n - 1 - right > q or q + block_m > n_q
               or k_start + block_n > n_k for q in (q_first + i * block_m for i in range(n_vis))]
        assert 0 <= a <= n_vis and 0 <= m <= n_vis - a and m % 2 == 0 and (a % 2 == 0 or a == n_vis)
        assert not any(cut[a:a + m]), (a, m, cut)
        assert cut.count(False) - m <= 2, (a, m, cut)


def test_gluon_launch_keys_fix_every_constant_of_the_argument_template():
    """A launch's cached `_Compiled` keeps the argument template of the first call at its key: every value the
    template fixes (integers, the window's edges), the grid and the constexprs must then be the same for every call
    with that key (keys that held only whether a packed call has a window reused the first window's edges), and the
    constexprs come in the kernel's order (the cached launch passes them positionally). Plans of the dense and packed
    forward and dK/dV passes over calls that differ in one thing each; CPU placeholders."""
    from cs336_systems.flash.gluon import interface

    def fixed(plan):
        kernel, grid, template, constexprs, key = plan[:5]
        positional = [n for n in constexprs if n not in interface.COMPILE_OPTIONS]  # (maxnreg: a compile option)
        assert positional == [p.name for p in kernel.params if p.is_constexpr]
        assert len(template) == len(kernel.params) - len(positional)
        values = tuple(a for a in template if a.__class__ not in (interface._Tma, interface._Arg)
                       and a is not interface._SCALE)
        return key, (grid, values, tuple(constexprs.items()))

    plans = []
    for d in (64, 128):
        for is_causal in (True, False):
            for batch, heads, kv_heads, n in ((1, 4, 4, 512), (2, 4, 4, 512), (1, 8, 2, 512), (1, 4, 4, 1024)):
                q = torch.empty(batch, heads, n, d, dtype=torch.bfloat16)
                k = torch.empty(batch, kv_heads, n, d, dtype=torch.bfloat16)
                lse = torch.empty(batch * heads, n)
                acc = torch.empty(batch * heads, n, d)
                v_inside = torch.empty(batch, n, kv_heads, d, dtype=torch.bfloat16).transpose(1, 2)
                for band in (None, (64, 0), (128, 0), (0, 64)):
                    plans.append(fixed(interface._fwd_launch_plan((q, k, k, q, lse), is_causal, None, band)))
                    plans.append(fixed(interface._fwd_launch_plan((q, k, v_inside, q, lse), is_causal, None, band)))
                    plans.append(fixed(interface._kv_launch_plan((q, k, k, q, lse, lse, k, k, acc), is_causal,
                                                                 None, band=band)))
                    plans.append(fixed(interface._kv_launch_plan((q, k, v_inside, q, lse, lse, k, v_inside, acc),
                                                                 is_causal, None, band=band)))
                plans.append(fixed(interface._kv_launch_plan((q, k, k, q, lse, lse, k, k, None), is_causal, None)))
            for lengths in ((100, 200), (150, 150), (100, 100, 100)):
                cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
                q, k = torch.empty(300, 4, d, dtype=torch.bfloat16), torch.empty(300, 2, d, dtype=torch.bfloat16)
                lse = torch.zeros(4, 300)
                for band in (None, (0, 0), (64, 0), (128, 0), (0, 64)):
                    plans.append(fixed(interface._packed_fwd_launch_plan(q, k, k, q, lse, cu, cu, is_causal, band)))
                    plans.append(fixed(interface._packed_launch_plan(q, k, k, q, lse, lse, k, k,
                                                                    torch.empty(4, 300, d), cu, cu, is_causal, band)))
    by_key = {}
    for key, values in plans:
        assert by_key.setdefault(key, values) == values, f"two templates at one launch key {key}"
    assert len(by_key) > 100


def test_gluon_later_launches_take_cached_descriptors_as_tritons_wrapper_would_pass_them(monkeypatch):
    """After a signature's first launch, each TMA descriptor comes from a cache by its tensor's address: the same
    addresses build none, a new one builds its own, a misaligned L is copied and built at every launch (never
    cached), and an argument's cache starts over past DESCRIPTORS_PER_ARGUMENT. Each launch passes the C launch
    what Triton's own wrapper (`wrap_handle_tensordesc`, around the same launch) passes it for TensorDescriptor
    arguments. CPU placeholders, a fake driver and descriptor builder: nothing is launched."""
    import types

    import triton
    import triton.backends.nvidia.driver as nvidia_driver

    from cs336_systems.flash.gluon import interface

    built = []

    def make_tensordesc_arg(desc, meta):  # (Triton's fills a CUtensorMap: here a tag of what it would encode)
        built.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), tuple(desc.block_shape), meta["i"]), *desc.shape, *desc.strides]

    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", make_tensordesc_arg)
    calls = []
    x = torch.empty(1, 2, 256, 64, dtype=torch.bfloat16)
    tensors = (x, torch.empty_like(x), torch.empty_like(x), torch.empty_like(x), torch.empty(2, 256),
               torch.empty(2, 256), torch.empty_like(x), torch.empty_like(x), torch.empty(2, 256, 64))
    kernel, grid, template, constexprs, _ = interface._kv_launch_plan(tensors, True, None)
    tmas = [a for a in template if isinstance(a, interface._Tma)]
    params = [*template, *constexprs.values()]
    signature = {i: "tensordesc<bf16[1, 1]>" if isinstance(a, interface._Tma) else "i32"
                 for i, a in enumerate(params)}
    metas = [{"i": i} for i in range(len(tmas))]
    launch = nvidia_driver.wrap_handle_tensordesc(lambda *args: calls.append(args), signature, metas)
    run = types.SimpleNamespace(launch=launch, num_ctas=1, global_scratch_size=0, profile_scratch_size=0,
                                launch_cooperative_grid=False, launch_pdl=False)
    compiled = type("Compiled", (), {"__getitem__": lambda self, grid: None, "run": run, "function": "f",
                                     "packed_metadata": "m",
                                     "metadata": types.SimpleNamespace(tensordesc_meta=metas)})()
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(get_current_stream=lambda device: 7))
    cached = interface._Compiled(compiled, grid, template, constexprs, 0)
    assert cached.steps is not None, "Triton's launcher should come apart"

    def wrapper_args(tensors, scale=0.5):  # what the wrapper passes on, from TensorDescriptors
        launch(*range(13), *interface._arguments(template, tensors, scale), *constexprs.values())
        return calls.pop()[13:]

    cached(tensors, 0.5)
    assert len(built) == len(tmas)
    assert calls.pop()[13:] == wrapper_args(tensors)
    built.clear()
    cached(tensors, 0.5)
    assert built == [] and calls.pop()[13:] == wrapper_args(tensors)
    built.clear()
    moved = (torch.empty_like(x), *tensors[1:])
    cached(moved, 0.25)
    assert built == [moved[0].data_ptr()] and calls.pop()[13:] == wrapper_args(moved, 0.25)
    built.clear()
    misaligned = torch.empty(2 * 256 + 1)[1:].view(2, 256)  # (4 bytes past an aligned base)
    odd = (*tensors[:4], misaligned, *tensors[5:])
    for _ in range(2):  # copied, built and launched each time; its copy's descriptor is never reused
        cached(odd, 0.5)
        assert len(built) == 1 and built.pop() % 16 == 0 and calls.pop()
    assert not any(misaligned.data_ptr() in cache for _, _, cache in cached.steps if cache is not None)
    monkeypatch.setattr(interface, "DESCRIPTORS_PER_ARGUMENT", 2)
    for _ in range(3):
        cached((torch.empty_like(x), *tensors[1:]), 0.5)
    assert all(len(cache) <= 2 for _, _, cache in cached.steps if cache is not None)


@pytest.mark.gpu
def test_gluon_launches_key_on_the_batch():
    """Batches 1, 3, 2 of one shape through the Gluon forward and the Gluon single pass, twice (the second round
    from the launch caches): each against the Triton kernels on the same inputs."""
    from cs336_systems.flash_triton import KernelOptions, flash_backward_triton, flash_forward_triton

    gluon = KernelOptions(gluon_fwd=True, gluon_kv=True, deterministic=False)
    plain = KernelOptions(autotune=False, gluon_fwd=False, gluon_kv=False, deterministic=True)
    for _ in range(2):
        for batch in (1, 3, 2):
            q, k, v, do = (randn_cuda(batch, 2, 1024, 64, seed=110 + i, dtype=torch.bfloat16) for i in range(4))
            o, lse = flash_forward_triton(q, k, v, True, gluon)
            ref, ref_lse = flash_forward_triton(q, k, v, True, plain)
            assert rel_err(o, ref) < 1e-2 and (lse - ref_lse).abs().max().item() < 1e-2, f"batch {batch}"
            ours = flash_backward_triton(q, k, v, o, lse, do, True, gluon)
            theirs = flash_backward_triton(q, k, v, ref, ref_lse, do, True, plain)
            for name, x, y in zip(("dQ", "dK", "dV"), ours, theirs):
                assert rel_err(x, y) < 2e-2, f"batch {batch} {name}: {rel_err(x, y):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gluon_head_groups_cover_every_program(d):
    """The keys-on-rows single pass runs a few heads at a time (`grouped_program`'s (HEAD_GROUP, TAIL)): with 5
    heads in groups of 1, 2 or 3 before a last group of 1 to 4, and all 5 at once, every program runs once, on its
    own key tile: dK and dV are bitwise those of the default order (they start as NaN), dQ's fp32 sums equal up to
    the order of their additions."""
    from cs336_systems.flash import gluon as flash_gluon

    b, h, n = 1, 5, 1024
    q, k, v, do = (randn_cuda(b, h, n, d, seed=120 + i, dtype=torch.bfloat16) for i in range(4))
    scale = d ** -0.5
    o = torch.empty_like(q)
    lse = torch.empty(b * h, n, device=q.device)
    flash_gluon.forward(q, k, v, o, lse, True, scale)
    delta = (o.float() * do.float()).sum(-1).view(b * h, n)

    def grads(groups):
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        acc = torch.zeros(b * h, n, d, device=q.device)
        flash_gluon.kv_pass(q, k, v, do, lse, delta, dk, dv, True, scale, dq_acc=acc, groups=groups)
        return dk, dv, acc

    first = grads(None)
    assert not any(t.isnan().any() for t in first)
    for groups in ((1, 1), (2, 1), (2, 3), (3, 2), (1, 4), (5, 5)):
        dk, dv, acc = grads(groups)
        assert torch.equal(dk, first[0]) and torch.equal(dv, first[1]), f"(HEAD_GROUP, TAIL) = {groups}"
        torch.testing.assert_close(acc, first[2], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gluon_forward_head_groups_cover_every_program(monkeypatch, is_causal):
    """The forward in `grouped_program`'s order: with 5 heads in groups of 1, 2 or 3 before a last group of 1 to 4,
    and all 5 at once (the plain order), every program runs once, on its own query tile: O and L bitwise those of
    the plain order (they start as NaN)."""
    from cs336_systems.flash import gluon as flash_gluon
    from cs336_systems.flash.gluon import interface

    b, h, n, d = 1, 5, 1024, 64
    q, k, v = (randn_cuda(b, h, n, d, seed=140 + i, dtype=torch.bfloat16) for i in range(3))

    def forward(groups):
        monkeypatch.setattr(interface, "fwd_head_groups", lambda *args: groups)
        o, lse = torch.full_like(q, float("nan")), torch.full((b * h, n), float("nan"), device=q.device)
        flash_gluon.forward(q, k, v, o, lse, is_causal, d ** -0.5)
        return o, lse

    first = forward((h, h))
    assert not any(t.isnan().any() for t in first)
    for groups in ((1, 1), (2, 1), (2, 3), (3, 2), (1, 4)):
        o, lse = forward(groups)
        assert torch.equal(o, first[0]) and torch.equal(lse, first[1]), f"(HEAD_GROUP, TAIL) = {groups}"


def test_gluon_forward_groups_a_wave_of_lines_with_the_tail_rule(monkeypatch):
    """`fwd_head_groups` on a stand-in device (132 SMs): groups of as many (batch, head) lines as their query tiles
    fill the SMs once, whole groups before a last group that holds TAIL_WORK longest programs of work per SM (or
    every line); one group of every line without a device; a window keeps the plain order (the template's group
    and tail: every head)."""
    from types import SimpleNamespace

    from cs336_systems.flash.gluon import heuristics, interface

    props = SimpleNamespace(L2_cache_size=50 << 20, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(heuristics, "_fwd_head_groups", heuristics._fwd_head_groups.__wrapped__)
    # 32 x 16 x 512, 192-row programs, 128-key tiles, causal: 512 lines of 3 programs of 2, 3, 4 key tiles
    group, tail = heuristics._fwd_head_groups(512, 512, 512, True, 192, 128, 0)
    assert group == 132 // 3 and (512 - tail) % group == 0
    assert tail * (2 + 3 + 4) >= heuristics.TAIL_WORK * 4 * 132 > (tail - group) * (2 + 3 + 4)
    # 1 x 16 x 16384, not causal: 16 lines of 86 programs, a line a group; the tail holds 1.5 programs per SM
    group, tail = heuristics._fwd_head_groups(16, 16384, 16384, False, 192, 128, 0)
    assert (group, tail) == (1, 3)
    assert heuristics._fwd_head_groups(512, 512, 512, True, 192, 128, None) == (512, 512)
    q = torch.empty(8, 16, 2048, 128, dtype=torch.bfloat16)
    lse = torch.empty(8 * 16, 2048)
    *_, template, _, key = interface._fwd_launch_plan((q, q, q, q, lse), True, None, (4096, 0))
    assert template[17:] == (128, 128)  # (HEAD_GROUP, TAIL)


@pytest.mark.gpu
def test_gluon_launch_cache_keys_on_the_head_dim():
    """Same shape and config at two head dims: each call runs the kernel compiled for its own (a cache keyed
    without the head dim once ran the d 64 kernel on d 128 tensors)."""
    from cs336_systems.flash_triton import KernelOptions, flash_forward_triton

    opts = KernelOptions(autotune=False, gluon_fwd=True, configs=(("fwd", (64, 128, 8, 2)),))
    plain = KernelOptions(autotune=False)
    for _ in range(2):  # the second round runs from the launch cache
        for d in (64, 128):
            q, k, v = (randn_cuda(1, 2, 1024, d, seed=100 + i, dtype=torch.bfloat16) for i in range(3))
            o, lse = flash_forward_triton(q, k, v, True, opts)
            ref, ref_lse = flash_forward_triton(q, k, v, True, plain)
            assert rel_err(o, ref) < 1e-2 and (lse - ref_lse).abs().max().item() < 1e-2, f"d {d}"


@pytest.mark.gpu
def test_gluon_kernels_compiled_ahead_for_longer_calls():
    """A signature's first call, short enough for the Triton kernels, compiles in the background the kernels that
    its batch and heads run from `chooser.gluon_lengths` (the Gluon ones and the Triton ones around them): the first
    longer call then compiles none (fp16, full attention, d 128: a signature no other test here runs first)."""
    from cs336_systems.flash import chooser, launch, triton_kernels
    from cs336_systems.flash.gluon import flash_bwd_kv, flash_bwd_kv_qrows, flash_bwd_single_keys, flash_fwd
    from cs336_systems.flash_triton import flash_attention

    modules = (flash_fwd, flash_bwd_kv, flash_bwd_kv_qrows, flash_bwd_single_keys, triton_kernels)
    kernels = [kernel for module in modules for kernel in vars(module).values()
               if hasattr(kernel, "device_caches")]

    def compiled() -> int:
        return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())

    b, h, d = 2, 16, 128
    n = chooser.gluon_lengths(b * h, d, False)[-1]
    for length in (512, n):
        q, k, v = (randn_cuda(b, h, length, d, seed=60 + i, dtype=torch.float16).requires_grad_() for i in range(3))
        flash_attention(q, k, v, False).sum().backward()
        if length == 512:
            launch.wait_for_background_compiles()
            before = compiled()
    ran = [(key[0][0], plan.choice.design) for key, plan in launch._BACKWARD_PLANS.items()]
    assert ((b, h, n, d), chooser.Backward.GLUON_SINGLE) in ran, "the longer call must run the Gluon kernels"
    assert compiled() == before, "the longer call compiled a kernel at its first launch"


@pytest.mark.gpu
def test_gluon_forward_of_a_larger_batch_compiled_ahead():
    """A signature's first call of 1024 keys, short enough for the Triton kernels, compiles in the background what a
    batch large enough for the Gluon forward runs at its length (`launch._larger_batch`: the forward's one-warpgroup
    config, which no longer length runs): the first call of that batch then compiles nothing (fp16, full attention,
    d 64, 8 heads: a signature no other test here runs first)."""
    from cs336_systems.flash import chooser, launch, triton_kernels
    from cs336_systems.flash.gluon import flash_bwd_kv, flash_bwd_kv_qrows, flash_bwd_single_keys, flash_fwd
    from cs336_systems.flash_triton import flash_attention

    modules = (flash_fwd, flash_bwd_kv, flash_bwd_kv_qrows, flash_bwd_single_keys, triton_kernels)
    kernels = [kernel for module in modules for kernel in vars(module).values()
               if hasattr(kernel, "device_caches")]

    def compiled() -> int:
        return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())

    b, h, n, d = 2, 8, 1024, 64
    factor = launch._larger_batch(b * h, n, n)
    assert factor > 1
    for batch in (b, b * factor):
        q, k, v = (randn_cuda(batch, h, n, d, seed=70 + i, dtype=torch.float16).requires_grad_() for i in range(3))
        flash_attention(q, k, v, False).sum().backward()
        if batch == b:
            launch.wait_for_background_compiles()
            before = compiled()
    ran = [(key[0][0], plan.design) for key, plan in launch._FORWARD_PLANS.items()]
    assert ((b * factor, h, n, d), chooser.Forward.GLUON) in ran, "the larger batch must run the Gluon forward"
    assert compiled() == before, "the larger batch compiled a kernel at its first launch"


@pytest.mark.gpu
def test_a_call_runs_compiled_triton_kernels_while_its_gluon_kernel_compiles(monkeypatch):
    """A new length whose backward is the Gluon single pass while that kernel still compiles in the background (as
    `prewarm` sent it at a longer length): the call runs the Triton kernels it has compiled, at once and with their
    results, and keeps no plan; once the compile has ended, the next call plans the Gluon kernel and keeps it."""
    import threading
    import time
    from concurrent.futures import Future

    from cs336_systems.flash import background, chooser, gluon, launch
    from cs336_systems.flash_triton import KernelOptions, flash_backward_triton, flash_forward_triton

    b, h, n, d = 2, 16, 1536, 64
    q, k, v, do = (randn_cuda(b, h, n, d, seed=70 + i, dtype=torch.bfloat16) for i in range(4))
    if not gluon.supported(q, k, v, do, single_pass=True):
        pytest.skip("the Gluon single pass does not take this call here")
    o, lse = flash_forward_triton(q, k, v, True)
    triton_only = flash_backward_triton(q, k, v, o, lse, do, True, KernelOptions(gluon_fwd=False, gluon_kv=False))
    launch.wait_for_background_compiles()  # (what the first forward sent; then one compile is made to look pending)
    own: list = []
    flash_backward_triton(q, k, v, o, lse, do, True, warm=own)
    compiling = Future()
    for launcher, args, constexprs in own:
        if not isinstance(launcher, launch._Launcher):  # (the Gluon kernel)
            monkeypatch.setitem(background._IN_FLIGHT, background.specialization(
                launcher.name, args, constexprs, launcher.plain), compiling)
    assert background.compiling(own)
    monkeypatch.setattr(launch, "_BACKWARD_PLANS", {})
    ends = threading.Timer(60, compiling.set_result, (None,))  # (a failing routing waits this long, not forever)
    ends.start()
    try:
        start = time.perf_counter()
        grads = flash_backward_triton(q, k, v, o, lse, do, True)
        waited = time.perf_counter() - start
    finally:
        ends.cancel()
        if not compiling.done():
            compiling.set_result(None)
    assert waited < 30, f"the call waited {waited:.1f} s for the background compile"
    assert not launch._BACKWARD_PLANS, "a plan chosen while a kernel compiles must not be kept"
    assert all(torch.equal(x, y) for x, y in zip(grads, triton_only)), "the two-pass Triton backward is repeatable"
    flash_backward_triton(q, k, v, o, lse, do, True)
    (plan,) = launch._BACKWARD_PLANS.values()
    assert plan.choice.design == chooser.Backward.GLUON_SINGLE
