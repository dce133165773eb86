"""Hybrid attention + Mamba-2 models: which pieces of the Mamba state a local rank reads.

The conv state's x, B and C channels and the SSM state shard over TP like KV
heads (x and SSM by SSM head, B and C by group), so each piece is planned with
the same per-unit algorithm as attention (:func:`~kvbridge.topology.reads.plan_dim`);
:class:`MambaFacts` collects what descriptor building needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import TopologyError
from .heads import check_tp_heads
from .reads import ReadOp, ordered_unique, plan_dim
from .spec import ConvLayout, EngineSpec, mamba_state_layout


@dataclass(frozen=True)
class MambaPiece:
    """One contiguous piece of a Mamba state page read from one remote rank."""

    name: str  # "x", "B", "C" or "ssm"
    remote_rank: int
    remote_offset: int
    length: int
    local_offset: int


@dataclass(frozen=True)
class MambaFacts:
    """What a local rank of a hybrid attention + Mamba model needs of one remote engine."""

    fa_source_ranks: tuple[int, ...]
    all_source_ranks: tuple[int, ...]
    num_fa_reads: int
    num_mamba_reads: int
    #: bytes of one attention descriptor (one head when ``RankPlan.reads_per_head``)
    fa_descriptor_bytes: int
    #: remote offset of the first attention read when one remote rank is read, else 0
    fa_rank_offset: int
    #: (remote rank, slot of its first attention read in the local element, in
    #: units of fa_descriptor_bytes), one per attention source rank
    fa_head_slots: tuple[tuple[int, int], ...]
    needs_split_handles: bool
    remote_replicated: bool
    remote_physical_heads: int
    #: remote ranks read for Mamba groups only: their attention block lists are emptied
    fa_emptied_ranks: tuple[int, ...]
    mamba_pieces: tuple[MambaPiece, ...]
    #: per remote rank: (local offset, length) pieces of the local page it fills,
    #: attention element pieces first (within a unit), then Mamba pieces (within the page)
    local_split: tuple[tuple[int, tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]], ...]


def mamba_facts(
    local: EngineSpec,
    remote: EngineSpec,
    local_rank: int,
    preferred: tuple[int, ...] | None,
    fa_reads: tuple[ReadOp, ...],
    fa_sources: tuple[int, ...],
    uhb: int,
    per_head: bool,
) -> MambaFacts:
    """The Mamba facts of ``local_rank`` of a hybrid ``local`` engine against ``remote``.

    ``preferred`` are the seed handshake ranks, ``fa_reads`` / ``fa_sources`` the attention
    reads and their remote ranks already planned, ``uhb`` one head's bytes in a transfer unit
    and ``per_head`` whether attention is read head by head.
    """
    if local.mamba is None or remote.mamba is None:  # pragma: no cover - callers check
        raise TopologyError("not a Mamba hybrid")
    for spec in (local, remote):
        for name, units in (("SSM heads", spec.mamba.ssm_heads), ("groups", spec.mamba.n_groups)):
            check_tp_heads(spec.tp_size, units, what=f"engine {spec.engine_id!r} Mamba {name}")
    llay, rlay = mamba_state_layout(local), mamba_state_layout(remote)
    pieces: list[MambaPiece] = []
    for name in ("x", "B", "C", "ssm"):
        units, unit, loff = llay[name]
        _, _, roff = rlay[name]
        for run in plan_dim(local.tp_size, remote.tp_size, units, local_rank, preferred):
            pieces.append(
                MambaPiece(name, run.remote_rank, roff + run.remote_start * unit, run.count * unit,
                           loff + run.local_start * unit)
            )
    split_conv = local.tp_size != remote.tp_size
    if split_conv and (
        local.mamba.conv_layout is not ConvLayout.DIM_FIRST
        or remote.mamba.conv_layout is not ConvLayout.DIM_FIRST
    ):
        raise TopologyError(
            "reading a sharded Mamba conv state across different TP sizes needs the dimension-first "
            "conv state layout on both engines; switch the conv state layout to dim-first"
        )
    mamba_sources = ordered_unique(p.remote_rank for p in pieces)
    all_sources = ordered_unique(list(fa_sources) + list(mamba_sources))
    if preferred is not None:
        all_sources = tuple(q for q in preferred if q in all_sources)
    # one attention descriptor: one head when heads are read one by one, else a source rank's part
    fa_bytes = uhb if per_head else min(local.heads_per_rank, remote.heads_per_rank) * uhb
    fa_rank_offset = fa_reads[0].remote_offset if len(fa_sources) == 1 else 0
    first_read = {}
    for r in fa_reads:
        first_read.setdefault(r.remote_rank, r)
    slots = tuple((q, r.local_offset // fa_bytes) for q, r in first_read.items())
    split: list[tuple[int, tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]] = []
    for q in all_sources:
        fa = tuple((r.local_offset, r.length) for r in fa_reads if r.remote_rank == q)
        mm = tuple((p.local_offset, p.length) for p in pieces if p.remote_rank == q)
        split.append((q, fa, mm))
    return MambaFacts(
        fa_source_ranks=fa_sources,
        all_source_ranks=all_sources,
        num_fa_reads=len(fa_sources),
        num_mamba_reads=len(mamba_sources),
        fa_descriptor_bytes=fa_bytes,
        fa_rank_offset=fa_rank_offset,
        fa_head_slots=slots,
        needs_split_handles=len(all_sources) > 1,
        remote_replicated=remote.is_replicated,
        remote_physical_heads=remote.heads_per_rank,
        fa_emptied_ranks=tuple(q for q in all_sources if q not in fa_sources),
        mamba_pieces=tuple(pieces),
        local_split=tuple(split),
    )
