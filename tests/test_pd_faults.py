"""Faults between real prefill and decode processes (real NIXL/UCX, real ZMQ on 127.0.0.1)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from kvbridge.nixl import AgentConfig, EngineConfig
from kvbridge.tools.harness import Cluster, spec_pair

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
    """A prefill process killed with SIGKILL after the handshake: requests to it fail with their
    invalid blocks within bounded time (never hang, never leak handles); a restarted engine is
    found again.

    Steps: "mid" (killed while a large read may be in flight: racy, either outcome is checked),
    "after-death" (a request to the dead engine, whichever way "mid" went), "reborn" (the
    restarted engine serves), "posted-to-dead" (deterministic: the engine is killed after a
    completed handshake and the decode side, still holding it as ready, posts READs to it).
    """
    p, d = spec_pair(prefill_tp=2, decode_tp=1, head_dim=64, layers=4)
    bound = FAST.transfer_timeout_s + 10  # a request's deadline is transfer_timeout_s after load
    with Cluster(p, d, num_blocks=256, config=FAST) as c:
        c.submit("warm", seed=1, p_blocks=[0, 1], d_blocks=[0, 1])
        assert c.wait(["warm"], released=True)["warm"].ok

        # "mid": killed while a large request may be being read. The kill may land after the
        # read completed; either way the request ends (never hangs) and leaves no handle behind
        big = list(range(16, 256))
        c.submit("mid", seed=2, p_blocks=big, d_blocks=big, verify=False)
        c.prefill.kill()
        res = c.wait(["mid"], timeout=bound)["mid"]
        mid_completed = not res.failed
        if res.failed:
            kind, invalid, _ = res.failed[0]
            assert kind in ("transfer-error", "post-exception", "timeout") and invalid == tuple(big)
        (_s, counts), = c.rank_stats(c.decode).values()
        assert counts["transfers"] == 0, ("mid completed" if mid_completed else "mid failed", counts)

        # "after-death": a new request to the dead engine fails, with its blocks, within the bound.
        # If "mid" completed, the decode side still holds the engine as ready and posts READs to
        # the dead agents; if "mid" failed, it may have dropped the engine, and then the new
        # handshake fails instead.
        params = c.params("after-death", [2, 3], "f" * 32)
        c.load("after-death", params, [2, 3], seed=3, ntok=32)
        res = c.wait(["after-death"], timeout=bound)["after-death"]
        assert res.failed and not res.done
        kind, invalid, msg = res.failed[0]
        allowed = ("transfer-error", "timeout", "post-exception")
        assert kind in (allowed if mid_completed else (*allowed, "handshake")), msg
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

        # "posted-to-dead" (deterministic): the handshake with the new engine is done and the
        # decode side has seen no failure since, so after SIGKILL it posts READs to dead agents;
        # the request must fail with its blocks within the bound, not wait for a handshake
        c.prefill.kill()
        params = c.params("posted-to-dead", [9, 10], "e" * 32)
        c.load("posted-to-dead", params, [11, 12], seed=5, ntok=32)
        res = c.wait(["posted-to-dead"], timeout=bound)["posted-to-dead"]
        assert res.failed and not res.done
        kind, invalid, msg = res.failed[0]
        assert kind in allowed, msg
        assert invalid == (11, 12)
        (_s, counts), = c.rank_stats(c.decode).values()
        assert counts["transfers"] == 0
