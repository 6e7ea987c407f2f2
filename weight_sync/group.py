"""The broadcast group between the learner and rollout services, one per membership epoch.

A stateless torch.distributed process group (not the default group: a learner already has its
own DDP/ZeRO group, and rollout processes have none), built over a PrefixStore (one prefix per
epoch) on the TCPStore served by learner rank 0. The backend follows the device: nccl on CUDA,
hccl on Ascend (torch_npu), gloo on CPU; everything above this module is the same code for all
three.

Failure rules:
- The group is built with the (short) ready timeout, so a member that died between confirming
  and connecting costs at most that long, and less where the caller knows it is gone
  (`make_group(should_abort=...)`: the learner when a member LEAVEs, a receiver when the learner
  abandons the epoch); its collectives then use the publish timeout.
- Collectives are asynchronous (`broadcast_async` returns the work). `wait_work` waits on the
  work's future, never forever: it gives up at a deadline, or at once when `should_abort` says
  so (the learner abandoned the epoch, or the receiver is stopping). A gloo op whose peer died
  is not woken by the peer's socket closing (it waits out its timeout), so the learner's abort
  key is what frees a receiver stuck in a collective the learner will never finish.
- A group is never reused after a failure: `close()` drops it (NCCL/HCCL communicators are
  aborted), and the next epoch builds a new one under a new prefix.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, Store

if TYPE_CHECKING:
    # torch's stubs (torch 2.13) fall short of the store weight sync uses: TCPStore is documented as
    # torch.distributed.TCPStore but not exported there, `set` is typed str-only (the binding takes
    # bytes) and `append` is missing. This class says what the binding does; at run time it is
    # torch's own.
    class TCPStore(dist.TCPStore):  # pyright: ignore[reportPrivateImportUsage]
        def set(self, key: str, value: str | bytes) -> None: ...
        def append(self, key: str, value: str | bytes) -> None: ...

else:
    TCPStore = dist.TCPStore


class Collectives(Protocol):
    """What a group asks of its torch c10d backend (ProcessGroupGloo, ProcessGroupNCCL,
    ProcessGroupHCCL). torch's stubs give those classes no `broadcast`; the binding has it."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...
    def abort(self) -> None: ...
    def _set_default_timeout(self, timeout: datetime.timedelta) -> None: ...


class CollectiveError(RuntimeError):
    """A collective of the group failed (peer gone, timeout) or was abandoned."""


class CollectiveAborted(CollectiveError):
    """`should_abort` turned true while waiting: the epoch was abandoned or we are stopping."""


ACCELERATOR_BACKENDS = {"cuda": "nccl", "npu": "hccl"}  # device type -> its collective library


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend != "auto":
        return backend
    return ACCELERATOR_BACKENDS.get(device.type, "gloo")


def epoch_backend(configured: str, learner_device: str, member_devices: list[str]) -> str:
    """The backend of an epoch's group. `configured` other than auto is used as is; auto: the
    accelerator's collective library (nccl, hccl) when the learner and every member hold their
    weights on that accelerator type, else gloo (a CPU transport every device can reach through
    host memory: a CUDA learner with CPU rollout services, say). The commit names it, so
    receivers never guess."""
    if configured != "auto":
        return configured
    own = ACCELERATOR_BACKENDS.get(learner_device, "gloo")
    if own != "gloo" and all(d == learner_device for d in member_devices):
        return own
    return "gloo"


