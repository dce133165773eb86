"""What a decode rank learns about one prefill rank: agent metadata and memory geometry.

These are msgspec Structs encoded as msgpack *maps* (field names on the wire),
so the schema can evolve: a field added later must have a default, an older
peer's payload without it still decodes, and fields a newer peer adds are
ignored by an older decoder.
"""

from __future__ import annotations

import itertools
import operator

import msgspec

from kvbridge.topology import (
    CacheGroup,
    ConvLayout,
    EngineSpec,
    GroupKind,
    HeadOrder,
    Layout,
    MambaSpec,
)

from .errors import InvalidMetadata
from .wire import Decoder

MEMORY_TYPES = ("DRAM", "VRAM")
_U64 = 1 << 64


class MambaSpecFacts(msgspec.Struct, frozen=True, kw_only=True):
    """Wire form of :class:`kvbridge.topology.MambaSpec` (enums as their string values)."""

    ssm_heads: int
    ssm_head_dim: int
    state_size: int
    n_groups: int
    conv_width: int
    conv_dtype_size: int = 2
    ssm_dtype_size: int = 4
    conv_layout: str = ConvLayout.DIM_FIRST.value

    @classmethod
    def from_spec(cls, spec: MambaSpec) -> MambaSpecFacts:
        return cls(
            ssm_heads=spec.ssm_heads,
            ssm_head_dim=spec.ssm_head_dim,
            state_size=spec.state_size,
            n_groups=spec.n_groups,
            conv_width=spec.conv_width,
            conv_dtype_size=spec.conv_dtype_size,
            ssm_dtype_size=spec.ssm_dtype_size,
            conv_layout=ConvLayout(spec.conv_layout).value,
        )

    def to_spec(self) -> MambaSpec:
        """The topology value; raises TopologyError/ValueError when a field is invalid."""
        return MambaSpec(
            ssm_heads=self.ssm_heads,
            ssm_head_dim=self.ssm_head_dim,
            state_size=self.state_size,
            n_groups=self.n_groups,
            conv_width=self.conv_width,
            conv_dtype_size=self.conv_dtype_size,
            ssm_dtype_size=self.ssm_dtype_size,
            conv_layout=ConvLayout(self.conv_layout),
        )


class CacheGroupFacts(msgspec.Struct, frozen=True, kw_only=True):
    """Wire form of :class:`kvbridge.topology.CacheGroup` (the kind as its string value)."""

    kind: str
    layers: tuple[int, ...]
    block_size: int
    sliding_window: int | None = None

    @classmethod
    def from_group(cls, group: CacheGroup) -> CacheGroupFacts:
        return cls(kind=GroupKind(group.kind).value, layers=tuple(group.layers),
                   block_size=group.block_size, sliding_window=group.sliding_window)

    def to_group(self) -> CacheGroup:
        """The topology value; raises TopologyError when a field is invalid."""
        return CacheGroup(kind=self.kind, layers=tuple(self.layers), block_size=self.block_size,
                          sliding_window=self.sliding_window)


