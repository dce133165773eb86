"""A flood of hostile traffic from other processes does not stop valid clients being served."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
from handshake_helpers import HASH, engine_metadata, flood

from kvbridge.handshake import MetadataServer, fetch_metadata, wire

pytestmark = pytest.mark.timeout(120)

KEY = "flood-test-shared-secret-0123456789"
SECONDS = 2.5


@pytest.mark.parametrize("key", [None, KEY], ids=["open", "keyed"])
def test_valid_clients_are_served_during_a_flood(key):
    mds = engine_metadata(2)
    with MetadataServer(mds, compat_hash=HASH, auth_key=key) as server:
        ctx = mp.get_context("spawn")
        pipes, procs = [], []
        for i, kind in enumerate(("zmq", "zmq", "tcp")):
            rx, tx = ctx.Pipe(duplex=False)
            p = ctx.Process(target=flood, args=(server.port, kind, SECONDS, i, tx), daemon=True)
            p.start()
            pipes.append(rx)
            procs.append(p)
        try:
            # wait until the flood reaches the server, then fetch while it lasts
            deadline = time.monotonic() + 30
            while (server.stats.total_errors == 0 and time.monotonic() < deadline
                   and any(p.is_alive() for p in procs)):
                time.sleep(0.01)
            assert server.stats.total_errors > 0, "the flood never reached the server"
            fetched = 0
            while (fetched == 0 or any(p.is_alive() for p in procs)) and fetched < 500:
                got = fetch_metadata("127.0.0.1", server.port, [0, 1], compat_hash=HASH,
                                     auth_key=key, timeout=20.0, retries=0)
                assert got == mds
                fetched += 1
            results = [rx.recv() for rx in pipes if rx.poll(30)]
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
        assert fetched > 0 and len(results) == 3
        assert sum(sent for sent, _ in results) > 0
        stats = server.stats
        assert stats.total_errors > 0
        if key is not None:  # nothing hostile was served
            assert stats.requests_served == fetched
            assert stats.errors.get(wire.AUTH_FAILED, 0) > 0
        # and after the flood, as before
        assert fetch_metadata("127.0.0.1", server.port, [1], compat_hash=HASH, auth_key=key,
                              timeout=20.0, retries=0) == {1: mds[1]}
