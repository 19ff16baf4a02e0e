"""`cs336_systems.flash.c_launch` on the CPU: a fake compiled kernel stands in for one Triton compiled."""

from types import SimpleNamespace

import pytest
import torch
import triton

from cs336_systems.flash.c_launch import CLaunch


@pytest.fixture(autouse=True)
def fake_driver(monkeypatch):
    """A Triton driver with streams named after their device (the CPU has no active driver)."""
    monkeypatch.setattr(triton.runtime.driver, "_active", SimpleNamespace(get_current_stream=lambda d: f"stream{d}"))


class FakeCompiled:
    """What `CLaunch.of` reads of a compiled kernel: its runner's pieces, `function` and packed metadata."""

    def __init__(self, scratch_per_cta: int = 0):
        self.calls = []
        self.run = SimpleNamespace(launch=lambda *a: self.calls.append(a), num_ctas=1,
                                   global_scratch_size=scratch_per_cta, profile_scratch_size=0,
                                   launch_cooperative_grid=False, launch_pdl=False)
        self.function, self.packed_metadata = "cufunction", "metadata"

    def __getitem__(self, grid):
        return self


@pytest.mark.parametrize("grid,full", [((7,), (7, 1, 1)), ((4, 5), (4, 5, 1)), ((2, 3, 4), (2, 3, 4))])
def test_c_launch_pads_short_grids_with_ones(grid, full):
    """Our small kernels launch on 2-D grids: the C launch gets three dims (missing ones 1), and the global scratch
    it allocates counts every program."""
    compiled = FakeCompiled(scratch_per_cta=128)
    launch = CLaunch.of(compiled, grid)
    assert launch.grid == full
    assert launch.scratch_size == 128 * full[0] * full[1] * full[2]


def test_c_launch_passes_the_full_grid_and_arguments():
    compiled = FakeCompiled()
    launch = CLaunch.of(compiled, (4, 5))
    launch(0, "a", 1)
    (call,) = compiled.calls
    assert call[:5] == (4, 5, 1, "stream0", "cufunction")
    assert call[-2:] == ("a", 1)


@pytest.mark.parametrize("grid", [(), (1, 2, 3, 4)])
def test_c_launch_rejects_grids_of_other_ranks(grid):
    with pytest.raises(ValueError, match="one to three dims"):
        CLaunch.of(FakeCompiled(), grid)


def test_background_specialization_follows_the_jit():
    """The key a background compile is found by: integers by their classes (1, multiple of 16, width) except at the
    kernel's `do_not_specialize` positions, tensors by dtype and alignment, TMA descriptors by dtype and block."""
    from cs336_systems.flash import background

    def key(*args, plain=frozenset()):
        return background.specialization("k", args, {"D": 64}, plain)

    x = torch.empty(8)
    assert key(x, 32) == key(x, 64) != key(x, 33) != key(x, 1)
    assert key(x, 33, plain=frozenset({1})) == key(x, 1, plain=frozenset({1})) == key(x, 64, plain=frozenset({1}))
    assert key(x, 2**31, plain=frozenset({1})) != key(x, 1, plain=frozenset({1}))
    assert key(x, 32) != key(x.half(), 32) and key(x[1:], 32) != key(x, 32)
    desc = SimpleNamespace(base=x, block_shape=[64, 64])
    assert key(desc) == key(SimpleNamespace(base=torch.empty(4), block_shape=[64, 64]))
    assert key(desc) != key(SimpleNamespace(base=x, block_shape=[128, 64]))
    assert key(desc) != key(SimpleNamespace(base=x.half(), block_shape=[64, 64]))


