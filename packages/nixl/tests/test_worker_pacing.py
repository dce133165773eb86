"""The worker's progress pacing: often while its engine is busy, seldom while idle."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from kvbridge.nixl import AgentConfig, EngineConfig
from kvbridge.nixl.worker import Worker
from kvbridge.tools.local_ranks import LocalRanks
from kvbridge.tools.synthetic_cache import logical_kv
from kvbridge.topology import EngineSpec

pytestmark = pytest.mark.timeout(120)

P = EngineSpec("prefill", 1, 4, 16, 2, 16)
D = EngineSpec("decode", 1, 4, 16, 2, 16)
CFG = EngineConfig(agent=AgentConfig(num_threads=0), handshake_timeout_s=2, transfer_timeout_s=10)


class CountingAgent:
    """Stands in for NixlAgent: counts the worker's progress calls (logic test only)."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def progress(self) -> None:
        with self._lock:
            self.calls += 1

    def count(self) -> int:
        with self._lock:
            return self.calls


def _calls_during(agent: CountingAgent, seconds: float) -> int:
    start = agent.count()
    time.sleep(seconds)
    return agent.count() - start


def test_idle_worker_progresses_at_the_idle_interval_and_busy_at_the_short_one():
    agent, busy = CountingAgent(), threading.Event()
    w = Worker(agent, "pacing", 0.001, idle_interval_s=0.1, busy=busy.is_set)  # type: ignore[arg-type]
    try:
        time.sleep(0.2)  # settle into the idle rhythm
        idle = _calls_during(agent, 1.0)
        busy.set()
        w.wake()
        fast = _calls_during(agent, 1.0)
    finally:
        w.close(5)
    # 1 s at 100 ms: about 10 calls (load only makes it fewer); at 1 ms: hundreds
    assert idle <= 12, idle
    assert fast > 5 * max(idle, 1), (idle, fast)


def test_wake_ends_an_idle_wait_at_once():
    agent, busy = CountingAgent(), threading.Event()
    w = Worker(agent, "pacing", 0.001, idle_interval_s=1.0, busy=busy.is_set)  # type: ignore[arg-type]
    try:
        time.sleep(0.1)  # now inside a 1 s idle wait
        before = agent.count()
        busy.set()
        w.wake()
        time.sleep(0.3)  # without wake() the worker would sleep on for up to 0.9 s
        assert agent.count() - before >= 5
    finally:
        w.close(5)


def test_a_busy_predicate_that_raises_counts_as_busy():
    agent = CountingAgent()

    def broken() -> bool:
        raise RuntimeError("dict changed size")

    w = Worker(agent, "pacing", 0.001, idle_interval_s=1.0, busy=broken)  # type: ignore[arg-type]
    try:
        assert _calls_during(agent, 0.5) >= 5
    finally:
        w.close(5)


def test_engines_are_busy_while_blocks_are_held_or_reads_awaited_and_shortly_after_a_poll():
    cfg = replace(CFG, busy_after_poll_s=0.3)
    decode = LocalRanks.start("d", D, [0], 8, cfg, serve=False)
    prefill = LocalRanks.start("p", P, [0], 8, cfg)
    dec, pre = decode.engines[0], prefill.engines[0]
    try:
        assert not pre._busy() and not dec._busy()
        prefill.fill(logical_kv(P, 1, 32), [2, 3])
        params = pre.hold("a", ([2, 3],))
        assert pre._busy()  # the decode rank may READ from now on
        dec.load("a", params, ([5, 6],))
        assert dec._busy()
        done: list[str] = []
        deadline = time.monotonic() + 30
        while (not done or pre.held) and time.monotonic() < deadline:
            done += dec.poll().done
            pre.poll()
            time.sleep(0.001)
        assert done == ["a"] and pre.held == 0
        assert pre._busy() and dec._busy()  # both polled just now: a next request may follow
        time.sleep(0.4)
        assert not pre._busy() and not dec._busy()  # idle again: the long interval
        pre.poll()
        assert pre._busy() and not dec._busy()  # stepping again
        assert decode.caches[0].verify(logical_kv(P, 1, 32), [5, 6], 0, 32) == 0
    finally:
        decode.close()
        prefill.close()


