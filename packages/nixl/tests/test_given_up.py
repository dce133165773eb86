"""A request the decode engine gives up (here: timed out while its handshake ran) must
never be read into afterwards: its blocks are back with the serving engine, which
recomputes them or hands them to another request. Real NIXL agents, in one process."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pytest
from test_engine import CFG, P, Pair

from kvbridge.nixl import FailureKind, NixlError
from kvbridge.tools.synthetic_cache import logical_kv

pytestmark = pytest.mark.timeout(120)

HANDSHAKE_DELAY_S = 1.0


def _slow_handshake(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode engine's loading of a peer's agent takes HANDSHAKE_DELAY_S longer."""
    agent = pair.dec.agent
    add_remote = agent.add_remote

    def slow(metadata: bytes) -> str:
        time.sleep(HANDSHAKE_DELAY_S)
        return add_remote(metadata)

    monkeypatch.setattr(agent, "add_remote", slow)


def test_a_load_timed_out_during_its_handshake_is_never_read_into(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="kvbridge.nixl")
    pair = Pair(replace(CFG, transfer_timeout_s=0.3, handshake_timeout_s=10))
    try:
        _slow_handshake(pair, monkeypatch)
        posts = []
        post = pair.dec.agent.post
        monkeypatch.setattr(pair.dec.agent, "post", lambda x: posts.append(x) or post(x))
        pair.dc.clear([4, 5])
        pair.dec.load("a", pair.hold("a", [3, 1]), ([4, 5],))
        t0 = time.monotonic()
        _, failed, _ = pair.run(lambda d, f, r: f)
        assert [(f.request_id, f.kind) for f in failed] == [("a", FailureKind.TIMEOUT)]
        assert sorted(failed[0].invalid_block_ids) == [4, 5]
        assert time.monotonic() - t0 < HANDSHAKE_DELAY_S  # given up before the handshake ended
        # the handshake completes after the request was given up ...
        pair.run(lambda d, f, r: pair.dec.stats.handshakes == 1)
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            assert pair.dec.poll().done == []
            time.sleep(0.005)
        # ... and nothing was read into the request's blocks (still zero)
        assert all(int(t[[4, 5]].abs().sum()) == 0 for t in pair.dc.regions)
        assert pair.dc.verify(logical_kv(P, 1, 32), [4, 5], 0, 32) > 0
        assert posts == []
        assert pair.dec.stats.posts == 0
        assert [r.getMessage() for r in caplog.records if "nothing was read" in r.getMessage()] == [
            "request a was given up before its READs were posted; nothing was read into its blocks"]
        assert pair.dec.resource_counts()["transfers"] == 0
        # the peer itself is fine: the next request is read and lands
        monkeypatch.setattr(pair.dec.agent, "post", post)
        pair.dec.load("b", pair.hold("b", [2], seed=2), ([6],))
        done, failed, _ = pair.run(lambda d, f, r: d or f)
        assert done == ["b"] and not failed
        assert pair.dc.verify(logical_kv(P, 2, 16), [6], 0, 16) == 0
    finally:
        pair.close()


def test_a_load_timed_out_while_its_reads_were_built_is_never_read_into(monkeypatch, caplog):
    """The worker checks again, holding the agent, between building the READs and posting
    them: a request poll() gave up meanwhile is not posted, and what was built is released."""
    caplog.set_level(logging.INFO, logger="kvbridge.nixl")
    pair = Pair(replace(CFG, transfer_timeout_s=0.3))
    try:
        pair.dec.load("warm", pair.hold("warm", [2]), ([3],))  # handshake done beforehand
        pair.run(lambda d, f, r: d == ["warm"])
        mode = pair.dec.mode
        build = mode._build

        def slow_build(*args):
            took = build(*args)
            time.sleep(0.6)  # past the request's deadline, the agent not held
            return took

        monkeypatch.setattr(mode, "_build", slow_build)
        pair.dc.clear([4, 5])
        pair.dec.load("a", pair.hold("a", [3, 1]), ([4, 5],))
        _, failed, _ = pair.run(lambda d, f, r: f)
        assert [(f.request_id, f.kind) for f in failed] == [("a", FailureKind.TIMEOUT)]
        pair.run(lambda d, f, r: any("nothing was read" in rec.getMessage() for rec in caplog.records))
        assert all(int(t[[4, 5]].abs().sum()) == 0 for t in pair.dc.regions)
        assert pair.dec.stats.posts == 1  # "warm" alone
        assert pair.dec.resource_counts()["transfers"] == 0  # the built READs were released
    finally:
        pair.close()


