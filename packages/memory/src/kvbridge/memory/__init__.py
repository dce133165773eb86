"""kvbridge KV-cache memory regions and NIXL descriptor geometry.

API summary (everything is a frozen value or a plain function; no global state)
===============================================================================

Conventions
-----------
* A *region* is one registrable, contiguous memory range holding ``num_blocks``
  blocks ``block_stride`` bytes apart: the K or the V tensor of one layer
  (kv-first), one layer's ``[blocks, 2, ...]`` tensor (blocks-first, K half then
  V half), one layer's packed tensor (one element per block holding K and V of
  every head, e.g. vLLM's ``[blocks, heads, tokens, 2*dim]``; its inside is never
  interpreted), one layer's MLA latent, the single cross-layer tensor, or one hybrid
  layer's shared page tensor (attention K/V *or* Mamba conv+SSM state per page).
* Blocks are *logical* (the engine's ``block_size``). An attention kernel may
  split each logical block into ``kernel_blocks_per_block`` physical blocks;
  descriptors for attention are per **kernel** block (block id ``b`` -> kernel
  ids ``b*n .. b*n+n-1``). Mamba state is per logical block (page), never split.
* Topology plans transfer units on physical (kernel) blocks, so
  ``plan_rank(local, remote, r)`` and ``plan_rank(kernel_spec(local),
  kernel_spec(remote), r)`` give the same plan.
* Descriptor arrays are ``numpy.uint64``: N x 3 ``(address, length, device)`` or
  strided N x 5 ``(address, length, device, stride, count)`` where one row stands
  for ``count`` descriptors ``stride`` apart. Both forms enumerate the same
  descriptors in the same order: *row-major, block-minor*, so descriptor
  ``row * num_blocks + b`` is block ``b`` of that row and consecutive blocks are
  consecutive indices (NIXL merges them). Rows are ordered region, element
  (K/V), read, transfer unit.

Regions (``kvbridge.memory.regions``)
-------------------------------------
``Region``: frozen; ``base_addr, size, device_id, mem_type ("DRAM"|"VRAM"),
num_blocks (logical), block_stride (bytes between logical blocks),
element_bytes, element_offsets`` (attention elements within a *kernel* block),
``roles`` (per element, the ``(layer, kind)`` pairs stored there; kind 0 = K or
MLA latent, 1 = V, 2 = packed K+V; several layers when a tensor is shared) and
``mamba_layers`` (Mamba layers whose conv + SSM state share the pages) and
``positions`` (the ``kv_caches`` entries it holds: ``CacheGroup.layers`` numbers;
``CacheRegions.group_regions(layers)`` lists the regions of a KV-cache group).

``regions_from_kv_caches(kv_caches, spec) -> CacheRegions``: ``kv_caches`` is a
``Mapping[str, Tensor | (conv, ssm)]`` or a ``Sequence`` of the same, one entry
per layer in layer order; tensors sharing memory are registered once.
Raises ``MemoryLayoutError`` (a ``ValueError``) for non-contiguous blocks, mixed
devices, inconsistent block counts or sizes.

``CacheRegions``: frozen; ``regions: tuple[Region, ...]``, ``spec``,
``num_blocks`` (logical), ``device_id``, ``mem_type``;
``registration_descs() -> ndarray[N, 3] uint64`` (adjacent ranges merged),
``byte_view(i) -> Tensor`` (uint8 ``[num_blocks, block_stride]`` view of region i).
``expand_strided(rows)`` (in ``descriptors``) turns N x 5 rows into the N x 3 list.

Kernel blocks (``kvbridge.memory.kernel``)
------------------------------------------
``kernel_spec(spec) -> EngineSpec``: the spec of one kernel block (plan on it).

Geometry (``kvbridge.memory.geometry``)
---------------------------------------

``RegionGeometry``: plain numbers only; ``base_addrs, block_strides (per region,
between logical blocks), num_blocks, block_tokens, kernel_blocks_per_block,
element_bytes, element_offsets (within a kernel block), device_id, mem_type``.
``RegionGeometry.from_regions(cache_regions)`` (local side) and
``RegionGeometry.from_remote(spec, base_addrs, num_blocks, block_lens,
device_id=0, mem_type="VRAM")`` (a peer's handshake numbers; ``block_lens`` are
bytes between logical blocks per region).

Descriptors (``kvbridge.memory.descriptors``)
---------------------------------------------
``rank_descriptors(plan, remote_rank, local, remote) -> RankDescriptors``:
for one remote rank of a ``RankPlan``: the remote prepared list and the
matching local split list, attention rows first then (hybrids) Mamba rows
(x, B, C, SSM pieces from ``plan.mamba``). Block-size ratios: the side with the
larger kernel block has ``ratio`` transfer units per element, each its own row.

``RankDescriptors`` (frozen): ``remote_rank``, ``local_rows`` / ``remote_rows``
(the N x 5 tables), ``remote_descs(strided=False)``,
``local_descs(strided=False)``, ``num_remote_descs``, ``num_local_descs``, and
``indices(local_ids, remote_ids, *, group="attention"|"mamba",
local_skip_blocks=None, layers=None, regions=None) -> (local_idx, remote_idx)``
(int32 index arrays into the two lists; concatenate the pairs of several groups;
``layers`` keeps some attention layers, ``regions`` some local regions). Ids are logical block ids of that group; ``remote_ids`` start
at the prompt's first token, ``local_ids`` at block ``local_skip_blocks`` (a
partial prefix hit: only the uncomputed tail is read; ``None`` = the vLLM
convention ``len(remote_ids) - len(local_ids)`` for equal block sizes).

Post-processing (``kvbridge.memory.postprocess``)
-------------------------------------------------
``post_process(cache_regions, block_ids, post, spec=None)``: in-place rearrangement
of received blocks per ``topology.PostProcess`` (HND<->NHD, ``units`` smaller
remote blocks ``[units, heads, tokens, dim]`` -> ``[heads, units*tokens, dim]``,
or both). ``block_ids`` are local logical ids. Packed caches are never
rearranged (raises ``MemoryLayoutError`` if ``post.needed``).

Huge pages (``kvbridge.memory.hugepages``)
------------------------------------------
``advise_huge_pages(ranges, *, collapse=True) -> HugePageResult``: mark the
2 MiB-aligned inside of host ``(address, bytes)`` ranges ``MADV_HUGEPAGE`` and
collapse what is already faulted in (``MADV_COLLAPSE``, Linux 6.1+); best effort,
the result says what was done. ``huge_page_bytes(ranges)``: bytes on huge pages
now (``/proc/self/smaps``). ``huge_page_size()``: 0 when the host has none.
Host-memory READs over UCX run markedly faster on huge pages.

Block ids (``kvbridge.memory.blockids``)
----------------------------------------
``block_id_array(ids, num_blocks, what="")``: the one check of a request's block ids
(integers in ``[0, num_blocks)``) as an int64 array; raises ``BlockIdError``.
"""

from .blockids import BlockIdError, block_id_array
from .descriptors import RankDescriptors, expand_strided, rank_descriptors
from .device import use_cache_device
from .errors import MemoryLayoutError
from .geometry import RegionGeometry
from .hugepages import HugePageResult, advise_huge_pages, huge_page_bytes, huge_page_size
from .kernel import kernel_spec
from .postprocess import post_process
from .regions import CacheRegions, Region, regions_from_kv_caches

__all__ = [
    "BlockIdError",
    "CacheRegions",
    "HugePageResult",
    "MemoryLayoutError",
    "RankDescriptors",
    "Region",
    "RegionGeometry",
    "advise_huge_pages",
    "block_id_array",
    "expand_strided",
    "huge_page_bytes",
    "huge_page_size",
    "kernel_spec",
    "post_process",
    "rank_descriptors",
    "regions_from_kv_caches",
    "use_cache_device",
]