def test_engine_config_refuses_a_bad_idle_progress_interval():
    with pytest.raises(ValueError, match="idle_progress_interval_s"):
        EngineConfig(idle_progress_interval_s=-1)
    with pytest.raises(ValueError, match="idle_progress_interval_s"):
        EngineConfig(idle_progress_interval_s=2)
    with pytest.raises(ValueError, match="busy_after_poll_s"):
        EngineConfig(busy_after_poll_s=-1)
    with pytest.raises(ValueError, match="gil_handoff_s"):
        EngineConfig(gil_handoff_s=-0.001)
    with pytest.raises(ValueError, match="gil_handoff_s"):
        EngineConfig(gil_handoff_s=0.5)


@pytest.mark.parametrize("handoff", [0.0002, 0.0])
def test_poll_pauses_for_the_worker_only_while_it_has_a_job(monkeypatch, handoff):
    """CPython hands the GIL to a waiting thread only when its holder blocks: ``poll()``
    sleeps ``gil_handoff_s`` while the worker runs a job (a handshake, posting), and never
    otherwise, so that an engine loop that never blocks cannot starve the worker."""
    import kvbridge.nixl.rank as rank_module

    decode = LocalRanks.start("d", D, [0], 8, replace(CFG, gil_handoff_s=handoff), serve=False)
    dec = decode.engines[0]
    slept: list[float] = []
    real_sleep = time.sleep

    class Clock:  # rank.py's view of the time module: records the engine's own sleeps
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(s):
            slept.append(s)
            real_sleep(s)

    def idle_worker():
        deadline = time.monotonic() + 10
        while dec._worker.in_job and time.monotonic() < deadline:
            real_sleep(0.001)
        assert not dec._worker.in_job

    try:
        idle_worker()  # past the engine's start-up jobs
        monkeypatch.setattr(rank_module, "time", Clock())
        dec.poll()
        assert slept == []  # nothing running on the worker
        gate, started = threading.Event(), threading.Event()
        dec._worker.submit(lambda: (started.set(), gate.wait(10)))
        assert started.wait(10)
        dec.poll()
        dec.poll()
        assert slept == ([handoff, handoff] if handoff else [])
        gate.set()
        idle_worker()
        slept.clear()
        dec.poll()
        assert slept == []
    finally:
        gate.set()
        decode.close()


def test_checks_a_job_leaves_run_between_later_jobs_until_they_are_finished():
    """A job that leaves a check (``Worker.watch``) does not hold up the jobs behind it; the
    check runs after each of them and while the worker idles, as often as it asks, until it
    returns None. A check that raises is dropped (logged), and the worker goes on."""
    agent = CountingAgent()
    w = Worker(agent, "watching", 0.0)  # type: ignore[arg-type]
    gate, log, second_ran = threading.Event(), [], threading.Event()

    def check() -> float | None:
        log.append("check")
        return None if gate.is_set() else 0.0005

    def broken() -> float | None:
        raise RuntimeError("a bug in a check")

    try:
        w.submit(lambda: (w.watch(check), w.watch(broken)))
        w.submit(second_ran.set)
        assert second_ran.wait(10)  # ran while the first job's check is still unfinished
        deadline = time.monotonic() + 10
        while log.count("check") < 20 and time.monotonic() < deadline:  # checked while idle
            time.sleep(0.01)
        assert log.count("check") >= 20 and w.in_job  # poll()'s GIL hand-off still applies
        gate.set()
        while w.in_job and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not w.in_job
        n = log.count("check")
        time.sleep(0.1)
        assert log.count("check") == n  # finished: no longer called
    finally:
        w.close(5)


