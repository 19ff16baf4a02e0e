"""Run a function on N freshly spawned ranks of one host, under a deadline, and collect the results.

`launch(worker, world_size, ...)` hosts the rendezvous `TCPStore` in the calling process on a port
the OS picks (port 0: no clash between concurrent launches or tests), spawns `world_size` processes
that join it, call `init_process_group`, and run `worker(ctx, *args)`. It returns every rank's
return value, in rank order. If any rank raises or dies, or the deadline passes, all remaining ranks
are terminated (then killed) and joined before `WorkerError` / `TimeoutError` is raised, so a caller
such as pytest can never hang on a peer stuck in a collective.

When torchrun started this process (RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR in the environment),
`join(worker, ...)` instead makes it one rank of torchrun's job, on one host or several: the process
group comes from torchrun's rendezvous (`env://`), every rank runs rank 0's arguments, and an exception
propagates (torchrun then stops the other ranks). `run_ranks` picks `join` or `launch`.

On CUDA (NCCL) rank r uses GPU r (under torchrun, GPU LOCAL_RANK). NVLink SHARP / multicast stays off
in every rank (`NCCL_NVLS_ENABLE=0`, `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`, `NVSHMEM_DISABLE_NVLS=1`, set
with `setdefault` before the process group exists).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
HOST = "127.0.0.1"
POLL_S = 0.05
TERMINATE_GRACE_S = 5.0
FAILURE_SETTLE_S = 1.0  # after a rank fails, how long the others get to report their own failure or exit
# What a rank's error says when it only lost a peer (Gloo, NCCL): named after the rank that failed first
PEER_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                 "NCCL communicator was aborted", "remote process exited")


class WorkerError(RuntimeError):
    """A rank raised or died; the message carries its traceback (or exit code)."""


@dataclass(frozen=True)
class WorkerContext:
    """What a worker function gets: its rank, the group's size and backend, its device, a message channel."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    channel: Any  # multiprocessing queue to the launcher

    def send(self, message: Any) -> None:
        """Hand `message` (picklable) to the launcher's `on_message(rank, message)` right away."""
        self.channel.put(("message", self.rank, pickle.dumps(message)))


