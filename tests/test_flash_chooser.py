"""The chooser and the tuning table: pure functions of a call's metadata, tested without running a kernel."""

from __future__ import annotations

import json

import pytest
import torch

from cs336_systems.flash import chooser, tuning
from cs336_systems.flash.chooser import Backward, Call, Forward, KernelOptions
from cs336_systems.flash.tuning import TableKey, TileConfig

LARGE = dict(batch=1, heads=16, n_q=16384, n_k=16384)  # the leaderboard: 2^32 work
SMALL = dict(batch=1, heads=16, n_q=1024, n_k=1024)    # 2^24 work: host-bound, below the Gluon thresholds


def call(sizes=SMALL, d=64, causal=True, kernels=True, sms=132, tma=True, gluon=True, **layout) -> Call:
    facts = {**dict(gluon_fwd=gluon, gluon_single=gluon, gluon_kv=gluon), **layout}
    return Call(**sizes, d=d, causal=causal, kernels=kernels, sms=sms, tma=tma, **facts)


@pytest.mark.parametrize("facts,opts,expected", [
    (dict(kernels=False), {}, (Forward.PYTORCH, 0)),
    (dict(), {}, (Forward.TRITON, 0)),                                       # short of the Gluon kernels' work
    (dict(sizes=LARGE), {}, (Forward.GLUON, 0)),
    (dict(sizes=LARGE, gluon=False), {}, (Forward.TRITON, 0)),              # a layout Gluon does not take
    (dict(sizes=LARGE, tma=False), {}, (Forward.TRITON, 0)),
    (dict(sizes=LARGE), {"gluon_fwd": False}, (Forward.TRITON, 0)),
    (dict(), {"gluon_fwd": True}, (Forward.GLUON, 0)),                        # wherever it applies
    (dict(sizes=dict(batch=1, heads=1, n_q=32768, n_k=32768)), {}, (Forward.TRITON_SPLIT, 16384)),  # a short grid
    (dict(sizes=dict(batch=1, heads=1, n_q=32768, n_k=32768)), {"split_rows": 0}, (Forward.GLUON, 0)),
], ids=["cpu", "small", "large", "large-layout", "large-no-tma", "off", "forced", "short-grid", "split-off"])
def test_flash_chooser_forward_routes(facts, opts, expected):
    assert chooser.forward_design(call(**facts), KernelOptions(**opts)) == expected


@pytest.mark.parametrize("batch_heads", [1, 16, 32, 100, 512, 4096])
@pytest.mark.parametrize("d,causal", [(64, True), (64, False), (128, True), (128, False)])
def test_flash_chooser_gluon_lengths_are_the_shortest_whole_tile_lengths_of_each_gluon_backward(batch_heads, d,
                                                                                               causal):
    """Where a signature compiles its Gluon kernels ahead (`launch.prewarm`): at the first length the Gluon forward
    runs with the two-pass design's Gluon dK/dV pass (or already the single pass), at the last with the single pass;
    256 rows shorter each of them does not (unless that is empty)."""
    def designs(n):
        facts = call(dict(batch=1, heads=batch_heads, n_q=n, n_k=n), d=d, causal=causal, sms=0)  # (no split)
        choice = chooser.backward_design(facts)
        gluon_backward = choice.design is Backward.GLUON_SINGLE or choice.gluon_kv
        return chooser.forward_design(facts) == (Forward.GLUON, 0), gluon_backward, choice.design

    lengths = chooser.gluon_lengths(batch_heads, d, causal)
    assert 1 <= len(lengths) <= 2 and list(lengths) == sorted(set(lengths))
    assert all(n % 256 == 0 for n in lengths)
    first, last = lengths[0], lengths[-1]
    assert designs(first)[:2] == (True, True)
    assert first == 256 or designs(first - 256)[:2] != (True, True)
    assert designs(last) == (True, True, Backward.GLUON_SINGLE)
    assert last == 256 or designs(last - 256) != (True, True, Backward.GLUON_SINGLE)
    assert chooser.gluon_lengths(0, d, causal) == chooser.gluon_lengths(1, d, causal)  # (no heads: as one)


