"""The connector's halves wired as KVBridgeConnector wires them, for tests without vLLM."""

from __future__ import annotations

import random
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvbridge.vllm import Allocated, scheduler_half


def free_port() -> int:
    """A free side-channel port below the kernel's ephemeral range.

    An engine binds its side channel only after its worker half built a NIXL agent, whose
    UCX listeners and connections take ephemeral ports: a port that bind(("", 0)) handed out
    and released can be taken in between (CI, 2026-11-29: "Address already in use" on
    127.0.0.1:39707). Ports below the range are never handed out that way.
    """
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def alloc(new_block_ids: Sequence[Sequence[int]], hits: int = 0) -> Allocated:
    """An allocation whose new blocks (per group) follow ``hits`` prefix-cache hits."""
    groups = tuple(tuple(int(b) for b in g) for g in new_block_ids)
    return Allocated(block_ids=groups, new_block_ids=groups, prefix_hits=hits, first_group_hits=hits)


class SchedulerHalves:
    """The engine core's half: the mode's bookkeeping (``mode``) and its side channel."""

    def __init__(self, **kw) -> None:
        self.mode, self.side = scheduler_half(**kw)
        self.port = kw["port"]

    def serve(self, payloads: Mapping[int, tuple]) -> None:
        served = self.side.serve(payloads)
        if served is not None:
            self.mode.set_served(*served)

    @property
    def server(self):
        return self.side.server

    def close(self) -> None:
        self.mode.close()
        self.side.close()
