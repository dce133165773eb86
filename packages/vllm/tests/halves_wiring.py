"""The connector's halves wired as KVBridgeConnector wires them, for tests without vLLM."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvbridge.vllm import Allocated, scheduler_half


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
