"""`cs336-bench resources`: the real kernels compiled for sm_90a without a GPU, ptxas's report recorded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cs336_systems import flash_triton
from cs336_systems.bench import cli
from cs336_systems.bench import resources as resources_bench

from .helpers import rows_of


def _resources(tmp_path, *argv) -> subprocess.CompletedProcess:
    """`cs336-bench resources` in a fresh process without TRITON_INTERPRET (this one runs the kernels through
    the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "cs336_systems.bench.cli", "resources", *argv, "--out", str(tmp_path)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def test_smoke_resources_compiles_every_kernel_for_sm90(tmp_path):
    from cs336_systems.flash.gluon import GLUON_KERNELS

    done = _resources(tmp_path, "--smoke")
    assert done.returncode == 0, f"resources failed:\n{done.stdout}\n{done.stderr}"
    rows = rows_of(tmp_path, "resources")
    assert sorted(r["kernel"] for r in rows) == sorted([*flash_triton.KERNELS, *GLUON_KERNELS]), rows
    for r in rows:
        assert r["target"] == "sm_90a" and r["gpu"] == "none" and r["smoke"] and r["use_tma"] is True, r
        if r["kernel"] in GLUON_KERNELS:  # the smoke head dim, 16, is not one of theirs
            dims = list(GLUON_KERNELS[r["kernel"]])
            assert r["status"].startswith("unsupported: ") and f"head dims {dims}" in r["status"], r
            continue
        assert r["status"] == "ok", r
        assert 0 < r["registers"] <= 255 and r["shared_mem_bytes"] > 0, r
        assert r["wgmma"] is True, f"{r['kernel']} {r['variant']}: bf16 on sm_90a should use wgmma"
        assert isinstance(r["ptxas_warnings"], str), r
    assert cli.main(["report", "--out", str(tmp_path), "--problems", "resources"]) == 0
    assert "| flash_fwd | " in (tmp_path / "resources" / "table.md").read_text()


# spill-store bytes a Gluon kernel may have: the keys-on-rows single pass spills bookkeeping scalars at 240
# registers (compute warps): with its stores under dV and dK, 76 B at d 64 (two 4-byte reloads per tile in its
# tile loop) and 64 B at d 128 (none in its loop); docs/design.md
SPILL_ALLOWED = {"flash_bwd_single_pass_keys_gluon": 76, "flash_bwd_single_pass_keys_packed_gluon": 88,
                 "flash_bwd_single_pass_keys_window_gluon": 76, "flash_fwd_packed_gluon": 144}


# local stores a Gluon kernel's hot loops may hold (the most in any one): the packed forward tests each tile against
# its sequence's ends and band in the loop, and the packed and windowed single pass in its loops over the tiles an
# edge or end cuts (one tile an iteration), and those registers spill there; every kernel has a loop with no local
# stores
LOOP_STORES_ALLOWED = {"flash_bwd_single_pass_keys_packed_gluon": 10, "flash_bwd_single_pass_keys_window_gluon": 8,
                       "flash_fwd_packed_gluon": 2}


def test_resources_gluon_kernels_compile_without_serialized_wgmmas(tmp_path):
    """The Gluon kernels at their shipped configs: compiled for sm_90a, and ptxas keeps their wgmmas
    asynchronous (no C75xx warning: a warning there means every wgmma waits for the one before) and spills
    nothing (beyond SPILL_ALLOWED), and nothing in their hot loops (beyond LOOP_STORES_ALLOWED)."""
    from cs336_systems.flash.gluon import GLUON_KERNELS

    done = _resources(tmp_path, "--kernels", *GLUON_KERNELS, "--d", "64", "128", "--seq", "1024", "--n-heads", "2")
    assert done.returncode == 0, f"resources failed:\n{done.stdout}\n{done.stderr}"
    rows = rows_of(tmp_path, "resources")
    assert sorted((r["kernel"], r["d_head"]) for r in rows) == sorted(
        (k, d) for k in GLUON_KERNELS for d in (64, 128)), rows
    for r in rows:
        if r["d_head"] not in GLUON_KERNELS[r["kernel"]]:  # (the single pass runs d 64 only)
            assert r["status"].startswith("unsupported: "), r
            continue
        assert r["status"] == "ok" and r["wgmma"] is True, r
        assert r["ptxas_warnings"] == "" and r["spill_store_bytes"] <= SPILL_ALLOWED.get(r["kernel"], 0), r
        # the warps launched, worker partitions padded to whole warpgroups (the forward's producer warp to four)
        assert r["warps_per_cta"] % 4 == 0 and r["warps_per_cta"] >= r["num_warps"], r
        assert r["warps_per_sm_by_registers"] == resources_bench.warps_per_sm(r["registers"], r["warps_per_cta"]), r
        if r["kernel"] == "flash_fwd_gluon" and r["d_head"] == 64:  # three consumer warpgroups and the producer's
            assert (r["num_warps"], r["warps_per_cta"], r["warps_per_sm_by_registers"]) == (13, 16, 16), r
        loops = [tuple(map(int, loop.replace(":", "/").split("/"))) for loop in r["hot_loops"].split()]
        assert loops and max(stores for _, _, stores in loops) <= LOOP_STORES_ALLOWED.get(r["kernel"], 0), r
        assert min(stores for _, _, stores in loops) == 0, r


# nvdisasm -c's shape: a loop with a matrix instruction and a spill, a loop nested in it, a wait's retry path (an
# unpredicated branch back), a loop of no matrix instruction
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDL R4, [R1+0x28] ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], RZ, !UPT ;
.L_x_1:
        /*0030*/                   STL [R1+0x84], R0 ;
        /*0040*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16].tnspA.tnspB, RZ, !UPT ;
        /*0050*/               @P1 LDL.LU.64 R216, [R1+0x98] ;
        /*0060*/               @P0 BRA `(.L_x_1) ;
        /*0070*/              @!P2 BRA `(.L_x_0) ;
