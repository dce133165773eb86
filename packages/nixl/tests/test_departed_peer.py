"""What a dead peer leaves in a surviving process (NIXL's UCX backend, real processes).

A survivor connects to a peer in another process, WRITEs to it, the peer is killed and
the survivor removes its agent (as ``PeerTable.drop`` does). Every connection socket
goes, except one per UCX worker thread (``AgentConfig.num_threads``): such a thread's
endpoint is never progressed again and keeps its TCP socket in CLOSE-WAIT (upstream
ai-dynamo/nixl#2025). The soak allows exactly this (testing/probes.py); if NIXL fixes it,
this test fails and the allowance can go.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from kvbridge.nixl.agent import AgentConfig, NixlAgent

pytestmark = pytest.mark.timeout(180)


def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _peer(conn, name: str, threads: int) -> None:
    buf = np.zeros(1 << 16, dtype=np.uint8)
    agent = NixlAgent(name, AgentConfig(num_threads=threads))
    agent.register([(buf.ctypes.data, buf.nbytes, 0)])
    conn.send((agent.metadata(), buf.ctypes.data))
    while True:  # answer connection set-up and transfers until killed
        agent.progress()
        time.sleep(0.001)


def _settled(agent: NixlAgent, seconds: float = 3.0) -> int:
    """The socket count once it stopped changing (progressing the agent meanwhile)."""
    last, end = _sockets(), time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(25):
            agent.progress()
            time.sleep(0.01)
        now = _sockets()
        if now == last:
            return now
        last = now
    return last


def _connect_write_kill(survivor: NixlAgent, local, ctx, name: str, threads: int) -> None:
    rx, tx = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(tx, name, threads), daemon=True)
    proc.start()
    try:
        md, addr = rx.recv()
        peer = survivor.add_remote(md)
        remote = survivor.prepare(peer, np.array([[addr, 4096, 0]], dtype=np.uint64))
        x = survivor.make_transfer("WRITE", local, np.array([0], dtype=np.int32), remote,
                                   np.array([0], dtype=np.int32), b"w")
        survivor.post(x)
        end = time.monotonic() + 30
        while survivor.state(x) == "PROC" and time.monotonic() < end:
            time.sleep(0.001)
        assert survivor.state(x) == "DONE"
        survivor.release_transfer(x)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    _settled(survivor)
    survivor.remove_remote(peer)
    assert survivor.counts()["remote_agents"] == 0 and survivor.counts()["transfers"] == 0


@pytest.fixture(scope="module")
def ctx():
    """Peers forked from a server that imported NIXL once (a fresh interpreter per peer takes
    seconds)."""
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["nixl._api", "kvbridge.nixl.agent"])
    return c


@pytest.mark.parametrize("threads", [0, 1, 2])
def test_a_dead_peer_leaves_one_socket_per_ucx_worker_thread(ctx, threads):
    buf = np.ones(1 << 16, dtype=np.uint8)
    with NixlAgent(f"survivor-{threads}", AgentConfig(num_threads=threads)) as survivor:
        survivor.register([(buf.ctypes.data, buf.nbytes, 0)])
        local = survivor.prepare(None, np.array([[buf.ctypes.data, 4096, 0]], dtype=np.uint64))
        # the first peer also opens what the agent keeps for later peers
        _connect_write_kill(survivor, local, ctx, f"peer-{threads}-0", threads)
        base = _settled(survivor)
        _connect_write_kill(survivor, local, ctx, f"peer-{threads}-1", threads)
        assert _settled(survivor) - base == threads