class EngineFacts(msgspec.Struct, frozen=True, kw_only=True):
    """Wire form of :class:`kvbridge.topology.EngineSpec`: every field, enums as strings.

    A decode rank rebuilds the remote engine description from this alone
    (``to_spec()``) and plans against it. ``from_spec(s).to_spec() == s``.
    """

    engine_id: str
    tp_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    block_size: int
    dtype: str = "bf16"
    kernel_blocks_per_block: int = 1
    layout: str = Layout.KV_FIRST.value
    head_order: str = HeadOrder.HND.value
    use_mla: bool = False
    mamba: MambaSpecFacts | None = None
    cross_layer: bool = False
    block_bytes: int | None = None
    extra: tuple[tuple[str, str], ...] = ()
    #: KV-cache groups (empty: one FULL group of every layer; older peers send none)
    groups: tuple[CacheGroupFacts, ...] = ()

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> EngineFacts:
        return cls(
            engine_id=spec.engine_id,
            tp_size=spec.tp_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            num_layers=spec.num_layers,
            block_size=spec.block_size,
            dtype=spec.dtype,
            kernel_blocks_per_block=spec.kernel_blocks_per_block,
            layout=Layout(spec.layout).value,
            head_order=HeadOrder(spec.head_order).value,
            use_mla=spec.use_mla,
            mamba=None if spec.mamba is None else MambaSpecFacts.from_spec(spec.mamba),
            cross_layer=spec.cross_layer,
            block_bytes=spec.block_bytes,
            extra=tuple((str(k), str(v)) for k, v in spec.extra),
            groups=tuple(CacheGroupFacts.from_group(g) for g in spec.groups),
        )

    def to_spec(self) -> EngineSpec:
        """The topology value; raises TopologyError/ValueError when the facts are invalid."""
        return EngineSpec(
            engine_id=self.engine_id,
            tp_size=self.tp_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_layers=self.num_layers,
            block_size=self.block_size,
            dtype=self.dtype,
            kernel_blocks_per_block=self.kernel_blocks_per_block,
            layout=Layout(self.layout),
            head_order=HeadOrder(self.head_order),
            use_mla=self.use_mla,
            mamba=None if self.mamba is None else self.mamba.to_spec(),
            cross_layer=self.cross_layer,
            block_bytes=self.block_bytes,
            extra=tuple((k, v) for k, v in self.extra),
            groups=tuple(g.to_group() for g in self.groups),
        )


class AgentMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a decode rank needs of one prefill rank before its first transfer.

    ``incarnation`` is a fresh value each time the engine starts (see
    :func:`new_incarnation`): a decode rank that sees a new one must drop
    what it learned before. Region ``i`` is ``region_sizes[i]`` bytes at
    ``region_base_addrs[i]`` on device ``device_id`` and holds ``num_blocks``
    blocks of ``block_lens[i]`` bytes. Fields added in later versions must
    have defaults.
    """

    engine_id: str
    incarnation: str
    rank: int
    tp_size: int
    agent_name: str
    agent_metadata: bytes
    memory_type: str
    device_id: int
    region_base_addrs: list[int]
    region_sizes: list[int]
    num_blocks: int
    block_lens: list[int]
    block_size: int
    kernel_blocks_per_block: int
    layout: str
    head_order: str
    attention_backend: str
    engine: EngineFacts

    def spec(self) -> EngineSpec:
        """The remote engine description (``engine.to_spec()``)."""
        return self.engine.to_spec()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _regions_ok(addrs: list[int], sizes: list[int], lens: list[int], num_blocks: int) -> bool:
    """Fast path: True when every region is sound (the slow loop then finds nothing to say)."""
    try:
        if not set(map(type, itertools.chain(addrs, sizes, lens))) <= {int}:
            return False
        return (
            min(addrs) >= 0 and min(sizes) > 0 and min(lens) > 0
            and max(map(operator.add, addrs, sizes)) <= _U64
            and all(map(operator.ge, sizes, [num_blocks * x for x in lens]))
        )
    except (TypeError, ValueError):
        return False


def metadata_problems(md: AgentMetadata, *, check_engine: bool = True) -> list[str]:
    """Every internal inconsistency of ``md`` as a readable sentence (empty when consistent).

    ``check_engine=False`` skips rebuilding the EngineSpec from ``md.engine``
    (for callers that already checked equal engine facts of another rank).
    """
    problems: list[str] = []
    for name in ("engine_id", "incarnation", "agent_name", "attention_backend"):
        value = getattr(md, name)
        if not isinstance(value, str) or not value:
            problems.append(f"{name} must be a non-empty string, got {value!r}")
    for name in ("rank", "device_id"):
        value = getattr(md, name)
        if not _is_int(value) or value < 0:
            problems.append(f"{name} must be a non-negative integer, got {value!r}")
    for name in ("tp_size", "num_blocks", "block_size", "kernel_blocks_per_block"):
        value = getattr(md, name)
        if not _is_int(value) or value <= 0:
            problems.append(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(md.agent_metadata, bytes) or not md.agent_metadata:
        problems.append("agent_metadata must be the non-empty bytes of the NIXL agent metadata")
    if md.memory_type not in MEMORY_TYPES:
        problems.append(f"memory_type must be one of {MEMORY_TYPES}, got {md.memory_type!r}")
    if md.layout not in {x.value for x in Layout}:
        problems.append(f"layout {md.layout!r} is not one of {[x.value for x in Layout]}")
    if md.head_order not in {x.value for x in HeadOrder}:
        problems.append(f"head_order {md.head_order!r} is not one of {[x.value for x in HeadOrder]}")
    if problems:
        return problems

    if md.rank >= md.tp_size:
        problems.append(f"rank {md.rank} is outside TP size {md.tp_size}")
    if md.block_size % md.kernel_blocks_per_block:
        problems.append(
            f"block_size {md.block_size} is not divisible by kernel_blocks_per_block "
            f"{md.kernel_blocks_per_block}"
        )

    n = len(md.region_base_addrs)
    if n == 0:
        problems.append("no memory regions: region_base_addrs is empty")
    if len(md.region_sizes) != n or len(md.block_lens) != n:
        problems.append(
            f"region counts differ: {n} base addresses, {len(md.region_sizes)} sizes, "
            f"{len(md.block_lens)} block lengths (one of each per region)"
        )
    elif not _regions_ok(md.region_base_addrs, md.region_sizes, md.block_lens, md.num_blocks):
        for i, (addr, size, blen) in enumerate(
            zip(md.region_base_addrs, md.region_sizes, md.block_lens, strict=True)
        ):
            if not (_is_int(addr) and _is_int(size) and _is_int(blen)):
                problems.append(f"region {i}: address, size and block length must be integers")
            elif addr < 0 or size <= 0 or blen <= 0:
                problems.append(
                    f"region {i}: address {addr} must be >= 0 and size {size} and block length "
                    f"{blen} positive"
                )
            elif addr + size > _U64:
                problems.append(f"region {i}: address {addr:#x} + size {size} overflows 64 bits")
            elif size < md.num_blocks * blen:
                problems.append(
                    f"region {i}: size {size} is smaller than num_blocks {md.num_blocks} x "
                    f"block length {blen} = {md.num_blocks * blen}"
                )
            if len(problems) >= 8:
                problems.append("(further region problems not listed)")
                break
    # The engine facts must describe this rank's engine.
    e = md.engine
    if check_engine:
        try:
            e.to_spec()
        except (ValueError, TypeError) as exc:  # TopologyError is a ValueError
            problems.append(f"engine facts do not describe a valid engine: {exc}")
    pairs = (
        ("engine_id", md.engine_id, e.engine_id),
        ("tp_size", md.tp_size, e.tp_size),
        ("block_size", md.block_size, e.block_size),
        ("kernel_blocks_per_block", md.kernel_blocks_per_block, e.kernel_blocks_per_block),
        ("layout", md.layout, e.layout),
        ("head_order", md.head_order, e.head_order),
    )
    for name, mine, theirs in pairs:
        if mine != theirs:
            problems.append(f"{name} is {mine!r} but the engine facts say {theirs!r}")
    return problems


def check_metadata(md: AgentMetadata) -> AgentMetadata:
    """Return ``md`` or raise :class:`InvalidMetadata` listing what is inconsistent."""
    if not isinstance(md, AgentMetadata):
        raise InvalidMetadata(f"expected an AgentMetadata, got {type(md).__name__}")
    problems = metadata_problems(md)
    if problems:
        raise InvalidMetadata(
            f"metadata of engine {md.engine_id!r} rank {md.rank!r} is inconsistent: "
            + "; ".join(problems)
        )
    return md


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = Decoder(AgentMetadata)


def encode_metadata(md: AgentMetadata) -> bytes:
    """msgpack bytes of ``md`` (a map: field names on the wire)."""
    return _ENCODER.encode(md)


def decode_metadata(data: bytes) -> AgentMetadata:
    """Decode and type-check (not consistency-check) one AgentMetadata.

    Raises ``msgspec.DecodeError`` (``msgspec.ValidationError`` for wrong types) for any
    bytes that do not decode, invalid UTF-8 and deep nesting included.
    """
    return _DECODER.decode(data)
