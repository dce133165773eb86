"""Registrable memory regions of an engine's KV-cache tensors.

:func:`regions_from_kv_caches` turns per-layer cache tensors (CUDA or host)
into :class:`Region` values: base address, size, device, and where the K/V
elements of each block sit. Tensors that share memory (hybrid allocators pool
one tensor across KV-cache groups; a cross-layer cache is one tensor viewed per
layer) become one region.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvbridge.topology import KIND_KV, EngineSpec

from .errors import MemoryLayoutError
from .kernel import kernel_spec

Role = tuple[int, int]


@dataclass(frozen=True)
class Region:
    """One registrable memory range holding ``num_blocks`` logical blocks.

    ``block_stride`` is the byte distance between logical blocks; each holds
    ``kernel_blocks_per_block`` kernel blocks (see :class:`CacheRegions`) whose
    attention elements (K, V or the MLA latent) are ``element_bytes`` long at
    ``element_offsets`` within the kernel block. ``roles[i]`` lists the
    ``(layer, kind)`` pairs stored at ``element_offsets[i]`` (kind 0 = K or the
    MLA latent, 1 = V, 2 = K and V of each head together in the packed layout;
    several layers when a tensor is shared).
    ``mamba_layers`` are the Mamba layers whose conv + SSM state share the
    region's pages (conv state at page offset 0, SSM state right after it).
    ``positions`` are the positions in ``kv_caches`` of every entry (attention or
    Mamba layer) the region holds: the layer indices of ``CacheGroup.layers``.
    """

    base_addr: int
    size: int
    device_id: int
    mem_type: str
    num_blocks: int
    block_stride: int
    element_bytes: int
    element_offsets: tuple[int, ...]
    roles: tuple[tuple[Role, ...], ...]
    mamba_layers: tuple[int, ...] = ()
    #: not compared: a cross-layer cache is equal whether given as one tensor or per-layer views
    positions: tuple[int, ...] = field(default=(), compare=False)

    @property
    def end_addr(self) -> int:
        return self.base_addr + self.size


@dataclass(frozen=True)
class CacheRegions:
    """All regions of one rank's cache, in registration/descriptor order."""

    spec: EngineSpec
    regions: tuple[Region, ...]
    num_blocks: int
    device_id: int
    mem_type: str
    #: one tensor per region whose storage holds it (for byte views); not compared
    anchors: tuple[torch.Tensor, ...] = field(default=(), compare=False, repr=False)

    def group_regions(self, layers: Sequence[int]) -> tuple[int, ...]:
        """Indices of the regions holding any of ``layers`` (positions in ``kv_caches``, as
        ``CacheGroup.layers`` counts them), in region order."""
        want = {int(x) for x in layers}
        return tuple(i for i, r in enumerate(self.regions) if want.intersection(r.positions))

    def registration_descs(self, merge_adjacent: bool | None = None) -> np.ndarray:
        """``N x 3`` uint64 ``(address, length, device)`` rows to register with NIXL.

        Overlapping ranges always merge into one row; adjacent ones too when
        ``merge_adjacent``. By default (None) they do in host memory and not in GPU
        memory: two CUDA allocations can lie back to back, and UCX's CUDA IPC maps
        only the allocation a registered row starts in, so a row spanning two
        allocations fails every WRITE into its second one (seen on an H100).
        """
        if merge_adjacent is None:
            merge_adjacent = self.mem_type != "VRAM"
        spans = sorted((r.base_addr, r.end_addr) for r in self.regions)
        rows: list[list[int]] = []
        for start, end in spans:
            if rows and (start < rows[-1][1] or (merge_adjacent and start == rows[-1][1])):
                rows[-1][1] = max(rows[-1][1], end)
            else:
                rows.append([start, end])
        out = np.empty((len(rows), 3), dtype=np.uint64)
        if rows:
            arr = np.asarray(rows, dtype=np.uint64)
            out[:, 0] = arr[:, 0]
            out[:, 1] = arr[:, 1] - arr[:, 0]
        out[:, 2] = self.device_id
        return out

    def byte_view(self, index: int) -> torch.Tensor:
        """A ``uint8`` tensor ``[num_blocks, block_stride]`` aliasing region ``index``."""
        if not self.anchors:
            raise MemoryLayoutError("these regions carry no tensors; byte views need the local cache")
        reg = self.regions[index]
        anchor = self.anchors[index]
        storage = anchor.untyped_storage()
        offset = reg.base_addr - storage.data_ptr()
        if offset < 0 or offset + reg.size > storage.nbytes():
            # the last block may be shorter than the stride (padding past the tensor)
            view_blocks = (storage.nbytes() - offset) // reg.block_stride
            if offset < 0 or view_blocks < reg.num_blocks:
                raise MemoryLayoutError(f"region {index} lies outside its tensor's storage")
        view = torch.empty(0, dtype=torch.uint8, device=anchor.device)
        view.set_(storage, offset, (reg.num_blocks, reg.block_stride), (reg.block_stride, 1))
        return view


