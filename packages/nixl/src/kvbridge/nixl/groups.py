"""KV-cache groups as the engine moves them: per-group block ids and how they pair up.

Every call that takes block ids takes :data:`~kvbridge.topology.BlockIds`: one
tuple per group, in the order of ``EngineSpec.groups``. An engine without
declared groups (``EngineSpec.groups`` empty) has one FULL group of every layer,
so it takes ``(ids,)``. Pairing per group (see :class:`~kvbridge.topology.GroupKind`): FULL pairs
the blocks in token order; SLIDING does the same and drops every pair in which
either id is ``EngineConfig.null_block_id``; MAMBA pairs the last non-null block
of each side and moves the plan's Mamba state pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.memory import CacheRegions, RankDescriptors, block_id_array
from kvbridge.topology import BlockIds, EngineSpec, GroupKind

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class EngineGroup:
    """One KV-cache group as an engine sees it: its kind and the regions holding its layers
    (None: every region)."""

    kind: GroupKind
    regions: tuple[int, ...] | None = None

    @property
    def attention(self) -> bool:
        return self.kind is not GroupKind.MAMBA


def engine_groups(spec: EngineSpec, regions: CacheRegions) -> tuple[EngineGroup, ...]:
    """The engine's groups with their regions; raises ValueError for groups that cannot be moved."""
    if not spec.groups:
        if spec.mamba is not None:
            raise ValueError(
                f"engine {spec.engine_id!r} is a Mamba hybrid but declares no KV-cache groups: "
                "name its attention and Mamba groups in EngineSpec.groups (CacheGroup), so the "
                "engine knows which block ids hold the Mamba state"
            )
        return (EngineGroup(GroupKind.FULL),)
    out = []
    for i, g in enumerate(spec.groups):
        regs = regions.group_regions(g.layers)
        if not regs:
            raise ValueError(
                f"engine {spec.engine_id!r}: KV-cache group {i} ({g.kind.value}, layers "
                f"{list(g.layers)[:8]}) names no layer of the registered cache; CacheGroup.layers "
                "are positions in the KV-cache mapping"
            )
        if g.kind is GroupKind.MAMBA and not any(regions.regions[r].mamba_layers for r in regs):
            raise ValueError(f"engine {spec.engine_id!r}: Mamba group {i} names no Mamba layer")
        every = len(regs) == len(regions.regions)
        out.append(EngineGroup(g.kind, None if every else regs))
    return tuple(out)


def group_arrays(ids: BlockIds, n_groups: int, num_blocks: int, what: str) -> tuple[np.ndarray, ...]:
    """Per-group block ids (:data:`~kvbridge.topology.BlockIds`) as one checked ``int64``
    array per group.

    ``ids`` holds exactly ``n_groups`` groups, each a sequence (or 1-D array) of ids
    inside ``0 .. num_blocks - 1``. Raises ``ValueError`` saying what to pass for a flat
    list of ids, a wrong number of groups or ids outside the cache.
    """
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise ValueError(f"{what} block ids must be one sequence of ids per KV-cache group, "
                         f"got {type(ids).__name__}")
    if (isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype != object) or any(
            isinstance(g, (int, np.integer)) for g in ids):
        raise ValueError(
            f"{what} block ids are one flat list, but this engine has {n_groups} KV-cache "
            f"group{'s' if n_groups != 1 else ''}: pass one tuple of ids per group, in the order "
            f"of EngineSpec.groups ({'(ids,)' if n_groups == 1 else '(ids_0, ids_1, ...)'})"
        )
    if len(ids) != n_groups:
        raise ValueError(
            f"{what} block ids: expected {n_groups} KV-cache group(s) (one tuple per group, in "
            f"the order of EngineSpec.groups), got {len(ids)}"
        )
    return tuple(block_id_array(g, num_blocks, f"{what} (group {i})") for i, g in enumerate(ids))


def flat_ids(groups: tuple[np.ndarray, ...], null: int | None,
             kinds: tuple[EngineGroup, ...] | None = None, attention_only: bool = False) -> np.ndarray:
    """Every group's ids in one array, null ids left out (``attention_only``: FULL and
    SLIDING groups only)."""
    parts = [g for i, g in enumerate(groups)
             if not (attention_only and kinds is not None and not kinds[i].attention)]
    out = np.concatenate(parts) if parts else _EMPTY
    return out if null is None else out[out != null]


def _last(ids: np.ndarray, null: int | None) -> np.ndarray:
    if null is not None:
        ids = ids[ids != null]
    return ids[-1:]


def pair_indices(rd: RankDescriptors, groups: tuple[EngineGroup, ...],
                 local: tuple[np.ndarray, ...], remote: tuple[np.ndarray, ...], *,
                 skip: int | None, null: int | None, layers: Sequence[int] | None = None,
                 attention: bool = True, mamba: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(local_idx, remote_idx)`` of one request's descriptors against one remote rank, every
    group paired by its kind. ``local`` / ``remote`` are per-group ids of the plan's local
    (decode) and remote (prefill) sides; ``layers`` selects attention layers (layered push);
    ``attention`` / ``mamba`` select the kinds of descriptors."""
    lparts, rparts = [], []
    for g, lids, rids in zip(groups, local, remote, strict=True):
        if g.attention:
            if not attention:
                continue
            li, ri = rd.indices(lids, rids, local_skip_blocks=skip, layers=layers, regions=g.regions)
            if g.kind is GroupKind.SLIDING and null is not None and li.size:
                lb = (li.astype(np.int64) % rd.local_kernel_blocks) // rd.local_kernel_per_block
                rb = (ri.astype(np.int64) % rd.remote_kernel_blocks) // rd.remote_kernel_per_block
                keep = (lb != null) & (rb != null)
                li, ri = li[keep], ri[keep]
        else:
            if not mamba:
                continue
            lids, rids = _last(lids, null), _last(rids, null)
            if not lids.size or not rids.size:
                continue
            li, ri = rd.indices(lids, rids, group="mamba", regions=g.regions)
        lparts.append(li)
        rparts.append(ri)
    if not lparts:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    if len(lparts) == 1:
        return lparts[0], rparts[0]
    return np.concatenate(lparts), np.concatenate(rparts)
