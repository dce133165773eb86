"""A READ in progress when its request times out, over real NIXL/UCX TCP between processes.

The prefill process is stopped (SIGSTOP) after the handshake, so a READ over TCP cannot
progress; the request times out and its blocks go back to the caller. NIXL cannot cancel
the READ: when the prefill process runs again the READ completes into those blocks. The
decode engine keeps the READ's handle until then, counts it in ``stats.late_transfers``,
logs it as an error and releases it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from dataclasses import replace

import pytest

from kvbridge.nixl import AgentConfig, EngineConfig, FailureKind
from kvbridge.tools.local_ranks import LocalRanks
from kvbridge.tools.synthetic_cache import logical_kv
from kvbridge.topology import EngineSpec

pytestmark = pytest.mark.timeout(180)

P = EngineSpec("prefill", 1, 4, 16, 2, 16)
D = replace(P, engine_id="decode")
NB = 64
BLOCKS = list(range(8, 40))
CFG = EngineConfig(agent=AgentConfig(num_threads=0), lease_s=120, handshake_timeout_s=10,
                   transfer_timeout_s=1.0)


def _prefill(conn) -> None:
    """Child: hold "warm" and "a" and poll until killed."""
    pre = LocalRanks.start("p", P, [0], NB, CFG)
    engine = pre.engines[0]
    params = {}
    for rid, blocks, seed in (("warm", [1], 1), ("a", BLOCKS, 2)):
        pre.fill(logical_kv(P, seed, len(blocks) * P.block_size), blocks)
        params[rid] = engine.hold(rid, (blocks,))
    conn.send(params)
    while True:
        engine.poll()
        time.sleep(0.001)


def _poll(dec, until, timeout_s: float = 15.0):
    done, failed = [], []
    end = time.monotonic() + timeout_s
    while not until(done, failed):
        if time.monotonic() > end:
            raise TimeoutError(f"done={done} failed={failed}")
        ev = dec.poll()
        done += ev.done
        failed += ev.failed
        time.sleep(0.001)
    return done, failed


def test_a_read_given_up_in_progress_is_kept_until_it_ends_and_counted_late(monkeypatch, caplog):
    caplog.set_level(logging.ERROR, logger="kvbridge.nixl")
    monkeypatch.setenv("UCX_TLS", "tcp")  # a READ then needs the prefill process to run
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_prefill, args=(child_end,), daemon=True)
    child.start()
    decode = None
    try:
        assert parent.poll(120), "the prefill process did not start"
        params = parent.recv()
        decode = LocalRanks.start("d", D, [0], NB, CFG, serve=False)
        dec, cache = decode.engines[0], decode.caches[0]
        # the handshake first: the short transfer timeout is for the READs, not the handshake
        # (over TCP, on a loaded machine, the first connection can take longer than 1 s)
        dec.prepare(params["warm"])
        _poll(dec, lambda d, f: dec.stats.handshakes == 1, timeout_s=60)
        dec.load("warm", params["warm"], ([2],))
        assert _poll(dec, lambda d, f: d or f) == (["warm"], [])
        base = dec.resource_counts()

        cache.clear(BLOCKS)
        os.kill(child.pid, signal.SIGSTOP)
        dec.load("a", params["a"], (BLOCKS,))
        _, failed = _poll(dec, lambda d, f: f)
        assert [(f.request_id, f.kind) for f in failed] == [("a", FailureKind.TIMEOUT)]
        assert sorted(failed[0].invalid_block_ids) == BLOCKS
        for _ in range(50):
            dec.poll()
            time.sleep(0.002)
        assert dec.resource_counts()["transfers"] == base["transfers"] + 1  # kept, in progress
        assert dec.stats.late_transfers == 0
        cache.clear(BLOCKS)  # the caller reuses the blocks

        os.kill(child.pid, signal.SIGCONT)
        _poll(dec, lambda d, f: dec.stats.late_transfers == 1)
        assert dec.resource_counts() == base  # released once it ended
        written = sum(int((t[BLOCKS] != 0).sum()) for t in cache.regions)
        assert written > 0  # what the count reports: the READ did write after the hand-back
        (msg,) = [r.getMessage() for r in caplog.records if "given up" in r.getMessage()]
        assert msg.startswith("a READ with prefill/p0/") and "handed back" in msg
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        child.join(10)
        if decode is not None:
            decode.close()
