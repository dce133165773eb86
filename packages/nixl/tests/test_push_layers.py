"""Layer-by-layer push (PrefillEngine.push_start / push_layers / push_finish) and WRITTEN
notifications that arrive before the decode side expects them; real NIXL, one process."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from test_engine import CFG, NB, D, P, Pair

from kvbridge.nixl import TransferParams
from kvbridge.nixl.messages import Kind, Notification, encode_notification
from kvbridge.tools.synthetic_cache import logical_kv
from kvbridge.topology import FailureKind

pytestmark = pytest.mark.timeout(120)

PUSH = replace(CFG, mode="push")


@pytest.fixture
def pair():
    p = Pair(PUSH, p_spec=replace(P, num_layers=4), d_spec=replace(D, num_layers=4))
    p.dec.serve()
    yield p
    p.close()


def _target(pair, rid, d_blocks):
    host, port = pair.dec.address
    return TransferParams("decode", host, port, 1, (tuple(d_blocks),), "tok-" + rid)


def _fill(pair, p_blocks, seed):
    kv = logical_kv(pair.p_spec, seed, len(p_blocks) * pair.p_spec.block_size)
    pair.fill(kv, p_blocks)
    return kv


def _drain(pair, seconds):
    """Poll both sides for a while; returns what they reported."""
    done, failed, released = [], [], []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ev = pair.dec.poll()
        done += ev.done
        failed += ev.failed
        for e in pair.pre:
            released += e.poll()
        time.sleep(0.002)
    return done, failed, released


def _wait_written(pair, check, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        _drain(pair, 0.01)
        if check():
            return
    raise TimeoutError("the expected bytes did not arrive")


def test_each_layer_lands_when_named_and_decode_is_told_once_all_did(pair):
    d_blocks, p_blocks = [3, 7], [5, 6]
    kv = _fill(pair, p_blocks, seed=11)
    ntok = len(p_blocks) * pair.p_spec.block_size
    pair.dec.expect("a", "prefill", pair.p_spec.tp_size, "tok-a", (d_blocks,))
    for e in pair.pre:
        e.push_start("a", (p_blocks,), _target(pair, "a", d_blocks))
    for e in pair.pre:
        e.push_layers("a", [0, 1])
    # layers 0 and 1 arrive, 2 and 3 are untouched, and decode is not told anything yet
    _wait_written(pair, lambda: pair.dc.verify(kv, d_blocks, 0, ntok, layers=[0, 1]) == 0)
    assert pair.dc.verify(kv, d_blocks, 0, ntok, layers=[2]) > 0
    assert pair.dc.verify(kv, d_blocks, 0, ntok, layers=[3]) > 0
    done, failed, released = _drain(pair, 0.3)
    assert (done, failed, released) == ([], [], [])
    for e in pair.pre:
        e.push_layers("a", [2, 1])  # 1 again: skipped
    _wait_written(pair, lambda: pair.dc.verify(kv, d_blocks, 0, ntok, layers=[2]) == 0)
    assert pair.dc.verify(kv, d_blocks, 0, ntok, layers=[3]) > 0
    for e in pair.pre:
        e.push_finish("a")  # writes layer 3, then notifies
    done, failed, released = pair.run(lambda d, f, r: d and len(r) == 2)
    assert done == ["a"] and not failed
    assert {r.reason for r in released} == {"written"}
    assert pair.dc.verify(kv, d_blocks, 0, ntok) == 0
    # one WRITE per named batch and per decode rank: layers [0,1], [2], [3] from each rank
    assert all(e.stats.posts == 0 for e in pair.pre)  # pull counter untouched
    assert [e.stats.transfers for e in pair.pre] == [3, 3]
    assert pair.dec.stats.notifications_unknown == 0


def test_layers_named_before_the_handshake_are_written_after_it(pair):
    d_blocks, p_blocks = [1], [2]
    kv = _fill(pair, p_blocks, seed=5)
    pair.dec.expect("b", "prefill", pair.p_spec.tp_size, "tok-b", (d_blocks,))
    for e in pair.pre:
        assert e.peers.get("decode") is None
        e.push_start("b", (p_blocks,), _target(pair, "b", d_blocks))
        e.push_layers("b", [3])
        e.push_layers("b", [0])
        e.push_finish("b")
    done, failed, released = pair.run(lambda d, f, r: d and len(r) == 2)
    assert done == ["b"] and not failed
    assert pair.dc.verify(kv, d_blocks, 0, pair.p_spec.block_size) == 0


def test_written_before_expect_is_kept_and_applied(pair):
    d_blocks, p_blocks = [4], [9]
    kv = _fill(pair, p_blocks, seed=2)
    for e in pair.pre:
        e.push("c", (p_blocks,), _target(pair, "c", d_blocks))
    # the prefill ranks finish and notify before decode expects the request
    _, _, released = _drain(pair, 0.0)
    end = time.monotonic() + 10
    while len(released) < 2 and time.monotonic() < end:
        released += _drain(pair, 0.02)[2]
    assert len(released) == 2
    _wait_written(pair, lambda: pair.dec.stats.notifications_received == 2)
    pair.dec.expect("c", "prefill", pair.p_spec.tp_size, "tok-c", (d_blocks,))
    done, failed, _ = pair.run(lambda d, f, r: d)
    assert done == ["c"] and not failed
    assert pair.dc.verify(kv, d_blocks, 0, pair.p_spec.block_size) == 0
    assert pair.dec.stats.notifications_unknown == 0


def test_unclaimed_early_notifications_expire_as_unknown():
    pair = Pair(replace(PUSH, transfer_timeout_s=0.3))
    try:
        pair.dec.serve()
        _fill(pair, [1], seed=1)
        for e in pair.pre:
            e.push("x", ([1],), _target(pair, "x", [2]))
        _drain(pair, 0.2)
        assert pair.dec.stats.notifications_unknown == 0
        _drain(pair, 0.5)
        assert pair.dec.stats.notifications_unknown == 2
    finally:
        pair.close()


def test_layered_push_refuses_what_it_cannot_do(pair):
    e = pair.pre[0]
    with pytest.raises(ValueError, match="no layered push"):
        e.push_layers("nope", [0])
    e.push_start("d", ([1],), _target(pair, "d", [1]))
    with pytest.raises(ValueError, match="already being pushed"):
        e.push_start("d", ([1],), _target(pair, "d", [1]))
    with pytest.raises(ValueError, match="outside this model's 4 layers"):
        e.push_layers("d", [4])
    e.push_finish("d")
    with pytest.raises(ValueError, match="no more layers"):
        e.push_layers("d", [0])
    e.push("w", ([2],), _target(pair, "w", [2]))
    with pytest.raises(ValueError, match="no layered push"):
        e.push_finish("w")


def test_layered_push_needs_push_mode():
    pair = Pair(CFG)
    try:
        with pytest.raises(ValueError, match="push_start\\(\\) needs an engine configured with mode='push'"):
            pair.pre[0].push_start("a", ([1],), TransferParams("decode", "127.0.0.1", 1, 1, ((1,),), "t"))
    finally:
        pair.close()


@pytest.mark.parametrize("layered", [False, True])
def test_notifications_name_the_decode_engines_request_id(pair, layered):
    d_blocks, p_blocks = [6], [3]
    kv = _fill(pair, p_blocks, seed=9)
    pair.dec.expect("dec-9", "prefill", pair.p_spec.tp_size, "tok-9", (d_blocks,))
    host, port = pair.dec.address
    target = TransferParams("decode", host, port, 1, (tuple(d_blocks),), "tok-9", request_id="dec-9")
    for e in pair.pre:
        if layered:
            e.push_start("pre-9", (p_blocks,), target)
            e.push_finish("pre-9")
        else:
            e.push("pre-9", (p_blocks,), target)
    done, failed, released = pair.run(lambda d, f, r: d and len(r) == 2)
    assert done == ["dec-9"] and not failed
    assert {r.request_id for r in released} == {"pre-9"}
    assert pair.dc.verify(kv, d_blocks, 0, pair.p_spec.block_size) == 0


def test_the_worker_thread_runs_on_the_cpus_it_was_given():
    """An engine built by a thread bound to one CPU (as vLLM binds its CPU workers) still
    posts and copies on every CPU given in worker_cpus."""
    import os
    import threading

    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux and two CPUs")
    built = {}

    def build():
        os.sched_setaffinity(0, {0})  # this thread only
        built["pair"] = Pair(replace(PUSH, worker_cpus=(0, 1)))
        built["inherit"] = Pair(PUSH)

    t = threading.Thread(target=build)
    t.start()
    t.join()
    try:
        wide, narrow = built["pair"], built["inherit"]
        for e in (wide.dec, *wide.pre):
            assert os.sched_getaffinity(e._worker._thread.native_id) == {0, 1}
        for e in (narrow.dec, *narrow.pre):  # inherited from the building thread
            assert os.sched_getaffinity(e._worker._thread.native_id) == {0}
        assert os.sched_getaffinity(0) != {0}  # the test's own thread was never narrowed
    finally:
        for p in built.values():
            p.close()


def test_a_push_that_times_out_before_its_write_is_posted_leaves_no_handle():
    """A push whose posting job still waits on the worker when it times out posts nothing
    afterwards, and its blocks are released only once that job came back: a released push
    never leaves a WRITE handle behind (the soak probes handles right after releases)."""
    pair = Pair(replace(PUSH, transfer_timeout_s=0.3), p_spec=replace(P, num_layers=4),
                d_spec=replace(D, num_layers=4))
    pair.dec.serve()
    gates = []
    try:
        _fill(pair, [2], seed=3)
        pair.dec.expect("warm", "prefill", pair.p_spec.tp_size, "tok-warm", ([1],))
        for e in pair.pre:
            e.push("warm", ([2],), _target(pair, "warm", [1]))
        pair.run(lambda d, f, r: d == ["warm"] and len(r) == len(pair.pre))
        for e in pair.pre:  # hold each worker: the next posting job waits behind this one
            gate = threading.Event()
            gates.append(gate)
            e._worker.submit(gate.wait)
            e.push("late", ([2],), _target(pair, "late", [1]))
        time.sleep(0.5)  # past the timeout
        released = [r for e in pair.pre for r in e.poll()]
        assert released == []  # timed out, but the posting job has not come back yet
        assert all(e.held == 1 for e in pair.pre)
        for gate in gates:
            gate.set()
        end = time.monotonic() + 10
        while len(released) < len(pair.pre) and time.monotonic() < end:
            for e in pair.pre:
                got = e.poll()
                if got:
                    assert e.resource_counts()["transfers"] == 0  # nothing left at the release
                released += got
            time.sleep(0.002)
        assert {(r.request_id, r.reason) for r in released} == {("late", "push-failed")}
        assert len(released) == len(pair.pre)
        assert all(e.held == 0 and e.stats.requests_released == 2 for e in pair.pre)
    finally:
        for gate in gates:
            gate.set()
        pair.close()


def test_decode_is_told_without_waiting_for_the_prefill_poll(pair):
    """Once every layer was named and the push finished, the prefill worker notifies decode as
    soon as the WRITEs completed: decode learns it while the prefill engine is not polled."""
    d_blocks, p_blocks = [2, 5], [1, 3]
    kv = _fill(pair, p_blocks, seed=23)
    ntok = len(p_blocks) * pair.p_spec.block_size
    pair.dec.expect("w", "prefill", pair.p_spec.tp_size, "tok-w", (d_blocks,))
    for e in pair.pre:
        e.push_start("w", (p_blocks,), _target(pair, "w", d_blocks))
    _drain(pair, 0.2)  # the handshake
    for e in pair.pre:
        e.push_layers("w", [0, 1, 2, 3])
        e.push_finish("w")
    done: list[str] = []
    end = time.monotonic() + 10
    while not done and time.monotonic() < end:  # only the decode side polls
        done += pair.dec.poll().done
        time.sleep(0.002)
    assert done == ["w"]
    assert pair.dc.verify(kv, d_blocks, 0, ntok) == 0
    # the prefill side then releases the blocks, and notified each decode rank only once
    _, failed, released = pair.run(lambda d, f, r: len(r) == 2)
    assert not failed and {r.reason for r in released} == {"written"}
    assert [e.stats.notifications_sent for e in pair.pre] == [1, 1]
    assert pair.dec.stats.notifications_unknown == 0


def test_naming_every_layer_closes_the_push_without_waiting_for_finish(pair):
    """An attention-only model's push is complete once every layer was named: decode is told
    when those WRITEs land, before push_finish (the forward pass's tail) comes."""
    d_blocks, p_blocks = [4, 6], [2, 7]
    kv = _fill(pair, p_blocks, seed=31)
    ntok = len(p_blocks) * pair.p_spec.block_size
    pair.dec.expect("e", "prefill", pair.p_spec.tp_size, "tok-e", (d_blocks,))
    for e in pair.pre:
        e.push_start("e", (p_blocks,), _target(pair, "e", d_blocks))
        e.push_layers("e", [0, 1, 2])
    _wait_written(pair, lambda: pair.dc.verify(kv, d_blocks, 0, ntok, layers=[0, 1, 2]) == 0)
    assert _drain(pair, 0.3)[0] == []  # three of four layers: not complete
    for e in pair.pre:
        e.push_layers("e", [3])
    done, failed, released = pair.run(lambda d, f, r: d)
    assert done == ["e"] and not failed
    assert pair.dc.verify(kv, d_blocks, 0, ntok) == 0
    for e in pair.pre:
        e.push_finish("e")  # comes after the forward pass: nothing left to do, no error
        with pytest.raises(ValueError):  # closed (and perhaps already released by poll)
            e.push_layers("e", [0])
    if len(released) < 2:
        _, failed, more = pair.run(lambda d, f, r: len(released) + len(r) == 2)
        released += more
    assert not failed and len(released) == 2 and {r.reason for r in released} == {"written"}
    assert [e.stats.notifications_sent for e in pair.pre] == [1, 1]


def test_a_push_the_prefill_gives_up_fails_on_the_decode_side_at_once():
    """A prefill rank that cannot write (here: the target names a block the decode engine does
    not have) tells the decode ranks it feeds; they fail the request long before their
    transfer timeout, and a FAILED notification that comes before ``expect`` counts too."""
    pair = Pair(replace(PUSH, transfer_timeout_s=120.0))
    pair.dec.serve()
    try:
        _fill(pair, [2], seed=4)
        pair.dec.expect("bad", "prefill", pair.p_spec.tp_size, "tok-bad", ([1],))
        for e in pair.pre:
            e.push("bad", ([2],), _target(pair, "bad", [NB + 5]))
            e.push("early", ([2],), _target(pair, "early", [NB + 5]))
        _, failed, released = pair.run(lambda d, f, r: f and len(r) == 2 * len(pair.pre), timeout=30)
        assert [(f.request_id, f.kind) for f in failed] == [("bad", FailureKind.TRANSFER)]
        assert "gave the push up" in failed[0].message and failed[0].invalid_block_ids == (1,)
        assert {(r.request_id, r.reason) for r in released} == {("bad", "push-failed"), ("early", "push-failed")}
        pair.dec.expect("early", "prefill", pair.p_spec.tp_size, "tok-early", ([3],))
        _, failed, _ = pair.run(lambda d, f, r: f, timeout=5)
        assert [f.request_id for f in failed] == ["early"]
    finally:
        pair.close()


def test_a_failed_notice_for_a_written_part_or_with_a_wrong_token_changes_nothing():
    """FAILED from a rank whose part already arrived never retracts it, and one without the
    request's token is ignored (counted): the request completes with every byte."""
    pair = Pair(PUSH)
    pair.dec.serve()
    try:
        kv = _fill(pair, [2], seed=5)
        pair.dec.expect("a", "prefill", pair.p_spec.tp_size, "tok-a", ([1],))
        first, second = pair.pre
        first.push("a", ([2],), _target(pair, "a", [1]))
        end = time.monotonic() + 10
        while pair.dec.tracker.get("a").outstanding != {1} and time.monotonic() < end:
            assert not pair.dec.poll().failed
            first.poll()
            time.sleep(0.002)
        assert pair.dec.tracker.get("a").outstanding == {1}  # rank 0 wrote, rank 1 not yet
        decode_agent = first.peers.get("decode").agents[0]
        for rank, token in ((0, "tok-a"), (1, "forged")):
            first.agent.notify(decode_agent, encode_notification(Notification(Kind.FAILED, "a", 2, rank, token)))
        end = time.monotonic() + 10
        while pair.dec.stats.notifications_bad_token == 0 and time.monotonic() < end:
            assert not pair.dec.poll().failed
            time.sleep(0.002)
        assert pair.dec.stats.notifications_bad_token == 1
        second.push("a", ([2],), _target(pair, "a", [1]))
        done, failed, _ = pair.run(lambda d, f, r: d or f)
        assert done == ["a"] and failed == []
        assert pair.dc.verify(kv, [1], 0, 16) == 0
    finally:
        pair.close()


def _spy_notify(monkeypatch, engines):
    """Record the prefill agents' separate notify() calls (the real call still happens)."""
    calls: list[bytes] = []
    for e in engines:
        real = e.agent.notify

        def spy(peer, message, real=real):
            calls.append(message)
            real(peer, message)

        monkeypatch.setattr(e.agent, "notify", spy)
    return calls


def _layered_push_in_two_batches(pair, rid, seed):
    d_blocks, p_blocks = [1, 6], [4, 3]
    kv = _fill(pair, p_blocks, seed=seed)
    ntok = len(p_blocks) * pair.p_spec.block_size
    pair.dec.expect(rid, "prefill", pair.p_spec.tp_size, "tok-" + rid, (d_blocks,))
    for e in pair.pre:
        e.push_start(rid, (p_blocks,), _target(pair, rid, d_blocks))
        e.push_layers(rid, [0, 1])
    _wait_written(pair, lambda: pair.dc.verify(kv, d_blocks, 0, ntok, layers=[0, 1]) == 0)
    assert _drain(pair, 0.2)[0] == []
    for e in pair.pre:
        e.push_layers(rid, [2, 3])
    done, failed, released = pair.run(lambda d, f, r: d and len(r) == 2)
    assert done == [rid] and not failed and {r.reason for r in released} == {"written"}
    assert pair.dc.verify(kv, d_blocks, 0, ntok) == 0
    assert [e.stats.notifications_sent for e in pair.pre] == [1, 1]
    assert pair.dec.stats.notifications_received == 2 and pair.dec.stats.notifications_unknown == 0


def test_the_last_writes_carry_the_notifications_when_the_earlier_ones_completed(pair, monkeypatch):
    """Decode is told by NIXL as the last batch's WRITEs complete: no separate notify call."""
    calls = _spy_notify(monkeypatch, pair.pre)
    _layered_push_in_two_batches(pair, "n", seed=41)
    assert calls == []


def test_the_notifications_are_sent_apart_when_an_earlier_write_was_not_seen_complete(pair, monkeypatch):
    calls = _spy_notify(monkeypatch, pair.pre)
    for e in pair.pre:
        monkeypatch.setattr(e.mode, "_all_written", lambda p: False)
    _layered_push_in_two_batches(pair, "m", seed=43)
    assert len(calls) == 2  # one WRITTEN per prefill rank, each sent once


def test_carried_notifications_are_not_sent_again_when_poll_sees_the_writes_complete(monkeypatch):
    """Without background checking (complete_in_background_s 0) the last WRITEs' completion is
    seen by the worker's notify job or by poll(): neither sends the WRITTEN notices again."""
    p = Pair(replace(PUSH, complete_in_background_s=0.0), p_spec=replace(P, num_layers=4),
             d_spec=replace(D, num_layers=4))
    p.dec.serve()
    try:
        calls = _spy_notify(monkeypatch, p.pre)
        _layered_push_in_two_batches(p, "c", seed=47)
        assert calls == []
    finally:
        p.close()
