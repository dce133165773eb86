"""Tensor helpers for payload-based transfers, where a whole shard arrives per sender rank.

Heads follow kvbridge.topology placement: with T ranks and K heads, rank r
holds heads [r*K/T, (r+1)*K/T) when T <= K, else the single head r*K//T.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvbridge.topology import Layout, head_range, ranks_holding

from .errors import MemoryLayoutError


def split_kv(kv: torch.Tensor | Sequence[torch.Tensor], layout: Layout | str) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's KV as ``(K, V)`` views: stacked kv-first ``[2, ...]``, stacked
    blocks-first ``[blocks, 2, ...]``, or already a ``(K, V)`` pair."""
    if not isinstance(kv, torch.Tensor):
        if len(kv) != 2:
            raise MemoryLayoutError(f"expected a (K, V) pair, got {len(kv)} tensors")
        k, v = kv
        if k.shape != v.shape:
            raise MemoryLayoutError(f"K {tuple(k.shape)} and V {tuple(v.shape)} differ in shape")
        return k, v
    layout = Layout(layout)
    if layout is Layout.PACKED:
        raise MemoryLayoutError(
            "a packed cache keeps K and V of each head together in a backend-specific order, so "
            "split_kv cannot separate them; move packed blocks whole (or by whole heads)"
        )
    if layout is Layout.KV_FIRST:
        if kv.dim() < 1 or kv.shape[0] != 2:
            raise MemoryLayoutError(f"kv-first KV must be [2, ...], got {tuple(kv.shape)}")
        return kv[0], kv[1]
    if kv.dim() < 2 or kv.shape[1] != 2:
        raise MemoryLayoutError(f"blocks-first KV must be [blocks, 2, ...], got {tuple(kv.shape)}")
    return kv[:, 0], kv[:, 1]


def _check_dim(t: torch.Tensor, dim: int, want: int, who: str) -> None:
    if t.shape[dim] != want:
        raise MemoryLayoutError(
            f"{who} has {t.shape[dim]} heads along dim {dim}, expected {want}; check the TP sizes "
            "and the head dimension"
        )


def slice_heads(
    shard: torch.Tensor,
    *,
    num_heads: int,
    sender_tp: int,
    sender_rank: int,
    receiver_tp: int,
    receiver_rank: int,
    dim: int,
) -> torch.Tensor:
    """The part of ``sender_rank``'s shard that ``receiver_rank`` needs (a view)."""
    have = head_range(sender_tp, num_heads, sender_rank)
    want = head_range(receiver_tp, num_heads, receiver_rank)
    _check_dim(shard, dim, len(have), f"sender rank {sender_rank}'s shard")
    lo, hi = max(have.start, want.start), min(have.stop, want.stop)
    if lo >= hi:
        raise MemoryLayoutError(
            f"sender rank {sender_rank} (heads {have.start}..{have.stop - 1}) holds none of receiver "
            f"rank {receiver_rank}'s heads ({want.start}..{want.stop - 1})"
        )
    return shard.narrow(dim, lo - have.start, hi - lo)


def merge_heads(
    shards: Mapping[int, torch.Tensor],
    *,
    num_heads: int,
    sender_tp: int,
    receiver_tp: int,
    receiver_rank: int,
    dim: int,
) -> torch.Tensor:
    """Receiver ``receiver_rank``'s tensor from the shards (or slices) of several senders.

    ``shards`` maps sender rank -> that sender's whole shard or its
    :func:`slice_heads` slice for this receiver. Each needed head is taken
    once, from the lowest sender rank given that holds it (replicas are
    interchangeable).
    """
    want = head_range(receiver_tp, num_heads, receiver_rank)
    pieces: list[torch.Tensor] = []
    for head in want:
        holders = [q for q in ranks_holding(sender_tp, num_heads, head) if q in shards]
        if not holders:
            raise MemoryLayoutError(
                f"head {head} of receiver rank {receiver_rank} needs one of sender ranks "
                f"{list(ranks_holding(sender_tp, num_heads, head))}, got shards from {sorted(shards)}"
            )
        q = holders[0]
        t = shards[q]
        have = head_range(sender_tp, num_heads, q)
        if t.shape[dim] == len(have):
            start = have.start
        else:  # a slice for this receiver: it starts at the first shared head
            start = max(have.start, want.start)
            _check_dim(t, dim, min(have.stop, want.stop) - start, f"slice from sender rank {q}")
        pieces.append(t.narrow(dim, head - start, 1))
    return torch.cat(pieces, dim=dim)
