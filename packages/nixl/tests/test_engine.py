"""Engine behaviour with real NIXL agents (UCX, host memory) and real ZMQ, in one process.

Cross-process behaviour (killed peers, real TP layouts per process) is in the
repository's top-level tests/.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import replace

import pytest

from kvbridge.memory import huge_page_bytes, huge_page_size, kernel_spec
from kvbridge.nixl import (
    AgentConfig,
    DecodeEngine,
    EngineConfig,
    FailureKind,
    PrefillEngine,
    TransferParams,
)
from kvbridge.tools.local_ranks import LocalRanks
from kvbridge.tools.synthetic_cache import SyntheticCache, logical_kv
from kvbridge.topology import EngineSpec, kernel_block_ids, plan_transfer

pytestmark = pytest.mark.timeout(120)

P = EngineSpec("prefill", 2, 4, 16, 2, 16)
D = EngineSpec("decode", 1, 4, 16, 2, 16)
NB = 16
CFG = EngineConfig(agent=AgentConfig(num_threads=0), lease_s=30, handshake_timeout_s=2,
                   transfer_timeout_s=10)



def poll_round(engine):
    """``engine.poll()``, with its round surely run: ``poll()`` skips the round while the
    worker thread is inside a NIXL call (idle progress, a transfer check). The agent's lock
    is reentrant, so holding it here waits that call out and keeps the worker off."""
    with engine.agent.turn():
        return engine.poll()


class Pair:
    """A decode engine (TP 1, not served) and a prefill engine in this process."""

    def __init__(self, cfg: EngineConfig = CFG, p_spec: EngineSpec = P, d_spec: EngineSpec = D):
        self.cfg = cfg
        self.p_spec = p_spec
        decode = LocalRanks.start("d", d_spec, [0], NB, cfg, serve=False)
        self.dc, self.dec = decode.caches[0], decode.engines[0]
        self.start_prefill()

    def start_prefill(self, port=0):
        self.prefill = LocalRanks.start("p", self.p_spec, range(self.p_spec.tp_size), NB, self.cfg, port=port)
        self.pc = list(self.prefill.caches.values())
        self.pre = list(self.prefill.engines.values())

    def fill(self, kv, blocks):
        """Write ``kv`` into the prefill caches' logical ``blocks`` (their kernel blocks)."""
        self.prefill.fill(kv, blocks)

    def stop_prefill(self):
        for e in self.pre:
            e.close()

    def hold(self, rid, blocks, seed=1, token=None):
        kv = logical_kv(self.p_spec, seed, len(blocks) * self.p_spec.block_size)
        self.fill(kv, blocks)
        params = self.pre[0].hold(rid, (blocks,), token)
        for e in self.pre[1:]:
            e.hold(rid, (blocks,), params.token)
        return params

    def run(self, until, timeout=15.0):
        done, failed, released = [], [], []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ev = self.dec.poll()
            done += ev.done
            failed += ev.failed
            for e in self.pre:
                if not e._closed:
                    released += e.poll()
            if until(done, failed, released):
                return done, failed, released
            time.sleep(0.001)
        raise TimeoutError(f"done={done} failed={failed} released={released}")

    def close(self):
        self.dec.close()
        self.stop_prefill()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_pull_verifies_and_releases(pair):
    params = pair.hold("a", [3, 1, 7])
    pair.dec.load("a", params, ([9, 10, 2],))
    done, failed, released = pair.run(lambda d, f, r: len(d) == 1 and len(r) == 2)
    assert done == ["a"] and not failed
    assert {(r.request_id, r.reason) for r in released} == {("a", "notified")}
    assert pair.dc.verify(logical_kv(P, 1, 48), [9, 10, 2], 0, 48) == 0


def test_handshake_log_says_where_the_worker_threads_time_went(pair, caplog):
    """The handshake's log line splits the agents phase into load and connect and gives the
    worker thread's CPU time, preemptions and waits per phase (to tell a busy core from a wait)."""
    caplog.set_level(logging.INFO, logger="kvbridge.nixl")
    pair.dec.load("a", pair.hold("a", [3, 1]), ([9, 10],))
    done, failed, _ = pair.run(lambda d, f, r: d == ["a"] and len(r) == 2)
    assert done == ["a"] and not failed
    (line,) = [r.getMessage() for r in caplog.records if "handshake with engine" in r.getMessage()]
    m = re.search(r"agents ([0-9.]+) ms, .*agents: load ([0-9.]+) ms, connect ([0-9.]+) ms; worker "
                  r"thread per phase \(metadata/agents/lists\): CPU ([0-9.]+)/([0-9.]+)/([0-9.]+) ms, "
                  r"waiting for a CPU [0-9.]+/[0-9.]+/[0-9.]+ ms, "
                  r"preempted \d+/\d+/\d+, blocked \d+/\d+/\d+ times", line)
    assert m, line
    agents, load, connect = (float(m.group(i)) for i in (1, 2, 3))
    assert load + connect == pytest.approx(agents, abs=0.2)
    assert sum(float(m.group(i)) for i in (4, 5, 6)) > 0  # the thread did run


