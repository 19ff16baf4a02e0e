"""Background compiles: threads that compile kernels before their first launch, and the compiles in flight per
kernel specialization, which a launch waits for rather than compiling the same kernel twice (or, where another
design's kernels are all compiled, runs that design instead: `compiling`, `compiled`).

A compile is submitted as (launcher, arguments, constexprs): the launcher has a `name`, `plain` (its kernel's
`plain_positions`) and a `warm(arguments, constexprs)` that compiles and loads the kernel those arguments launch
without launching it (`compile_ahead`). Triton's and Gluon's launchers both take this form. Triton's compiler leaves
the GIL for most of its work, so the threads overlap the caller's own compiles and launches. At interpreter exit the
compiles no thread has started are dropped.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

# per `specialization`: its background compile (kept after it ends: a later submit of it is a no-op)
_IN_FLIGHT: dict[tuple, Future] = {}
_LAUNCHED: set[tuple] = set()  # specializations compiled by a launch through the JIT (`note_compiled`)
_POOL: list[ThreadPoolExecutor] = []
WORKERS = 4
_EXITING = threading.Event()


def specialization(name: str, args: tuple, constexprs: dict, plain: frozenset[int] = frozenset()) -> tuple:
    """What Triton compiles a kernel anew for, of a launch's arguments: each tensor's dtype and 16-byte alignment (a
    TMA descriptor's: its tensor's dtype and its block shape), each integer's classes (1, multiple of 16, 32-bit;
    only its width at the positions in `plain`, the kernel's `do_not_specialize`), also inside tuples (the
    strides), the other arguments' types, and the constexprs."""

    def spec(a):
        if isinstance(a, torch.Tensor):
            return (a.dtype, a.data_ptr() % 16 == 0)
        if isinstance(a, tuple):
            return tuple(spec(x) for x in a)
        if isinstance(a, int) and not isinstance(a, bool):
            return (a == 1, a % 16 == 0, -2**31 <= a < 2**31)
        if hasattr(a, "block_shape") and hasattr(a, "base"):  # a host-side TMA descriptor
            return ("desc", a.base.dtype, tuple(a.block_shape))
        return a if isinstance(a, bool) else type(a)

    specs = tuple(-2**31 <= a < 2**31 if i in plain else spec(a) for i, a in enumerate(args))
    return (name, specs, tuple(constexprs.items()))


def plain_positions(kernel) -> frozenset[int]:
    """The positions of a JIT function's parameters that it does not specialize (`do_not_specialize`)."""
    return frozenset(p.num for p in getattr(kernel, "params", ()) if p.do_not_specialize)


def compile_ahead(kernel, args: tuple, constexprs: dict) -> None:
    """Compile and load the kernel (a JIT function, Triton's or Gluon's) these arguments launch, without launching
    it: the JIT's cache then holds it for the first real launch."""
    compiled = kernel.warmup(*args, grid=None, **constexprs)
    if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
        compiled = compiled.result()
    compiled._init_handles()  # the module load and the C launcher's build, otherwise paid at the first launch


def submit(launches: list, device: torch.device, after: tuple[Future, ...] = ()) -> tuple[Future, ...]:
    """Compile each (launcher, arguments, constexprs) in the background on `device`, unless its specialization was
    submitted before; those compiles start once the compiles `after` have ended (the pool runs them in order of
    submission: the threads waiting for `after` do not hold back what came earlier). Gives every launch's compile."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="cs336-flash-warm"))
        # (run at exit before the pool's own exit hook, which runs every queued compile: registered after it)
        getattr(threading, "_register_atexit", lambda f: None)(_drop_pending)

    def warm(launcher, args: tuple, constexprs: dict) -> None:
        wait(after)
        if _EXITING.is_set():
            return
        with torch.cuda.device(device):
            launcher.warm(args, constexprs)

    futures = []
    for launcher, args, constexprs in launches:
        spec = specialization(launcher.name, args, constexprs, launcher.plain)
        if spec not in _IN_FLIGHT:
            _IN_FLIGHT[spec] = _POOL[0].submit(warm, launcher, args, constexprs)
        futures.append(_IN_FLIGHT[spec])
    return tuple(futures)


def _drop_pending() -> None:
    """At interpreter exit: cancel the compiles no thread has started (nothing will launch them), so that the exit
    waits only for those already compiling."""
    _EXITING.set()
    for future in _IN_FLIGHT.values():
        future.cancel()


def wait_for(launcher, args: tuple, constexprs: dict) -> None:
    """Before a kernel's first launch through the JIT: wait for its background compile, if one was submitted."""
    in_flight = _IN_FLIGHT.get(specialization(launcher.name, args, constexprs, launcher.plain))
    if in_flight is not None:
        wait((in_flight,))


def note_compiled(launcher, args: tuple, constexprs: dict) -> None:
    """Record that a launch through the JIT compiled (and loaded) this kernel specialization (`compiled`)."""
    _LAUNCHED.add(specialization(launcher.name, args, constexprs, launcher.plain))


def busy() -> bool:
    """Whether any background compile is still running or queued."""
    return any(not in_flight.done() for in_flight in list(_IN_FLIGHT.values()))


def compiling(launches: list) -> bool:
    """Whether the kernel of any (launcher, arguments, constexprs) is still compiling, or queued, in the background:
    its first launch would wait for that compile."""
    for launcher, args, constexprs in launches:
        in_flight = _IN_FLIGHT.get(specialization(launcher.name, args, constexprs, launcher.plain))
        if in_flight is not None and not in_flight.done():
            return True
    return False


def compiled(launches: list) -> bool:
    """Whether the kernel of every (launcher, arguments, constexprs) is compiled in this process: launched through
    the JIT before, or compiled in the background without error. Never for an autotuned launcher: its background
    compile compiles nothing, and a new tuning key times every config again."""
    for launcher, args, constexprs in launches:
        if getattr(launcher, "tuned", False):
            return False
        spec = specialization(launcher.name, args, constexprs, launcher.plain)
        if spec in _LAUNCHED:
            continue
        in_flight = _IN_FLIGHT.get(spec)
        if in_flight is None or not in_flight.done() or in_flight.cancelled() or in_flight.exception() is not None:
            return False
    return True


def wait_all() -> None:
    """Block until every background compile submitted so far has ended."""
    wait(tuple(_IN_FLIGHT.values()))
