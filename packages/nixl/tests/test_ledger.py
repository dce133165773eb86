from dataclasses import replace

import pytest

from kvbridge.nixl.ledger import DecodeTracker, FailureKind, PrefillLedger, State
from kvbridge.nixl.messages import Kind, Notification
from kvbridge.nixl.stats import Stats
from kvbridge.topology import EngineSpec, plan_transfer


def n(rid, rank, tp=2, tok="t", kind=Kind.DONE):
    return Notification(kind, rid, tp, rank, tok)


def ledger(consumers=(0, 1), lease=10.0):
    """A ledger whose rank is notified by ``consumers`` of a TP-2 decode engine (all of TP 4)."""
    return PrefillLedger(lambda tp: {2: consumers, 4: (0, 1, 2, 3)}.get(tp, ()), lease)


def test_releases_after_every_decode_rank_notified_once():
    lg = ledger()
    lg.hold("a", [1, 2], "t", now=0)
    assert lg.on_notification(n("a", 0), 1) == "counted"
    assert lg.on_notification(n("a", 0), 1) == "duplicate"  # same rank twice counts once
    assert lg.take_released() == []
    assert lg.on_notification(n("a", 1), 2) == "released"
    (rel,) = lg.take_released()
    assert (rel.request_id, rel.block_ids, rel.reason) == ("a", (1, 2), "notified")
    assert "a" not in lg and lg.stats.notifications_duplicate == 1
    assert lg.on_notification(n("a", 1), 3) == "unknown"  # late: already released
    assert lg.stats.notifications_unknown == 1


def test_wrong_token_unknown_and_malformed_are_ignored_and_counted():
    lg = ledger(consumers=(0,))
    lg.hold("a", [1], "good", now=0)
    assert lg.on_notification(n("a", 0, tok="bad"), 1) == "bad-token"
    assert lg.on_notification(n("zzz", 0), 1) == "unknown"
    assert lg.on_notification(None, 1) == "malformed"
    assert lg.on_notification(n("a", 0, tp=3, tok="good"), 1) == "bad-decode-tp"  # 0 expected
    assert "a" in lg
    s = lg.stats
    assert (s.notifications_bad_token, s.notifications_unknown, s.notifications_malformed) == (1, 1, 2)
    assert lg.on_notification(n("a", 0, tok="good"), 1) == "released"


def test_decode_tp_must_stay_the_same_within_a_request():
    lg = ledger()
    lg.hold("a", [1], "t", now=0)
    lg.on_notification(n("a", 0, tp=2), 0)
    assert lg.on_notification(n("a", 1, tp=4), 0) == "bad-decode-tp"
    assert "a" in lg


def test_lease_expiry_and_renewal():
    lg = ledger(lease=10)
    lg.hold("a", [1], "t", now=0)
    lg.hold("b", [2], "t", now=0)
    assert lg.on_notification(n("a", 0, kind=Kind.RENEW), 8) == "renewed"
    assert lg.expire(9.9) == []
    assert lg.expire(10) == ["b"]
    assert lg.expire(17.9) == []
    assert lg.expire(18) == ["a"]
    rel = lg.take_released()
    assert [r.reason for r in rel] == ["lease-expired", "lease-expired"]
    assert lg.stats.leases_expired == 2 and lg.stats.leases_renewed == 1 and len(lg) == 0


def test_renew_with_wrong_token_does_not_extend():
    lg = ledger(lease=10)
    lg.hold("a", [1], "t", now=0)
    lg.on_notification(n("a", 0, tok="x", kind=Kind.RENEW), 5)
    assert lg.expire(10) == ["a"]


def test_hold_twice_rejected_and_lease_validated():
    lg = ledger()
    lg.hold("a", [1], "t", now=0)
    with pytest.raises(ValueError, match="already held"):
        lg.hold("a", [1], "t", now=0)
    with pytest.raises(ValueError):
        PrefillLedger(lambda tp: (0,), 0)