def test_reads_posted_on_the_callers_thread():
    """post_in_background=False: the READs are built and posted by load() (peer ready) or by the
    poll() that applies the handshake (peer new)."""
    pair = Pair(replace(CFG, post_in_background=False))
    try:
        pair.dec.load("a", pair.hold("a", [3, 1]), ([9, 10],))  # new peer: posted once handshaken
        done, failed, _ = pair.run(lambda d, f, r: d == ["a"] and len(r) == 2)
        assert not failed
        pair.dec.load("b", pair.hold("b", [5], seed=2), ([4],))  # peer ready: posted inside load()
        assert pair.dec.stats.posts == 2
        done, failed, _ = pair.run(lambda d, f, r: d == ["b"] and len(r) == 2)
        assert not failed and pair.dec.stats.handshakes == 1
        assert pair.dc.verify(logical_kv(P, 1, 32), [9, 10], 0, 32) == 0
        assert pair.dc.verify(logical_kv(P, 2, 16), [4], 0, 16) == 0
    finally:
        pair.close()


@pytest.mark.parametrize("seconds", [0.5, 0.0])
def test_the_posting_thread_checks_its_reads(monkeypatch, seconds):
    """complete_in_background_s > 0: the worker that posted a READ checks it (each check lets
    NIXL progress, and the first check that sees it done times it) before any poll(); with 0
    only poll() checks it."""
    pair = Pair(replace(CFG, complete_in_background_s=seconds))
    try:
        pair.dec.load("warm", pair.hold("warm", [2]), ([3],))
        pair.run(lambda d, f, r: "warm" in d and len(r) == 2)
        callers: list[str] = []
        real_state = pair.dec.agent.state

        def spy(x):
            callers.append(threading.current_thread().name)
            return real_state(x)

        monkeypatch.setattr(pair.dec.agent, "state", spy)
        pair.dec.load("a", pair.hold("a", [1, 4], seed=3), ([6, 7],))
        t_end = time.monotonic() + 10
        while pair.dec._events.empty() and time.monotonic() < t_end:  # the worker's "posted" event
            time.sleep(0.001)
        assert not pair.dec._events.empty(), "the worker never posted the READs"
        t_end = time.monotonic() + (10 if seconds else 0.3)
        while not callers and time.monotonic() < t_end:  # no poll() runs meanwhile
            time.sleep(0.001)
        assert bool(callers) is (seconds > 0), callers
        assert all(name.startswith("kvbridge-handshake") for name in callers)
        done, failed, _ = pair.run(lambda d, f, r: d == ["a"] and len(r) == 2)
        assert not failed
        assert pair.dc.verify(logical_kv(P, 3, 32), [6, 7], 0, 32) == 0
    finally:
        pair.close()


def test_requests_wait_for_the_handshake_and_fail_with_it(pair):
    dead = TransferParams("ghost", "127.0.0.1", 1, 2, ((1, 2),), "tok")
    pair.dec.load("x", dead, ([4, 5],))
    pair.dec.load("y", dead, ([6],))
    assert pair.dec.pending == 2  # load() returned at once; the handshake runs in the background
    _, failed, _ = pair.run(lambda d, f, r: len(f) == 2)
    assert {f.request_id: f.invalid_block_ids for f in failed} == {"x": (4, 5), "y": (6,)}
    assert all(f.kind is FailureKind.HANDSHAKE for f in failed)
    assert pair.dec.resource_counts()["remote_agents"] == 0


def test_wrong_token_notification_is_ignored(pair):
    params = pair.hold("a", [1])
    pair.dec.load("a", replace(params, token="not-the-token"), ([2],))
    done, _, released = pair.run(lambda d, f, r: len(d) == 1)
    time.sleep(0.2)
    for e in pair.pre:
        released += e.poll()
    assert released == []  # nothing freed by a notification carrying the wrong token
    assert all(e.stats.notifications_bad_token == 1 and e.held == 1 for e in pair.pre)