@pytest.mark.parametrize("facts,opts,expected", [
    (dict(kernels=False), {}, Backward.PYTORCH),
    (dict(), {"triton_backward": False}, Backward.PYTORCH),
    (dict(), {}, Backward.TRITON_TWO_PASS),
    (dict(sizes=LARGE), {}, Backward.GLUON_SINGLE),
    (dict(sizes=LARGE), {"deterministic": True}, Backward.TRITON_TWO_PASS),
    (dict(sizes=LARGE, gluon_single=False), {}, Backward.TRITON_TWO_PASS),
    (dict(), {"deterministic": False}, Backward.TRITON_SINGLE),
    (dict(sizes=LARGE), {"deterministic": False}, Backward.GLUON_SINGLE),
    (dict(sizes=LARGE), {"skip_masked_tiles": False}, Backward.TRITON_TWO_PASS),
], ids=["cpu", "pytorch-variant", "small", "large", "large-deterministic", "large-layout", "atomic-small",
        "atomic-large", "no-skip"])
def test_flash_chooser_backward_routes(facts, opts, expected):
    assert chooser.backward_design(call(**facts), KernelOptions(**opts)).design is expected


def test_flash_chooser_two_pass_takes_the_gluon_kv_pass_only_unsplit_and_large():
    deterministic = KernelOptions(deterministic=True)
    assert chooser.backward_design(call(sizes=LARGE), deterministic).gluon_kv
    assert not chooser.backward_design(call(), deterministic).gluon_kv
    short = chooser.backward_design(call(sizes=dict(batch=1, heads=1, n_q=32768, n_k=32768)), deterministic)
    assert short.kv_chunk and short.dq_chunk and not short.gluon_kv


@pytest.mark.parametrize("batch,seq,d,causal,forward,backward,gluon_kv,inlined_fwd,inlined_bwd", [
    (32, 512, 64, True, Forward.GLUON, Backward.GLUON_SINGLE, False, False, False),  # 2^27: the Gluon forward, and
    # at causal d 64 the single pass from 2^25 visible
    (32, 512, 64, False, Forward.GLUON, Backward.TRITON_TWO_PASS, True, False, False),  # not causal: Gluon dK/dV
    (32, 512, 128, False, Forward.GLUON, Backward.GLUON_SINGLE, False, False, False),  # d 128 the Gluon backward
    (32, 512, 128, True, Forward.GLUON, Backward.TRITON_TWO_PASS, True, False, False),  # 2^26 visible: Gluon dK/dV
    (16, 1024, 64, False, Forward.GLUON, Backward.GLUON_SINGLE, False, False, False),  # 2^28: Gluon both ways
    (16, 1024, 64, True, Forward.GLUON, Backward.GLUON_SINGLE, False, False, False),
    (16, 1024, 128, True, Forward.GLUON, Backward.GLUON_SINGLE, False, False, False),
    (8, 2048, 64, True, Forward.GLUON, Backward.GLUON_SINGLE, False, False, False),
    (8, 1024, 64, True, Forward.GLUON, Backward.GLUON_SINGLE, False, False, False),  # 2^26 visible at causal d 64
    (4, 1024, 64, True, Forward.TRITON, Backward.GLUON_SINGLE, False, True, False),  # 2^25 visible: Triton forward
    (1, 1024, 64, True, Forward.TRITON, Backward.TRITON_TWO_PASS, False, True, True),  # 2^23 (host-bound): Triton
    (4, 512, 128, False, Forward.TRITON, Backward.TRITON_TWO_PASS, False, True, True),  # 2^24 at d 128
])
def test_flash_chooser_gluon_thresholds_at_the_training_grid(batch, seq, d, causal, forward, backward, gluon_kv,
                                                             inlined_fwd, inlined_bwd):
    """The training grid's points (16 heads): the Gluon forward from GLUON_FWD_MIN_WORK, the Gluon single pass from
    GLUON_BWD_MIN_WORK of visible work (half the work when causal) by head dim and causality, the two-pass design's
    Gluon dK/dV pass from GLUON_KV_MIN_WORK where the single pass does not run, each inlined under torch.compile
    below its own threshold (the backward: below both)."""
    grid_call = call(sizes=dict(batch=batch, heads=16, n_q=seq, n_k=seq), d=d, causal=causal)
    assert chooser.forward_design(grid_call) == (forward, 0)
    choice = chooser.backward_design(grid_call)
    assert (choice.design, choice.gluon_kv) == (backward, gluon_kv)
    assert (chooser.inlined(grid_call), chooser.inlined(grid_call, backward=True)) == (inlined_fwd, inlined_bwd)
    deterministic = chooser.backward_design(grid_call, KernelOptions(deterministic=True))
    assert deterministic.design is Backward.TRITON_TWO_PASS
    assert deterministic.gluon_kv == (grid_call.visible_work >= chooser.gluon_kv_min_work(d))