def open_store(
    host: str, port: int, is_master: bool, timeout_s: float, should_abort: Callable[[], bool] | None = None
) -> TCPStore:
    """Rank 0 serves the store; receivers connect to it, retrying until `timeout_s`. No world
    size: membership is elastic, the store does not count workers. A receiver with
    `should_abort` first waits for the port to take connections (TCPStore's own retries run in
    C++ and cannot be interrupted: a service stopped while the learner is not up would wait
    them out), and raises CollectiveAborted once it says so."""
    if not is_master and should_abort is not None:
        timeout_s = _await_port(host, port, timeout_s, should_abort)
    return TCPStore(
        host,
        port,
        None,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _await_port(host: str, port: int, timeout_s: float, should_abort: Callable[[], bool]) -> float:
    """Probe (host, port) every 0.1 s until it takes a connection, `timeout_s` passes (the store's
    connect then reports the failure), or `should_abort`. Returns the time left."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                break
        except OSError:
            if should_abort():
                raise CollectiveAborted(f"stopped while waiting for the store at {host}:{port}") from None
            time.sleep(0.1)
    return max(0.5, deadline - time.monotonic())


@dataclass
class BroadcastGroup:
    """Rank 0 is the learner (the source); ranks 1..world_size-1 are receivers."""

    pg: Collectives
    rank: int
    world_size: int
    backend: str
    epoch: int

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            return self.pg.broadcast([tensor], opts)
        except RuntimeError as e:  # gloo raises at enqueue when the group is already broken
            raise CollectiveError(f"epoch {self.epoch}: broadcast could not start: {e}") from e

    def close(self, pending: list | None = None) -> threading.Thread | None:
        """Drop the group without waiting for it. A gloo group's destructor waits until its
        queued ops ran, and an op whose peer is gone only ends at its timeout: so the last
        reference (and the `pending` works and buffers of an abandoned collective) is released
        in a short-lived daemon thread, never in the caller. Returns that thread: a process
        about to exit joins it (a group torn down during interpreter exit aborts the process)."""
        if self.pg is None:
            return None
        if self.backend in ("nccl", "hccl"):
            try:
                self.pg.abort()
            except RuntimeError:
                pass  # already torn down by its watchdog
        box = [self.pg, pending]
        self.pg = None  # type: ignore[assignment]
        dropper = threading.Thread(target=box.clear, name="weight-sync-drop-group", daemon=True)
        dropper.start()
        return dropper


def wait_work(
    work: dist.Work,
    timeout_s: float,
    should_abort: Callable[[], bool] | None = None,
    poll_s: float = 0.2,
) -> None:
    """Wait for a collective; raise CollectiveError on failure, timeout or abort."""
    done = threading.Event()
    work.get_future().add_done_callback(lambda _: done.set())
    deadline = time.monotonic() + timeout_s
    while not done.wait(poll_s if should_abort is not None else max(0.0, deadline - time.monotonic())):
        if should_abort is not None and should_abort():
            raise CollectiveAborted("abandoned while waiting for a collective")
        if time.monotonic() >= deadline:
            raise CollectiveError(f"collective did not complete within {timeout_s:.1f}s")
    try:
        work.wait()
    except RuntimeError as e:
        raise CollectiveError(str(e).splitlines()[0]) from e


def make_group(
    backend: str,
    store: Store,
    rank: int,
    world_size: int,
    *,
    epoch: int,
    prefix: str,
    connect_timeout_s: float,
    op_timeout_s: float,
    should_abort: Callable[[], bool] | None = None,
) -> BroadcastGroup:
    """Join epoch `epoch`'s group over `store` (blocks until all world_size ranks have joined,
    or raises CollectiveError after `connect_timeout_s`). With `should_abort`, the connect runs
    in a thread and this gives up as soon as it says so (a member left, the epoch was
    abandoned): raises FormationAbandoned. A connect waiting on a key holds its store client's
    lock, so whatever `should_abort` or the caller's other threads write must use another
    client, made ahead of time (`new_client`)."""
    connect = datetime.timedelta(seconds=connect_timeout_s)
    try:
        if should_abort is None:
            pg = _new_process_group(backend, PrefixStore(prefix, store), rank, world_size, connect)
        else:
            scoped = PrefixStore(prefix, store)
            pg = _connect_abortably(backend, scoped, rank, world_size, connect, should_abort, epoch)
    except FormationAbandoned:
        raise
    except (RuntimeError, dist.DistError) as e:
        raise CollectiveError(f"epoch {epoch}: group of {world_size} did not form: {e}") from e
    if hasattr(pg, "_set_default_timeout"):
        pg._set_default_timeout(datetime.timedelta(seconds=op_timeout_s))
    return BroadcastGroup(pg=pg, rank=rank, world_size=world_size, backend=backend, epoch=epoch)


def new_client(store: Store) -> TCPStore:
    """A new client connection to the same store (c10d's `Store.clone`, which torch's stubs
    (2.13) do not list). Make it ahead of the moment it is needed: under CPU load a new
    client's first operations (its connect, or its first wait inside a group's connect) took
    5 s now and then, where a client in use for a while never did (docs/architecture.md,
    "Weight sync")."""
    return cast(TCPStore, store.clone())  # pyright: ignore[reportAttributeAccessIssue]


class FormationAbandoned(CollectiveAborted):
    """A group's connect given up on. Its thread still waits in the backend's constructor (which
    cannot be interrupted) until the connect timeout or until the store goes, and holds no group:
    a connect that never completes builds none, and one that completes after all is dropped there.
    No join at exit: no group can be torn down during the interpreter's."""


def _connect_abortably(
    backend: str,
    store: Store,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    should_abort: Callable[[], bool],
    epoch: int,
) -> Collectives:
    """The backend's constructor in a daemon thread, waited for until `should_abort`. A gloo or
    NCCL connect blocks until every rank has connected: a member that died after confirming would
    otherwise hold every other rank for the whole connect timeout. A group built after it was
    given up on is dropped as any other (`BroadcastGroup.close`)."""
    built: Future[Collectives] = Future()

    def connect() -> None:
        try:
            built.set_result(_new_process_group(backend, store, rank, world_size, timeout))
        except (RuntimeError, dist.DistError) as e:
            built.set_exception(e)

    def drop_late(done: Future[Collectives]) -> None:
        if done.exception() is None:
            BroadcastGroup(done.result(), rank, world_size, backend, epoch).close()

    threading.Thread(target=connect, name="weight-sync-connect", daemon=True).start()
    while not wait([built], timeout=0.01).done:
        if should_abort():
            built.add_done_callback(drop_late)
            raise FormationAbandoned(f"epoch {epoch}: gave up forming the group")
    return built.result()


def _new_process_group(
    backend: str, store: Store, rank: int, world_size: int, timeout: datetime.timedelta
) -> Collectives:
    if backend == "gloo":
        return cast(Collectives, dist.ProcessGroupGloo(store, rank, world_size, timeout))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return cast(Collectives, dist.ProcessGroupNCCL(store, rank, world_size, opts))
    if backend == "hccl":
        # torch_npu exists only on Ascend machines (the npu extra): unresolved elsewhere
        try:
            import torch_npu  # noqa: F401  # pyright: ignore[reportMissingImports]  (registers hccl)
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # pyright: ignore[reportMissingImports]
        except ImportError as e:
            raise RuntimeError("weight_sync.backend=hccl needs torch_npu (Ascend)") from e
        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return ProcessGroupHCCL(store, rank, world_size, opts)
    raise ValueError(f"weight_sync.backend={backend!r}: expected gloo, nccl or hccl")