def test_lease_expires_when_decode_never_reads():
    pair = Pair(replace(CFG, lease_s=0.3))
    try:
        pair.hold("a", [1, 2])
        _, _, released = pair.run(lambda d, f, r: len(r) == 2, timeout=5)
        assert {(r.request_id, r.reason, r.block_ids) for r in released} == {("a", "lease-expired", (1, 2))}
        assert all(e.stats.leases_expired == 1 for e in pair.pre)
    finally:
        pair.close()


def test_decode_renews_the_lease_while_a_transfer_is_slow(monkeypatch):
    pair = Pair(replace(CFG, lease_s=0.5, renew_interval_s=0.1))
    try:
        pair.dec.load("warm", pair.hold("warm", [2]), ([3],))
        pair.run(lambda d, f, r: "warm" in d and len(r) == 2)
        # the READ of "a" is held back and looks in progress for 1.5 s (three leases)
        monkeypatch.setattr(pair.dec.agent, "post", lambda x: "PROC")
        monkeypatch.setattr(pair.dec.agent, "state", lambda x: "PROC")
        params = pair.hold("a", [1])
        pair.dec.load("a", params, ([4],))
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            assert pair.dec.poll().failed == []
            for e in pair.pre:
                assert e.poll() == [], "the lease lapsed although the decode side renewed it"
            time.sleep(0.005)
        assert all(e.stats.leases_renewed >= 5 for e in pair.pre)
        assert all(e.held == 1 for e in pair.pre)
    finally:
        pair.close()


def test_prefill_restart_triggers_a_new_handshake(pair):
    pair.dec.load("a", pair.hold("a", [1]), ([1],))
    pair.run(lambda d, f, r: d == ["a"])
    old_agents = set(pair.dec.agent.remote_agents)
    pair.stop_prefill()
    pair.start_prefill()  # same engine id, new incarnation, new port, new agents
    pair.dec.load("b", pair.hold("b", [2], seed=2), ([5],))
    done, failed, _ = pair.run(lambda d, f, r: d or f)
    assert done == ["b"] and not failed
    assert pair.dc.verify(logical_kv(P, 2, 16), [5], 0, 16) == 0
    assert pair.dec.stats.handshakes == 2 and pair.dec.stats.stale_agents_dropped == 1
    assert not (old_agents & set(pair.dec.agent.remote_agents))


def test_prefill_restart_on_the_same_port_is_found_by_incarnation(pair):
    """Same engine id, host and port, new incarnation: only TransferParams.incarnation tells."""
    pair.dec.load("a", pair.hold("a", [1]), ([1],))
    pair.run(lambda d, f, r: d == ["a"])
    address, old_inc = pair.pre[0].address, pair.pre[0].incarnation
    old_agents = set(pair.dec.agent.remote_agents)
    pair.stop_prefill()
    pair.start_prefill(port=address[1])
    params = pair.hold("b", [2], seed=2)
    assert (params.host, params.port) == address and params.incarnation != old_inc
    pair.dec.load("b", params, ([5],))
    done, failed, _ = pair.run(lambda d, f, r: d or f)
    assert done == ["b"] and not failed
    assert pair.dc.verify(logical_kv(P, 2, 16), [5], 0, 16) == 0
    assert pair.dec.stats.handshakes == 2 and pair.dec.stats.stale_agents_dropped == 1
    assert not (old_agents & set(pair.dec.agent.remote_agents))
    assert pair.dec.resource_counts()["remote_agents"] == 2


def test_a_handshake_superseded_by_a_restart_leaves_nothing_behind(pair):
    """The prefill engine restarts on the same host and port while the decode rank's handshake
    with the old incarnation has finished but not been applied: the superseded peer is dropped
    through the one drop path, so its agents, lists and descriptors are all released."""
    address = pair.pre[0].address
    pair.dec.prepare(pair.hold("a", [1]))  # handshake with the old incarnation, on the worker
    entered, gate = threading.Event(), threading.Event()

    def stall():
        entered.set()
        gate.wait(10)

    pair.dec._worker.submit(stall)  # runs after that handshake; poll() has not applied it yet
    assert entered.wait(10)
    old = pair.dec.peers.get("prefill")
    assert old.handshaked and not old.error and old.local_lists  # it prepared its lists
    pair.stop_prefill()
    pair.start_prefill(port=address[1])  # same host and port, new incarnation
    params = pair.hold("b", [2], seed=2)
    pair.dec.load("b", params, ([5],))  # supersedes the old incarnation's peer
    gate.set()
    done, failed, _ = pair.run(lambda d, f, r: d or f)
    assert done == ["b"] and not failed
    assert pair.dc.verify(logical_kv(P, 2, 16), [5], 0, 16) == 0
    counts = pair.dec.resource_counts()
    # one local and one remote list per prefill rank, for the new incarnation only
    assert (counts["lists"], counts["remote_agents"], counts["peers"]) == (2 * P.tp_size, P.tp_size, 1)
    assert not old.local_lists and not old.remote_lists and not old.descs and not old.agents


