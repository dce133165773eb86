"""Head placement across tensor-parallel ranks.

With T ranks and K heads: if T <= K, K must be divisible by T and rank r holds
the contiguous heads [r*K/T, (r+1)*K/T). If T > K, T must be divisible by K and
rank r holds the single head floor(r*K/T); consecutive ranks share it.
The same rule shards any other per-rank dimension (Mamba SSM heads, groups).
"""

from __future__ import annotations

from .errors import TopologyError


def check_tp_heads(tp_size: int, num_heads: int, *, what: str = "engine") -> None:
    """Raise TopologyError unless ``num_heads`` heads can be placed on ``tp_size`` ranks."""
    if tp_size <= 0 or num_heads <= 0:
        raise TopologyError(f"{what}: TP size and head count must be positive")
    if tp_size <= num_heads and num_heads % tp_size:
        raise TopologyError(
            f"{what}: {num_heads} KV heads cannot be split evenly over TP {tp_size}; "
            f"use a TP size that divides {num_heads}"
        )
    if tp_size > num_heads and tp_size % num_heads:
        raise TopologyError(
            f"{what}: TP {tp_size} exceeds the {num_heads} KV heads but is not a multiple of it, "
            f"so heads cannot be replicated evenly; use a multiple of {num_heads}"
        )


def heads_per_rank(tp_size: int, num_heads: int) -> int:
    """Physical heads stored per rank."""
    check_tp_heads(tp_size, num_heads)
    return max(1, num_heads // tp_size)


def head_range(tp_size: int, num_heads: int, rank: int) -> range:
    """The heads rank ``rank`` holds, as a contiguous range."""
    check_tp_heads(tp_size, num_heads)
    if not 0 <= rank < tp_size:
        raise TopologyError(f"rank {rank} is outside TP size {tp_size}")
    if tp_size <= num_heads:
        per = num_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    head = rank * num_heads // tp_size
    return range(head, head + 1)


def ranks_holding(tp_size: int, num_heads: int, head: int) -> range:
    """The ranks that hold ``head`` (several when heads are replicated)."""
    check_tp_heads(tp_size, num_heads)
    if not 0 <= head < num_heads:
        raise TopologyError(f"head {head} is outside {num_heads} heads")
    if tp_size <= num_heads:
        per = num_heads // tp_size
        return range(head // per, head // per + 1)
    per = tp_size // num_heads
    return range(head * per, (head + 1) * per)


def is_replicated(tp_size: int, num_heads: int) -> bool:
    return tp_size > num_heads
