"""Where K/V elements sit inside the registered regions of one rank."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import TopologyError
from .spec import EngineSpec

#: element kinds of a role ``(layer, kind)``
KIND_K = 0  # K, or the MLA latent
KIND_V = 1
KIND_KV = 2  # packed layout: K and V of each head together (pairs only with another KIND_KV)


def element_kinds(spec: EngineSpec) -> tuple[int, ...]:
    """The kinds of one layer's elements, in block order: ``(K, V)``, ``(latent,)`` for MLA,
    ``(KV,)`` for the packed layout."""
    if spec.is_packed:
        return (KIND_KV,)
    if spec.use_mla:
        return (KIND_K,)
    return (KIND_K, KIND_V)


@dataclass(frozen=True)
class ElementLayout:
    """Element geometry of one rank's cache.

    A *region* is one registrable memory range per layer (or one for all layers
    with a cross-layer cache); one block of a region holds
    ``elements_per_block`` elements of ``element_bytes`` at ``element_offsets``.
    Element ``e`` of a block is (layer, kind) with kind 0 = K (or the MLA
    latent), 1 = V, 2 = K and V of each head together (packed layout), ordered
    layer-major for cross-layer caches.
    """

    separate_kv_regions: bool
    regions: int
    elements_per_block: int
    element_bytes: int
    element_offsets: tuple[int, ...]
    region_block_bytes: int
    #: (layer, kind) of each (region, element) pair, region-major
    element_roles: tuple[tuple[int, int], ...]


def element_layout(spec: EngineSpec) -> ElementLayout:
    """Element geometry for ``spec`` (see :class:`ElementLayout`)."""
    kinds = element_kinds(spec)
    elem = spec.element_bytes
    if spec.cross_layer:
        # one tensor: each block holds every layer's slot (K then V, or the latent)
        n = spec.num_layers * len(kinds)
        roles = tuple((layer, k) for layer in range(spec.num_layers) for k in kinds)
        slot = spec.region_block_bytes
        offsets = tuple(
            layer * slot + i * elem for layer in range(spec.num_layers) for i in range(len(kinds))
        )
        return ElementLayout(
            separate_kv_regions=False,
            regions=1,
            elements_per_block=n,
            element_bytes=elem,
            element_offsets=offsets,
            region_block_bytes=slot * spec.num_layers,
            element_roles=roles,
        )
    if spec.separate_kv_regions:
        roles = tuple((layer, k) for layer in range(spec.num_layers) for k in kinds)
        return ElementLayout(True, 2 * spec.num_layers, 1, elem, (0,), spec.region_block_bytes, roles)
    per_block = spec.elements_per_block_region
    if per_block != len(kinds):  # pragma: no cover - EngineSpec keeps these in step
        raise TopologyError(f"internal error: {per_block} elements per block but kinds {kinds}")
    roles = tuple((layer, k) for layer in range(spec.num_layers) for k in kinds)
    return ElementLayout(
        False,
        spec.num_layers,
        per_block,
        elem,
        tuple(i * elem for i in range(per_block)),
        spec.region_block_bytes,
        roles,
    )
