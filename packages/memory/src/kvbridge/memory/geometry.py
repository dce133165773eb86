"""Plain-number geometry of one side's registered regions.

A :class:`RegionGeometry` is what descriptor building needs and nothing more:
it is made either from local :class:`~kvbridge.memory.regions.CacheRegions`
or from the numbers a remote peer sent in its handshake, so this module never
touches tensors and never imports the handshake package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.topology import EngineSpec, element_layout

from .errors import MemoryLayoutError
from .kernel import kernel_spec

if TYPE_CHECKING:  # pragma: no cover
    from .regions import CacheRegions

MEM_TYPES = ("DRAM", "VRAM")


def _as_int_tuple(values: Sequence[int] | int, n: int | None, what: str) -> tuple[int, ...]:
    if isinstance(values, int):
        if n is None:
            raise MemoryLayoutError(f"{what}: give one value per region")
        values = [values] * n
    out = tuple(int(v) for v in values)
    if n is not None and len(out) != n:
        raise MemoryLayoutError(f"{what}: expected {n} values (one per region), got {len(out)}")
    return out


@dataclass(frozen=True)
class RegionGeometry:
    """Where every block element of one rank's cache sits, in plain numbers.

    ``block_strides[i]`` is the byte distance between consecutive *logical*
    blocks of region ``i``; a logical block holds ``kernel_blocks_per_block``
    kernel blocks of ``block_stride // kernel_blocks_per_block`` bytes each, and
    each kernel block holds elements of ``element_bytes`` at ``element_offsets``.
    ``block_tokens`` is the logical block size in tokens. ``element_roles``
    gives the ``(layer, kind)`` of every (region, element) pair, region-major
    (empty when unknown, e.g. elements shared by several layers); descriptor
    building pairs the two sides' elements by these roles, so engines with
    different layouts (kv-first, blocks-first, cross-layer) line up.
    """

    base_addrs: tuple[int, ...]
    block_strides: tuple[int, ...]
    num_blocks: int
    block_tokens: int
    kernel_blocks_per_block: int
    element_bytes: int
    element_offsets: tuple[int, ...]
    device_id: int = 0
    mem_type: str = "VRAM"
    element_roles: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.base_addrs:
            raise MemoryLayoutError("a geometry needs at least one region")
        if self.element_roles and len(self.element_roles) != (
                len(self.base_addrs) * len(self.element_offsets)):
            raise MemoryLayoutError(
                f"{len(self.element_roles)} element roles for {len(self.base_addrs)} regions x "
                f"{len(self.element_offsets)} elements; give one (layer, kind) per region element"
            )
        if len(self.block_strides) != len(self.base_addrs):
            raise MemoryLayoutError(
                f"{len(self.base_addrs)} base addresses but {len(self.block_strides)} block strides; "
                "give one block length per region"
            )
        for name in ("num_blocks", "block_tokens", "kernel_blocks_per_block", "element_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise MemoryLayoutError(f"geometry {name} must be a positive integer, got {v!r}")
        if self.mem_type not in MEM_TYPES:
            raise MemoryLayoutError(f"mem_type must be one of {MEM_TYPES}, got {self.mem_type!r}")
        if self.device_id < 0:
            raise MemoryLayoutError(f"device_id must be >= 0, got {self.device_id}")
        n = self.kernel_blocks_per_block
        if self.block_tokens % n:
            raise MemoryLayoutError(
                f"block of {self.block_tokens} tokens does not split into {n} kernel blocks"
            )
        end = max(self.element_offsets, default=0) + self.element_bytes
        for i, (addr, stride) in enumerate(zip(self.base_addrs, self.block_strides, strict=False)):
            if addr < 0 or stride <= 0:
                raise MemoryLayoutError(f"region {i}: bad base address {addr} or block length {stride}")
            if stride % n:
                raise MemoryLayoutError(
                    f"region {i}: block length {stride} is not divisible by {n} kernel blocks"
                )
            if end > stride // n:
                raise MemoryLayoutError(
                    f"region {i}: elements end at byte {end} of a kernel block but the block is only "
                    f"{stride // n} bytes; the block length does not match the engine description"
                )

    # ----- derived -------------------------------------------------------
    @property
    def num_regions(self) -> int:
        return len(self.base_addrs)

    @property
    def elements_per_block(self) -> int:
        return len(self.element_offsets)

    @property
    def num_kernel_blocks(self) -> int:
        return self.num_blocks * self.kernel_blocks_per_block

    @property
    def kernel_block_tokens(self) -> int:
        return self.block_tokens // self.kernel_blocks_per_block

    @property
    def kernel_strides(self) -> tuple[int, ...]:
        n = self.kernel_blocks_per_block
        return tuple(s // n for s in self.block_strides)

    @property
    def region_sizes(self) -> tuple[int, ...]:
        return tuple(s * self.num_blocks for s in self.block_strides)

    # ----- constructors --------------------------------------------------
    @classmethod
    def from_regions(cls, regions: CacheRegions) -> RegionGeometry:
        """Geometry of local regions made by :func:`regions_from_kv_caches`."""
        regs = regions.regions
        first = regs[0]
        for r in regs[1:]:
            if r.element_bytes != first.element_bytes or r.element_offsets != first.element_offsets:
                raise MemoryLayoutError(
                    "regions differ in element geometry; every region of one engine must hold "
                    "the same K/V elements"
                )
        return cls(
            base_addrs=tuple(r.base_addr for r in regs),
            block_strides=tuple(r.block_stride for r in regs),
            num_blocks=regions.num_blocks,
            block_tokens=regions.spec.block_size,
            kernel_blocks_per_block=regions.spec.kernel_blocks_per_block,
            element_bytes=first.element_bytes,
            element_offsets=first.element_offsets,
            device_id=regions.device_id,
            mem_type=regions.mem_type,
            element_roles=_single_roles(regs),
        )

    @classmethod
    def from_remote(
        cls,
        spec: EngineSpec,
        base_addrs: Sequence[int],
        num_blocks: int,
        block_lens: Sequence[int] | int,
        *,
        device_id: int = 0,
        mem_type: str = "VRAM",
    ) -> RegionGeometry:
        """Geometry of a peer rank from its handshake numbers.

        ``base_addrs``: one per registered region, in the peer's region order;
        ``num_blocks``: logical blocks per region; ``block_lens``: bytes between
        consecutive logical blocks, per region (or one value for all). Element
        sizes and offsets follow from the peer's engine ``spec``.
        """
        lay = element_layout(kernel_spec(spec))
        addrs = _as_int_tuple(base_addrs, None, "base_addrs")
        if len(addrs) != lay.regions:
            raise MemoryLayoutError(
                f"remote engine {spec.engine_id!r} sent {len(addrs)} regions but its description "
                f"({spec.num_layers} layers, {spec.layout.value}, mla={spec.use_mla}, "
                f"cross_layer={spec.cross_layer}) has {lay.regions}"
            )
        return cls(
            base_addrs=addrs,
            block_strides=_as_int_tuple(block_lens, len(addrs), "block_lens"),
            num_blocks=int(num_blocks),
            block_tokens=spec.block_size,
            kernel_blocks_per_block=spec.kernel_blocks_per_block,
            element_bytes=lay.element_bytes,
            element_offsets=lay.element_offsets,
            device_id=int(device_id),
            mem_type=mem_type,
            element_roles=lay.element_roles,
        )


def _single_roles(regs) -> tuple[tuple[int, int], ...]:
    """Region-major roles when every element holds exactly one (layer, kind), else ()."""
    out: list[tuple[int, int]] = []
    for r in regs:
        for roles in r.roles:
            if len(roles) != 1:
                return ()
            out.append(tuple(roles[0]))
    return tuple(out)