@pytest.mark.parametrize("ending", ["completes", "errs"])
def test_a_read_that_never_completes_times_out_and_is_kept_until_it_ends(monkeypatch, ending):
    """The READ stays "PROC": the request fails at its timeout with kind timeout and its
    blocks, but the READ's handle is kept (NIXL cannot cancel a transfer in progress) and
    checked on every poll until it ends. One that then completes is counted as late (it
    wrote into blocks already handed back), one that ends in error as a late error (it may
    have written part); a release NIXL refuses is retried."""
    pair = Pair(replace(CFG, transfer_timeout_s=0.5))
    try:
        pair.dec.load("warm", pair.hold("warm", [2]), ([3],))
        pair.run(lambda d, f, r: "warm" in d and len(r) == 2)
        base = pair.dec.resource_counts()
        agent = pair.dec.agent
        real_release = agent.release_transfer
        state, refusals = ["PROC"], [1]

        def release(x):
            if refusals[0] and not x.released:
                refusals[0] -= 1
                return False
            return real_release(x)

        monkeypatch.setattr(agent, "state", lambda x: state[0])
        monkeypatch.setattr(agent, "release_transfer", release)
        pair.dec.load("a", pair.hold("a", [1, 4], seed=3), ([6, 7],))
        t0 = time.monotonic()
        done, failed, _ = pair.run(lambda d, f, r: d or f, timeout=5)
        elapsed = time.monotonic() - t0
        assert done == []
        assert [(f.request_id, f.kind, f.invalid_block_ids) for f in failed] == [
            ("a", FailureKind.TIMEOUT, (6, 7))]
        assert 0.4 <= elapsed < 3, elapsed
        assert pair.dec.stats.failures == {"timeout": 1} and pair.dec.pending == 0
        for _ in range(10):  # still in progress: both READs (one per prefill rank) are kept
            poll_round(pair.dec)
        assert pair.dec.resource_counts()["transfers"] == base["transfers"] + P.tp_size
        assert pair.dec.resource_counts()["kept_transfers"] == P.tp_size
        assert refusals == [1] and pair.dec.stats.late_transfers == pair.dec.stats.late_errors == 0
        state[0] = "DONE" if ending == "completes" else "ERR"
        poll_round(pair.dec)  # both ended; NIXL refuses one release
        assert pair.dec.resource_counts()["transfers"] == base["transfers"] + 1
        assert pair.dec.resource_counts()["kept_transfers"] == 1  # retried on the next round
        poll_round(pair.dec)
        assert pair.dec.resource_counts() == base
        assert pair.dec.stats.late_transfers == (P.tp_size if ending == "completes" else 0)
        assert pair.dec.stats.late_errors == (0 if ending == "completes" else P.tp_size)
        monkeypatch.undo()
        pair.dec.load("b", pair.hold("b", [5], seed=4), ([8],))  # the peer was not dropped
        done, failed, _ = pair.run(lambda d, f, r: d or f)
        assert done == ["b"] and not failed and pair.dec.stats.handshakes == 1
        assert pair.dec.resource_counts() == base
    finally:
        pair.close()


def test_full_prefix_hit_notifies_without_reading(pair):
    params = pair.hold("a", [1, 2])
    pair.dec.load("a", params, ((),), computed_tokens=32)
    done, _, released = pair.run(lambda d, f, r: d and len(r) == 2)
    assert done == ["a"] and pair.dec.stats.transfers == 0
    assert {r.reason for r in released} == {"notified"}


def test_bad_local_block_ids_are_refused(pair):
    with pytest.raises(ValueError, match="outside"):
        pair.dec.load("a", TransferParams("prefill", "127.0.0.1", 1, 2, ((1,),), "t"), ([NB],))


def test_remote_block_ids_out_of_range_fail_the_request(pair):
    params = pair.hold("a", [1])
    pair.dec.load("a", replace(params, block_ids=((NB + 5,),)), ([1],))
    _, failed, _ = pair.run(lambda d, f, r: f)
    assert failed[0].kind is FailureKind.POST and "outside" in failed[0].message