@pytest.mark.parametrize("facts,expected", [
    (dict(), True), (dict(sizes=LARGE), False), (dict(kernels=False), False), (dict(sms=0), False),
    (dict(sizes=dict(batch=1, heads=1, n_q=16384, n_k=16384)), False),  # a split pass
])
def test_flash_chooser_inlines_only_short_unsplit_gpu_calls(facts, expected):
    assert chooser.inlined(call(**facts)) is expected


SHORT_GRID = dict(batch=1, heads=1, n_q=32768, n_k=32768)


@pytest.mark.parametrize("opts", [{}, {"gluon_fwd": True, "gluon_kv": True}, {"split_rows": 256}],
                         ids=["default", "gluon-forced", "split-forced"])
@pytest.mark.parametrize("sizes", [SMALL, LARGE, SHORT_GRID], ids=["small", "large", "short-grid"])
@pytest.mark.parametrize("window_keys", [4097, 257], ids=["band-4097", "band-257"])
def test_flash_chooser_routes_windowed_calls(sizes, opts, window_keys):
    """A band bounds every reduction: unsplit, never inlined. The forward and the single-pass backward run in Gluon
    where it takes the call (the launcher's facts: self-attention) and the band's work reaches each one's threshold
    (or Gluon is forced), the backward unless deterministic is True; else the Triton designs, never the Gluon
    two-pass dK/dV pass."""
    windowed = call(sizes=sizes, window_keys=window_keys)
    band_work = sizes["batch"] * sizes["heads"] * sizes["n_q"] * window_keys
    assert windowed.visible_work == band_work
    # (a window keeps the non-causal threshold, though the call is causal)
    gluon = band_work >= chooser.gluon_bwd_min_work(64, False) if "gluon_kv" not in opts else opts["gluon_kv"]
    gluon_fwd = band_work >= chooser.GLUON_FWD_MIN_WORK if "gluon_fwd" not in opts else opts["gluon_fwd"]
    single = chooser.BackwardChoice(Backward.GLUON_SINGLE)
    forward = chooser.forward_design(windowed, KernelOptions(**opts))
    assert forward == ((Forward.GLUON, 0) if gluon_fwd else (Forward.TRITON, 0))
    not_taken = call(sizes=sizes, window_keys=window_keys, gluon_fwd=False)
    assert chooser.forward_design(not_taken, KernelOptions(**opts)) == (Forward.TRITON, 0)
    default = chooser.backward_design(windowed, KernelOptions(**opts))
    assert default == (single if gluon else chooser.BackwardChoice(Backward.TRITON_TWO_PASS))
    atomic = chooser.backward_design(windowed, KernelOptions(deterministic=False, **opts))
    assert atomic == (single if gluon else chooser.BackwardChoice(Backward.TRITON_SINGLE))
    deterministic = chooser.backward_design(windowed, KernelOptions(deterministic=True, **opts))
    assert deterministic == chooser.BackwardChoice(Backward.TRITON_TWO_PASS)
    no_gluon = chooser.backward_design(call(sizes=sizes, window_keys=window_keys, gluon_single=False),
                                       KernelOptions(**opts))
    assert no_gluon == chooser.BackwardChoice(Backward.TRITON_TWO_PASS)
    assert not chooser.inlined(windowed)


@pytest.mark.parametrize("opts", [{}, {"gluon_fwd": True, "gluon_kv": True}, {"split_rows": 256},
                                  {"deterministic": False}, {"deterministic": True}],
                         ids=["default", "gluon-forced", "split-forced", "atomic-asked", "deterministic"])
@pytest.mark.parametrize("sizes", [SMALL, LARGE, SHORT_GRID], ids=["small", "large", "short-grid"])
@pytest.mark.parametrize("window", [False, True], ids=["no-window", "window"])
def test_flash_chooser_routes_packed_calls(sizes, opts, window):
    """Packed sequences (varlen): the forward runs in Gluon where it takes the call (at any work, with or without a
    window; `deterministic` does not matter to a forward), else the Triton kernels' IS_VARLEN variant, unsplit; the
    backward the Gluon single pass where it takes the call and `deterministic` is not True, else the two-pass
    IS_VARLEN passes (they have no atomic dQ); never split, never inlined."""
    options = KernelOptions(**opts)
    two_pass = chooser.BackwardChoice(Backward.TRITON_TWO_PASS)
    for gluon in (False, True):
        packed = call(sizes=sizes, window_keys=257 if window else 0, varlen=True, gluon=gluon)
        assert chooser.forward_design(packed, options) == ((Forward.GLUON if gluon else Forward.TRITON), 0)
        wanted = gluon and options.deterministic is not True
        assert chooser.backward_design(packed, options) == (
            chooser.BackwardChoice(Backward.GLUON_SINGLE) if wanted else two_pass)
        assert not chooser.inlined(packed) and not chooser.inlined(packed, backward=True)
    no_tma = call(sizes=sizes, varlen=True, tma=False)
    assert chooser.backward_design(no_tma, options) == two_pass
    assert chooser.forward_design(no_tma, options) == (Forward.TRITON, 0)
    gluon_off = call(sizes=sizes, varlen=True)
    assert chooser.backward_design(gluon_off, KernelOptions(**{**opts, "gluon_kv": False})) == two_pass
    assert chooser.forward_design(gluon_off, KernelOptions(**{**opts, "gluon_fwd": False})) == (Forward.TRITON, 0)