def test_close_runs_the_checks_left_to_their_end():
    agent = CountingAgent()
    w = Worker(agent, "closing", 0.0)  # type: ignore[arg-type]
    ends: list[float] = []
    t0 = time.monotonic()

    def check() -> float | None:
        if time.monotonic() - t0 < 0.3:
            return 0.001
        ends.append(time.monotonic())
        return None

    w.submit(lambda: w.watch(check))
    w.close(10)
    assert len(ends) == 1 and not w.in_job


def test_drive_returns_at_once_and_wakes_the_owner_when_the_transfers_complete(monkeypatch):
    """``RankEngine.drive`` leaves its checks to the worker: the next job (the next request's
    posts) runs before these transfers complete; when they do, ``then`` runs and only then
    the engine's ``fileno()`` becomes readable, so an owner waiting on it polls at once."""
    import select

    # a deadline no loaded machine reaches: this test is about completion, not giving up
    decode = LocalRanks.start("d", D, [0], 8, replace(CFG, complete_in_background_s=60), serve=False)
    dec = decode.engines[0]
    gate, order = threading.Event(), []
    monkeypatch.setattr(dec.agent, "state", lambda t: "DONE" if gate.is_set() else "PROC")
    try:
        dec.poll()
        # the next job is queued before the driving job ends (no race with the check's timing)
        dec.submit(lambda: (dec.drive([object()], lambda: order.append("checked")),
                            dec.submit(lambda: order.append("next job"))))
        deadline = time.monotonic() + 10
        while "next job" not in order and time.monotonic() < deadline:
            time.sleep(0.005)
        assert order == ["next job"]
        assert not select.select([dec], [], [], 0.2)[0]  # in progress: nothing to wake for
        gate.set()
        assert select.select([dec], [], [], 10)[0]
        assert order == ["next job", "checked"]
    finally:
        gate.set()  # a failed assertion must not leave the check running to its deadline
        decode.close()


def test_drive_gives_up_checking_after_complete_in_background_s(monkeypatch):
    """Past the deadline ``then`` runs, the next jobs have run meanwhile, and the owner is not
    woken (the transfer is not complete: ``poll()`` goes on checking it)."""
    import select

    decode = LocalRanks.start("d", D, [0], 8, replace(CFG, complete_in_background_s=0.3), serve=False)
    dec = decode.engines[0]
    monkeypatch.setattr(dec.agent, "state", lambda t: "PROC")
    called, order = threading.Event(), []
    try:
        dec.poll()
        t0 = time.monotonic()
        dec.submit(lambda: (dec.drive([object()], lambda: (order.append("then"), called.set())),
                            dec.submit(lambda: order.append("next job"))))
        assert called.wait(10)
        assert 0.25 < time.monotonic() - t0 < 5
        assert order == ["next job", "then"]
        assert not select.select([dec], [], [], 0.1)[0]
        deadline = time.monotonic() + 5
        while dec._worker.in_job and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not dec._worker.in_job  # no check left behind
    finally:
        decode.close()


def test_a_queued_job_counts_as_in_job():
    """The owner hands the GIL over while a job waits to start, not only while one runs: a
    worker woken for a job must take the GIL before it can start it (in vLLM a first handshake
    waited 135 ms for it while ``in_job`` said nothing was going on)."""
    agent = CountingAgent()
    w = Worker(agent, "queued", 0.0)  # type: ignore[arg-type]
    started, gate, second = threading.Event(), threading.Event(), threading.Event()
    try:
        w.submit(lambda: (started.set(), gate.wait(10)))
        assert started.wait(10)
        w._active = False  # as between two jobs: only the queue can say that one waits
        assert not w.in_job
        w.submit(second.set)
        assert w.in_job  # queued, not started
        gate.set()
        assert second.wait(10)
        deadline = time.monotonic() + 10
        while w.in_job and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not w.in_job
    finally:
        w.close(5)