def test_background_compiles_not_started_are_dropped_at_exit(tmp_path):
    """A process that exits while background compiles are queued waits only for those already running: the queued ones
    are cancelled (a short script would otherwise wait for every compile its first calls queued)."""
    import subprocess
    import sys
    import textwrap

    log = tmp_path / "ran.txt"
    script = textwrap.dedent(f"""
        import contextlib, time, torch
        torch.cuda.device = lambda device: contextlib.nullcontext()  # (no GPU here)
        from cs336_systems.flash import background

        class Slow:
            plain = frozenset()
            def __init__(self, i):
                self.name = f"slow{{i}}"
            def warm(self, args, constexprs):
                with open({str(log)!r}, "a") as f:
                    f.write(self.name + "\\n")
                time.sleep(0.5)

        background.submit([(Slow(i), (), {{}}) for i in range(4 * background.WORKERS)], None)
        time.sleep(0.2)  # the first WORKERS compiles have started
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    started = log.read_text().split()
    assert 0 < len(started) <= 4 * 2, started  # (WORKERS = 4 running at exit; the other 12 were dropped)


class FakeLauncher:
    """A launcher as `background` sees it: a name, no `do_not_specialize` positions, a compile that waits for `go`."""

    plain = frozenset()

    def __init__(self, name: str, tuned: bool = False):
        import threading

        self.name, self.tuned, self.go = name, tuned, threading.Event()

    def warm(self, args, constexprs):
        assert self.go.wait(60)


@pytest.fixture
def fresh_background(monkeypatch):
    """`background` with empty records, and a device context the CPU can enter."""
    import contextlib

    from cs336_systems.flash import background

    monkeypatch.setattr(background, "_IN_FLIGHT", {})
    monkeypatch.setattr(background, "_LAUNCHED", set())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return background


def test_background_tells_what_is_compiling_and_what_is_compiled(fresh_background):
    """A kernel queued or compiling is `compiling` until its compile ends; `compiled` once it ended without error, or
    once a launch through the JIT compiled it; an autotuned launcher's kernels never count as compiled."""
    background = fresh_background
    gluon, triton_kv, tuned = FakeLauncher("gluon"), FakeLauncher("kv"), FakeLauncher("tuned", tuned=True)
    x = torch.empty(8)
    mine, theirs, other_length = (gluon, (x, 1024), {}), (triton_kv, (x, 1024), {}), (gluon, (x, 1023), {})
    assert not background.busy() and not background.compiling([mine]) and not background.compiled([mine])
    (future,) = background.submit([mine], None)
    assert background.busy() and background.compiling([mine]) and not background.compiled([mine])
    assert not background.compiling([other_length])  # (another specialization: 1023 is no multiple of 16)
    assert not background.compiled([theirs])
    background.note_compiled(triton_kv, (x, 2048), {})  # (the same specialization as 1024's)
    assert background.compiled([theirs]) and not background.compiled([theirs, mine])
    gluon.go.set()
    future.result(timeout=60)
    assert not background.busy() and not background.compiling([mine]) and background.compiled([theirs, mine])
    tuned.go.set()
    background.submit([(tuned, (x, 16), {})], None)[0].result(timeout=60)
    background.note_compiled(tuned, (x, 16), {})
    assert not background.compiled([(tuned, (x, 16), {})])  # (a new tuning key times its configs again)


def test_background_compile_that_failed_is_not_compiled(fresh_background):
    background = fresh_background

    class Failing(FakeLauncher):
        def warm(self, args, constexprs):
            raise RuntimeError("out of resources")

    launch = (Failing("bad"), (torch.empty(8),), {})
    background.submit([launch], None)[0].exception(timeout=60)
    assert not background.compiling([launch]) and not background.compiled([launch])


def test_a_call_runs_the_compiled_design_while_its_own_kernel_compiles(fresh_background, monkeypatch):
    """`launch._compiled_instead`: the plan of Triton kernels runs instead of one whose Gluon kernel is still
    compiling in the background, only where every Triton kernel it launches is compiled; never when the Gluon kernel
    is compiled or was never sent to the background (its launch compiles it), nor for a plan without Gluon."""
    from cs336_systems.flash import launch

    background = fresh_background
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "launch_hooks_installed", lambda: False)
    gluon, triton_kv = FakeLauncher("gluon"), FakeLauncher("kv")
    x, q = torch.empty(8), torch.empty(2, 16, 64, 64)
    launches = {"gluon plan": [(gluon, (x, 1536), {})], "triton plan": [(triton_kv, (x, 1536), {})]}

    def instead(uses_gluon: bool = True, small_q: torch.Tensor = q):
        return launch._compiled_instead("gluon plan", uses_gluon, small_q, lambda p, out: out.extend(launches[p]),
                                        lambda: "triton plan")

    assert instead() is None  # nothing in the background
    background.submit([(gluon, (x, 2048), {})], None)  # (prewarm's longer length: the same specialization)
    assert instead() is None  # the Triton kernels are not compiled either: waiting costs no more than compiling
    background.note_compiled(triton_kv, (x, 1024), {})
    assert instead() == "triton plan"
    assert instead(uses_gluon=False) is None
    big = torch.empty(1).expand(launch.PREWARM_MAX_BYTES // 4 + 1)  # (a float32 view of one element)
    assert instead(small_q=big) is None
    gluon.go.set()
    background.wait_all()
    assert instead() is None  # compiled: the Gluon plan runs
