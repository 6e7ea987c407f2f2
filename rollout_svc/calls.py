"""A bounded pool for user code that may be slow or hang: each call has a deadline, and the
result of every call is a value, an error with its traceback, or a timeout; never an exception
out of the pool.

Plain functions run on a thread pool; `async def` functions run as tasks on one event loop in
a thread of its own, at most `workers` at once. A timed-out async call is cancelled. A timed-out
thread cannot be stopped (Python has no way to): its result is ignored and it keeps its worker
until it returns; once every worker is held so, further calls fail at once as timeouts instead
of queueing forever. The threads are daemons, so a call that never returns cannot keep the
service from exiting. (Threads rather than processes: a user's reward may be a closure or hold
a client; nothing has to pickle.) Sluice's own scoring code (built-in tasks and rewards: pure
and fast) runs inline, in the caller's thread: the pool's hand-offs cost 1.3 ms per 64-sample
batch, 15x the built-in copy task's scoring (measured).
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Call:
    fn: Callable[..., Any]
    kwargs: Mapping[str, Any]
    args: tuple[Any, ...] = ()
    inline: bool = False  # run in the caller's thread, no deadline: for Sluice's own fast, pure code


@dataclass(frozen=True)
class CallResult:
    status: Literal["ok", "error", "timeout"]
    value: Any = None
    error: str = ""  # the traceback (error) or what timed out (timeout)


class DaemonThreads:
    """A fixed set of daemon worker threads taking jobs from a queue (ThreadPoolExecutor's
    threads are joined at interpreter exit: one hung call would hang the process). They start
    with the first job: a service whose scoring runs inline (built-in tasks) never starts them,
    which matters when a thousand services share one process (docs/architecture.md, "Packed
    sim services")."""

    def __init__(self, workers: int, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)
        ]
        self._started = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if not self._started:
            self._started = True
            for t in self._threads:
                t.start()
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Workers stop after their current job; queued jobs are cancelled."""
        for _ in self._threads:
            self._jobs.put(None)


class CallPool:
    def __init__(self, workers: int, timeout_s: float) -> None:
        self.workers = workers
        self.timeout_s = timeout_s
        self._threads = DaemonThreads(workers, "user-call")
        self._stuck = 0  # threads still running a call past its deadline
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._slots: asyncio.Semaphore | None = None

    def run(self, calls: list[Call]) -> list[CallResult]:
        """Every call's result, in order; returns once each has ended or passed its deadline."""
        results: list[CallResult | None] = [None] * len(calls)
        started: dict[int, float] = {}
        pending: dict[Future, int] = {}
        for i, call in enumerate(calls):
            if call.inline:
                results[i] = self._timed(call, i, started)
            elif inspect.iscoroutinefunction(call.fn):
                pending[self._submit_async(call)] = i
            else:
                pending[self._threads.submit(self._timed, call, i, started)] = i
        while pending:
            done, _ = wait(list(pending), timeout=0.05, return_when=FIRST_COMPLETED)
            for fut in done:
                results[pending.pop(fut)] = fut.result()
            self._expire(pending, started, results)
        return [r if r is not None else CallResult("timeout", error="no result") for r in results]

    def _expire(self, pending: dict[Future, int], started: dict[int, float], results: list) -> None:
        """Give up on thread calls past their deadline, and on queued ones no worker can take."""
        now = time.monotonic()
        for fut, i in list(pending.items()):
            t0 = started.get(i)
            if t0 is not None and now - t0 > self.timeout_s and not fut.done():
                del pending[fut]
                results[i] = CallResult("timeout", error=f"still running after {self.timeout_s:g}s")
                with self._lock:
                    self._stuck += 1
                fut.add_done_callback(self._unstick)
            elif t0 is None and self._stuck >= self.workers and fut.cancel():
                del pending[fut]
                results[i] = CallResult(
                    "timeout", error=f"all {self.workers} workers are held by calls past their deadline"
                )

    def _unstick(self, _fut: Future) -> None:
        with self._lock:
            self._stuck -= 1

    @staticmethod
    def _timed(call: Call, index: int, started: dict[int, float]) -> CallResult:
        started[index] = time.monotonic()
        try:
            return CallResult("ok", call.fn(*call.args, **call.kwargs))
        except Exception:
            return CallResult("error", error=traceback.format_exc())

    # -- async ---------------------------------------------------------------------------------

    def _submit_async(self, call: Call) -> Future:
        loop = self._event_loop()
        return asyncio.run_coroutine_threadsafe(self._guarded(call), loop)

    async def _guarded(self, call: Call) -> CallResult:
        assert self._slots is not None
        async with self._slots:
            try:
                value = await asyncio.wait_for(call.fn(*call.args, **call.kwargs), self.timeout_s)
                return CallResult("ok", value)
            except TimeoutError:
                return CallResult("timeout", error=f"cancelled after {self.timeout_s:g}s")
            except Exception:
                return CallResult("error", error=traceback.format_exc())

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                self._slots = asyncio.Semaphore(self.workers)
                ready.set()
                loop.run_forever()

            self._loop_thread = threading.Thread(target=serve, name="user-call-loop", daemon=True)
            self._loop_thread.start()
            ready.wait()
            self._loop = loop
        return self._loop

    def close(self) -> None:
        self._threads.shutdown()
        if self._loop is not None and self._loop_thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=5)
            self._loop.close()
            self._loop = None
