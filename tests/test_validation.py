"""`cs336_systems.validation`: the combined fast condition of `check_attention_inputs` against its checks one by one."""

import numpy as np
import pytest
import torch

from cs336_systems.validation import _check_one_by_one, check_attention_inputs


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.empty(*shape, dtype=dtype, device=device)


CASES = [
    ((_t(2, 8, 16), _t(2, 8, 16), _t(2, 8, 16), True, False), "plain"),
    ((_t(8, 16), _t(9, 16), _t(9, 16), False, False), "2d, Nq != Nk"),
    ((_t(2, 4, 8, 16, dtype=torch.bfloat16),) + (_t(2, 4, 9, 16, dtype=torch.bfloat16),) * 2 + (True, False), "bf16"),
    ((_t(2, 4, 8, 16), _t(2, 2, 8, 16), _t(2, 2, 8, 16), False, True), "gqa"),
    ((_t(2, 4, 8, 16), _t(2, 2, 8, 16), _t(2, 2, 8, 16), False, False), "heads differ without gqa"),
    ((_t(2, 4, 8, 16), _t(2, 3, 8, 16), _t(2, 3, 8, 16), False, False), "heads not dividing without gqa"),
    ((_t(2, 4, 8, 16), _t(2, 3, 8, 16), _t(2, 3, 8, 16), False, True), "gqa heads not dividing"),
    ((_t(2, 4, 8, 16), _t(2, 0, 8, 16), _t(2, 0, 8, 16), False, True), "gqa zero kv heads"),
    ((_t(8, 16), _t(8, 16), _t(8, 16), False, True), "gqa without a head dim"),
    ((_t(2, 8, 16), _t(3, 8, 16), _t(3, 8, 16), False, False), "batch"),
    ((_t(2, 8, 16), _t(2, 8, 32), _t(2, 8, 32), False, False), "head dim"),
    ((_t(2, 8, 16), _t(2, 8, 16), _t(2, 8, 32), False, False), "v head dim"),
    ((_t(2, 8, 16), _t(2, 8, 16), _t(2, 9, 16), False, False), "kv lengths"),
    ((_t(2, 8, 16), _t(2, 8, 16), _t(8, 16), False, False), "ndim"),
    ((_t(2, 8, 16, dtype=torch.float64),) * 3 + (False, False), "float64"),
    ((_t(2, 8, 16), _t(2, 8, 16, dtype=torch.float16), _t(2, 8, 16), False, False), "mixed dtype"),
    ((_t(2, 8, 16), _t(2, 8, 16, device="meta"), _t(2, 8, 16), False, False), "device"),
    ((np.zeros((2, 8, 16)), _t(2, 8, 16), _t(2, 8, 16), False, False), "not a tensor"),
    ((_t(2, 8, 16),) * 3 + (1, False), "is_causal an int"),
    ((_t(2, 8, 16),) * 3 + (np.bool_(True), False), "is_causal a NumPy bool"),
    ((_t(2, 8, 16),) * 3 + (False, np.bool_(False)), "enable_gqa a NumPy bool"),
    ((_t(2, 0, 16), _t(2, 8, 16), _t(2, 8, 16), False, False), "no queries"),
    ((_t(2, 8, 0),) * 3 + (False, False), "head dim 0"),
]


def _outcome(fn, args):
    try:
        return "returned", fn(*args)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)


@pytest.mark.parametrize("args", [c[0] for c in CASES], ids=[c[1] for c in CASES])
def test_fast_condition_agrees_with_the_checks_one_by_one(args):
    """Same return value, or the same error and message, for good and bad inputs alike."""
    fast, slow = _outcome(check_attention_inputs, args), _outcome(_check_one_by_one, args)
    assert fast == slow
    if fast[0] == "returned":
        assert type(fast[1]) is bool


def test_gqa_with_zero_kv_heads_is_a_value_error():
    with pytest.raises(ValueError, match="must divide"):
        check_attention_inputs(_t(2, 4, 8, 16), _t(2, 0, 8, 16), _t(2, 0, 8, 16), False, True)


@pytest.mark.parametrize("kv_heads,hint", [(2, "enable_gqa=True allows this"), (3, "enable_gqa=True would need")])
def test_head_counts_differing_without_gqa_are_named(kv_heads, hint):
    """Not "batch dimensions differ": the head counts, and whether enable_gqa=True would take them."""
    message = f"^head counts of q and k, v differ: q has 4, k and v have {kv_heads}; {hint}"
    with pytest.raises(ValueError, match=message):
        check_attention_inputs(_t(2, 4, 8, 16), _t(2, kv_heads, 8, 16), _t(2, kv_heads, 8, 16), False)


def test_dim_minus_3_of_3d_inputs_is_named_as_heads_or_batch():
    with pytest.raises(ValueError, match=r"head counts \(or, for \(batch, seq, d\) inputs, batch sizes\)"):
        check_attention_inputs(_t(4, 8, 16), _t(2, 8, 16), _t(2, 8, 16), False)


@pytest.mark.parametrize("scale", [3e38, 1e39, 1e-40, 1e-39])
def test_scales_beyond_float32s_range_are_refused(scale):
    """scale·log2(e) must be a normal float32 (the kernels' exponent): beyond it came NaN or an opaque failure."""
    from cs336_systems.validation import check_scale

    with pytest.raises(ValueError, match="normal float32"):
        check_scale(scale, 64)
    assert check_scale(1e30, 64) == 1e30 and check_scale(1e-30, 64) == 1e-30


def test_a_window_of_symbolic_ints_compiles_one_graph_per_window():
    """torch.compile(fullgraph=True) of calls with two windows (the second makes the window's ints symbolic): both
    compile and equal eager."""
    from cs336_systems import flash_attention

    q, k, v = (torch.randn(1, 2, 13, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, w: flash_attention(q, k, v, is_causal=True, window=w),
                             backend="aot_eager", fullgraph=True)
    for window in ((3, 0), (5, 0), (2, 1)):
        assert torch.equal(compiled(q, k, v, window), flash_attention(q, k, v, is_causal=True, window=window))
