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

from .dtypes import canonical_dtype
from .errors import TopologyError
from .heads import check_tp_heads, head_range, ranks_holding
from .spec import ConvLayout, EngineSpec, HeadOrder, mamba_state_layout


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

    def fa_head_slot(self, remote_rank: int) -> int:
        return dict(self.fa_head_slots)[remote_rank]


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


def check_compatible(local: EngineSpec, remote: EngineSpec) -> None:
    """Raise TopologyError for any pair of engines a transfer cannot serve."""
    where = f"local engine {local.engine_id!r} vs remote engine {remote.engine_id!r}"
    if local.engine_id == remote.engine_id:
        raise TopologyError(f"{where}: both sides have the same engine id; give each engine its own id")
    for name, hint in (
        ("num_kv_heads", "both engines must serve the same model"),
        ("head_dim", "both engines must serve the same model"),
        ("num_layers", "both engines must serve the same model"),
        ("use_mla", "both engines must use the same attention (MLA or not)"),
    ):
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            raise TopologyError(f"{where}: {name} differs ({a} vs {b}); {hint}")
    if local.dtype_size != remote.dtype_size or canonical_dtype(local.dtype) != canonical_dtype(remote.dtype):
        raise TopologyError(
            f"{where}: KV cache dtype differs ({local.dtype} vs {remote.dtype}); "
            "run both engines with the same kv-cache dtype"
        )
    _check_packed(local, remote, where)
    if _mamba_shape(local) != _mamba_shape(remote):
        raise TopologyError(
            f"{where}: Mamba state differs ({local.mamba} vs {remote.mamba}); "
            "both engines must serve the same hybrid model"
        )
    for what, a, b in (
        ("block sizes", local.block_size, remote.block_size),
        ("kernel block sizes", local.kernel_block_size, remote.kernel_block_size),
    ):
        if max(a, b) % min(a, b):
            raise TopologyError(
                f"{where}: {what} {a} and {b} tokens do not divide; "
                "the larger block size must be a multiple of the smaller"
            )
    if local.block_size != remote.block_size and local.mamba is not None:
        raise TopologyError(
            f"{where}: hybrid Mamba models need equal block sizes on both sides "
            f"({local.block_size} vs {remote.block_size}); set the same block size"
        )
    if local.cross_layer != remote.cross_layer and local.block_size != remote.block_size:
        raise TopologyError(
            f"{where}: a cross-layer cache on one side only cannot be combined with a block-size "
            "mismatch; use equal block sizes"
        )


def _check_packed(local: EngineSpec, remote: EngineSpec, where: str) -> None:
    """Packed caches pair only with packed caches of the same head order and kernel block size.

    Inside a packed head slice the order of K and V over the tokens is backend-specific
    (K rows then V rows, or K|V per token), so kvbridge never cuts a slice along tokens and
    never rearranges one: reads take whole head slices of whole physical blocks.
    """
    if not (local.is_packed or remote.is_packed):
        return
    if local.layout is not remote.layout:
        raise TopologyError(
            f"{where}: cache layouts {local.layout.value} and {remote.layout.value} cannot be "
            "paired: a packed cache keeps K and V of each head together in a backend-specific "
            "order, so it cannot be split into K and V elements; both engines must use the same "
            "vLLM-style packed cache (layout packed)"
        )
    if local.head_order is not remote.head_order:
        raise TopologyError(
            f"{where}: packed caches with different head orders ({local.head_order.value} vs "
            f"{remote.head_order.value}) would need the tokens inside each head slice rearranged, "
            "whose order is backend-specific; use the same head order (HND) on both engines"
        )
    if local.kernel_block_size != remote.kernel_block_size:
        raise TopologyError(
            f"{where}: packed caches need equal kernel (physical) block sizes, got "
            f"{local.kernel_block_size} and {remote.kernel_block_size} tokens; kvbridge cannot "
            "regroup tokens inside a packed head slice (their order is backend-specific), so use "
            "the same (kernel) block size on both engines"
        )


def _mamba_shape(spec: EngineSpec) -> tuple[int, ...] | None:
    m = spec.mamba
    if m is None:
        return None
    return (m.ssm_heads, m.ssm_head_dim, m.state_size, m.n_groups, m.conv_width,
            m.conv_dtype_size, m.ssm_dtype_size)


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
    fa_sources = _ordered_unique(r.remote_rank for r in reads)
    mamba = None
    sources = fa_sources
    if local.mamba is not None:
        per_head = _remote_units_cut_heads(local, remote)
        mamba = _mamba_facts(local, remote, local_rank, preferred, reads, fa_sources, uhb, per_head)
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


def _ordered_unique(values) -> tuple[int, ...]:
    seen: dict[int, None] = {}
    for v in values:
        seen.setdefault(v, None)
    return tuple(seen)


def _check_head_order(local: EngineSpec, remote: EngineSpec, plan: RankPlan) -> None:
    if local.use_mla:
        return
    split = plan.splits_local or plan.splits_remote()
    if split and remote.head_order is not HeadOrder.HND:
        fix = (
            "set both engines' KV cache layout to HND (packed caches need the same head order)"
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


def _mamba_facts(
    local: EngineSpec,
    remote: EngineSpec,
    local_rank: int,
    preferred: tuple[int, ...] | None,
    fa_reads: tuple[ReadOp, ...],
    fa_sources: tuple[int, ...],
    uhb: int,
    per_head: bool,
) -> MambaFacts:
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
    mamba_sources = _ordered_unique(p.remote_rank for p in pieces)
    all_sources = _ordered_unique(list(fa_sources) + list(mamba_sources))
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

