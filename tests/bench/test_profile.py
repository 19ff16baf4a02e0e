"""`cs336-bench profile`: torch.profiler tables per range of the LM's forward and train step."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd.profiler_util import Interval, Kernel
from torch.profiler import DeviceType

from cs336_systems.bench import profile
from cs336_systems.bench.profile import PHASES, SUB_RANGES, is_matmul, kernel_tables, short_name, slug

from .helpers import check_report, check_rows, rows_of, run_cli


def test_smoke_profile(tmp_path):
    assert run_cli("profile", "--smoke", "--out", str(tmp_path), "--trace") == 0
    rows = rows_of(tmp_path, "profile")
    check_rows(rows, "profile", ("kernel_time", "trace", "forward_ms", "forward_kernel_ms", "forward_kernels"))
    assert {(r["mode"], r["status"]) for r in rows} == {("fwd", "ok"), ("step", "ok")}
    for r in rows:
        assert r["kernel_time"] == ("cuda_kernels" if torch.cuda.is_available() else "cpu_ops_self")
        for name in (*PHASES[r["mode"]], *SUB_RANGES):
            kernels = r[f"{slug(name)}_kernels"]
            assert r[f"{slug(name)}_kernel_ms"] > 0 and 0 <= r[f"{slug(name)}_matmul_share"] <= 1, name
            assert 0 < len(kernels) <= profile.TOP_KERNELS
            assert all(calls > 0 and ms >= 0 and 0 <= share <= 1 for _, calls, ms, share in kernels)
            assert sum(share for *_, share in kernels) <= 1 + 1e-9
        for name in PHASES[r["mode"]]:
            assert r[f"{slug(name)}_ms"] > 0
        # the attention sub-ranges run inside the forward; their matmuls are the handout's two
        assert sum(r[f"{slug(s)}_kernel_ms"] for s in SUB_RANGES) <= r["forward_kernel_ms"]
        assert any(is_matmul(k[0]) for k in r["attention_scores_kernels"])
        assert any(is_matmul(k[0]) for k in r["final_matmul_kernels"])
        assert r["softmax_matmul_share"] == 0
        with gzip.open(tmp_path / "profile" / r["trace"]) as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert {*PHASES[r["mode"]], *SUB_RANGES} <= names
    step = next(r for r in rows if r["mode"] == "step")
    phases = step["forward_ms"] + step["backward_ms"] + step["optimizer_step_ms"]
    assert step["ms"] == step["train_step_ms"] >= phases
    assert step["optimizer_step_matmul_share"] == 0
    table = check_report(tmp_path, "profile", plots=False)
    assert "## Time per step, mode fwd" in table and "## Time per step, mode step" in table
    assert "## Top kernels per step, context 32, fp32" in table and "`aten::" in table


def test_bad_steps_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exc:
        run_cli("profile", "--smoke", "--steps", "0", "--out", str(tmp_path))
    assert exc.value.code == 2 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", [
    "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel",
    "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN",
    "ampere_sgemm_128x64_tn",
    "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_32x6_tn_align4>("
    "cutlass_80_tensorop_s1688gemm_64x64_32x6_tn_align4::Params)",
    "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>(float const*)",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, false, true, false>(float*)",
    "aten::mm", "aten::bmm", "aten::addmm", "aten::matmul",
])
def test_matmul_kernels(name):
    assert is_matmul(name)


@pytest.mark.parametrize("name", [
    "void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, std::array<char*, 2ul>)",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, "
    "float, 4, 4> >(at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, float, 4, 4>)",
    "Memcpy DtoD (Device -> Device)", "aten::addcmul_", "aten::mul", "aten::exp", "aten::amax",
])
def test_other_kernels(name):
    assert not is_matmul(name)


def test_short_name_drops_void_the_parameters_and_anonymous_namespaces():
    assert short_name("void at::native::(anonymous namespace)::f<(anonymous namespace)::g>(int, float*)") == (
        "at::native::f<g>")
    assert short_name("nvjet_tst_128x256") == "nvjet_tst_128x256"
    assert short_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD (Device -> Device)"
    long = short_name("void k<" + "x" * 500 + ">(int)")
    assert len(long) == profile.NAME_CHARS and long.endswith("…")


def _event(name, start, end, device=DeviceType.CPU, annotation=False, kernels=(), self_us=0.0):
    return SimpleNamespace(name=name, time_range=Interval(start, end), device_type=device, is_async=False,
                           is_user_annotation=annotation, kernels=list(kernels), self_cpu_time_total=self_us)


def test_kernels_belong_to_the_range_their_launching_op_started_in():
    """The CUDA branch on hand-made events: kernels by their launching op's start (any thread), the GPU-side
    copies of the ranges and the device events themselves ignored, every instance of a range summed."""
    events = [
        _event("forward", 0, 100, annotation=True),
        _event("forward", 0, 100, device=DeviceType.CUDA, annotation=True),  # kineto's gpu_user_annotation
        _event("softmax", 40, 60, annotation=True),
        _event("aten::mm", 10, 12, kernels=[Kernel("nvjet_tst_128x256", 0, 30.0)]),
        _event("aten::exp", 45, 46, kernels=[Kernel("void exp_kernel<float>(float*)", 0, 5.0)]),
        _event("nvjet_tst_128x256", 120, 150, device=DeviceType.CUDA),  # the mm's kernel, running late
        _event("backward", 100, 200, annotation=True),
        _event("aten::mm", 130, 131, kernels=[Kernel("nvjet_tst_128x256", 0, 20.0)] * 2),  # autograd's thread
        _event("forward", 300, 400, annotation=True),
        _event("aten::exp", 310, 311, kernels=[Kernel("void exp_kernel<float>(float*)", 0, 5.0)]),
        _event("aten::exp", 250, 251, kernels=[Kernel("void exp_kernel<float>(float*)", 0, 7.0)]),  # in no range
    ]
    spans = profile.range_spans(events, ["forward", "softmax", "backward"])
    assert spans == {"forward": [(0, 100), (300, 400)], "softmax": [(40, 60)], "backward": [(100, 200)]}
    tables = kernel_tables(events, spans, on_cuda=True)
    assert tables == {
        "forward": {"nvjet_tst_128x256": [1, 30.0], "void exp_kernel<float>(float*)": [2, 10.0]},
        "softmax": {"void exp_kernel<float>(float*)": [1, 5.0]},
        "backward": {"nvjet_tst_128x256": [2, 40.0]},
    }
    summary = profile.summarize(tables["forward"], 2, "forward")
    assert summary == {"forward_kernel_ms": 0.02, "forward_matmul_share": 0.75,
                       "forward_kernels": [["nvjet_tst_128x256", 0.5, 0.015, 0.75],
                                           ["exp_kernel<float>", 1, 0.005, 0.25]]}
