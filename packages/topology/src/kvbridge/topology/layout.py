"""Where K/V elements sit inside the registered regions of one rank."""

from __future__ import annotations

from dataclasses import dataclass

from .spec import EngineSpec


@dataclass(frozen=True)
class ElementLayout:
    """Element geometry of one rank's cache.

    A *region* is one registrable memory range per layer (or one for all layers
    with a cross-layer cache); one block of a region holds
    ``elements_per_block`` elements of ``element_bytes`` at ``element_offsets``.
    Element ``e`` of a block is (layer, kind) with kind 0 = K (or the MLA
    latent), 1 = V, ordered layer-major for cross-layer caches.
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
    kinds = 1 if spec.use_mla else 2
    elem = spec.element_bytes
    if spec.cross_layer:
        # one tensor: each block holds every layer's slot (K then V, or the latent)
        n = spec.num_layers * kinds
        roles = tuple((layer, k) for layer in range(spec.num_layers) for k in range(kinds))
        slot = spec.region_block_bytes
        offsets = tuple(layer * slot + k * elem for layer in range(spec.num_layers) for k in range(kinds))
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
        roles = tuple((layer, k) for layer in range(spec.num_layers) for k in range(2))
        return ElementLayout(True, 2 * spec.num_layers, 1, elem, (0,), spec.region_block_bytes, roles)
    per_block = spec.elements_per_block_region
    roles = tuple(
        (layer, k) for layer in range(spec.num_layers) for k in range(per_block)
    )
    return ElementLayout(
        False,
        spec.num_layers,
        per_block,
        elem,
        tuple(i * elem for i in range(per_block)),
        spec.region_block_bytes,
        roles,
    )