def test_flash_chooser_routes_packed_calls_without_kernels_to_pytorch():
    packed = call(kernels=False, varlen=True)
    assert chooser.forward_design(packed) == (Forward.PYTORCH, 0)
    assert chooser.backward_design(packed) == chooser.BackwardChoice(Backward.PYTORCH)


@pytest.mark.parametrize("band,n_k,expected", [
    (None, 4096, 0), ((3, 0), 4096, 4), ((200, 56), 4096, 257), ((4096, 4096), 1000, 1000), ((0, 0), 0, 1),
])
def test_flash_chooser_band_keys(band, n_k, expected):
    """The keys a query sees at most under a band, which sets `Call.window` (0: no window)."""
    assert chooser.band_keys(band, n_k) == expected
    assert call(window_keys=chooser.band_keys(band, n_k)).window is (band is not None)


@pytest.mark.parametrize("window,is_causal,n_q,n_k,expected", [
    ((-1, -1), False, 64, 64, None),
    ((-1, -1), True, 64, 64, None),
    ((-1, 5), True, 64, 64, None),          # causal already hides every key right of the query
    ((63, 63), False, 64, 64, None),        # wider than the sequence
    ((62, -1), False, 64, 64, (62, 64)),
    ((-1, 62), False, 64, 64, (64, 62)),
    ((3, 7), True, 64, 64, (3, 0)),         # causal folded into the right bound
    ((3, 7), False, 20, 100, (3, 7)),
    ((0, 0), False, 100, 20, (0, 0)),
    ((10**9, 2), False, 30, 40, (30, 2)),   # an unbounded side as the lengths (kernel ints stay small)
], ids=str)
def test_flash_chooser_band(window, is_causal, n_q, n_k, expected):
    assert chooser.band(window, is_causal, n_q, n_k) == expected


def test_flash_tuning_buckets_are_powers_of_two_within_bounds():
    assert tuning.length_bucket(1, 1) == tuning.MIN_BUCKET
    assert tuning.length_bucket(1536, 777) == 2048 == tuning.length_bucket(2048, 100)
    assert tuning.length_bucket(10 ** 6, 3) == tuning.MAX_BUCKET


@pytest.mark.parametrize("dtype,precision,expected", [
    (torch.bfloat16, "tf32", "16bit"), (torch.float16, "ieee", "16bit"), (torch.float32, "tf32", "fp32"),
    (torch.float32, "ieee", "ieee"),
])
def test_flash_tuning_dtype_classes(dtype, precision, expected):
    assert tuning.dtype_class(dtype, precision) == expected


def test_flash_tuning_new_lengths_in_a_bucket_share_a_config():
    """A new sequence length of a bucket gets the configs the bucket's others got: nothing to time or retune."""
    configs = {tuning.tile_config(k, arch="sm90", d_tile=64, dtype=torch.bfloat16, precision="tf32", causal=True,
                                  n_q=n, n_k=n, table={}) for k in tuning.KERNELS for n in (1025, 1536, 2000, 2048)}
    assert len(configs) == len(tuning.KERNELS)


def test_flash_tuning_fits_tiles_to_short_lengths_and_fp32_runs_smaller_tiles():
    short = tuning.tile_config("fwd", arch="sm90", d_tile=64, dtype=torch.bfloat16, precision="tf32", causal=True,
                               n_q=40, n_k=20, table={})
    assert (short.q_tile, short.k_tile) == (64, 32)
    for kernel in tuning.KERNELS:
        for d in (64, 128, 256):
            half = tuning.rule_config(kernel, d, "16bit")
            full = tuning.rule_config(kernel, d, "ieee")
            assert full.q_tile * full.k_tile <= half.q_tile * half.k_tile, (kernel, d)
    assert tuning.tile_config("kv", arch=None, d_tile=64, dtype=torch.float32, precision="ieee", causal=False,
                              n_q=128, n_k=128) == tuning.INTERPRETER_CONFIG