def test_no_growth_after_many_requests(pair):
    pair.dec.load("warm", pair.hold("warm", [0]), ([0],))
    pair.run(lambda d, f, r: d)
    base_d = pair.dec.resource_counts()
    base_p = [e.resource_counts() for e in pair.pre]
    n = 1000
    for i in range(n):
        rid = f"r{i}"
        params = pair.pre[0].hold(rid, ([i % NB],))
        pair.pre[1].hold(rid, ([i % NB],), params.token)
        pair.dec.load(rid, params, ([(i * 7) % NB],))
        if i % 50 == 49:
            pair.run(lambda d, f, r, i=i: pair.dec.pending == 0 and all(e.held == 0 for e in pair.pre))
    pair.run(lambda d, f, r: pair.dec.pending == 0 and all(e.held == 0 for e in pair.pre))
    assert pair.dec.resource_counts() == base_d
    assert [e.resource_counts() for e in pair.pre] == base_p
    assert pair.dec.stats.requests_done == n + 1 and pair.dec.stats.handshakes == 1
    assert len(pair.dec._loads) == 0 and len(pair.dec.tracker) == 0


def test_close_releases_everything():
    pair = Pair()
    pair.dec.load("a", pair.hold("a", [1]), ([1],))
    pair.run(lambda d, f, r: d)
    agent = pair.dec.agent
    pair.close()
    assert agent.closed
    assert agent.counts() == {"registrations": 0, "lists": 0, "transfers": 0, "remote_agents": 0}


def _push(pair, rid, p_blocks, d_blocks, seed, **expect_kw):
    """Fill and push ``p_blocks`` into ``d_blocks``; returns the request's KV content."""
    ntok = len(p_blocks) * pair.p_spec.block_size
    kv = logical_kv(pair.p_spec, seed, ntok)
    pair.fill(kv, p_blocks)
    host, port = pair.dec.address
    target = TransferParams("decode", host, port, 1, (tuple(d_blocks),), "tok-" + rid)
    pair.dec.expect(rid, "prefill", pair.p_spec.tp_size, "tok-" + rid, (d_blocks,), **expect_kw)
    for e in pair.pre:
        e.push(rid, (p_blocks,), target)
    return kv


def test_push_mode_in_process():
    cfg = replace(CFG, mode="push")
    pair = Pair(cfg)
    try:
        pair.dec.serve()
        kv = _push(pair, "a", [4, 5], [8, 9], seed=3)
        done, failed, released = pair.run(lambda d, f, r: d and len(r) == 2)
        assert done == ["a"] and not failed
        assert {r.reason for r in released} == {"written"}
        assert pair.dc.verify(kv, [8, 9], 0, 32) == 0
    finally:
        pair.close()


PUSH_REARRANGED = [
    # id, prefill spec, expect() keywords: every case needs the decode engine to rearrange
    ("P8tok-HND-into-D16tok-HND", replace(P, block_size=8), dict(prefill_block_size=8)),
    ("P16tok-NHD-into-D16tok-HND", replace(P, tp_size=1, head_order="NHD"),
     dict(prefill_head_order="NHD")),
    ("P16tok-kernel-split-8-into-D16tok", replace(P, kernel_blocks_per_block=2),
     dict(prefill_block_size=16, prefill_kernel_blocks_per_block=2)),
]


@pytest.mark.parametrize("p_spec,kw", [c[1:] for c in PUSH_REARRANGED], ids=[c[0] for c in PUSH_REARRANGED])
def test_push_mode_post_processes_on_the_decode_side(p_spec, kw):
    """Push into 16-token HND decode blocks holding 4 heads: the decode engine rearranges the
    received units itself, before it reports the request done (nobody else post-processes)."""
    assert plan_transfer(kernel_spec(p_spec), kernel_spec(D)).post_process.needed  # a case that needs it
    pair = Pair(replace(CFG, mode="push"), p_spec=p_spec)
    try:
        pair.dec.serve()
        n_p = 4 * 16 // p_spec.block_size
        p_blocks = [5, 0, 9, 2, 12, 7, 3, 14][:n_p]
        kv = _push(pair, "a", p_blocks, [4, 11, 1, 6], seed=8, **kw)
        done, failed, released = pair.run(lambda d, f, r: d and len(r) == p_spec.tp_size)
        assert done == ["a"] and not failed
        assert pair.dc.verify(kv, [4, 11, 1, 6], 0, 64) == 0
    finally:
        pair.close()


