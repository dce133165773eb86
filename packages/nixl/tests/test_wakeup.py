"""The engines' wake-up descriptor: readable when the worker reported something for poll()."""

from __future__ import annotations

import queue
import select
import threading
import time

import pytest

from kvbridge.nixl import AgentConfig, EngineConfig
from kvbridge.nixl.worker import EventQueue
from kvbridge.tools.local_ranks import LocalRanks
from kvbridge.tools.synthetic_cache import logical_kv
from kvbridge.topology import EngineSpec

pytestmark = pytest.mark.timeout(120)

P = EngineSpec("prefill", 1, 4, 16, 2, 16)
D = EngineSpec("decode", 1, 4, 16, 2, 16)
CFG = EngineConfig(agent=AgentConfig(num_threads=0), handshake_timeout_s=2, transfer_timeout_s=10)


def _readable(fd, timeout: float = 0.0) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def test_event_queue_wakes_once_per_clear_and_keeps_order():
    q = EventQueue()
    try:
        assert not _readable(q)
        q.put(("a",))
        q.put(("b",))
        assert _readable(q)
        q.clear()
        assert not _readable(q)  # cleared, events still there
        assert q.get_nowait() == ("a",) and q.get_nowait() == ("b",)
        with pytest.raises(queue.Empty):
            q.get_nowait()
        threading.Thread(target=lambda: (time.sleep(0.05), q.put(("c",)))).start()
        assert _readable(q, 10.0)  # a put from another thread wakes a waiting select()
        q.clear()
        assert q.get_nowait() == ("c",)
        for i in range(100_000):  # a full pipe never blocks put()
            q.put((i,))
        assert _readable(q)
    finally:
        q.close()
    q.close()  # idempotent
    q.put(("late",))  # after close: kept, no wake-up
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            break
    assert items[0] == (0,) and items[-1] == ("late",) and len(items) == 100_001


def test_engine_fileno_wakes_when_reads_are_posted():
    decode = LocalRanks.start("d", D, [0], 8, CFG, serve=False)
    prefill = LocalRanks.start("p", P, [0], 8, CFG)
    dec, pre = decode.engines[0], prefill.engines[0]
    try:
        prefill.fill(logical_kv(P, 1, 32), [2, 3])
        params = pre.hold("a", ([2, 3],))
        dec.load("a", params, ([5, 6],))
        done: list[str] = []
        woke = 0
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            if _readable(dec, 0.05):  # the handshake ended, or the READ was posted
                woke += 1
            done += dec.poll().done
            pre.poll()
        assert done == ["a"] and woke >= 1
        assert not _readable(dec)  # poll() consumed the wake-ups
        assert decode.caches[0].verify(logical_kv(P, 1, 32), [5, 6], 0, 32) == 0
    finally:
        decode.close()
        prefill.close()
