"""The pull timeline (``kvbridge.timeline`` at INFO): the decode side's posting and
completion of each request's READs, with the posts' CPU figures, over real NIXL agents."""

from __future__ import annotations

import logging
import re

import pytest
from test_engine import Pair

from kvbridge.nixl import TIMELINE_LOGGER, timeline_mark
from kvbridge.nixl.peers import ThreadUsage, thread_usage

pytestmark = pytest.mark.timeout(120)

LINE = re.compile(r"kvbridge-timeline (\w+) (\S+) t=([0-9.]+)(.*)")


def _events(caplog) -> list[tuple[str, str, float, dict[str, str]]]:
    out = []
    for rec in caplog.records:
        m = LINE.search(rec.getMessage())
        if m:
            out.append((m.group(1), m.group(2), float(m.group(3)),
                        dict(kv.split("=", 1) for kv in m.group(4).split())))
    return out


def _pull_one() -> None:
    """Request "a" read from a TP 2 prefill engine by a TP 1 decode engine, to completion."""
    pair = Pair()
    try:
        pair.dec.load("a", pair.hold("a", [3, 1]), ([9, 10],))
        done, failed, _ = pair.run(lambda d, f, r: d == ["a"] and len(r) == 2)
    finally:
        pair.close()
    assert done == ["a"] and not failed


def test_a_pull_logs_its_posting_and_completion_with_the_posts_cpu_figures(caplog):
    caplog.set_level(logging.INFO, logger=TIMELINE_LOGGER)
    _pull_one()
    ev = {e: (t, f) for e, rid, t, f in _events(caplog) if rid == "a"}
    assert set(ev) == {"read_posted", "read_checked"}
    t_posted, fields = ev["read_posted"]
    assert fields["reads"] == "2"  # TP 2 -> 1: one READ from each prefill rank
    post, cpu, runnable = (float(fields[k]) for k in ("post_ms", "post_cpu_ms", "runnable_ms"))
    assert post > 0 and cpu >= 0 and runnable >= 0
    assert cpu + runnable <= post + 1.0  # both parts of the posts' wall time (clock granularity)
    assert ev["read_checked"][0] >= t_posted


def test_nothing_is_logged_with_the_timeline_off(caplog):
    caplog.set_level(logging.WARNING, logger=TIMELINE_LOGGER)
    _pull_one()
    timeline_mark("load_start", "b")  # off: a no-op
    assert _events(caplog) == []


def test_thread_usage_counts_time_spent_waiting_for_a_cpu():
    a = thread_usage()
    x = 0
    for i in range(200_000):
        x += i
    d = thread_usage() - a
    assert d.cpu_s > 0 and d.runnable_s >= 0
    assert (ThreadUsage(1.0, 2, 3, 0.5) - ThreadUsage(0.25, 1, 1, 0.125)) == ThreadUsage(0.75, 1, 2, 0.375)
