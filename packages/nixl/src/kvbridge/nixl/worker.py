"""The engine's background thread: runs jobs (handshakes, posting transfers) in order.

Each engine owns one :class:`Worker`. Jobs are callables; they run one at a
time in the order they were submitted, so a request submitted after its peer's
handshake runs after that handshake. Jobs report back to the engine's caller
thread by putting events on a queue the engine drains in ``poll()``. Nothing a
job raises stops the thread.

By default the agent runs NIXL's native progress thread, which moves transfers,
connection set-up and notifications; the worker then only waits for jobs
(``progress_interval_s=0``). Without that thread (``AgentConfig(progress_thread=
False)``) the worker lets NIXL progress (``NixlAgent.progress``) between jobs,
since over UCX in host memory a peer's READ of this rank's blocks (and its
connection set-up) completes only while this side progresses too (measured:
with the target progressing every 50 ms, a 16 MiB READ took 42 ms; every
millisecond, 3 ms; never, it did not complete). It then progresses every
``progress_interval_s`` while its engine says it is ``busy`` (blocks held for a
peer, transfers awaited), and every ``idle_interval_s`` otherwise (each wake-up
also takes the GIL from the process's other threads). The engine calls
:meth:`Worker.wake` when it becomes busy.

``cpus`` pins the thread to those CPUs (Linux; best effort). An engine embedded in
a process whose threads are bound to one core (vLLM's CPU workers) otherwise
copies host memory on that core, between the forward pass's own work; on
other CPUs the copies overlap the computation.

A job that must see its transfers complete does not wait for them: it leaves a
check (:meth:`Worker.watch`), which the worker runs when it is due, after a job
or while no job waits, until the check says it is finished; the check says when
it wants to run again. So a request's posts never wait behind the completion of
the request before it, and transfers of several requests are in flight at once.
Checks do not run while a job runs (a handshake delays them by its length).

Jobs report through an :class:`EventQueue`: besides the events it holds a
wake-up pipe that becomes readable when an event is queued, so a caller waiting
in ``select()`` (the engines' ``fileno()``) runs ``poll()`` as soon as the worker
has something for it rather than on its next timed round.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence

from .agent import NixlAgent

log = logging.getLogger("kvbridge.nixl")

Job = Callable[[], None]
#: a check left by a job: returns None when finished, else seconds until it wants to run again
Check = Callable[[], "float | None"]


class EventQueue:
    """A thread-safe FIFO of events with a wake-up file descriptor.

    :meth:`put` (any thread) queues an event and makes :meth:`fileno` readable;
    :meth:`clear` (the consuming thread, before it drains) makes it unreadable
    again. An event put after ``clear`` always leaves the descriptor readable, so
    no wake-up is lost. Close with :meth:`close`.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()  # no write after close (the fd number may be reused)
        self._closed = False

    def put(self, event: object) -> None:
        self._q.put(event)
        self.wake()

    def wake(self) -> None:
        """Make :meth:`fileno` readable without queuing an event (something the owner's next
        ``poll()`` checks by itself has changed, e.g. a transfer completed)."""
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._w, b"!")
            except OSError:  # the pipe is full: readable already
                pass

    def get_nowait(self) -> object:
        """The oldest event; raises ``queue.Empty`` when there is none."""
        return self._q.get_nowait()

    def empty(self) -> bool:
        """True when no event is queued (a snapshot: another thread may put one at once)."""
        return self._q.empty()

    def fileno(self) -> int:
        """Readable while wake-ups are pending (for ``select()``-style waits)."""
        return self._r

    def clear(self) -> None:
        """Consume the pending wake-ups (call before draining the events)."""
        with self._lock:
            if self._closed:
                return
            try:
                while os.read(self._r, 4096):
                    pass
            except OSError:  # empty
                pass

    def close(self) -> None:
        """Close the wake-up pipe (idempotent); events can still be put and taken."""
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._r)
                os.close(self._w)


