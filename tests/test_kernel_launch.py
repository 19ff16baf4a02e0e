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
