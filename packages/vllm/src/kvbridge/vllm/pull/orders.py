"""What a pull-mode scheduler orders its workers to do in one engine step."""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.topology import BlockIds
from kvbridge.vllm.params import RemotePrefill

__all__ = ["HoldOrder", "LoadOrder", "PullOrders"]


@dataclass(frozen=True)
class LoadOrder:
    """Decode: read one request's prompt blocks from its prefill engine."""

    request_id: str  # the decode engine's id of the request
    source: RemotePrefill  # parsed once by the scheduler
    #: this engine's blocks for the tokens from ``computed_tokens`` on, per KV-cache group
    local_block_ids: BlockIds
    #: leading tokens already present locally (whole blocks), in the unit DecodeEngine.load takes
    computed_tokens: int


@dataclass(frozen=True)
class HoldOrder:
    """Prefill: keep one finished request's blocks until the decode side has them."""

    request_id: str
    block_ids: BlockIds  # per KV-cache group
    token: str


@dataclass(frozen=True)
class PullOrders:
    """Everything the workers do for one engine step (pickled to every worker)."""

    loads: tuple[LoadOrder, ...] = ()
    holds: tuple[HoldOrder, ...] = ()
    #: decode: tell these prefill requests' ranks that nothing will be read
    releases: tuple[RemotePrefill, ...] = ()
    #: decode: queued requests whose prefill lease to renew (handshaking first if needed)
    renewals: tuple[RemotePrefill, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.loads or self.holds or self.releases or self.renewals)
