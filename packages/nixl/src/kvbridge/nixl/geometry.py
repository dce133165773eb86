"""Descriptor geometry: where a rank's blocks live, and which descriptors a request needs.

A rank's cache is a set of *regions* (one per layer, or per layer and K/V),
each ``num_blocks`` blocks of ``block_bytes`` bytes; one block of a region
holds ``len(element_offsets)`` elements (K, V or the MLA latent). Flattening
(region, element) in order gives the *roles* (layer, kind) in the same order
on every layout, which is how two engines with different layouts line up.

Descriptor lists are built per (peer rank, read set): one row per
(role, unit, read) with ``count = num_blocks`` blocks spaced ``block_bytes``
apart (the N x 5 strided form), so descriptor index
``((role * units + unit) * reads + k) * num_blocks + block``. Consecutive block
ids are consecutive indices on both sides, which NIXL merges into one larger
transfer. Everything is numpy; nothing loops over blocks in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.topology import ElementLayout, ReadOp


@dataclass(frozen=True)
class CacheGeometry:
    """Addresses of one rank's registered cache."""

    region_bases: tuple[int, ...]
    num_blocks: int
    block_bytes: int
    element_offsets: tuple[int, ...]
    element_bytes: int
    device: int = 0

    def __post_init__(self) -> None:
        if not self.region_bases:
            raise ValueError("a cache needs at least one region")
        if self.num_blocks <= 0 or self.block_bytes <= 0 or self.element_bytes <= 0:
            raise ValueError("num_blocks, block_bytes and element_bytes must be positive")
        if any(o < 0 or o + self.element_bytes > self.block_bytes for o in self.element_offsets):
            raise ValueError(
                f"element offsets {self.element_offsets} of {self.element_bytes} bytes do not fit in "
                f"a block of {self.block_bytes} bytes"
            )

    @classmethod
    def from_layout(cls, region_bases: Sequence[int], num_blocks: int, layout: ElementLayout,
                    device: int = 0) -> CacheGeometry:
        if len(region_bases) != layout.regions:
            raise ValueError(f"layout has {layout.regions} regions but {len(region_bases)} bases were given")
        return cls(tuple(int(b) for b in region_bases), int(num_blocks), layout.region_block_bytes,
                   layout.element_offsets, layout.element_bytes, device)

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def registration(self) -> np.ndarray:
        """N x 3 (address, length, device) rows, one per region."""
        n = len(self.region_bases)
        out = np.empty((n, 3), dtype=np.uint64)
        out[:, 0] = self.region_bases
        out[:, 1] = self.region_bytes
        out[:, 2] = self.device
        return out

    def role_bases(self) -> np.ndarray:
        """Base address of each role (region-major, element-minor)."""
        bases = np.asarray(self.region_bases, dtype=np.uint64)[:, None]
        offs = np.asarray(self.element_offsets, dtype=np.uint64)[None, :]
        return (bases + offs).reshape(-1)

    @property
    def roles(self) -> int:
        return len(self.region_bases) * len(self.element_offsets)


@dataclass(frozen=True)
class Side:
    """One side of a read set: which geometry, how many units per block, unit size."""

    geometry: CacheGeometry
    units_per_block: int
    unit_bytes: int


def strided_descs(side: Side, pieces: Sequence[tuple[int, int]]) -> np.ndarray:
    """N x 5 rows for ``pieces`` = (offset in unit, length) of every unit of every block.

    Row order: role, unit, piece; each row covers all blocks.
    """
    g = side.geometry
    roles = g.role_bases()
    units = np.arange(side.units_per_block, dtype=np.uint64) * np.uint64(side.unit_bytes)
    offs = np.asarray([p[0] for p in pieces], dtype=np.uint64)
    lens = np.asarray([p[1] for p in pieces], dtype=np.uint64)
    addr = roles[:, None, None] + units[None, :, None] + offs[None, None, :]
    n = addr.size
    out = np.empty((n, 5), dtype=np.uint64)
    out[:, 0] = addr.reshape(-1)
    out[:, 1] = np.broadcast_to(lens[None, None, :], addr.shape).reshape(-1)
    out[:, 2] = g.device
    out[:, 3] = g.block_bytes
    out[:, 4] = g.num_blocks
    return out


def remote_pieces(reads: Sequence[ReadOp]) -> list[tuple[int, int]]:
    return [(r.remote_offset, r.length) for r in reads]


def local_pieces(reads: Sequence[ReadOp]) -> list[tuple[int, int]]:
    return [(r.local_offset, r.length) for r in reads]


def unit_pairs(local_ids: Sequence[int] | np.ndarray, remote_ids: Sequence[int] | np.ndarray,
               local_units: int, remote_units: int, skip_remote_units: int = 0
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Matched transfer units in token order: (local block, local unit, remote block, remote unit).

    The side with larger blocks has several units per block. ``skip_remote_units``
    drops leading remote units (tokens the local side already has: a prefix hit).
    Units past the end of the shorter side are left out.
    """
    lid = np.asarray(local_ids, dtype=np.int64).reshape(-1)
    rid = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    n = min(lid.size * local_units, rid.size * remote_units - skip_remote_units)
    n = max(n, 0)
    g = np.arange(n, dtype=np.int64)
    rg = g + skip_remote_units
    return lid[g // local_units], g % local_units, rid[rg // remote_units], rg % remote_units


def request_indices(blocks: np.ndarray, units: np.ndarray, roles: int, units_per_block: int,
                    pieces: int, num_blocks: int) -> np.ndarray:
    """int32 descriptor indices of (role, piece, unit-pair) for one side of a request.

    Order: role-major, then piece, then the matched units in token order.
    """
    r = np.arange(roles, dtype=np.int64)[:, None, None]
    k = np.arange(pieces, dtype=np.int64)[None, :, None]
    row = (r * units_per_block + units[None, None, :]) * pieces + k
    idx = row * num_blocks + blocks[None, None, :]
    if idx.size and idx.max() >= np.iinfo(np.int32).max:
        raise ValueError("descriptor index exceeds int32; use fewer blocks per prepared list")
    return idx.reshape(-1).astype(np.int32)


def check_block_ids(ids: np.ndarray, num_blocks: int, what: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)][:5].tolist()
        raise ValueError(f"{what} block ids {bad} are outside 0..{num_blocks - 1}")
