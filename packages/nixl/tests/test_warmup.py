"""The start-up warm-up (kvbridge.nixl.warmup) on real UCX in host memory: it moves bytes both
ways through a throwaway agent and leaves nothing behind but its scratch registration."""

import numpy as np

from kvbridge.nixl import warmup
from kvbridge.nixl.agent import AgentConfig, NixlAgent


def test_warm_up_moves_bytes_and_leaves_nothing_behind(monkeypatch):
    agent = NixlAgent("test-warmup", AgentConfig(num_threads=1))
    try:
        mine = warmup.scratch_buffer()
        mine[:] = 7
        agent.register([(mine.ctypes.data, mine.nbytes, 0)])
        theirs: list[np.ndarray] = []

        def fill_theirs() -> np.ndarray:
            buf = np.full(warmup.SCRATCH_BYTES, 3, dtype=np.uint8)
            theirs.append(buf)
            return buf

        monkeypatch.setattr(warmup, "scratch_buffer", fill_theirs)
        ms = warmup.warm_up(agent, mine)
        half = warmup.SCRATCH_BYTES // 2
        # this agent's READ brought the other's first half; its WRITE sent its second half;
        # then the other agent READ our first half (now 3s) and WROTE its second half (7s)
        assert (mine[:half] == 3).all() and (theirs[0][half:] == 7).all()
        assert ms > 0
        assert agent.counts() == {"registrations": 1, "lists": 0, "transfers": 0, "remote_agents": 0}
    finally:
        agent.close()