def test_a_failed_rearrangement_fails_the_request(monkeypatch):
    """If post-processing raises, the request is reported failed with its blocks, not done."""
    import kvbridge.nixl.decode as decode_mod

    def broken(*args, **kwargs):
        raise RuntimeError("simulated rearrangement failure")

    monkeypatch.setattr(decode_mod, "post_process", broken)
    pair = Pair(replace(CFG, mode="push"), p_spec=replace(P, block_size=8))
    try:
        pair.dec.serve()
        _push(pair, "a", [1, 2, 3, 4], [5, 6], seed=2, prefill_block_size=8)
        done, failed, _ = pair.run(lambda d, f, r: d or f)
        assert done == [] and [(f.kind, f.invalid_block_ids) for f in failed] == [(FailureKind.POST, (5, 6))]
        assert "simulated" in failed[0].message and pair.dec.pending == 0 and not pair.dec._loads
    finally:
        pair.close()


def test_push_expect_with_no_blocks_completes_and_keeps_nothing():
    pair = Pair(replace(CFG, mode="push"))
    try:
        pair.dec.expect("a", "prefill", 2, "tok", ((),))
        assert poll_round(pair.dec).done == ["a"]
        assert pair.dec.pending == 0 and not pair.dec._loads
    finally:
        pair.close()


def test_push_expect_refuses_prefill_geometry_it_cannot_plan():
    pair = Pair(replace(CFG, mode="push"))
    try:
        with pytest.raises(ValueError, match="multiple|divid"):
            pair.dec.expect("a", "prefill", 2, "tok", ([1],), prefill_block_size=12)
        with pytest.raises(ValueError, match="HND"):  # heads split across ranks need HND
            pair.dec.expect("b", "prefill", 2, "tok", ([1],), prefill_head_order="NHD")
        assert pair.dec.pending == 0
    finally:
        pair.close()


def test_kernel_split_decode_blocks_receive_every_byte():
    """Decode blocks of 32 tokens, each two 16-token kernel blocks, from 16-token prefill blocks."""
    d_split = replace(D, block_size=32, kernel_blocks_per_block=2)
    pair = Pair(d_spec=d_split)
    try:
        params = pair.hold("a", [1, 2, 6, 7], seed=4)
        pair.dec.load("a", params, ([3, 5],))
        done, failed, released = pair.run(lambda d, f, r: d and len(r) == 2)
        assert done == ["a"] and not failed
        kernel_ids = kernel_block_ids([3, 5], 2)
        assert list(kernel_ids) == [6, 7, 10, 11]
        assert pair.dc.verify(logical_kv(P, 4, 64), list(kernel_ids), 0, 64) == 0
        untouched = [b for b in range(2 * NB) if b not in set(kernel_ids)]
        assert all(int(t[untouched].count_nonzero()) == 0 for t in pair.dc.regions)
    finally:
        pair.close()


def test_block_size_mismatch_is_post_processed_by_the_engine():
    """8-token prefill blocks into 16-token HND decode blocks with 4 heads: the engine rearranges."""
    p8 = replace(P, block_size=8)
    pair = Pair(p_spec=p8)
    try:
        kv = logical_kv(p8, 7, 32)
        for c in pair.pc:
            c.fill(kv, [5, 0, 9, 2])
        params = pair.pre[0].hold("a", ([5, 0, 9, 2],))
        pair.pre[1].hold("a", ([5, 0, 9, 2],), params.token)
        pair.dec.load("a", params, ([4, 11],))
        done, failed, _ = pair.run(lambda d, f, r: d)
        assert done == ["a"] and not failed
        assert pair.dc.verify(kv, [4, 11], 0, 32) == 0
    finally:
        pair.close()


def test_unsupported_cache_shapes_are_refused_with_a_reason():
    from kvbridge.memory import MemoryLayoutError

    spec = replace(D, block_size=32, kernel_blocks_per_block=2)
    cache = SyntheticCache.allocate(D, 0, 5)  # 5 kernel blocks: not whole 2-kernel-block blocks
    with pytest.raises(MemoryLayoutError, match="kernel_blocks_per_block"):
        DecodeEngine(spec, 0, cache.cache_regions(spec), CFG)
    with pytest.raises(ValueError, match="another description"):
        DecodeEngine(spec, 0, cache.cache_regions(), CFG)
    with pytest.raises(ValueError, match="outside TP size"):
        DecodeEngine(D, 1, cache.cache_regions(), CFG)


def test_cross_layer_prefill_to_kv_first_decode():
    """Different layouts on the two sides: elements pair by (layer, K/V)."""
    from kvbridge.topology import Layout

    p_cross = replace(P, layout=Layout.BLOCKS_FIRST, cross_layer=True)
    pair = Pair(p_spec=p_cross)
    try:
        params = pair.hold("a", [6, 2, 3], seed=9)
        pair.dec.load("a", params, ([1, 12, 13],))
        done, failed, released = pair.run(lambda d, f, r: d and len(r) == 2)
        assert done == ["a"] and not failed
        assert pair.dc.verify(logical_kv(p_cross, 9, 48), [1, 12, 13], 0, 48) == 0
    finally:
        pair.close()