def test_only_the_decode_ranks_the_plan_assigns_are_counted():
    """Prefill TP 2 -> decode TP 4: prefill rank 1 is read by decode ranks 2 and 3 only.

    DONE from decode ranks 0 and 1 (right token, right TP) must not release it.
    """
    p = EngineSpec("prefill", 2, 4, 16, 2, 16)
    d = replace(p, engine_id="decode", tp_size=4)

    def consumers_for(decode_tp):
        return plan_transfer(p, replace(d, tp_size=decode_tp)).prefill_ranks[1].consumer_ranks

    assert consumers_for(4) == (2, 3)
    lg = PrefillLedger(consumers_for, 10.0)
    lg.hold("a", [1, 2], "t", now=0)
    assert lg.on_notification(n("a", 0, tp=4), 1) == "unassigned"
    assert lg.on_notification(n("a", 1, tp=4), 1) == "unassigned"
    assert "a" in lg and lg.take_released() == []
    assert lg.stats.notifications_unassigned == 2
    assert lg.on_notification(n("a", 2, tp=4), 1) == "counted"
    assert lg.on_notification(n("a", 3, tp=4), 1) == "released"
    assert [r.reason for r in lg.take_released()] == ["notified"]
    assert lg.stats.notifications_malformed == 0 and lg.stats.notifications_duplicate == 0


def test_an_unassigned_rank_does_not_fix_the_decode_tp():
    """The first *accepted* DONE fixes the request's decode TP; an ignored one does not."""
    lg = ledger(consumers=(1,))
    lg.hold("a", [1], "t", now=0)
    assert lg.on_notification(n("a", 0, tp=2), 0) == "unassigned"  # TP 2 assigns rank 1 only
    for r in range(3):
        assert lg.on_notification(n("a", r, tp=4), 0) == "counted"  # TP 4 is still open
    assert lg.on_notification(n("a", 1, tp=2), 0) == "bad-decode-tp"  # now TP 4 is fixed
    assert lg.on_notification(n("a", 3, tp=4), 0) == "released"


def test_consumers_for_must_name_ranks():
    lg = PrefillLedger(lambda tp: 2, 10.0)  # a count is not the ranks
    lg.hold("a", [1], "t", now=0)
    with pytest.raises(TypeError, match="decode ranks"):
        lg.on_notification(n("a", 0), 0)


def test_decode_tracker_state_machine():
    tr = DecodeTracker()
    t = tr.add("a", "P", [5, 6], deadline=10, ready=False)
    assert t.state is State.WAITING
    tr.add("b", "P", [7], deadline=10, ready=False)
    tr.add("c", "Q", [8], deadline=10, ready=False)
    assert [x.request_id for x in tr.handshake_done("P")] == ["a", "b"]
    tr.posted("a", [0, 1])
    assert tr.part_done("a", 0) is False
    assert tr.part_done("a", 1) is True
    assert tr.take_done() == ["a"]
    (f,) = tr.handshake_failed("Q", "boom")
    assert (f.kind, f.invalid_block_ids) == (FailureKind.HANDSHAKE, (8,))
    tr.posted("b", [])  # nothing to read: done at once
    assert tr.take_done() == ["b"]
    assert len(tr) == 0 and tr.stats.requests_done == 2 and tr.stats.failures == {"handshake": 1}


def test_decode_tracker_timeout_and_post_guard():
    tr = DecodeTracker()
    tr.add("a", "P", [1], deadline=5, ready=True)
    with pytest.raises(ValueError):
        tr.add("a", "P", [1], deadline=5, ready=True)
    assert [t.request_id for t in tr.overdue(4.9)] == []
    assert [t.request_id for t in tr.overdue(5)] == ["a"]
    tr.fail("a", FailureKind.TIMEOUT, "late")
    (f,) = tr.take_failed()
    assert f.kind is FailureKind.TIMEOUT and f.invalid_block_ids == (1,)
    tr.add("w", "P", [1], deadline=5, ready=False)
    with pytest.raises(ValueError, match="not ready"):
        tr.posted("w", [0])


def test_stats_merge():
    a, b = Stats(bytes=10, xfer_us=1), Stats(bytes=5, xfer_us=2)
    a.fail("timeout")
    b.fail("timeout")
    b.fail("handshake")
    m = Stats.merge([a, b])
    assert m.bytes == 15 and m.xfer_us == 3 and m.requests_failed == 3
    assert m.failures == {"timeout": 2, "handshake": 1}
    assert a.failures == {"timeout": 1}  # inputs untouched
    assert abs(Stats(bytes=3000, xfer_us=1).gbps - 3.0) < 1e-9