class Worker:
    """One background thread that runs :data:`Job` callables in submission order, and
    between them the checks its jobs asked it to :meth:`watch`."""

    def __init__(self, agent: NixlAgent, name: str, progress_interval_s: float,
                 cpus: Sequence[int] | None = None, *, idle_interval_s: float | None = None,
                 busy: Callable[[], bool] | None = None,
                 on_start: Callable[[], None] | None = None) -> None:
        self._agent = agent
        #: called first on the thread (e.g. to make the cache's GPU its current device)
        self._on_start = on_start
        self._interval = progress_interval_s
        #: the interval while ``busy()`` is false (None: always ``progress_interval_s``)
        self._idle_interval = idle_interval_s
        self._busy = busy
        self._cpus = None if cpus is None else tuple(cpus)
        #: the CPUs the thread runs on once started (None: as inherited)
        self.cpus: frozenset[int] | None = None
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        #: checks the jobs left, with the monotonic time each is due (worker thread only)
        self._watches: list[tuple[float, Check]] = []
        #: a job is running, or a check it left is pending (worker thread writes)
        self._active = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def in_job(self) -> bool:
        """A job is queued or running, or a check it left is pending. The owner's thread reads
        it to hand the worker the GIL (``EngineConfig.gil_handoff_s``): a queued job counts,
        since a worker woken for it must take the GIL before it can start it."""
        return self._active or not self._jobs.empty()

    def submit(self, job: Job) -> None:
        """Run ``job`` on the worker thread after every job submitted before it."""
        self._jobs.put(job)

    def wake(self) -> None:
        """End an idle wait now: the engine became busy (progress at the short interval)."""
        self._jobs.put(_nothing)

    def watch(self, check: Check) -> None:
        """From a job (worker thread only): call ``check`` once this job ends, and again after
        the delay each call returns, between later jobs or while no job waits, until it
        returns None (or raises, which is logged). A job that must wait for something (its
        transfers to complete) leaves a check instead of waiting, so that the jobs behind it
        (the next request's posts) run at once. :meth:`close` runs the checks left to the end."""
        self._watches.append((0.0, check))

    def _run_watches(self) -> None:
        """Run the checks that are due; ``in_job`` then says whether any is left."""
        now = time.monotonic()
        current, self._watches = self._watches, []
        keep = []
        for due, check in current:
            if due > now:
                keep.append((due, check))
                continue
            try:
                again = check()
            except Exception:  # a bug in the check, not a peer's input: drop it, keep the thread
                log.exception("%s: a background check failed", self._thread.name)
                continue
            if again is not None:
                keep.append((time.monotonic() + again, check))
        self._watches[:0] = keep  # checks added by the ones that ran go after the older ones
        self._active = bool(self._watches)

    def _next_due(self) -> float:
        """Seconds until the earliest check is due (0: now)."""
        return max(0.0, min(due for due, _ in self._watches) - time.monotonic())

    def _timeout(self) -> float | None:
        """How long to wait for a job before letting NIXL progress (None: no timed progress)."""
        if not self._interval:
            return None
        if self._busy is None or self._idle_interval is None or self._idle_interval <= self._interval:
            return self._interval
        try:
            busy = self._busy()
        except Exception:  # a snapshot taken while the owner changes it: err on the fast side
            busy = True
        return self._interval if busy else self._idle_interval

    def close(self, timeout_s: float) -> None:
        """Stop after the jobs already submitted and the checks they left (waits at most
        ``timeout_s``)."""
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)

    def _pin(self) -> None:
        if self._cpus is None or not hasattr(os, "sched_setaffinity"):
            return
        try:
            os.sched_setaffinity(0, self._cpus)  # 0: this thread (Linux sets per thread)
            self.cpus = frozenset(os.sched_getaffinity(0))
        except OSError as exc:
            log.warning("%s: cannot run on CPUs %s (%s); it stays on the CPUs it inherited",
                        self._thread.name, list(self._cpus), exc)

    def _run(self) -> None:
        self._pin()
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception:
                log.exception("%s: its start-up call failed; it runs on without it", self._thread.name)
        while True:
            try:
                job = self._jobs.get(timeout=self._next_due() if self._watches else self._timeout())
            except queue.Empty:
                if self._watches:
                    self._run_watches()
                    continue  # (checking a transfer lets NIXL progress too)
                # no NIXL progress thread (it spins a core): keep connection set-up and
                # notifications moving while the owner is between poll() calls
                try:
                    self._agent.progress()
                except Exception as exc:  # never let the worker die; poll() reports NIXL errors
                    log.debug("%s: background NIXL progress failed: %s", self._thread.name, exc)
                continue
            if job is None:
                while self._watches:  # each check ends by its own deadline
                    time.sleep(self._next_due())
                    self._run_watches()
                return
            self._active = True
            try:
                job()
            except Exception:  # jobs report their own errors; this is a bug, not a peer's input
                log.exception("%s: a background job failed", self._thread.name)
            finally:
                self._run_watches()


def _nothing() -> None:
    """The job :meth:`Worker.wake` submits: it only ends the worker's wait."""
