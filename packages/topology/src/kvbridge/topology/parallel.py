"""Rank mapping and keys for store- or payload-based transfers.

Here a sender rank pushes whole shards (to a store or a receiver) instead of
the receiver reading byte ranges. Any parallel dimension that shards evenly
(TP, sequence parallel, ...) maps the same way: with S sender ranks and R
receiver ranks, one of the sizes divides the other and each rank talks to a
contiguous group of ranks on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

from .errors import TopologyError


def _check(sender_size: int, receiver_size: int, rank: int, side: str) -> None:
    if sender_size <= 0 or receiver_size <= 0:
        raise TopologyError("parallel sizes must be positive")
    big, small = max(sender_size, receiver_size), min(sender_size, receiver_size)
    if big % small:
        raise TopologyError(
            f"sender size {sender_size} and receiver size {receiver_size} do not divide; "
            "one must be a multiple of the other"
        )
    size = sender_size if side == "sender" else receiver_size
    if not 0 <= rank < size:
        raise TopologyError(f"{side} rank {rank} is outside size {size}")


def send_targets(sender_size: int, receiver_size: int, sender_rank: int) -> tuple[int, ...]:
    """Receiver ranks that sender ``sender_rank`` sends (a slice of) its shard to."""
    _check(sender_size, receiver_size, sender_rank, "sender")
    if receiver_size >= sender_size:
        k = receiver_size // sender_size
        return tuple(range(sender_rank * k, (sender_rank + 1) * k))
    return (sender_rank // (sender_size // receiver_size),)


def receive_sources(sender_size: int, receiver_size: int, receiver_rank: int) -> tuple[int, ...]:
    """Sender ranks whose shards receiver ``receiver_rank`` needs."""
    _check(sender_size, receiver_size, receiver_rank, "receiver")
    if sender_size >= receiver_size:
        k = sender_size // receiver_size
        return tuple(range(receiver_rank * k, (receiver_rank + 1) * k))
    return (receiver_rank // (receiver_size // sender_size),)


_KEY_PREFIX = "kvb1"


@dataclass(frozen=True)
class TransferKey:
    """A rank-aware key: one chunk of one stage of a request, from one rank to another."""

    request_id: str
    stage: str
    chunk: int
    from_rank: int
    to_rank: int

    def __post_init__(self) -> None:
        if not self.request_id:
            raise TopologyError("request_id must not be empty")
        for name in ("chunk", "from_rank", "to_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise TopologyError(f"{name} must be a non-negative integer, got {v!r}")

    def __str__(self) -> str:
        return "/".join(
            (_KEY_PREFIX, quote(self.request_id, safe=""), quote(self.stage, safe=""),
             str(self.chunk), f"{self.from_rank}-{self.to_rank}")
        )

    @classmethod
    def parse(cls, text: str) -> TransferKey:
        """Inverse of ``str(key)``; raises TopologyError on anything else."""
        parts = text.split("/")
        if len(parts) != 5 or parts[0] != _KEY_PREFIX:
            raise TopologyError(f"not a kvbridge transfer key: {text!r}")
        _, req, stage, chunk, ranks = parts
        try:
            frm, to = ranks.split("-")
            return cls(unquote(req), unquote(stage), int(chunk), int(frm), int(to))
        except ValueError as exc:
            raise TopologyError(f"malformed kvbridge transfer key {text!r}: {exc}") from None
