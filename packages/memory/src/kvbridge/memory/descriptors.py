"""Descriptor arrays for one remote rank of a read plan (numpy only, no per-block loops).

For each remote rank that a local rank reads, NIXL needs two prepared lists:
the *remote* list (descriptors inside the remote rank's registered regions)
and the matching *local split* list (where those bytes land locally). Both are
made once per (remote engine, remote rank); a request then selects descriptors
by index (:meth:`RankDescriptors.indices`).

Row model. A descriptor row is one (region, element, read, transfer unit) for
attention, or one (region, Mamba piece) for hybrid models; it stands for one
descriptor per block, ``stride`` bytes apart. Within an element, unit ``u`` of a
read sits at ``offset + u * unit step``: the local step is ``local_unit_bytes``,
the remote step ``RankPlan.remote_unit_stride`` (one head's unit bytes when a
larger remote HND block holding several heads is read head by head).
Descriptor ``start(row) + b`` is block ``b`` of ``row`` (kernel block for
attention, page for Mamba), so consecutive blocks are consecutive indices. The strided ``N x 5`` form is the
row table itself: O(rows) = O(regions x reads x units), independent of the
number of blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.topology import KIND_KV, RankPlan

from .blockids import block_id_array
from .errors import MemoryLayoutError
from .geometry import RegionGeometry

_U64 = np.uint64
_I32_MAX = np.iinfo(np.int32).max


def expand_strided(rows: np.ndarray) -> np.ndarray:
    """``N x 5`` strided rows -> the ``M x 3`` descriptors they stand for, in order.

    Each row is written with a few whole-column numpy operations: the cost is
    O(rows) Python steps plus one pass over the output memory.
    """
    rows = np.asarray(rows, dtype=_U64)
    if rows.ndim != 2 or rows.shape[1] != 5:
        raise MemoryLayoutError(f"strided descriptors must be N x 5, got shape {rows.shape}")
    counts = rows[:, 4].astype(np.int64)
    total = int(counts.sum())
    out = np.empty((total, 3), dtype=_U64)
    if total == 0:
        return out
    # one vectorised write per row and column (long contiguous inner loops); O(rows) Python
    pos = 0
    steps: dict[tuple[int, int], np.ndarray] = {}
    for row, cnt in zip(rows, counts.tolist(), strict=True):
        if cnt == 0:
            continue
        seg = out[pos:pos + cnt]
        key = (cnt, int(row[3]))
        if key not in steps:
            steps[key] = np.arange(cnt, dtype=_U64) * row[3]
        np.add(steps[key], row[0], out=seg[:, 0])
        seg[:, 1] = row[1]
        seg[:, 2] = row[2]
        pos += cnt
    return out


def _units(kernel_tokens: int, unit_tokens: int, side: str) -> int:
    if unit_tokens <= 0 or kernel_tokens % unit_tokens:
        raise MemoryLayoutError(
            f"the plan's transfer unit of {unit_tokens} tokens does not divide the {side} kernel "
            f"block of {kernel_tokens} tokens; make the plan with kernel_spec() of both engines"
        )
    return kernel_tokens // unit_tokens


@dataclass(frozen=True, eq=False)
class RankDescriptors:
    """Prepared-list geometry of one local rank against one remote rank.

    ``local_rows`` / ``remote_rows`` are the strided ``N x 5`` tables; the
    attention rows come first, then the Mamba rows (hybrid models). The counts
    and sizes below are what :meth:`indices` needs to address them.
    """

    remote_rank: int
    local_rows: np.ndarray
    remote_rows: np.ndarray
    #: attention rows per side = keys * units; keys = regions * elements * reads
    attn_keys: int
    local_units: int
    remote_units: int
    local_kernel_blocks: int
    remote_kernel_blocks: int
    local_kernel_per_block: int
    remote_kernel_per_block: int
    local_block_tokens: int
    remote_block_tokens: int
    unit_tokens: int
    #: Mamba rows per side (region x piece), one descriptor per page
    mamba_rows: int
    local_pages: int
    remote_pages: int
    #: whether the engines are hybrid attention + Mamba models
    has_mamba: bool = False
    #: the layer of each local role (region-major (region, element) pair), from the local
    #: geometry's ``element_roles``; empty when unknown (elements shared by several layers)
    local_role_layers: tuple[int, ...] = ()
    #: local regions (attention keys and Mamba rows are region-major; 0: unknown)
    local_regions: int = 0

    # ----- the lists -----------------------------------------------------
    def local_descs(self, strided: bool = False) -> np.ndarray:
        """The local split list: ``N x 5`` rows if ``strided`` else ``M x 3`` descriptors."""
        return self.local_rows.copy() if strided else expand_strided(self.local_rows)

    def remote_descs(self, strided: bool = False) -> np.ndarray:
        """The remote prepared list: ``N x 5`` rows if ``strided`` else ``M x 3`` descriptors."""
        return self.remote_rows.copy() if strided else expand_strided(self.remote_rows)

    @property
    def num_local_descs(self) -> int:
        return int(self.local_rows[:, 4].sum()) if len(self.local_rows) else 0

    @property
    def num_remote_descs(self) -> int:
        return int(self.remote_rows[:, 4].sum()) if len(self.remote_rows) else 0

    @property
    def local_attn_descs(self) -> int:
        return self.attn_keys * self.local_units * self.local_kernel_blocks

    @property
    def remote_attn_descs(self) -> int:
        return self.attn_keys * self.remote_units * self.remote_kernel_blocks

    # ----- request indices ----------------------------------------------
    def indices(
        self,
        local_ids: Sequence[int] | np.ndarray,
        remote_ids: Sequence[int] | np.ndarray,
        *,
        group: str = "attention",
        local_skip_blocks: int | None = None,
        layers: Sequence[int] | None = None,
        regions: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(local_idx, remote_idx)`` int32 arrays selecting one request's descriptors.

        ``local_ids`` / ``remote_ids`` are the request's *logical* block ids of
        one KV-cache group. Attention (``group="attention"``): ``remote_ids``
        cover the prompt from its first token and ``local_ids`` start at local
        block ``local_skip_blocks`` (a partial prefix hit: blocks the local
        engine already has are not read). ``None`` means
        ``len(remote_ids) - len(local_ids)`` when both block sizes are equal,
        else 0. Units are paired in token order; units past the end of either
        list are left out. Mamba (``group="mamba"``): the state pages pair
        up from the end (``remote_ids[-len(local_ids):]``).

        ``layers`` (attention only) keeps the descriptors of those model layers
        alone, in the same order: a layer-by-layer transfer selects each layer's
        share as soon as it is computed. None selects every layer.

        ``regions`` (local region indices) keeps the descriptors of those regions
        alone: the regions of one KV-cache group when groups do not share every
        region. None selects every region.
        """
        if group == "attention":
            lidx, ridx = self._attn_indices(local_ids, remote_ids, local_skip_blocks, layers)
            first, per_region = 0, self.local_kernel_blocks * self.local_units * (
                self.attn_keys // max(1, self.local_regions))
        elif layers is not None:
            raise MemoryLayoutError("layers selects attention descriptors only; the Mamba state "
                                    "moves with the whole request")
        elif group == "mamba":
            lidx, ridx = self._mamba_indices(local_ids, remote_ids)
            first, per_region = self.local_attn_descs, self.local_pages * (
                self.mamba_rows // max(1, self.local_regions))
        else:
            raise MemoryLayoutError(f"group must be 'attention' or 'mamba', got {group!r}")
        if regions is None or not lidx.size:
            return lidx, ridx
        if not self.local_regions:
            raise MemoryLayoutError("these descriptors do not know their regions; cannot select some")
        keep = np.isin((lidx.astype(np.int64) - first) // per_region,
                       np.asarray(list(regions), dtype=np.int64))
        return lidx[keep], ridx[keep]

    def _attn_keys(self, layers: Sequence[int] | None) -> np.ndarray:
        """The attention keys (role x read) to select, all of them when ``layers`` is None."""
        keys = np.arange(self.attn_keys, dtype=np.int64)
        if layers is None:
            return keys
        if not self.local_role_layers:
            raise MemoryLayoutError(
                "this cache's elements hold several layers (or their roles are unknown), so a "
                "transfer cannot select single layers; move the whole request instead"
            )
        role_layer = np.asarray(self.local_role_layers, dtype=np.int64)
        reads = self.attn_keys // len(role_layer)
        want = np.asarray(sorted({int(x) for x in layers}), dtype=np.int64)
        return keys[np.isin(role_layer[keys // reads], want)]

    def _attn_indices(self, local_ids, remote_ids, skip: int | None, layers: Sequence[int] | None):
        lids = block_id_array(local_ids, self.local_kernel_blocks // self.local_kernel_per_block,
                              "local")
        rids = block_id_array(remote_ids,
                              self.remote_kernel_blocks // self.remote_kernel_per_block, "remote")
        if skip is None:
            skip = max(0, len(rids) - len(lids)) if (
                self.local_block_tokens == self.remote_block_tokens) else 0
        if skip < 0:
            raise MemoryLayoutError(f"local_skip_blocks must be >= 0, got {skip}")
        if self.local_kernel_per_block == self.remote_kernel_per_block == 1 and (
                self.local_units == self.remote_units == 1):
            return self._same_block_indices(lids, rids, skip, layers)
        return self._unit_indices(lids, rids, skip, layers)

    def _same_block_indices(self, lids: np.ndarray, rids: np.ndarray, skip: int,
                            layers: Sequence[int] | None = None):
        """One descriptor per (key, block) on both sides: local block ``i`` pairs with remote
        block ``skip + i`` (the common case; a few whole-array operations)."""
        n = min(len(lids), len(rids) - skip)
        keys = self._attn_keys(layers)[:, None]
        if keys.size == 0 or n <= 0:
            return np.empty(0, np.int32), np.empty(0, np.int32)
        lidx = keys * self.local_kernel_blocks + lids[None, :n]
        ridx = keys * self.remote_kernel_blocks + rids[None, skip:skip + n]
        return _i32(lidx.ravel()), _i32(ridx.ravel())

    def _unit_indices(self, lids: np.ndarray, rids: np.ndarray, skip: int,
                      layers: Sequence[int] | None = None):
        """The general pairing: kernel-split blocks and transfer units, in token order."""
        nl, nr = self.local_kernel_per_block, self.remote_kernel_per_block
        lk = (lids[:, None] * nl + np.arange(nl, dtype=np.int64)).ravel()
        rk = (rids[:, None] * nr + np.arange(nr, dtype=np.int64)).ravel()
        lu, ru = self.local_units, self.remote_units
        skip_u = skip * (self.local_block_tokens // self.unit_tokens)
        end = min(skip_u + len(lk) * lu, len(rk) * ru)
        g = np.arange(skip_u, max(end, skip_u), dtype=np.int64)
        if self.attn_keys == 0 or len(g) == 0:
            return np.empty(0, np.int32), np.empty(0, np.int32)
        lpos = g - skip_u
        lblock, lunit = lk[lpos // lu], lpos % lu
        rblock, runit = rk[g // ru], g % ru
        if lu > 1 or ru > 1:  # unit-major so that consecutive blocks stay consecutive
            order = np.lexsort((g, runit, lunit))
            lblock, lunit, rblock, runit = lblock[order], lunit[order], rblock[order], runit[order]
        keys = self._attn_keys(layers)[:, None]
        if keys.size == 0:
            return np.empty(0, np.int32), np.empty(0, np.int32)
        lidx = (keys * lu + lunit[None, :]) * self.local_kernel_blocks + lblock[None, :]
        ridx = (keys * ru + runit[None, :]) * self.remote_kernel_blocks + rblock[None, :]
        return _i32(lidx.ravel()), _i32(ridx.ravel())

    def _mamba_indices(self, local_ids, remote_ids):
        if not self.has_mamba:
            raise MemoryLayoutError("this engine pair has no Mamba state; use group='attention'")
        lids = block_id_array(local_ids, self.local_pages, "local")
        rids = block_id_array(remote_ids, self.remote_pages, "remote")
        if len(lids) > len(rids):
            raise MemoryLayoutError(
                f"{len(lids)} local Mamba blocks but the remote request has only {len(rids)}"
            )
        rids = rids[len(rids) - len(lids):]
        if self.mamba_rows == 0 or len(lids) == 0:
            return np.empty(0, np.int32), np.empty(0, np.int32)
        rows = np.arange(self.mamba_rows, dtype=np.int64)[:, None]
        lidx = self.local_attn_descs + rows * self.local_pages + lids[None, :]
        ridx = self.remote_attn_descs + rows * self.remote_pages + rids[None, :]
        return _i32(lidx.ravel()), _i32(ridx.ravel())


def _i32(a: np.ndarray) -> np.ndarray:
    if len(a) and a.max() > _I32_MAX:
        raise MemoryLayoutError("descriptor index exceeds int32; register fewer blocks per list")
    return a.astype(np.int32)


def _rows(addr: np.ndarray, length: np.ndarray, device: int, stride: np.ndarray,
          count: int) -> np.ndarray:
    out = np.empty((len(addr), 5), dtype=_U64)
    out[:, 0] = addr
    out[:, 1] = length
    out[:, 2] = device
    out[:, 3] = stride
    out[:, 4] = count
    return out


def _pair_roles(local: RegionGeometry, remote: RegionGeometry, hybrid: bool) -> np.ndarray:
    """For each local (region, element), region-major: the remote (region, element) index
    holding the same (layer, kind). Same layout on both sides pairs positionally."""
    n_local = local.num_regions * local.elements_per_block
    n_remote = remote.num_regions * remote.elements_per_block
    same_shape = (local.num_regions == remote.num_regions
                  and local.elements_per_block == remote.elements_per_block)
    if same_shape and (not local.element_roles or not remote.element_roles
                       or local.element_roles == remote.element_roles):
        return np.arange(n_local, dtype=np.int64)
    if hybrid and not same_shape:
        raise MemoryLayoutError(
            f"hybrid Mamba engines need the same cache layout on both sides (local "
            f"{local.num_regions} regions x {local.elements_per_block} elements, remote "
            f"{remote.num_regions} x {remote.elements_per_block}); Mamba state is paired per region"
        )
    if not local.element_roles or not remote.element_roles:
        raise MemoryLayoutError(
            f"local cache has {local.num_regions} regions x {local.elements_per_block} elements but "
            f"the remote has {remote.num_regions} x {remote.elements_per_block}, and the (layer, kind) "
            "of every element is not known on both sides (elements shared by several layers); use "
            "the same KV-cache layout on both engines"
        )
    packed = [any(kind == KIND_KV for _, kind in geo.element_roles) for geo in (local, remote)]
    if packed[0] != packed[1]:
        raise MemoryLayoutError(
            f"the {'local' if packed[0] else 'remote'} cache is packed (K and V of each head "
            "together) and the other is not; a packed cache pairs only with a packed cache, so "
            "use the same vLLM-style packed layout on both engines"
        )
    where = {role: i for i, role in enumerate(remote.element_roles)}
    if len(where) != n_remote or len(set(local.element_roles)) != n_local:
        raise MemoryLayoutError("a (layer, kind) role appears twice in one cache; roles must be unique")
    missing = [role for role in local.element_roles if role not in where]
    if missing or n_local != n_remote:
        raise MemoryLayoutError(
            f"the engines hold different (layer, kind) elements (local {n_local}, remote {n_remote}; "
            f"missing remotely: {missing[:4]}); both engines must describe the same layers, "
            "MLA or not"
        )
    return np.asarray([where[role] for role in local.element_roles], dtype=np.int64)


def rank_descriptors(
    plan: RankPlan,
    remote_rank: int,
    local: RegionGeometry,
    remote: RegionGeometry,
) -> RankDescriptors:
    """Descriptor rows of ``plan`` for ``remote_rank``: remote list and local split list.

    ``plan`` comes from ``plan_rank(local_spec, remote_spec, rank)`` (topology
    plans on physical blocks, so planning on ``kernel_spec()`` gives the same). A remote rank that is only notified
    (or, in hybrids, read for Mamba state only) gets no attention rows.
    """
    if remote_rank not in plan.handshake_ranks and remote_rank not in plan.source_ranks:
        raise MemoryLayoutError(
            f"remote rank {remote_rank} is not a peer of local rank {plan.local_rank} "
            f"(handshake ranks {plan.handshake_ranks})"
        )
    remote_role_order = _pair_roles(local, remote, plan.mamba is not None)
    ut = plan.unit_tokens
    lu = _units(local.kernel_block_tokens, ut, "local")
    ru = _units(remote.kernel_block_tokens, ut, "remote")
    if min(lu, ru) != 1:
        raise MemoryLayoutError(
            f"the plan's transfer unit ({ut} tokens) is smaller than both kernel blocks "
            f"({local.kernel_block_tokens}, {remote.kernel_block_tokens}); make the plan with "
            "kernel_spec() of both engines"
        )
    reads = plan.reads_from(remote_rank)
    for side, geo, units, ub, step, offs in (
        ("local", local, lu, plan.local_unit_bytes, plan.local_unit_bytes,
         [r.local_offset for r in reads]),
        ("remote", remote, ru, plan.remote_unit_bytes, plan.remote_unit_stride,
         [r.remote_offset for r in reads]),
    ):
        end = max((o + r.length for o, r in zip(offs, reads, strict=True)), default=0)
        if units * ub > geo.element_bytes or (units - 1) * step + end > geo.element_bytes:
            raise MemoryLayoutError(
                f"{side} elements are {geo.element_bytes} bytes but the plan needs {units} units of "
                f"{ub} bytes; the plan does not match this cache (plan on kernel_spec() of the "
                "engines that own these regions)"
            )
    nreg, nrd = local.num_regions, len(reads)
    nroles = local.num_regions * local.elements_per_block
    # attention rows: (role, read, unit), unit fastest; roles in local region-major order
    l_read_off = np.array([r.local_offset for r in reads], dtype=np.int64)
    r_read_off = np.array([r.remote_offset for r in reads], dtype=np.int64)
    lengths = np.array([r.length for r in reads], dtype=np.int64)

    def attn(geo: RegionGeometry, order: np.ndarray, units: int, unit_step: int,
             read_off: np.ndarray) -> np.ndarray:
        nel = geo.elements_per_block
        role_base = (np.asarray(geo.base_addrs, dtype=np.int64)[:, None]
                     + np.asarray(geo.element_offsets, dtype=np.int64)[None, :]).reshape(-1)[order]
        role_stride = np.repeat(np.asarray(geo.kernel_strides, dtype=np.int64), nel)[order]
        roff = read_off[None, :, None]
        uoff = (np.arange(units, dtype=np.int64) * unit_step)[None, None, :]
        addr = (role_base[:, None, None] + roff + uoff).reshape(-1)
        shape = (nroles, nrd, units)
        length = np.broadcast_to(lengths[None, :, None], shape).reshape(-1)
        stride = np.broadcast_to(role_stride[:, None, None], shape).reshape(-1)
        return _rows(addr, length, geo.device_id, stride, geo.num_kernel_blocks)

    local_order = np.arange(nroles, dtype=np.int64)
    l_rows = [attn(local, local_order, lu, plan.local_unit_bytes, l_read_off)]
    # remote units are remote_unit_stride apart: remote_unit_bytes, or one head's unit bytes
    # when larger remote HND blocks hold several heads (reads are then per head)
    r_rows = [attn(remote, remote_role_order, ru, plan.remote_unit_stride, r_read_off)]
    mamba_rows = 0
    if plan.mamba is not None:
        pieces = [p for p in plan.mamba.mamba_pieces if p.remote_rank == remote_rank]
        mamba_rows = nreg * len(pieces)
        if pieces:
            if local.block_tokens != remote.block_tokens:
                raise MemoryLayoutError("hybrid Mamba models need equal block sizes on both sides")
            p_len = np.array([p.length for p in pieces], dtype=np.int64)
            for geo, offs, out in ((local, [p.local_offset for p in pieces], l_rows),
                                   (remote, [p.remote_offset for p in pieces], r_rows)):
                off = np.asarray(offs, dtype=np.int64)
                if int((off + p_len).max()) > min(geo.block_strides):
                    raise MemoryLayoutError(
                        "the Mamba state does not fit in a page of this cache; the engine "
                        "description (Mamba sizes, TP) does not match the regions"
                    )
                base = np.asarray(geo.base_addrs, dtype=np.int64)[:, None]
                addr = (base + off[None, :]).reshape(-1)
                length = np.broadcast_to(p_len[None, :], (nreg, len(pieces))).reshape(-1)
                stride = np.broadcast_to(
                    np.asarray(geo.block_strides, dtype=np.int64)[:, None], (nreg, len(pieces))
                ).reshape(-1)
                out.append(_rows(addr, length, geo.device_id, stride, geo.num_blocks))
    return RankDescriptors(
        remote_rank=remote_rank,
        local_rows=np.concatenate(l_rows),
        remote_rows=np.concatenate(r_rows),
        attn_keys=nroles * nrd,
        local_units=lu,
        remote_units=ru,
        local_kernel_blocks=local.num_kernel_blocks,
        remote_kernel_blocks=remote.num_kernel_blocks,
        local_kernel_per_block=local.kernel_blocks_per_block,
        remote_kernel_per_block=remote.kernel_blocks_per_block,
        local_block_tokens=local.block_tokens,
        remote_block_tokens=remote.block_tokens,
        unit_tokens=ut,
        mamba_rows=mamba_rows,
        local_pages=local.num_blocks,
        remote_pages=remote.num_blocks,
        has_mamba=plan.mamba is not None,
        local_role_layers=tuple(layer for layer, _kind in local.element_roles),
        local_regions=nreg,
    )
