"""Pay an agent's one-time connection costs at engine start rather than on the first request.

Measured in real vLLM (bench/bench_first_request.py): the first peer an engine's
agent ever meets costs far more than the next ones. Loading the peer's metadata
took 41 ms for a fresh engine and 1-4 ms after a prefill restart (same agent, new
peer), and preparing the first descriptor lists 56 ms against 0.4-0.6 ms. UCX
sets up per worker, on first use, what every later endpoint of the same kind
reuses (the endpoint configuration and its protocol choice for gets and puts),
and kvbridge's list path probes once whether NIXL takes strided rows. On two
busy cores these first-time costs stretched to 720-905 ms in the e2e logs.

:func:`warm_up` makes the agent meet a throwaway agent of the same
configuration in this process (same host, so the same transports a local peer
uses): both load each other's metadata, prepare strided lists, and each posts
a small READ and WRITE to the other, so that both the initiating and the
serving side of a transfer have run once. Only a scratch buffer of
:data:`SCRATCH_BYTES` is touched, never the cache; the throwaway agent is
closed and forgotten before this returns. Host memory (DRAM) only.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .agent import NixlAgent, NixlError

log = logging.getLogger("kvbridge.nixl")

#: bytes of scratch memory each side registers for the warm-up (two halves of 2 KiB)
SCRATCH_BYTES = 4096


def scratch_buffer() -> np.ndarray:
    """The scratch buffer an engine registers with its agent for :func:`warm_up` (keep it alive
    as long as the agent)."""
    return np.zeros(SCRATCH_BYTES, dtype=np.uint8)


def _rows(buf: np.ndarray) -> np.ndarray:
    """One strided row: the buffer's two halves (the form the engines' lists use)."""
    half = SCRATCH_BYTES // 2
    return np.array([[buf.ctypes.data, half, 0, half, 2]], dtype=np.uint64)


def _exchange(src: NixlAgent, peer: str, mine: np.ndarray, theirs: np.ndarray, deadline: float) -> None:
    """``src`` READs and WRITEs one half of the scratch with ``peer`` and waits for both."""
    loc = src.prepare(None, _rows(mine))
    rem = src.prepare(peer, _rows(theirs))
    try:
        for op, idx in (("READ", 0), ("WRITE", 1)):
            i = np.array([idx], dtype=np.int32)
            t = src.make_transfer(op, loc, i, rem, i)
            try:
                st = src.post(t)
                while st == "PROC" and time.monotonic() < deadline:
                    time.sleep(0.0005)
                    st = src.state(t)
                if st != "DONE":
                    raise NixlError(f"warm-up {op} with {peer!r} ended {st}")
            finally:
                src.release_transfer(t)
    finally:
        src.release_list(loc)
        src.release_list(rem)


def warm_up(agent: NixlAgent, scratch: np.ndarray, timeout_s: float = 5.0) -> float:
    """Connect ``agent`` once to a throwaway agent and move a few bytes both ways (see the
    module docstring); returns the milliseconds it took. ``scratch`` must be registered with
    ``agent`` (:func:`scratch_buffer`). Raises :class:`NixlError` when a step fails; the
    engine works without a warm-up (its first request pays these costs instead)."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    other = NixlAgent(f"{agent.name}/warm-up", agent.config)
    theirs = scratch_buffer()
    name = ""
    try:
        other.register(np.array([[theirs.ctypes.data, SCRATCH_BYTES, 0]], dtype=np.uint64))
        name = agent.add_remote(other.metadata())
        back = other.add_remote(agent.metadata())
        _exchange(agent, name, scratch, theirs, deadline)
        _exchange(other, back, theirs, scratch, deadline)
    finally:
        if name:
            agent.remove_remote(name)
        other.close()
    return (time.perf_counter() - t0) * 1e3
