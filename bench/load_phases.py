"""Where a pull round's load time goes, read from the decode engine's timeline.

With ``KVBRIDGE_TIMELINE=1`` (see kvbridge.nixl.timeline) a pull-mode decode engine
logs, per request: ``load_ordered`` (its scheduler ordered the load), ``load_start``
(the worker got the order), ``read_posted`` (its READs were posted; with the posts'
wall time, the posting thread's CPU time and its time waiting for a CPU), ``read_checked``
(the posting thread saw them complete), ``load_reported`` (the worker reported the
request done to vLLM) and ``load_seen`` (the scheduler got that report).
``bench/bench_push.py`` reads the push events of the same log format.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

TIMELINE = re.compile(r"kvbridge-timeline (\w+) (\S+) t=([0-9.]+)(.*)")

#: (figure, what it measures), in the order the table prints them
PHASES = (
    ("to_worker_ms", "order -> worker: scheduler's load order to the worker taking it"),
    ("posting_ms", "posting: worker taking the first order to the last READ posted"),
    ("post_ms", "  of which inside NIXL's post (summed over the round's READs)"),
    ("post_cpu_ms", "  of which the posting thread ran (host memory: UCX copies there)"),
    ("post_runnable_ms", "  of which it was ready but waited for a CPU"),
    ("to_report_ms", "READs seen complete to the worker reporting them to vLLM"),
    ("to_scheduler_ms", "worker's report to the scheduler seeing it"),
    ("total_ms", "order of the first load to the scheduler seeing the last one"),
)


def timeline(log: str) -> list[tuple[str, str, float, dict[str, str]]]:
    """(event, request id, wall-clock time, fields) of every timeline line in ``log``."""
    out = []
    for m in TIMELINE.finditer(log):
        fields = dict(kv.split("=", 1) for kv in m.group(4).split() if "=" in kv)
        out.append((m.group(1), m.group(2), float(m.group(3)), fields))
    return out


def load_phases(decode_log: str, per_round: int) -> list[dict[str, float]]:
    """One dict of :data:`PHASES` figures per round (rounds: consecutive groups of
    ``per_round`` requests in the order their loads were ordered); a round whose events
    are incomplete is left out. Empty without timeline lines."""
    events = timeline(decode_log)
    order = sorted((t, rid) for ev, rid, t, _ in events if ev == "load_ordered")
    rounds = [[rid for _, rid in order[i:i + per_round]] for i in range(0, len(order), per_round)]
    by_rid: dict[str, dict[str, list[tuple[float, dict[str, str]]]]] = {}
    for ev, rid, t, fields in events:
        by_rid.setdefault(rid, {}).setdefault(ev, []).append((t, fields))
    out = []
    for rids in rounds:
        try:
            out.append(_round(rids, by_rid))
        except (KeyError, ValueError):
            continue
    return out


def _round(rids: list[str], by_rid: dict[str, dict[str, list[tuple[float, dict[str, str]]]]]
           ) -> dict[str, float]:
    def times(ev: str) -> list[float]:
        return [t for r in rids for t, _ in by_rid[r][ev]]

    def summed(field: str) -> float:
        return sum(float(f.get(field, 0)) for r in rids for _, f in by_rid[r]["read_posted"])

    ordered, started, posted = times("load_ordered"), times("load_start"), times("read_posted")
    checked, reported, seen = times("read_checked"), times("load_reported"), times("load_seen")
    ms = 1e3
    return {
        "to_worker_ms": (min(started) - min(ordered)) * ms,
        "posting_ms": (max(posted) - min(started)) * ms,
        "post_ms": summed("post_ms"),
        "post_cpu_ms": summed("post_cpu_ms"),
        "post_runnable_ms": summed("runnable_ms"),
        "to_report_ms": (max(reported) - max(checked)) * ms,
        "to_scheduler_ms": (max(seen) - max(reported)) * ms,
        "total_ms": (max(seen) - min(ordered)) * ms,
    }


def median_phases(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """The median of each figure over ``rounds`` (None for none)."""
    return {k: (statistics.median(r[k] for r in rounds) if rounds else None) for k, _ in PHASES}
