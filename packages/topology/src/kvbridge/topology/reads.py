"""Read runs over a sharded dimension, and the read records of a plan.

A *sharded dimension* is anything tensor parallelism splits with the rule of
:mod:`kvbridge.topology.heads`: KV heads, Mamba SSM heads, Mamba groups.
:func:`plan_dim` says which remote rank each unit a local rank holds is read
from; :func:`tp_ratio` and :func:`seed_handshake_ranks` are the seed (vLLM)
convention of which remote ranks a local rank talks to.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .errors import TopologyError
from .heads import head_range, ranks_holding


def tp_ratio(local_tp: int, remote_tp: int) -> int | None:
    """The seed TP ratio: Tl/Tr when Tl >= Tr, else -(Tr/Tl); None when neither divides."""
    if local_tp <= 0 or remote_tp <= 0:
        raise TopologyError("TP sizes must be positive")
    if local_tp >= remote_tp:
        return local_tp // remote_tp if local_tp % remote_tp == 0 else None
    return -(remote_tp // local_tp) if remote_tp % local_tp == 0 else None


def seed_handshake_ranks(local_tp: int, remote_tp: int, local_rank: int) -> tuple[int, ...] | None:
    """Handshake targets of the seed convention; None when the TP sizes do not divide."""
    ratio = tp_ratio(local_tp, remote_tp)
    if ratio is None:
        return None
    if ratio > 0:
        return (local_rank // ratio,)
    m = -ratio
    return tuple(local_rank * m + i for i in range(m))


@dataclass(frozen=True)
class ReadOp:
    """Copy ``length`` bytes of every transfer unit from a remote rank to a local unit.

    The piece of unit ``u`` is read at ``remote_offset + u * remote_unit_stride`` of the remote
    kernel-block element (see :class:`RankPlan`) and lands at ``local_offset`` of the local unit.
    """

    remote_rank: int
    remote_offset: int
    length: int
    local_offset: int


@dataclass(frozen=True)
class DimRead:
    """A run of sharded units (heads, groups) read from one remote rank."""

    remote_rank: int
    remote_start: int  # unit index within the remote rank's shard
    count: int
    local_start: int  # unit index within the local rank's shard


def plan_dim(
    local_tp: int,
    remote_tp: int,
    units: int,
    local_rank: int,
    preferred: tuple[int, ...] | None,
) -> tuple[DimRead, ...]:
    """Read runs covering exactly the units ``local_rank`` holds of a sharded dimension.

    Each unit comes from one remote rank holding it: the first of ``preferred``
    that does (the seed handshake ranks), else one picked by local rank so that
    replicas share the load. Adjacent units from one rank merge into one run.
    """
    mine = head_range(local_tp, units, local_rank)
    runs: list[DimRead] = []
    for pos, unit in enumerate(mine):
        holders = ranks_holding(remote_tp, units, unit)
        src = None
        if preferred is not None:
            for q in preferred:
                if q in holders:
                    src = q
                    break
        if src is None:
            src = holders[local_rank % len(holders)]
        rpos = unit - head_range(remote_tp, units, src).start
        if runs:
            last = runs[-1]
            if (
                last.remote_rank == src
                and last.remote_start + last.count == rpos
                and last.local_start + last.count == pos
            ):
                runs[-1] = DimRead(src, last.remote_start, last.count + 1, last.local_start)
                continue
        runs.append(DimRead(src, rpos, 1, pos))
    return tuple(runs)


def ordered_unique(values: Iterable[int]) -> tuple[int, ...]:
    """``values`` without repeats, in first-seen order."""
    seen: dict[int, None] = {}
    for v in values:
        seen.setdefault(v, None)
    return tuple(seen)
