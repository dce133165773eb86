"""The soak's seeded fault schedule (faults.py) and its flatness rule (probes.py), pure logic
(the soak itself is soak.py beside them), and the /proc probe on this process."""

from __future__ import annotations

import os
import socket

import faults as F  # tests/soak/faults.py (pytest puts tests/soak on sys.path)
from probes import ProcSample, Series, flatness_problems, probe


def test_schedule_is_seeded_and_places_every_kind():
    per = {k: 2 for k in F.KINDS}
    a = F.schedule(5, 100, per, first=1, windows={F.KILL_DECODE_RANK: (1, 10)})
    assert a == F.schedule(5, 100, per, first=1, windows={F.KILL_DECODE_RANK: (1, 10)})
    assert a != F.schedule(6, 100, per, first=1, windows={F.KILL_DECODE_RANK: (1, 10)})
    kinds = [k for ks in a.values() for k in ks]
    assert sorted(kinds) == sorted(k for k in F.KINDS for _ in range(2))
    assert all(1 <= w < 100 for w in a)
    assert all(1 <= w < 10 for w, ks in a.items() if F.KILL_DECODE_RANK in ks)
    # more faults than waves: one per wave, the rest cut
    tight = F.schedule(1, 4, {k: 5 for k in F.KINDS}, first=1)
    assert sorted(tight) == [1, 2, 3] and all(len(v) == 1 for v in tight.values())


def _series(points):
    s = Series("p", 1)
    for n, rss, fds, departed, lists in points:
        s.add(n, ProcSample(rss, 5, fds, fds - 30), {"lists": lists, "transfers": 0}, departed)
    return s


def test_flatness_rule():
    flat = _series([(0, 1000, 40, 0, 4), (100, 1300, 41, 0, 4), (200, 1200, 41, 0, 0),
                    (300, 1400, 43, 2, 4), (400, 1250, 41, 2, 4)])
    assert flatness_problems(flat, 100, rss_tol_kib=512) == []
    # an fd more than the departed peers explain
    leak = _series([(0, 1000, 40, 0, 4), (100, 1000, 41, 0, 4), (200, 1000, 43, 1, 4)])
    assert any("fds" in p for p in flatness_problems(leak, 100, rss_tol_kib=512))
    # a handle above anything seen before the checkpoint
    handles = _series([(0, 1000, 40, 0, 4), (100, 1000, 40, 0, 4), (200, 1000, 40, 0, 6)])
    assert any("lists" in p for p in flatness_problems(handles, 100, rss_tol_kib=512))
    # a steady climb of memory, each step under the tolerance
    climb = _series([(n, 1000 + n * 2, 40, 0, 4) for n in range(0, 1100, 100)])
    probs = flatness_problems(climb, 100, rss_tol_kib=1000)
    assert any("RSS" in p for p in probs)
    assert flatness_problems(_series([(0, 1000, 40, 0, 4)]), 0, 1)  # too few samples says so


def test_flatness_counts_what_departed_peers_leave_behind():
    # two peers died before the window (their other sockets closed, one each left behind), and
    # their replacements connected inside it: as many sockets as before, plus those two
    late = _series([(0, 1000, 40, 0, 4), (100, 1000, 38, 2, 4), (200, 1000, 42, 2, 4)])
    assert flatness_problems(late, 100, rss_tol_kib=512) == []
    # with 2 UCX worker threads each departed peer leaves two
    two = _series([(0, 1000, 40, 0, 4), (100, 1000, 40, 0, 4), (200, 1000, 44, 2, 4)])
    assert flatness_problems(two, 100, rss_tol_kib=512, per_departed_peer=2) == []
    assert any("fds" in p for p in flatness_problems(two, 100, rss_tol_kib=512))
    # none with num_threads=0: every socket must go
    assert any("fds" in p for p in flatness_problems(late, 100, rss_tol_kib=512, per_departed_peer=0))


def test_probe_counts_this_process():
    before = probe(os.getpid())
    with socket.socket() as s1, socket.socket() as s2:
        during = probe(os.getpid())
        assert s1.fileno() >= 0 and s2.fileno() >= 0
    assert during.sockets == before.sockets + 2 and during.fds == before.fds + 2
    assert before.rss_kib > 0 and before.threads >= 1