def test_decode_may_use_its_own_request_id(pair):
    """vLLM gives the request another id on each engine: notifications name the prefill id."""
    params = pair.hold("p-17", [3, 4], seed=5)
    assert params.request_id == "p-17"
    pair.dec.load("d-99", params, ([6, 7],))
    done, failed, released = pair.run(lambda d, f, r: d and len(r) == 2)
    assert done == ["d-99"] and not failed
    assert {(r.request_id, r.reason) for r in released} == {("p-17", "notified")}
    assert pair.dc.verify(logical_kv(P, 5, 32), [6, 7], 0, 32) == 0
    assert all(e.stats.notifications_unknown == 0 for e in pair.pre)


def test_prepare_and_renew_keep_a_queued_request_alive():
    """A request queued on the decode side (not loading yet) keeps its prefill lease."""
    pair = Pair(replace(CFG, lease_s=0.4))
    try:
        params = pair.hold("a", [1], seed=6)
        pair.dec.prepare(params)  # handshake ahead of the load
        t_end = time.monotonic() + 1.2  # three leases
        while time.monotonic() < t_end:
            pair.dec.renew(params)
            assert pair.dec.poll().done == []
            for e in pair.pre:
                assert e.poll() == [], "the lease lapsed although the decode side renewed it"
            time.sleep(0.05)
        assert pair.dec.stats.handshakes == 1 and pair.dec.stats.leases_renewed >= 4
        pair.dec.load("a", params, ([2],))
        done, failed, released = pair.run(lambda d, f, r: d and len(r) == 2)
        assert done == ["a"] and not failed and pair.dec.stats.handshakes == 1
        assert pair.dc.verify(logical_kv(P, 6, 16), [2], 0, 16) == 0
    finally:
        pair.close()


def test_release_frees_prefill_blocks_without_reporting(pair):
    params = pair.hold("a", [1, 2])
    pair.dec.release(params)
    pair.dec.release(params)  # idempotent while in flight
    _, _, released = pair.run(lambda d, f, r: len(r) == 2)
    assert {(r.request_id, r.reason) for r in released} == {("a", "notified")}
    time.sleep(0.1)
    ev = poll_round(pair.dec)
    assert ev.done == [] and ev.failed == [] and pair.dec.pending == 0
    assert pair.dec.stats.transfers == 0 and not pair.dec._silent
    with pytest.raises(ValueError, match="request_id"):
        pair.dec.release(replace(params, request_id=""))


def test_transfer_records_are_kept_on_request():
    pair = Pair(replace(CFG, record_transfers=True))
    try:
        pair.dec.load("a", pair.hold("a", [1, 2]), ([3, 4],))
        pair.run(lambda d, f, r: d and len(r) == 2)
        recs = pair.dec.take_records()
        assert len(recs) == 2  # one READ per prefill rank
        assert {r.op for r in recs} == {"READ"} and {r.peer_engine for r in recs} == {"prefill"}
        assert sum(r.bytes for r in recs) == pair.dec.stats.bytes > 0
        assert pair.dec.take_records() == []
    finally:
        pair.close()


def test_stats_count_descriptors_posted_and_merged_by_nixl():
    """Contiguous blocks on both sides: NIXL merges each region's run into one descriptor."""
    pair = Pair(p_spec=replace(P, tp_size=1))
    try:
        regions = 2 * 2  # 2 layers x K, V (kv-first)
        pair.dec.load("run", pair.hold("run", [1, 2, 3]), ([4, 5, 6],))
        pair.run(lambda d, f, r: d and r)
        s = pair.dec.stats
        assert (s.descriptors_posted, s.descriptors) == (3 * regions, regions)
        pair.dec.load("gaps", pair.hold("gaps", [7, 9, 11]), ([8, 10, 12],))
        pair.run(lambda d, f, r: "gaps" in d and r)
        assert (s.descriptors_posted, s.descriptors) == (6 * regions, 4 * regions)  # no merging
    finally:
        pair.close()


