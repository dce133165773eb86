"""What a decode rank learns about one prefill rank: agent metadata and memory geometry.

These are msgspec Structs encoded as msgpack *maps* (field names on the wire),
so the schema can evolve: a field added later must have a default, an older
peer's payload without it still decodes, and fields a newer peer adds are
ignored by an older decoder.
"""

from __future__ import annotations

import operator
from typing import Annotated, Literal, TypeVar

import msgspec
import msgspec.inspect

from kvbridge.topology import (
    CacheGroup,
    ConvLayout,
    EngineSpec,
    HeadOrder,
    Layout,
    MambaSpec,
    TopologyError,
)

from .errors import InvalidMetadata
from .wire import Decoder

_F = TypeVar("_F", bound=msgspec.Struct)
_R = TypeVar("_R")

MEMORY_TYPES = ("DRAM", "VRAM")
_U64 = 1 << 64

#: value types with the bounds the decoder checks (msgspec constraints)
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
Address = NonNegative  # (below 2**64 with its size: checked with the region)
MemoryType = Literal["DRAM", "VRAM"]
LayoutName = Literal[tuple(x.value for x in Layout)]  # type: ignore[valid-type]
HeadOrderName = Literal[tuple(x.value for x in HeadOrder)]  # type: ignore[valid-type]


def _facts(value: object, facts_type: type[_F]) -> _F:
    """A topology record (frozen dataclass) as its wire form: the same fields, enums as
    their string values."""
    return msgspec.convert(msgspec.to_builtins(value), facts_type)


def _record(facts: msgspec.Struct, record_type: type[_R]) -> _R:
    """The topology record a wire form describes; raises TopologyError (the record's own
    checks, or a field of the wrong type or value) when it describes none."""
    try:
        return msgspec.convert(facts, record_type, from_attributes=True)
    except msgspec.ValidationError as exc:
        raise TopologyError(str(exc)) from None


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
        return _facts(spec, cls)

    def to_spec(self) -> MambaSpec:
        """The topology value; raises TopologyError/ValueError when a field is invalid."""
        return _record(self, MambaSpec)


class CacheGroupFacts(msgspec.Struct, frozen=True, kw_only=True):
    """Wire form of :class:`kvbridge.topology.CacheGroup` (the kind as its string value)."""

    kind: str
    layers: tuple[int, ...]
    block_size: int
    sliding_window: int | None = None

    @classmethod
    def from_group(cls, group: CacheGroup) -> CacheGroupFacts:
        return _facts(group, cls)

    def to_group(self) -> CacheGroup:
        """The topology value; raises TopologyError when a field is invalid."""
        return _record(self, CacheGroup)


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
        return _facts(spec, cls)

    def to_spec(self) -> EngineSpec:
        """The topology value; raises TopologyError/ValueError when the facts are invalid."""
        return _record(self, EngineSpec)


class AgentMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a decode rank needs of one prefill rank before its first transfer.

    ``incarnation`` is a fresh value each time the engine starts (see
    :func:`new_incarnation`): a decode rank that sees a new one must drop
    what it learned before. Region ``i`` is ``region_sizes[i]`` bytes at
    ``region_base_addrs[i]`` on device ``device_id`` and holds ``num_blocks``
    blocks of ``block_lens[i]`` bytes. Fields added in later versions must
    have defaults.

    The field types carry the bounds of each value (checked when decoding, and by
    :func:`metadata_problems` for a value built here); :func:`metadata_problems`
    adds what relates several fields.
    """

    engine_id: NonEmptyStr
    incarnation: NonEmptyStr
    rank: NonNegative
    tp_size: Positive
    agent_name: NonEmptyStr
    agent_metadata: Annotated[bytes, msgspec.Meta(min_length=1)]
    memory_type: MemoryType
    device_id: NonNegative
    region_base_addrs: list[Address]
    region_sizes: list[Positive]
    num_blocks: Positive
    block_lens: list[Positive]
    block_size: Positive
    kernel_blocks_per_block: Positive
    layout: LayoutName
    head_order: HeadOrderName
    attention_backend: NonEmptyStr
    engine: EngineFacts

    def spec(self) -> EngineSpec:
        """The remote engine description (``engine.to_spec()``)."""
        return self.engine.to_spec()


def _value_problem(md: AgentMetadata) -> str | None:
    """The first field of ``md`` outside the bounds of its type (None: all within)."""
    try:
        fields = msgspec.to_builtins(md, builtin_types=(bytes,))
    except TypeError as exc:  # a value msgpack cannot carry (a numpy integer, an object)
        return f"a field holds a value that cannot be sent: {exc}"
    try:
        msgspec.convert(fields, AgentMetadata, builtin_types=(bytes,))
    except msgspec.ValidationError as exc:
        text = str(exc)
        name = text.rsplit("`$.", 1)[-1].split("`")[0].split("[")[0] if "`$." in text else ""
        field = next((f for f in msgspec.inspect.type_info(AgentMetadata).fields
                      if f.name == name), None)
        if field is not None and isinstance(field.type, msgspec.inspect.LiteralType):
            text += f"; {name} must be one of {field.type.values}"
        return text
    return None


def metadata_problems(md: AgentMetadata, *, check_engine: bool = True) -> list[str]:
    """Every internal inconsistency of ``md`` as a readable sentence (empty when consistent).

    A value outside the bounds of its field's type is reported alone (the first
    one found); otherwise every relation between fields that does not hold.
    ``check_engine=False`` skips rebuilding the EngineSpec from ``md.engine``
    (for callers that already checked equal engine facts of another rank).
    """
    problem = _value_problem(md)
    if problem is not None:
        return [problem]
    problems: list[str] = []
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
    elif n and not (max(map(operator.add, md.region_base_addrs, md.region_sizes)) <= _U64
                    and all(map(operator.ge, md.region_sizes,
                                [md.num_blocks * x for x in md.block_lens]))):
        for i, (addr, size, blen) in enumerate(
            zip(md.region_base_addrs, md.region_sizes, md.block_lens, strict=True)
        ):
            if addr + size > _U64:
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