@dataclass(frozen=True)
class TorchrunPlace:
    """Where torchrun put this process: its global rank and the job's size, its rank and rank count on this host."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_place() -> TorchrunPlace | None:
    """This process's place in a torchrun job, or None when the environment does not name one."""
    if not all(name in os.environ for name in TORCHRUN_ENV):
        return None
    text = {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    text["LOCAL_WORLD_SIZE"] = os.environ.get("LOCAL_WORLD_SIZE", text["WORLD_SIZE"])  # unset: every rank on this host
    try:
        return TorchrunPlace(*(int(value) for value in text.values()))
    except ValueError:
        raise ValueError(f"torchrun's environment must hold integers, got {text}") from None


def default_backend(world_size: int) -> str:
    """NCCL when there is one CUDA device per rank, Gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def check_backend(backend: str, world_size: int) -> None:
    """ValueError unless `backend` can run `world_size` ranks on this host."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl":
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available < world_size:
            raise ValueError(
                f"NCCL with world size {world_size} needs {world_size} CUDA devices (one per rank); "
                f"this host has {available}"
            )


def launch(
    worker: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    backend: str | None = None,
    timeout_s: float = 300.0,
    num_threads: int | None = None,
    on_message: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """Run `worker(ctx, *args)` on ranks 0..world_size-1; return their results in rank order.

    `worker` must be a module-level function (the processes are spawned, not forked). `num_threads`
    caps each rank's intra-op CPU threads (useful when ranks share a few cores). Messages a rank
    sends with `ctx.send` reach `on_message(rank, message)` in this process while the ranks run.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    backend = backend or default_backend(world_size)
    check_backend(backend, world_size)

    store = dist.TCPStore(HOST, 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    ctx = mp.get_context("spawn")
    channel = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, backend, store.port, timeout_s, num_threads, channel, worker, args),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}  # rank -> the traceback it reported
    died: dict[int, int] = {}  # rank -> exit code, for ranks that exited reporting nothing

    def handle(kind: str, rank: int, payload: Any) -> None:
        if kind == "message":
            if on_message is not None:
                on_message(rank, pickle.loads(payload))
        elif kind == "result":
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload

    def note_deaths() -> None:
        for rank, p in enumerate(procs):
            if rank not in results and rank not in errors and p.exitcode is not None:
                died[rank] = p.exitcode

    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(results) < world_size and not errors and not died:
            try:
                handle(*channel.get(timeout=POLL_S))
            except queue.Empty:
                pass
            if len(results) == world_size or errors:
                break
            # (checked after every message too: ranks that keep sending must not hold off the deadline)
            if any(rank not in results and p.exitcode is not None for rank, p in enumerate(procs)):
                _drain(channel, handle)  # a rank has exited: take what it sent before it died
                note_deaths()
            elif time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:g} s")
        if errors or died:
            # The first report is often a peer's "connection closed" about the rank that failed: let the others
            # report or exit for a moment, so that the cause is named first
            _drain(channel, handle, wait_s=FAILURE_SETTLE_S)
            note_deaths()
    finally:
        # After a failure or timeout, peers may be stuck in a collective: no grace period then.
        _stop(procs, grace_s=TERMINATE_GRACE_S if len(results) == world_size else 0.0)
        channel.close()
    if errors or died:
        raise WorkerError(_failure_report(errors, died))
    return [results[r] for r in range(world_size)]


def _failure_report(errors: dict[int, str], died: dict[int, int]) -> str:
    """What failed, its likely cause first: ranks that died without a word, then ranks whose error is their own,
    then ranks that only lost a peer (a collective's connection closed or reset under them)."""
    def peer_loss(text: str) -> bool:
        return any(symptom in text for symptom in PEER_SYMPTOMS)

    parts = [f"rank {rank} exited with code {code} before reporting a result" for rank, code in sorted(died.items())]
    ranked = sorted(errors.items(), key=lambda item: (peer_loss(item[1]), item[0]))
    parts += [f"rank {rank} raised:\n{text}" for rank, text in ranked]
    return "\n".join(parts)


def join(
    worker: Callable[..., Any],
    args: tuple = (),
    *,
    backend: str | None = None,
    timeout_s: float = 300.0,
    num_threads: int | None = None,
    on_message: Callable[[int, Any], None] | None = None,
) -> Any:
    """Run `worker(ctx, *args)` as this process's rank of the torchrun job; return its result.

    Every rank runs rank 0's `args` (broadcast once the group exists), so a plan that rank 0 drew from
    its own records holds on every host. `on_message` gets this rank's `ctx.send` messages directly.
    """
    place = torchrun_place()
    if place is None:
        raise RuntimeError(f"join() runs under torchrun, which sets {', '.join(TORCHRUN_ENV)}; use launch() instead")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    backend = backend or default_backend(place.local_world_size)
    check_backend(backend, place.local_world_size)
    device = _init_rank(place.rank, place.world_size, backend, place.local_rank, timeout_s, num_threads,
                        init_method="env://")
    shared = [args]
    dist.broadcast_object_list(shared, src=0)
    result = worker(WorkerContext(place.rank, place.world_size, backend, device, _Direct(on_message)), *shared[0])
    dist.destroy_process_group()
    return result


def run_ranks(worker: Callable[..., Any], world_size: int, args: tuple = (), **kwargs: Any) -> None:
    """`join` torchrun's job when it started this process (its size must be `world_size`), else `launch` here."""
    place = torchrun_place()
    if place is None:
        launch(worker, world_size, args, **kwargs)
    elif place.world_size != world_size:
        raise ValueError(f"torchrun started {place.world_size} ranks; the run needs {world_size}")
    else:
        join(worker, args, **kwargs)


class _Direct:
    """The channel of a rank that runs in the caller's process: messages go straight to `on_message`."""

    def __init__(self, on_message: Callable[[int, Any], None] | None) -> None:
        self.on_message = on_message

    def put(self, item: tuple[str, int, bytes]) -> None:
        _, rank, payload = item
        if self.on_message is not None:
            self.on_message(rank, pickle.loads(payload))


def _drain(channel: Any, handle: Callable[..., None], wait_s: float = 1.0) -> None:
    """Hand every item still in (or arriving within `wait_s` on) the channel to `handle`."""
    while True:
        try:
            handle(*channel.get(timeout=wait_s))
        except queue.Empty:
            return


def _stop(procs: list, grace_s: float) -> None:
    """Join every started process; terminate, then kill, the ones still running after `grace_s`."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(TERMINATE_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()


def _rank_main(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    timeout_s: float,
    num_threads: int | None,
    channel: Any,
    worker: Callable[..., Any],
    args: tuple,
) -> None:
    _die_with_parent()
    try:
        store = dist.TCPStore(HOST, port, world_size + 1, is_master=False, timeout=timedelta(seconds=timeout_s))
        device = _init_rank(rank, world_size, backend, rank, timeout_s, num_threads, store=store)
        result = worker(WorkerContext(rank, world_size, backend, device, channel), *args)
        channel.put(("result", rank, pickle.dumps(result)))
    except BaseException:
        # Report first: the launcher then stops every rank, including peers stuck in a collective.
        channel.put(("error", rank, traceback.format_exc()))
        raise
    # Every rank finished its collectives before returning, so this does not wait on peers.
    dist.destroy_process_group()


def _die_with_parent() -> None:
    """Have the kernel kill this rank when the launcher dies (SIGTERM or SIGKILL from a scheduler, say), which no
    `finally` of the launcher's runs for: ranks left behind would hold their GPUs until their own deadline. Linux
    only (prctl PR_SET_PDEATHSIG); elsewhere nothing."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:  # the launcher died before the request took hold
        os._exit(1)


def _init_rank(
    rank: int, world_size: int, backend: str, gpu: int, timeout_s: float, num_threads: int | None, **init: Any
) -> torch.device:
    """Environment, CPU threads, device (GPU `gpu` under NCCL) and process group of one rank; its device."""
    for key, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(key, value)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if backend == "nccl":
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **({"device_id": device} if backend == "nccl" else {}),
        **init,
    )
    return device