# ----------------------------------------------------------------------------
@dataclass
class _View:
    """One tensor's contribution: a block grid and the elements it shows."""

    ptr: int
    stride: int  # bytes between logical blocks
    num_blocks: int  # logical
    elements: list[tuple[int, int, Role]]  # (offset in kernel block, bytes, role)
    mamba: list[tuple[int, int, int]]  # (offset in page, bytes, layer)
    anchor: torch.Tensor
    what: str
    position: int = -1  # of the tensor's entry in kv_caches


def _dense_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t`` when its elements fill one dense range (any dim order), else None."""
    dims = [(st, sz) for st, sz in zip(t.stride(), t.shape, strict=False) if sz != 1]
    if any(sz == 0 for sz in t.shape):
        return 0
    dims.sort()
    expect = 1
    for st, sz in dims:
        if st != expect:
            return None
        expect *= sz
    return expect * t.element_size()


def _block_dim(t: torch.Tensor, what: str) -> tuple[int, int]:
    """(number of blocks along dim 0, byte stride between them), with dense blocks."""
    if t.dim() < 2:
        raise MemoryLayoutError(f"{what}: expected a block dimension first, got shape {tuple(t.shape)}")
    nb = t.shape[0]
    stride = t.stride(0) * t.element_size()
    block = _dense_bytes(t[0]) if nb else 0
    if block is None:
        raise MemoryLayoutError(
            f"{what}: one block of shape {tuple(t.shape[1:])} with strides {t.stride()[1:]} is not a "
            "contiguous byte range; allocate the cache so that every block is contiguous"
        )
    if nb > 1 and stride < block:
        raise MemoryLayoutError(
            f"{what}: blocks overlap (stride {stride} bytes < block {block} bytes); blocks must be "
            "the outer dimension of the cache tensor"
        )
    return nb, stride


def _to_logical(nbk: int, kstride: int, n: int, what: str) -> tuple[int, int]:
    if nbk % n:
        raise MemoryLayoutError(
            f"{what}: {nbk} kernel blocks are not a whole number of logical blocks of {n} kernel "
            "blocks; check kernel_blocks_per_block"
        )
    return nbk // n, kstride * n


def _attention_views(t: torch.Tensor, layer: int, spec: EngineSpec, what: str) -> list[_View]:
    n = spec.kernel_blocks_per_block
    kinds = 1 if spec.use_mla else 2
    views: list[_View] = []
    if spec.cross_layer:
        nbk, kstride = _block_dim(t, what)
        nb, stride = _to_logical(nbk, kstride, n, what)
        per = _dense_bytes(t[0]) if nbk else 0
        ksp = kernel_spec(spec)
        elem = ksp.computed_element_bytes
        count = per // elem if elem else 0
        if count * elem != per or count % kinds:
            raise MemoryLayoutError(
                f"{what}: a block of {per} bytes is not a whole number of {elem}-byte K/V elements"
            )
        # a single cross-layer tensor holds every layer; per-layer views hold one layer each
        first_layer = 0 if count == spec.num_layers * kinds else layer
        els = [(i * elem, elem, (first_layer + i // kinds, i % kinds)) for i in range(count)]
        views.append(_View(t.data_ptr(), stride, nb, els, [], t, what))
        return views
    if spec.is_packed:
        # [kernel blocks, ...]: one dense K+V element per block, whatever the inner shape
        # (vLLM: [blocks, heads, tokens, 2*head_dim] for HND, [blocks, tokens, heads, 2*head_dim]
        # for NHD); its inner order is the backend's business and is never looked at
        nbk, kstride = _block_dim(t, what)
        nb, stride = _to_logical(nbk, kstride, n, what)
        elem = _dense_bytes(t[0]) if nbk else 0
        views.append(_View(t.data_ptr(), stride, nb, [(0, elem, (layer, KIND_KV))], [], t, what))
        return views
    if spec.separate_kv_regions:
        if t.shape[0] != 2:
            raise MemoryLayoutError(
                f"{what}: a kv-first cache tensor must have K and V as its first dimension (size 2), "
                f"got shape {tuple(t.shape)}; set layout to blocks-first if blocks come first"
            )
        for kind in range(2):
            part = t[kind]
            nbk, kstride = _block_dim(part, f"{what}[{kind}]")
            nb, stride = _to_logical(nbk, kstride, n, what)
            elem = _dense_bytes(part[0]) if nbk else 0
            views.append(_View(part.data_ptr(), stride, nb, [(0, elem, (layer, kind))], [], t, what))
        return views
    nbk, kstride = _block_dim(t, what)
    nb, stride = _to_logical(nbk, kstride, n, what)
    if kinds == 1:
        elem = _dense_bytes(t[0]) if nbk else 0
        views.append(_View(t.data_ptr(), stride, nb, [(0, elem, (layer, 0))], [], t, what))
        return views
    if t.dim() < 3 or t.shape[1] != 2:
        raise MemoryLayoutError(
            f"{what}: a blocks-first cache tensor must be [blocks, 2, ...], got shape "
            f"{tuple(t.shape)}; set layout to kv-first if K/V come first"
        )
    els = []
    for kind in range(2):
        part = t[0, kind] if nbk else t
        elem = _dense_bytes(part) if nbk else 0
        if elem is None:
            raise MemoryLayoutError(f"{what}: the K or V half of a block is not contiguous")
        els.append((part.data_ptr() - t.data_ptr(), elem, (layer, kind)))
    views.append(_View(t.data_ptr(), stride, nb, els, [], t, what))
    return views


def _mamba_view(states: Sequence[torch.Tensor], layer: int, what: str) -> _View:
    if len(states) != 2:
        raise MemoryLayoutError(f"{what}: a Mamba layer's state must be (conv_state, ssm_state)")
    conv, ssm = states
    nb_c, st_c = _block_dim(conv, f"{what} conv state")
    nb_s, st_s = _block_dim(ssm, f"{what} SSM state")
    if (nb_c, st_c) != (nb_s, st_s):
        raise MemoryLayoutError(
            f"{what}: conv state ({nb_c} blocks, stride {st_c}) and SSM state ({nb_s} blocks, "
            f"stride {st_s}) must share one page per block"
        )
    conv_bytes = _dense_bytes(conv[0]) if nb_c else 0
    ssm_bytes = _dense_bytes(ssm[0]) if nb_s else 0
    off = ssm.data_ptr() - conv.data_ptr()
    if off != conv_bytes:
        raise MemoryLayoutError(
            f"{what}: the SSM state must start right after the conv state in each page "
            f"(at byte {conv_bytes}), found it at byte {off}"
        )
    return _View(conv.data_ptr(), st_c, nb_c, [], [(0, conv_bytes, layer), (off, ssm_bytes, layer)],
                 conv, what)


def _device_of(t: torch.Tensor) -> tuple[str, int]:
    if t.device.type == "cuda":
        return "VRAM", t.device.index or 0
    if t.device.type == "cpu":
        return "DRAM", 0
    raise MemoryLayoutError(f"tensors on {t.device} cannot be registered; use CUDA or host memory")


def regions_from_kv_caches(
    kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]
    | Sequence[torch.Tensor | Sequence[torch.Tensor]]
    | torch.Tensor,
    spec: EngineSpec,
) -> CacheRegions:
    """Registrable regions of one rank's cache.

    ``kv_caches``: one entry per layer in layer order (a mapping keeps its
    insertion order): an attention layer's cache tensor in ``spec.layout`` —
    ``[2, blocks, ...]`` (kv-first), ``[blocks, 2, ...]`` (blocks-first),
    ``[blocks, ...]`` (MLA) or ``[blocks, ...]`` with K and V of each head
    together (packed, e.g. vLLM's ``[blocks, heads, tokens, 2*head_dim]``; any
    shape whose blocks are dense) — or, for a hybrid model's Mamba layer, the pair
    ``(conv_state, ssm_state)``, each ``[blocks, ...]``. A cross-layer cache is
    the single ``[blocks, ...]`` tensor (or its per-layer views). The block
    dimension counts kernel blocks for attention tensors and logical blocks
    (pages) for Mamba states.
    """
    if isinstance(kv_caches, torch.Tensor):
        items: list[tuple[str, object]] = [("cache", kv_caches)]
    elif isinstance(kv_caches, Mapping):
        items = [(str(k), v) for k, v in kv_caches.items()]
    else:
        items = [(f"layer {i}", v) for i, v in enumerate(kv_caches)]
    if not items:
        raise MemoryLayoutError("no KV-cache tensors given")
    views: list[_View] = []
    devices: set[tuple[str, int]] = set()
    attn_layer = 0
    mamba_layer = 0
    for pos, (name, value) in enumerate(items):
        what = f"KV cache {name!r}"
        if isinstance(value, torch.Tensor):
            devices.add(_device_of(value))
            for v in _attention_views(value, attn_layer, spec, what):
                v.position = pos
                views.append(v)
            attn_layer += 1
        elif isinstance(value, Sequence) and all(isinstance(v, torch.Tensor) for v in value):
            if spec.mamba is None:
                raise MemoryLayoutError(
                    f"{what}: got a tuple of state tensors but the engine has no Mamba spec"
                )
            for v in value:
                devices.add(_device_of(v))
            mv = _mamba_view(value, mamba_layer, what)
            mv.position = pos
            views.append(mv)
            mamba_layer += 1
        else:
            raise MemoryLayoutError(f"{what}: expected a torch.Tensor or (conv, ssm) tensors, got {type(value)}")
    if len(devices) > 1:
        raise MemoryLayoutError(
            f"KV-cache tensors are on different devices {sorted(devices)}; register one rank's "
            "cache on one device"
        )
    mem_type, device_id = devices.pop()
    return _merge(views, spec, mem_type, device_id)


def _merge(views: list[_View], spec: EngineSpec, mem_type: str, device_id: int) -> CacheRegions:
    views = sorted(views, key=lambda v: v.ptr)
    groups: list[list[_View]] = []
    for v in views:
        if groups:
            head = groups[-1][0]
            end = max(g.ptr + g.stride * g.num_blocks for g in groups[-1])
            if v.ptr - head.ptr < head.stride and (v.stride, v.num_blocks) == (head.stride, head.num_blocks):
                groups[-1].append(v)
                continue
            if v.ptr < end:
                raise MemoryLayoutError(
                    f"{v.what} overlaps {head.what} with a different block geometry "
                    f"({v.num_blocks} blocks of {v.stride} bytes vs {head.num_blocks} of "
                    f"{head.stride}); shared tensors must use the same blocks"
                )
        groups.append([v])
    counts = {g[0].num_blocks for g in groups}
    if len(counts) > 1:
        raise MemoryLayoutError(
            f"KV-cache tensors disagree on the number of blocks ({sorted(counts)}); every layer "
            "must have the same number of (logical) blocks"
        )
    n = spec.kernel_blocks_per_block
    ksp = kernel_spec(spec)
    want_elem = ksp.computed_element_bytes
    default_offsets = tuple(range(0, want_elem * spec.elements_per_block_region, want_elem))
    regions: list[Region] = []
    anchors: list[torch.Tensor] = []
    for group in groups:
        base = group[0]
        offsets: dict[int, list[Role]] = {}
        mamba: dict[int, None] = {}
        positions: dict[int, None] = {}
        ebytes: set[int] = set()
        for v in group:
            positions.setdefault(v.position, None)
            shift = v.ptr - base.ptr
            for off, nbytes, role in v.elements:
                ebytes.add(nbytes)
                offsets.setdefault(off + shift, []).append(role)
            for off, _nbytes, layer in v.mamba:
                if off == 0 and shift != 0:
                    raise MemoryLayoutError(f"{v.what}: Mamba conv state must start its page")
                mamba.setdefault(layer, None)
        if len(ebytes) > 1:
            raise MemoryLayoutError(
                f"{base.what}: elements of different sizes {sorted(ebytes)} share one region"
            )
        elem = ebytes.pop() if ebytes else want_elem
        if offsets and elem != want_elem:
            kv = " x 2 (K and V)" if spec.is_packed else ""
            raise MemoryLayoutError(
                f"{base.what}: a block element holds {elem} bytes but engine {spec.engine_id!r} "
                f"describes {want_elem} ({ksp.heads_per_rank} heads x {ksp.block_size} tokens x "
                f"{spec.head_dim}{kv} x {spec.dtype_size} bytes); fix the engine description"
            )
        offs = tuple(sorted(offsets)) if offsets else default_offsets
        kstride = base.stride // n
        if offs and offs[-1] + elem > kstride:
            raise MemoryLayoutError(
                f"{base.what}: elements end at byte {offs[-1] + elem} but a kernel block is only "
                f"{kstride} bytes"
            )
        roles = tuple(tuple(offsets.get(o, ())) for o in offs)
        regions.append(Region(
            base_addr=base.ptr,
            size=base.stride * base.num_blocks,
            device_id=device_id,
            mem_type=mem_type,
            num_blocks=base.num_blocks,
            block_stride=base.stride,
            element_bytes=elem,
            element_offsets=offs,
            roles=roles,
            mamba_layers=tuple(mamba),
            positions=tuple(sorted(positions)),
        ))
        anchors.append(base.anchor)
    # region order: by first role (layer, kind), so both engines agree whatever the addresses
    order = sorted(range(len(regions)), key=lambda i: _order_key(regions[i]))
    return CacheRegions(
        spec=spec,
        regions=tuple(regions[i] for i in order),
        num_blocks=counts.pop(),
        device_id=device_id,
        mem_type=mem_type,
        anchors=tuple(anchors[i] for i in order),
    )


def _order_key(r: Region) -> tuple:
    firsts = [roles[0] for roles in r.roles if roles]
    if firsts:
        layer, kind = min(firsts)
        return (0, layer, kind)
    return (1, min(r.mamba_layers, default=0), 0)
