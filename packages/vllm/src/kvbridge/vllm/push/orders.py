"""What a push-mode scheduler orders its workers to do in one engine step."""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.topology import BlockIds, TransferParams

__all__ = ["ExpectOrder", "PushOrder", "PushOrders"]


@dataclass(frozen=True)
class PushOrder:
    """Prefill worker: write one request's blocks into a decode engine."""

    request_id: str
    block_ids: BlockIds  # per KV-cache group
    #: the decode side: engine, side channel, TP, its blocks for the tokens from
    #: ``computed_tokens`` on, the token it expects
    target: TransferParams
    layerwise: bool


@dataclass(frozen=True)
class ExpectOrder:
    """Decode worker: wait for the prefill ranks that write one request."""

    request_id: str
    prefill_engine_id: str
    prefill_tp: int
    token: str
    local_block_ids: BlockIds  # per KV-cache group
    prefill_block_size: int
    prefill_kernel_blocks_per_block: int
    prefill_head_order: str


@dataclass(frozen=True)
class PushOrders:
    """Everything the workers do for one engine step (pickled to every worker)."""

    pushes: tuple[PushOrder, ...] = ()
    #: prefill: finished requests whose blocks vLLM frees once their push is released
    sent: tuple[str, ...] = ()
    expects: tuple[ExpectOrder, ...] = ()
    #: decode: requests whose offer failed, with their local blocks (to recompute)
    failed: tuple[tuple[str, BlockIds], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.pushes or self.sent or self.expects or self.failed)
