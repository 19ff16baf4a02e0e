"""The direct C launch of a compiled Triton or Gluon kernel, shared by `flash_triton` and `flash.gluon`.

After the first launch of an argument signature both modules call the compiled kernel's C launch function
directly with the device's current stream, skipping the JIT's argument binding and the runner's per-launch
Python (launch metadata, hooks, scratch allocation); at short sequences that is most of the host time.
`CLaunch.of(compiled, grid)` takes a compiled kernel apart for one grid, or gives None where Triton's
launcher does not expose the pieces (another Triton version) or the kernel needs profile scratch memory;
then the caller keeps calling the kernel's runner.
"""

from __future__ import annotations

import torch
import triton


def scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory a kernel asks for at launch: the TMA descriptors our Triton kernels build (128 B each).
    Fresh for each launch, or for each call of an op, shared by its launches (`CLaunch`'s buffer): a buffer kept
    across calls would outlive the private memory pool of a CUDA-graph tree that created it. (Also Triton's
    allocator: `triton.set_allocator(scratch)`.)"""
    return torch.empty(size, dtype=torch.int8, device="cuda")


class CLaunch:
    """A compiled kernel's C launch at a fixed grid; `launch(device_index, *arguments)` runs it with every
    kernel argument in order (constexprs included, as the C launcher takes them)."""

    __slots__ = ("launch_fn", "grid", "function", "cooperative", "pdl", "metadata", "scratch_size", "current_stream")

    def __init__(self, launch_fn, grid: tuple[int, int, int], function, cooperative: bool, pdl: bool, metadata,
                 scratch_size: int, current_stream):
        self.launch_fn, self.grid, self.function = launch_fn, grid, function
        self.cooperative, self.pdl, self.metadata = cooperative, pdl, metadata
        self.scratch_size, self.current_stream = scratch_size, current_stream

    @classmethod
    def of(cls, compiled, grid: tuple[int, ...], raw: bool = False) -> CLaunch | None:
        """The C launch of `compiled` (a kernel Triton compiled) at `grid` (one to three dims, as Triton takes it;
        missing dims are 1), or None (see the module). raw: the launch function beneath Triton's wrapper for kernels
        with host-side TensorDescriptor arguments (`unwrapped`), which takes each descriptor as Triton's
        `make_tensordesc_arg` expands it; None where there is no such wrapper to take apart."""
        if not 1 <= len(grid) <= 3:
            raise ValueError(f"a launch grid has one to three dims, got {grid!r}")
        launcher = compiled.run
        pieces = ("launch", "num_ctas", "global_scratch_size", "profile_scratch_size", "launch_cooperative_grid",
                  "launch_pdl")
        if not all(hasattr(launcher, p) for p in pieces) or launcher.profile_scratch_size:
            return None
        launch_fn = unwrapped(launcher.launch) if raw else launcher.launch
        if launch_fn is None:
            return None
        compiled[grid]  # loads the kernel: compiled.function
        gx, gy, gz = (*grid, 1, 1)[:3]
        return cls(launch_fn, (gx, gy, gz), compiled.function, launcher.launch_cooperative_grid,
                   launcher.launch_pdl, compiled.packed_metadata,
                   gx * gy * gz * launcher.num_ctas * launcher.global_scratch_size,
                   triton.runtime.driver.active.get_current_stream)

    def __call__(self, device_index: int, *args, buffer: torch.Tensor | None = None) -> None:
        """Launch on the device's current stream. `buffer`: global scratch the caller holds for this launch and others
        of its own that run one after another on that stream (used where it is large enough); else a fresh one."""
        stream = self.current_stream(device_index)
        if not self.scratch_size:
            buffer = None
        elif buffer is None or buffer.numel() < self.scratch_size:
            buffer = scratch(self.scratch_size, 128, stream)
        gx, gy, gz = self.grid
        # grid, stream, CUfunction, cooperative, PDL, global and profile scratch, packed metadata, the hooks'
        # launch metadata, enter and exit hooks, then the kernel's arguments
        self.launch_fn(gx, gy, gz, stream, self.function, self.cooperative, self.pdl, buffer, None, self.metadata,
                       None, None, None, *args)


def unwrapped(launch_fn):
    """The C launch function that Triton's wrapper for kernels with host-side TensorDescriptor arguments
    (`wrap_handle_tensordesc`, which expands each descriptor into a TMA descriptor, its shape and strides at every
    launch) closes over as `launcher`; None where launch_fn is not that wrapper."""
    code, cells = getattr(launch_fn, "__code__", None), getattr(launch_fn, "__closure__", None)
    if code is None or not cells or "launcher" not in code.co_freevars:
        return None
    return cells[code.co_freevars.index("launcher")].cell_contents
