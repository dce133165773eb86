"""Prefill and decode engines on two hosts (network namespaces), UCX over TCP between them.

The prefill processes run in one namespace, the decode processes in another; each engine
serves its side channel on its host's address (10.77.0.1 / 10.77.0.2), and UCX may use TCP
only (``UCX_TLS=tcp``): no shared memory, no CMA. Each case checks every received byte on
every decode rank, that the bytes crossed the link between the hosts (the decode host's
link received at least as many bytes as the engines moved: with shared memory or CMA they
would not), and that UCX's endpoints used ``tcp`` on that link and nothing else.
"""

from __future__ import annotations

import random
import time

import pytest
from netns_cluster import NetnsCluster, check_transports, spec_pair, ucx_env

from kvbridge.nixl import AgentConfig, EngineConfig

pytestmark = pytest.mark.timeout(300)

# the demo's geometry (kvbridge demo: 8 KV heads of 128, bf16, 16-token blocks), 4 layers
GEOMETRY = dict(kv_heads=8, head_dim=128, layers=4)
NB = 96  # blocks per rank


def _batch(rng: random.Random, n: int, blocks: int, block_size: int) -> list[tuple]:
    """``n`` requests of ``blocks`` blocks each, on scattered blocks (different on the two
    sides); the last one's final block partly filled."""
    p_pool, d_pool = rng.sample(range(NB), n * blocks), rng.sample(range(NB), n * blocks)
    out = []
    for i in range(n):
        ntok = blocks * block_size - (block_size // 2 if i == n - 1 else 0)
        out.append((f"req-{i}", 100 + i, p_pool[i * blocks:(i + 1) * blocks],
                    d_pool[i * blocks:(i + 1) * blocks], ntok))
    return out


MATRIX = [  # id, mode, prefill TP, decode TP
    ("pull-P2-D1", "pull", 2, 1),
    ("pull-P1-D2", "pull", 1, 2),
    ("push-P2-D1", "push", 2, 1),
]


@pytest.mark.parametrize(("mode", "ptp", "dtp"), [m[1:] for m in MATRIX], ids=[m[0] for m in MATRIX])
def test_demo_shapes_across_hosts(hosts, tmp_path, mode, ptp, dtp):
    phost, dhost = hosts
    p, d = spec_pair(prefill_tp=ptp, decode_tp=dtp, **GEOMETRY)
    config = EngineConfig(agent=AgentConfig(num_threads=2), mode=mode, handshake_timeout_s=20.0,
                          transfer_timeout_s=120.0)
    batch = _batch(random.Random(ptp * 10 + dtp), 5, 16, p.block_size)
    with NetnsCluster(p, d, prefill_host=phost, decode_host=dhost, env=ucx_env(tmp_path),
                      num_blocks=NB, config=config) as c:
        assert (c.prefill.host, c.decode.host) == (phost.address, dhost.address)
        rx0, _ = dhost.link_bytes()
        # the first request alone (it pays the handshake), then the rest together
        rid, seed, pb, db, ntok = batch[0]
        c.submit(rid, seed, pb, db, num_tokens=ntok)
        c.wait([rid], timeout=120, released=True)
        for _, seed, pb, _, ntok in batch[1:]:
            c.fill(seed, pb, ntok)
        c.submit_batch(batch[1:])
        res = c.wait([b[0] for b in batch], timeout=120, released=True)
        rx1, _ = dhost.link_bytes()
        mover = c.decode if mode == "pull" else c.prefill
        moved = sum(s.bytes for s, _ in c.rank_stats(mover).values())
        dcounts = [counts for _, counts in c.rank_stats(c.decode).values()]
    reason = "notified" if mode == "pull" else "written"
    for rid, r in res.items():
        assert not r.failed, (rid, r.failed)
        assert set(r.done) == set(range(dtp)), rid
        assert r.mismatches == 0 and all(v == 0 for v in r.done.values()), (rid, r.done)
        assert set(r.released) == set(range(ptp)) and set(r.released.values()) == {reason}, (rid, r.released)
    assert all(counts["transfers"] == 0 for counts in dcounts)
    print(f"{mode} TP {ptp} -> {dtp}: {len(batch)} requests, {moved / 2**20:.1f} MiB moved, "
          f"{(rx1 - rx0) / 2**20:.1f} MiB received on {dhost.name}:{dhost.dev}")
    assert moved > 0 and rx1 - rx0 >= moved
    check_transports(tmp_path, dhost)


# short timeouts: a request whose bytes cannot arrive fails after 6 s; its blocks stay held
# on the prefill side until the lease lapses
FAST = EngineConfig(agent=AgentConfig(num_threads=1), lease_s=6.0, renew_interval_s=2.0,
                    handshake_timeout_s=4.0, transfer_timeout_s=6.0)


def _ended_within(c: NetnsCluster, rids: list[str], bound: float) -> dict:
    """Wait for every request of ``rids`` to end (done or failed); the harness raises when one
    is still running after ``bound`` seconds (a hang)."""
    return c.wait(rids, timeout=bound)


def _failed_with_blocks(r, d_blocks: list[int], ranks: int) -> None:
    assert set(r.failed) == set(range(ranks)), (r.request_id, r.failed, r.done)
    for kind, blocks, message in r.failed.values():
        assert kind == "timeout", (r.request_id, kind, message)
        assert sorted(blocks) == sorted(d_blocks), (r.request_id, blocks)


def test_link_down_and_back(hosts, tmp_path):
    """The prefill host's link goes down (``ip link set eth0 down``): requests posted while it
    is down, and requests in flight when it goes down, end within their timeout (failed with
    all their blocks, or complete with every byte right), nothing hangs and no transfer handle
    stays behind; once the link is back, new requests complete."""
    phost, dhost = hosts
    p, d = spec_pair(prefill_tp=2, decode_tp=1, **GEOMETRY)
    bound = FAST.transfer_timeout_s + 10
    with NetnsCluster(p, d, prefill_host=phost, decode_host=dhost, env=ucx_env(tmp_path),
                      num_blocks=256, config=FAST) as c:
        c.submit("warm", seed=1, p_blocks=[0, 1], d_blocks=[0, 1])
        assert c.wait(["warm"], timeout=60, released=True)["warm"].ok

        # posted while the link is down: every one fails, reporting all its blocks
        phost.set_link(False)
        down = [(f"down-{i}", 10 + i, list(range(2 + 16 * i, 18 + 16 * i))) for i in range(2)]
        t0 = time.monotonic()
        for rid, seed, blocks in down:
            c.submit(rid, seed, blocks, blocks)
        res = _ended_within(c, [r[0] for r in down], bound)
        failed_after = time.monotonic() - t0
        for rid, _, blocks in down:
            _failed_with_blocks(res[rid], blocks, d.tp_size)
        phost.set_link(True)

        # back up: the same engines move a request again
        c.submit("back", seed=20, p_blocks=list(range(40, 56)), d_blocks=list(range(40, 56)))
        assert c.wait(["back"], timeout=60, released=True)["back"].ok

        # in flight when the link goes down (the prefill host sends at 200 Mbit/s, so the
        # batch's 40 MiB take about 1.7 s and the link goes down 0.3 s in): each request
        # completes (every byte right) or fails with all its blocks; some fail
        phost.limit_rate(200)
        flight = [(f"flight-{i}", 30 + i, list(range(64 + 16 * i, 80 + 16 * i)),
                   list(range(64 + 16 * i, 80 + 16 * i)), 16 * p.block_size) for i in range(10)]
        for _, seed, pb, _, ntok in flight:
            c.fill(seed, pb, ntok)
        c.submit_batch(flight)
        c.drain(0.3)
        phost.set_link(False)
        res = _ended_within(c, [f[0] for f in flight], bound)
        phost.set_link(True)
        phost.limit_rate(None)
        outcome = {"completed": 0, "failed": 0}
        for rid, _, _, db, _ in flight:
            r = res[rid]
            if r.failed:
                _failed_with_blocks(r, db, d.tp_size)
                outcome["failed"] += 1
            else:
                assert r.ok and set(r.done) == {0}, (rid, r.done)
                outcome["completed"] += 1
        assert outcome["failed"] > 0, outcome

        # after the link returns, requests complete again, every byte verified
        after = [(f"after-{i}", 60 + i, list(range(40, 56))) for i in range(3)]
        for rid, seed, blocks in after:
            c.submit(rid, seed, blocks, blocks)
            assert c.wait([rid], timeout=60, released=True)[rid].ok
        # the prefill side let go of every request: the failed ones by lease expiry at the latest
        rids = ["warm", *(r[0] for r in down), "back", *(f[0] for f in flight), *(r[0] for r in after)]
        deadline = time.monotonic() + FAST.lease_s + 15
        while not all(c.released(r) for r in rids) and time.monotonic() < deadline:
            c.drain(0.2)
        assert [r for r in rids if not c.released(r)] == []
        dstats = c.rank_stats(c.decode)
        pstats = c.rank_stats(c.prefill)
    assert all(counts["transfers"] == 0 for _, counts in dstats.values())
    assert all(counts["transfers"] == 0 and s.requests_released == len(rids) for s, counts in pstats.values())
    handshakes = sum(s.handshakes for s, _ in dstats.values())
    late = sum(s.late_transfers for s, _ in dstats.values())
    late_errors = sum(s.late_errors for s, _ in dstats.values())
    print(f"link down: {len(down)} requests posted while down failed after {failed_after:.1f} s "
          f"(transfer_timeout_s {FAST.transfer_timeout_s}); in flight when it went down: {outcome}; "
          f"READs that completed after their request failed (late): {late}, that ended in error "
          f"then: {late_errors}; handshakes in all: {handshakes}")
    check_transports(tmp_path, dhost)
