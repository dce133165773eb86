"""Transfer plans: which remote ranks a local rank reads, and which bytes go where.

"local" is the side that plans (the decode engine in pull mode); "remote" is
the other side (the prefill engine). Reads are planned per *transfer unit*: one
K or V element (or MLA latent, or packed K+V element) of ``unit_tokens``
tokens, the smaller of the two sides' kernel (physical) block sizes; a logical
block may be several kernel blocks (see :mod:`kvbridge.topology.blocks`), and
the side with the larger kernel blocks holds ``kernel block size / unit_tokens``
units per element.

On the local side unit ``u`` of an element is the byte range
``[u * local_unit_bytes, (u + 1) * local_unit_bytes)``. On the remote side a
read's piece of unit ``u`` starts at ``remote_offset + u * remote_unit_stride``
of the remote kernel-block element. ``remote_unit_stride`` equals
``remote_unit_bytes`` (units are consecutive byte ranges) except when the
remote kernel blocks are larger and hold several heads in HND order
(``[heads, tokens, dim]``): then one unit's tokens are contiguous only within
one head, so reads are one per head, ``remote_offset`` is the head's position
in the whole remote element and the stride is one head's unit bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .compat import check_compatible
from .errors import TopologyError
from .mamba import MambaFacts, mamba_facts
from .reads import ReadOp, ordered_unique, plan_dim, seed_handshake_ranks, tp_ratio
from .spec import EngineSpec, HeadOrder


@dataclass(frozen=True)
class RankPlan:
    """Plan of one local rank against one remote engine.

    ``local_unit_bytes`` / ``remote_unit_bytes``: bytes of one transfer unit of one element on
    each side (the rank's heads over ``unit_tokens`` tokens). ``remote_unit_stride``: bytes from
    a read's piece of one unit to the same piece of the next unit inside a remote kernel-block
    element. It is ``remote_unit_bytes`` (the default) unless the remote kernel blocks are larger
    than the local ones and hold several heads in HND order: then the reads are one per head,
    each ``remote_offset`` is the head's offset in the whole remote element
    (``head x remote kernel tokens x row bytes``) and the stride is ``unit_tokens x row bytes``.
    """

    local_rank: int
    tp_ratio: int | None
    handshake_ranks: tuple[int, ...]
    source_ranks: tuple[int, ...]
    notify_only_ranks: tuple[int, ...]
    reads: tuple[ReadOp, ...]
    unit_tokens: int
    local_unit_bytes: int
    remote_unit_bytes: int
    mamba: MambaFacts | None = None
    remote_unit_stride: int | None = None

    def __post_init__(self) -> None:
        if self.remote_unit_stride is None:
            object.__setattr__(self, "remote_unit_stride", self.remote_unit_bytes)
        elif self.remote_unit_stride <= 0:
            raise TopologyError(f"remote_unit_stride must be positive, got {self.remote_unit_stride}")

    @property
    def reads_per_head(self) -> bool:
        """True when the remote units are not contiguous (see ``remote_unit_stride``)."""
        return self.remote_unit_stride != self.remote_unit_bytes

    def reads_from(self, remote_rank: int) -> tuple[ReadOp, ...]:
        return tuple(r for r in self.reads if r.remote_rank == remote_rank)

    @property
    def splits_local(self) -> bool:
        """True when one local unit is filled by more than one read."""
        return len(self.reads) > 1

    def splits_remote(self) -> bool:
        """True when some read takes only part of a remote unit."""
        return any(r.length != self.remote_unit_bytes for r in self.reads)


def unit_tokens(local: EngineSpec, remote: EngineSpec) -> int:
    """Tokens per transfer unit: the smaller of the two sides' physical (kernel) blocks.

    A logical block is ``kernel_blocks_per_block`` physical blocks, each laid out
    ``[heads, kernel tokens, dim]`` (HND), so byte offsets of heads are only
    meaningful within one physical block.
    """
    return min(local.kernel_block_size, remote.kernel_block_size)


def _unit_head_bytes(local: EngineSpec, remote: EngineSpec) -> int:
    """Bytes of one head in one transfer unit (K and V together for the packed layout)."""
    return unit_tokens(local, remote) * local.head_token_bytes


def _remote_units_cut_heads(local: EngineSpec, remote: EngineSpec) -> bool:
    """True when a transfer unit is not one byte range of a remote element.

    A remote HND kernel block ``[heads, T_r, dim]`` larger than the unit holds one unit's
    tokens of one head contiguously, but the heads ``T_r`` token rows apart. (Packed caches
    never get here: they need equal kernel block sizes.)
    """
    return (
        remote.kernel_block_size > local.kernel_block_size
        and remote.head_order is HeadOrder.HND
        and remote.heads_per_rank > 1
        and not local.use_mla
    )


def plan_rank(local: EngineSpec, remote: EngineSpec, local_rank: int) -> RankPlan:
    """The read plan of ``local_rank`` of ``local`` against every rank of ``remote``."""
    check_compatible(local, remote)
    if not 0 <= local_rank < local.tp_size:
        raise TopologyError(f"local rank {local_rank} is outside local TP size {local.tp_size}")
    ratio = tp_ratio(local.tp_size, remote.tp_size)
    preferred = seed_handshake_ranks(local.tp_size, remote.tp_size, local_rank)
    heads = local.kv_heads_for_placement
    uhb = _unit_head_bytes(local, remote)
    runs = plan_dim(local.tp_size, remote.tp_size, heads, local_rank, preferred)
    local_unit = local.heads_per_rank * uhb
    remote_unit = remote.heads_per_rank * uhb
    if _remote_units_cut_heads(local, remote):
        # one read per head: head h of the remote element starts at h * (its kernel tokens x
        # row bytes); its unit u is uhb bytes at + u * uhb
        remote_head = remote.kernel_block_size * remote.head_token_bytes
        reads = tuple(
            ReadOp(r.remote_rank, (r.remote_start + i) * remote_head, uhb, (r.local_start + i) * uhb)
            for r in runs
            for i in range(r.count)
        )
        stride = uhb
    else:
        reads = tuple(
            ReadOp(r.remote_rank, r.remote_start * uhb, r.count * uhb, r.local_start * uhb)
            for r in runs
        )
        stride = remote_unit
    fa_sources = ordered_unique(r.remote_rank for r in reads)
    mamba = None
    sources = fa_sources
    if local.mamba is not None:
        per_head = _remote_units_cut_heads(local, remote)
        mamba = mamba_facts(local, remote, local_rank, preferred, reads, fa_sources, uhb, per_head)
        sources = mamba.all_source_ranks
    handshake = preferred if preferred is not None else tuple(sorted(sources))
    missing = [q for q in sources if q not in handshake]
    if missing:  # cannot happen for valid engines; guard the invariant the producer relies on
        raise TopologyError(
            f"internal planning error: source ranks {missing} are not handshake ranks "
            f"(local TP {local.tp_size}, remote TP {remote.tp_size}, K={heads})"
        )
    notify_only = tuple(q for q in handshake if q not in sources)
    plan = RankPlan(
        local_rank=local_rank,
        tp_ratio=ratio,
        handshake_ranks=tuple(handshake),
        source_ranks=tuple(sources),
        notify_only_ranks=notify_only,
        reads=reads,
        unit_tokens=unit_tokens(local, remote),
        local_unit_bytes=local_unit,
        remote_unit_bytes=remote_unit,
        mamba=mamba,
        remote_unit_stride=stride,
    )
    _check_head_order(local, remote, plan)
    return plan


def _check_head_order(local: EngineSpec, remote: EngineSpec, plan: RankPlan) -> None:
    if local.use_mla:
        return
    split = plan.splits_local or plan.splits_remote()
    if split and remote.head_order is not HeadOrder.HND:
        fix = (
            "set both engines' KV cache layout to HND (vLLM's LBHNC layout for packed caches: "
            "[blocks, heads, tokens, 2*head_dim]); an NHD packed cache interleaves the heads of "
            "every token, so it cannot be split by head"
            if remote.is_packed else "set its KV cache layout to HND"
        )
        raise TopologyError(
            f"local TP {local.tp_size} and remote TP {remote.tp_size} split KV heads across ranks, "
            f"which needs the remote engine {remote.engine_id!r} to store heads contiguously: {fix}"
        )
    if (
        split
        and local.kernel_block_size > remote.kernel_block_size
        and local.head_order is not HeadOrder.HND
        and local.heads_per_rank > 1
    ):
        # received units are [ratio, heads, tokens, dim]; regrouping them into NHD is supported
        return


@dataclass(frozen=True)
class ProducerRankPlan:
    """What one remote (prefill) rank expects per request."""

    rank: int
    consumer_ranks: tuple[int, ...]
    read_by: tuple[int, ...]
    notify_only_from: tuple[int, ...]

    @property
    def notifications_per_request(self) -> int:
        return len(self.consumer_ranks)


def producer_plans(rank_plans: tuple[RankPlan, ...], remote_tp: int) -> tuple[ProducerRankPlan, ...]:
    """For every remote rank: the local ranks that notify it, derived from the local plans."""
    out = []
    for q in range(remote_tp):
        consumers = tuple(p.local_rank for p in rank_plans if q in p.handshake_ranks)
        read_by = tuple(p.local_rank for p in rank_plans if q in p.source_ranks)
        notify = tuple(p.local_rank for p in rank_plans if q in p.notify_only_ranks)
        out.append(ProducerRankPlan(q, consumers, read_by, notify))
    return tuple(out)