def test_reads_posted_just_before_the_timeout_are_given_up_with_the_request(monkeypatch):
    """The worker posted the READs, but poll() gives the request up before it applies the
    posting event (here the event is held back 1 s). The request's failure must take the
    READs with it: kept while in progress, and counted late when they then complete."""
    pair = Pair(replace(CFG, transfer_timeout_s=0.3))
    try:
        pair.dec.load("warm", pair.hold("warm", [2]), ([3],))
        pair.run(lambda d, f, r: d == ["warm"])
        base = pair.dec.resource_counts()
        agent, dec = pair.dec.agent, pair.dec
        state = agent.state
        in_progress = [True]
        monkeypatch.setattr(agent, "state", lambda x: "PROC" if in_progress[0] else state(x))
        report = dec.report

        def late_report(event):
            time.sleep(1.0)
            report(event)

        monkeypatch.setattr(dec, "report", late_report)
        dec.load("a", pair.hold("a", [3, 1]), ([4, 5],))
        _, failed, _ = pair.run(lambda d, f, r: f)
        assert [(f.request_id, f.kind) for f in failed] == [("a", FailureKind.TIMEOUT)]
        assert dec.resource_counts()["transfers"] == base["transfers"] + P.tp_size  # kept
        assert dec.resource_counts()["kept_transfers"] == P.tp_size and base["kept_transfers"] == 0
        in_progress[0] = False  # the READs complete, after the request was given up
        time.sleep(1.2)  # the posting event arrives meanwhile
        pair.run(lambda d, f, r: dec.stats.late_transfers == P.tp_size, timeout=5)
        assert dec.resource_counts() == base
    finally:
        pair.close()


class _KeptAgent:
    """The two calls :class:`Abandoned` makes, for a transfer it keeps: ``state`` reports
    ``ending`` once ended (and raises NixlError once the agent is closed)."""

    def __init__(self) -> None:
        self.ending: str | None = None
        self.closed = False

    def state(self, x) -> str:
        if self.closed:
            raise NixlError("NIXL agent 'decode' is closed")
        return self.ending or "PROC"

    def release_transfer(self, x) -> bool:
        x.released = True
        return True


@pytest.mark.parametrize(("ending", "late", "errors"), [("DONE", 1, 0), ("ERR", 0, 1), ("closed", 0, 0)])
def test_a_kept_transfer_is_counted_by_how_it_ended(ending, late, errors, caplog):
    """Kept while in progress; then released and counted: completed late, ended in error late,
    or neither when the agent was closed meanwhile (nothing is known of it then)."""
    from types import SimpleNamespace

    from kvbridge.nixl.abandoned import Abandoned
    from kvbridge.nixl.stats import Stats

    agent, stats = _KeptAgent(), Stats()
    kept = Abandoned(agent, stats)  # type: ignore[arg-type]
    x = SimpleNamespace(released=False, op="READ", peer="prefill/p0")
    kept.drop([x])
    kept.sweep()
    assert len(kept) == 1 and not x.released  # in progress: kept
    agent.closed, agent.ending = ending == "closed", None if ending == "closed" else ending
    with caplog.at_level(logging.WARNING, logger="kvbridge.nixl"):
        kept.sweep()
    assert len(kept) == 0 and x.released
    assert (stats.late_transfers, stats.late_errors) == (late, errors)
    assert len(caplog.records) == late + errors