def test_compatibility_check_can_be_turned_off():
    """Engines with different model identities refuse each other unless enforce_compat is off."""
    for enforce, want_done in ((True, False), (False, True)):
        pair = Pair(replace(CFG, enforce_compat=enforce))
        try:
            pair.dec.close()
            pair.dec = DecodeEngine(D, 0, pair.dc.cache_regions(),
                                    replace(CFG, enforce_compat=enforce, model="another-model"))
            pair.dec.load("a", pair.hold("a", [1]), ([1],))
            done, failed, _ = pair.run(lambda d, f, r: d or f)
            assert bool(done) is want_done, (enforce, failed)
            if not want_done:
                assert failed[0].kind is FailureKind.HANDSHAKE and "compatib" in failed[0].message
        finally:
            pair.close()


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_packed_caches_move_head_slices(order):
    """vLLM >= 0.32 packs each head's K and V together; P TP 2 -> D TP 1 splits by heads (HND)
    and whole elements move when the TP sizes match (NHD)."""
    from kvbridge.topology import HeadOrder, Layout

    ho = HeadOrder(order)
    p_tp = 2 if ho is HeadOrder.HND else 1
    p_spec = replace(P, tp_size=p_tp, layout=Layout.PACKED, head_order=ho)
    d_spec = replace(D, layout=Layout.PACKED, head_order=ho)
    pair = Pair(p_spec=p_spec, d_spec=d_spec)
    try:
        kv = logical_kv(p_spec, 11, 40)  # 40 tokens: the last block is partial
        for c in pair.pc:
            c.fill(kv, [2, 5, 6])
        params = pair.pre[0].hold("a", ([2, 5, 6],))
        for e in pair.pre[1:]:
            e.hold("a", ([2, 5, 6],), params.token)
        pair.dec.load("a", params, ([8, 1, 3],))
        done, failed, released = pair.run(lambda d, f, r: d and len(r) == p_tp)
        assert done == ["a"] and not failed
        assert pair.dc.verify(kv, [8, 1, 3], 0, 40) == 0
        pair.dc.clear([1])
        assert pair.dc.verify(kv, [8, 1, 3], 0, 40) > 0  # the check sees a missing block
    finally:
        pair.close()


def test_engine_config_refuses_a_bad_progress_interval():
    with pytest.raises(ValueError, match="progress_interval_s"):
        EngineConfig(progress_interval_s=-0.001)
    with pytest.raises(ValueError, match="progress_interval_s"):
        EngineConfig(progress_interval_s=5)
    with pytest.raises(ValueError, match="complete_in_background_s"):
        EngineConfig(complete_in_background_s=-1)


@pytest.mark.skipif(huge_page_size() == 0, reason="no transparent huge pages on this host")
def test_host_caches_go_onto_huge_pages_before_registration():
    spec = EngineSpec("huge", 1, 8, 128, 2, 16)  # 32 KiB per block and region
    cache = SyntheticCache.allocate(spec, 0, 256)  # 8 MiB regions, 16 MiB per layer tensor
    regions = cache.cache_regions(spec)
    ranges = [(int(a), int(n)) for a, n, _ in regions.registration_descs()]
    eng = PrefillEngine(spec, 0, regions, CFG)
    try:
        res = eng.huge_pages
        assert res is not None and res.advised_bytes > 0 and not res.skipped
        if res.collapsed_bytes:  # MADV_COLLAPSE exists here: at least every whole page inside
            page = huge_page_size()
            inside = sum(max(0, (a + n) // page * page - -(-a // page) * page) for a, n in ranges)
            assert huge_page_bytes(ranges) >= inside > 0
    finally:
        eng.close()
    off = PrefillEngine(spec, 0, regions, replace(CFG, huge_pages=False))
    try:
        assert off.huge_pages is None
    finally:
        off.close()


def _assert_no_unknown_notifications(pair) -> None:
    time.sleep(0.2)
    poll_round(pair.dec)
    for e in pair.pre:
        e.poll()
        assert e.stats.notifications_unknown == 0


def test_a_renewal_ordered_with_the_load_sends_no_late_renew(pair):
    """vLLM orders a queued request's renewal and its load in the same step: the load
    renews its own lease, so no RENEW may reach the prefill after the DONE (where it would
    be an unknown request)."""
    params = pair.hold("a", [1], seed=7)
    pair.dec.load("a", params, ([2],))
    pair.dec.renew(params)  # same step, after the load
    assert pair.dec.mode._renewals == {}  # nothing queued to send after the DONE
    done, failed, released = pair.run(lambda d, f, r: d and len(r) == 2)
    assert done == ["a"] and not failed
    _assert_no_unknown_notifications(pair)
    # and a renewal that was queued before the load is dropped when the load starts
    params = pair.hold("b", [3], seed=8)
    pair.dec.renew(params)
    assert len(pair.dec.mode._renewals) == 1
    pair.dec.load("b", params, ([4],))
    assert pair.dec.mode._renewals == {}
    done, failed, released = pair.run(lambda d, f, r: d and len(r) == 2)
    assert done == ["b"] and not failed
    _assert_no_unknown_notifications(pair)