.L_x_2:
        /*0080*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0090*/               @P3 BRA `(.L_x_2) ;
.L_x_4:
        /*00a0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16].tnspA.tnspB, RZ, !UPT ;
        /*00b0*/                   EXIT ;
.L_x_3:
        /*00c0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR16+0x38940], R3 ;
        /*00d0*/                   BRA `(.L_x_4) ;
"""


def test_hot_loops_reads_the_innermost_matrix_loops_of_the_sass():
    assert resources_bench.hot_loops(SASS) == "4:1/1"  # the inner loop: 0x30-0x60
    outer_only = SASS.replace("@P0 BRA `(.L_x_1)", "@P0 BRA `(.L_x_2)")  # (now a forward branch): 0x10-0x70
    assert resources_bench.hot_loops(outer_only) == "7:2/1"
    assert resources_bench.hot_loops(SASS.replace("HGMMA", "FFMA")) == ""


# a loop whose mask (two selects) sits behind a forward branch, with a wait's retry path out of the loop
MASKED_LOOP = """
.L_x_1:
        /*0000*/                   STL [R1+0x84], R0 ;
        /*0010*/               @P2 BRA `(.L_x_5) ;
        /*0020*/                   FSEL R4, R4, -INF , P3 ;
        /*0030*/                   FSEL R5, R5, -INF , P3 ;
.L_x_5:
        /*0040*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR16+0x38940], R3 ;
        /*0050*/              @!P1 BRA `(.L_x_9) ;
        /*0060*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16].tnspA.tnspB, RZ, !UPT ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
.L_x_9:
        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR16+0x38940], R3 ;
        /*00a0*/                   BRA `(.L_x_5) ;
"""


def test_hot_loops_issued_skips_what_a_branch_inside_the_loop_guards():
    assert resources_bench.hot_loops(MASKED_LOOP) == "8:0/1"
    assert resources_bench.hot_loops_issued(MASKED_LOOP) == "6"  # the two selects skipped, the retry path not taken
    assert resources_bench.hot_loops_issued(SASS) == "4"  # no branch inside: every instruction
    assert resources_bench.hot_loops_issued(SASS.replace("HGMMA", "FFMA")) == ""


def test_resources_refuses_gluon_kernels_off_sm90(tmp_path):
    done = _resources(tmp_path, "--kernels", "flash_fwd_gluon", "--arch", "80")
    assert done.returncode == 2 and "written for sm_90" in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())


def test_resources_refuses_interpreted_kernels(tmp_path, capsys):
    # conftest.py enabled the interpreter (no CUDA here), so the kernels cannot be compiled for a target
    if not flash_triton.INTERPRET:
        pytest.skip("kernels are compiled for the GPU in this process")
    with pytest.raises(SystemExit) as exc:
        cli.main(["resources", "--smoke", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "without TRITON_INTERPRET=1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_warps_per_sm_arithmetic():
    # 255 registers round to 256: one 8-warp CTA (256 threads) fills the 65,536-register file
    assert resources_bench.warps_per_sm(255, 8) == 8
    assert resources_bench.warps_per_sm(128, 4) == 16
    assert resources_bench.warps_per_sm(129, 4) == 12