def test_flash_tuning_table_entry_then_nearest_bucket_then_rule():
    key = TableKey("fwd", "sm90", 64, "16bit", True, 1024)
    table = {key: TileConfig(64, 64, 4, 2), TableKey("fwd", "sm90", 64, "16bit", True, 8192): TileConfig(128, 32, 8, 3)}

    def config(n, arch="sm90"):
        return tuning.tile_config("fwd", arch=arch, d_tile=64, dtype=torch.bfloat16, precision="tf32", causal=True,
                                  n_q=n, n_k=n, table=table)

    assert config(1024) == TileConfig(64, 64, 4, 2)
    assert config(2048) == TileConfig(64, 64, 4, 2)      # 1024 is one bucket away, 8192 two
    assert config(16384) == TileConfig(128, 32, 8, 3)
    assert config(1024, arch="sm80") == tuning.rule_config("fwd", 64, "16bit")


def test_flash_tuning_loads_the_table_file(tmp_path):
    path = tmp_path / "table.json"
    entry = dict(kernel="kv", arch="sm90", d=128, dtype="16bit", causal=False, bucket=4096, config=[32, 64, 4, 3])
    path.write_text(json.dumps({"measured": [{"gpu": "NVIDIA H200"}], "entries": [entry]}))
    assert tuning.load_table(path) == {TableKey("kv", "sm90", 128, "16bit", False, 4096): TileConfig(32, 64, 4, 3)}
    assert tuning.load_table(tmp_path / "missing.json") == {}


def test_flash_tuning_shares_one_config_across_buckets_within_tolerance(tmp_path):
    """A config within 5% of every bucket's winner serves all buckets of its key (a new length compiles nothing);
    where none is, each bucket keeps its winner."""
    a, b, c = TileConfig(64, 64, 4, 2), TileConfig(128, 64, 8, 3), TileConfig(128, 32, 4, 3)
    assert tuning.shared_config({512: {a: 1.0, b: 1.045}, 2048: {a: 1.054, b: 1.0}}) == b
    assert tuning.shared_config({512: {a: 1.0, b: 1.07}, 2048: {a: 1.2, b: 1.0}}) is None
    assert tuning.shared_config({512: {a: 1.0, b: 1.01}}) is None                  # one bucket: its winner
    assert tuning.shared_config({512: {a: 1.0}, 2048: {c: 1.0}}) is None          # nothing timed in both

    def entry(bucket, config, tried):
        return dict(kernel="dq", arch="sm90", d=64, dtype="16bit", causal=True, bucket=bucket, config=config,
                    tried=[[*cfg, ms] for cfg, ms in tried])

    path = tmp_path / "table.json"
    path.write_text(json.dumps({"measured": [], "entries": [
        entry(512, [64, 64, 4, 2], [((64, 64, 4, 2), 1.0), ((128, 64, 8, 3), 1.045)]),
        entry(2048, [128, 64, 8, 3], [((64, 64, 4, 2), 1.054), ((128, 64, 8, 3), 1.0)])]}))
    assert set(tuning.load_table(path).values()) == {b}


def test_flash_tuning_shipped_table_names_known_kernels_and_its_provenance():
    if not tuning.TABLE_PATH.exists():
        pytest.skip("no tuning table shipped")
    data = json.loads(tuning.TABLE_PATH.read_text())
    assert data["measured"] and all(m.get("gpu") and m.get("commit") for m in data["measured"])
    for key, config in tuning.load_table().items():
        assert key.kernel in tuning.KERNELS and key.dclass in ("16bit", "fp32", "ieee"), key
        assert config.q_tile >= tuning.MIN_TILE and config.k_tile >= tuning.MIN_TILE, (key, config)


def test_flash_fixed_config_variants():
    assert KernelOptions().fixed_config("fwd") is None
    assert KernelOptions(autotune=True).fixed_config("fwd") is None
    assert KernelOptions(autotune=False).fixed_config("kv") == tuning.FIXED_CONFIG
    given = KernelOptions(autotune=False, configs=(("kv", (32, 64, 4, 3)),))
    assert given.fixed_config("kv") == TileConfig(32, 64, 4, 3) and given.fixed_config("fwd") == tuning.FIXED_CONFIG
