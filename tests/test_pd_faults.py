"""Faults between real prefill and decode processes (real NIXL/UCX, real ZMQ on 127.0.0.1)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from kvbridge.nixl.agent import AgentConfig
from kvbridge.nixl.engine import EngineConfig
from kvbridge.nixl.harness import Cluster, spec_pair

pytestmark = pytest.mark.timeout(400)

FAST = EngineConfig(agent=AgentConfig(num_threads=1), lease_s=3.0, renew_interval_s=1.0,
                    handshake_timeout_s=4.0, transfer_timeout_s=8.0)


def test_lifetimes_tokens_and_no_growth():
    """Decode never reads -> lease expiry; wrong token ignored; many requests -> counts at baseline."""
    p, d = spec_pair(prefill_tp=2, decode_tp=2, head_dim=16, layers=2)
    with Cluster(p, d, num_blocks=64, config=FAST) as c:
        c.submit("warm", seed=1, p_blocks=[0, 1], d_blocks=[0, 1])
        assert c.wait(["warm"], released=True)["warm"].ok
        base_d = {r: counts for r, (_, counts) in c.rank_stats(c.decode).items()}

        # the decode engine never comes: every prefill rank frees the blocks when the lease lapses
        c.submit("never", seed=2, p_blocks=[2, 3], d_blocks=[], load=False)
        # the decode engine reads, but its notifications carry the wrong token: ignored
        params = c.submit("forged", seed=3, p_blocks=[4, 5], d_blocks=[], load=False)
        t0 = time.monotonic()
        c.load("forged", replace(params, token="0" * 32), [4, 5], seed=3, ntok=32)
        res = c.wait(["forged"], timeout=60)["forged"]
        assert res.ok  # the bytes arrived: READs need no token
        deadline = time.monotonic() + 30
        while not (c.released("never") and c.released("forged")) and time.monotonic() < deadline:
            c.drain(0.2)
        assert set(c.results["never"].released.values()) == {"lease-expired"}
        assert set(c.results["forged"].released.values()) == {"lease-expired"}
        assert time.monotonic() - t0 >= FAST.lease_s * 0.9
        pstats = c.rank_stats(c.prefill)
        assert all(s.notifications_bad_token >= 1 and s.leases_expired == 2 for s, _ in pstats.values())

        # many requests later, nothing grew on either side
        n = 120
        rids = []
        for i in range(n):
            rid = f"many-{i}"
            c.submit(rid, seed=10 + i, p_blocks=[8 + i % 50], d_blocks=[8 + (i * 7) % 50], verify=(i % 20 == 0))
            rids.append(rid)
            if i % 20 == 19:
                c.wait(rids[-20:], timeout=120, released=True)
        res = c.wait(rids, timeout=120, released=True)
        assert all(r.ok for r in res.values())
        dstats = c.rank_stats(c.decode)
        assert {r: counts for r, (_, counts) in dstats.items()} == base_d
        assert all(s.handshakes == 1 and s.requests_failed == 0 for s, _ in dstats.values())
        pstats = c.rank_stats(c.prefill)
        assert all(counts["transfers"] == 0 for _, counts in pstats.values())
        assert all(s.requests_released == n + 3 for s, _ in pstats.values())


def test_prefill_killed_then_restarted():
    """A dead prefill fails requests (invalid blocks reported, no hang); a restarted one is found again."""
    p, d = spec_pair(prefill_tp=2, decode_tp=1, head_dim=64, layers=4)
    with Cluster(p, d, num_blocks=256, config=FAST) as c:
        c.submit("warm", seed=1, p_blocks=[0, 1], d_blocks=[0, 1])
        assert c.wait(["warm"], released=True)["warm"].ok

        # killed while a large request is being read: it either finished first or fails; never hangs
        big = list(range(16, 256))
        c.submit("mid", seed=2, p_blocks=big, d_blocks=big, verify=False)
        c.prefill.kill()
        t0 = time.monotonic()
        res = c.wait(["mid"], timeout=FAST.transfer_timeout_s + 30)["mid"]
        assert time.monotonic() - t0 < FAST.transfer_timeout_s + 30
        if res.failed:
            kind, invalid, _ = res.failed[0]
            assert kind in ("transfer-error", "post-exception", "timeout") and invalid == tuple(big)

        # the decode side still knows the dead engine: a new request to it fails, with its blocks
        params = c.params("after-death", [2, 3], "f" * 32)
        c.load("after-death", params, [2, 3], seed=3, ntok=32)
        t0 = time.monotonic()
        res = c.wait(["after-death"], timeout=FAST.transfer_timeout_s + 30)["after-death"]
        assert res.failed and not res.done
        kind, invalid, msg = res.failed[0]
        assert kind in ("transfer-error", "timeout", "post-exception", "handshake"), msg
        assert invalid == (2, 3)

        # the engine restarts (new incarnation, new port, new agents): later requests succeed
        c.restart_prefill()
        c.submit("reborn", seed=4, p_blocks=[5, 6], d_blocks=[7, 8])
        res = c.wait(["reborn"], timeout=60, released=True)["reborn"]
        assert res.ok, res
        dstats = c.rank_stats(c.decode)
        (s, counts), = dstats.values()
        assert s.handshakes >= 2
        assert counts["remote_agents"] == 2 and counts["transfers"] == 0
