"""Descriptions of one side of a transfer: an engine's cache geometry.

Everything here is a frozen value. Byte sizes are derived from the model shape
unless the engine measured them (``block_bytes``), in which case the measured
value wins and is checked for consistency.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .dtypes import dtype_size
from .errors import TopologyError
from .groups import CacheGroup, check_groups
from .heads import check_tp_heads, heads_per_rank, is_replicated


class Layout(str, enum.Enum):
    """How K and V of one layer are arranged in the cache tensor."""

    KV_FIRST = "kv-first"  # [2, blocks, ...]: K and V are separate regions
    BLOCKS_FIRST = "blocks-first"  # [blocks, 2, ...]: one region, each block K then V
    #: [blocks, heads, tokens, 2*head_dim] (HND) or [blocks, tokens, heads, 2*head_dim] (NHD):
    #: one region, each block one element holding K and V of every head together (vLLM >= 0.32).
    #: The order of K and V inside one head's slice is backend-specific, so kvbridge only ever
    #: moves whole head slices of a block.
    PACKED = "packed"


class HeadOrder(str, enum.Enum):
    """Order of the dimensions inside one K or V element of a block.

    For the packed layout ``D`` stands for one head's K and V of a token
    together: HND keeps each head's slice of a block contiguous.
    """

    HND = "HND"  # heads, tokens, head_dim: heads are contiguous byte ranges
    NHD = "NHD"  # tokens, heads, head_dim: heads interleave per token


class ConvLayout(str, enum.Enum):
    """Order of a Mamba conv state inside its page."""

    DIM_FIRST = "dim-first"  # [conv_dim, width]: channels are contiguous ranges
    TOKEN_FIRST = "token-first"  # [width, conv_dim]


@dataclass(frozen=True)
class MambaSpec:
    """Per-layer Mamba-2 state of a hybrid attention + Mamba model (unsharded sizes).

    The conv state holds ``x`` (``ssm_heads * ssm_head_dim`` channels), then
    ``B`` and ``C`` (``n_groups * state_size`` channels each), ``conv_width``
    columns each. The SSM state is ``[ssm_heads, ssm_head_dim, state_size]``.
    ``x`` and the SSM state shard by SSM head; ``B`` and ``C`` by group, and
    groups are replicated when the TP size exceeds ``n_groups``.
    """

    ssm_heads: int
    ssm_head_dim: int
    state_size: int
    n_groups: int
    conv_width: int
    conv_dtype_size: int = 2
    ssm_dtype_size: int = 4
    conv_layout: ConvLayout = ConvLayout.DIM_FIRST

    def __post_init__(self) -> None:
        for name in ("ssm_heads", "ssm_head_dim", "state_size", "n_groups", "conv_width",
                     "conv_dtype_size", "ssm_dtype_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise TopologyError(f"MambaSpec.{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "conv_layout", ConvLayout(self.conv_layout))


@dataclass(frozen=True)
class EngineSpec:
    """One engine (prefill or decode): its parallelism and its cache geometry.

    ``block_size`` is the logical block size in tokens; an attention kernel
    may use ``kernel_blocks_per_block`` smaller physical blocks per logical
    one. ``block_bytes``, when given, is the measured size of one block of one
    layer region on one rank: the K region for kv-first, the whole K+V page for
    blocks-first and packed, the padded page for Mamba hybrids.
    """

    engine_id: str
    tp_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    block_size: int
    dtype: str = "bf16"
    kernel_blocks_per_block: int = 1
    layout: Layout = Layout.KV_FIRST
    head_order: HeadOrder = HeadOrder.HND
    use_mla: bool = False
    mamba: MambaSpec | None = None
    cross_layer: bool = False
    block_bytes: int | None = None
    extra: tuple[tuple[str, str], ...] = field(default=())
    #: KV-cache groups (vLLM's hybrid allocator); empty: one FULL group of every layer
    groups: tuple[CacheGroup, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise TopologyError("engine_id must be a non-empty string")
        for name in ("tp_size", "num_kv_heads", "head_dim", "num_layers", "block_size",
                     "kernel_blocks_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise TopologyError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "layout", Layout(self.layout))
        object.__setattr__(self, "head_order", HeadOrder(self.head_order))
        dtype_size(self.dtype)  # validates the name
        if self.block_size % self.kernel_blocks_per_block:
            raise TopologyError(
                f"block_size {self.block_size} is not divisible by kernel_blocks_per_block "
                f"{self.kernel_blocks_per_block}; the kernel block size must divide the logical one"
            )
        if self.use_mla and self.mamba is not None:
            raise TopologyError("an engine cannot be both MLA and a Mamba hybrid")
        if self.layout is Layout.PACKED:
            if self.use_mla:
                raise TopologyError(
                    f"engine {self.engine_id!r}: MLA caches hold one latent per block, not K and V, "
                    "so they cannot use the packed layout; use layout kv-first"
                )
            if self.cross_layer:
                raise TopologyError(
                    f"engine {self.engine_id!r}: a cross-layer cache with the packed layout is not "
                    "supported yet; use per-layer packed caches (cross_layer=False) or another layout"
                )
        if self.use_mla and self.layout is Layout.BLOCKS_FIRST:
            raise TopologyError("MLA caches hold one latent per block; use layout kv-first")
        if self.mamba is not None and self.layout not in (Layout.BLOCKS_FIRST, Layout.PACKED):
            raise TopologyError(
                "hybrid Mamba models share cache pages with attention in the blocks-first or "
                "packed layout; set layout to blocks-first or packed"
            )
        if self.block_bytes is not None and (
            not isinstance(self.block_bytes, int) or self.block_bytes <= 0
        ):
            raise TopologyError(f"block_bytes must be a positive integer, got {self.block_bytes!r}")
        object.__setattr__(self, "groups", tuple(self.groups))
        check_groups(self.groups, has_mamba=self.mamba is not None, what=f"engine {self.engine_id!r}")
        # Head placement must be possible on this side alone.
        check_tp_heads(self.tp_size, self.kv_heads_for_placement, what=f"engine {self.engine_id!r}")
        if self.block_bytes is not None:
            # attention part only: a Mamba state page is checked against the real
            # tensors when they are registered (kvbridge.memory), since kernel-block
            # views of a hybrid page are smaller than the state they belong to
            computed = self.computed_element_bytes * self.elements_per_block_region
            if self.block_bytes < computed:
                raise TopologyError(
                    f"engine {self.engine_id!r}: measured block_bytes {self.block_bytes} is smaller "
                    f"than the {computed} bytes one block of this model shape needs"
                )
            if self.mamba is None and self.block_bytes % self.elements_per_block_region:
                raise TopologyError(
                    f"engine {self.engine_id!r}: block_bytes {self.block_bytes} does not split into "
                    f"{self.elements_per_block_region} equal K/V halves"
                )

    # ----- derived facts -------------------------------------------------
    @property
    def dtype_size(self) -> int:
        return dtype_size(self.dtype)

    @property
    def kv_heads_for_placement(self) -> int:
        """Heads that TP shards: the MLA latent counts as one replicated head."""
        return 1 if self.use_mla else self.num_kv_heads

    @property
    def kernel_block_size(self) -> int:
        return self.block_size // self.kernel_blocks_per_block

    @property
    def heads_per_rank(self) -> int:
        """Physical KV heads stored on each rank (1 when heads are replicated)."""
        return heads_per_rank(self.tp_size, self.kv_heads_for_placement)

    @property
    def is_replicated(self) -> bool:
        """True when several ranks hold the same KV head (TP > K, or MLA with TP > 1)."""
        return is_replicated(self.tp_size, self.kv_heads_for_placement)

    @property
    def separate_kv_regions(self) -> bool:
        """kv-first non-MLA caches (not cross-layer) register K and V as separate regions."""
        return self.layout is Layout.KV_FIRST and not self.use_mla and not self.cross_layer

    @property
    def is_packed(self) -> bool:
        """True for the packed layout (K and V of each head together in one element)."""
        return self.layout is Layout.PACKED

    @property
    def elements_per_block_region(self) -> int:
        """Elements in one block of one layer's region: 2 (K, V) when K and V are separate
        elements of it, else 1 (a kv-first K or V region, the MLA latent, a packed K+V block).

        For a cross-layer cache this is one layer's slot of the single block.
        """
        if self.is_packed:
            return 1
        shared = self.layout is Layout.BLOCKS_FIRST or self.cross_layer
        return 2 if (shared and not self.use_mla) else 1

    @property
    def head_token_bytes(self) -> int:
        """Bytes one head occupies per token in one element: ``head_dim x dtype``, twice that
        for the packed layout (its element holds K and V)."""
        return self.head_dim * self.dtype_size * (2 if self.is_packed else 1)

    @property
    def head_bytes(self) -> int:
        """Bytes of one head over one block's tokens (one element holds heads_per_rank of these).

        For the packed layout this covers the head's K and V.
        """
        return self.block_size * self.head_token_bytes

    @property
    def computed_element_bytes(self) -> int:
        return self.heads_per_rank * self.head_bytes

    @property
    def computed_block_bytes(self) -> int:
        attention = self.computed_element_bytes * self.elements_per_block_region
        if self.mamba is None:
            return attention
        # hybrid models share one page between attention blocks and Mamba state
        return max(attention, mamba_state_bytes(self))

    @property
    def region_block_bytes(self) -> int:
        """Bytes of one block of one region on one rank (measured when known)."""
        return self.block_bytes if self.block_bytes is not None else self.computed_block_bytes

    @property
    def element_bytes(self) -> int:
        """Bytes of one element of one block on one rank: K or V, the MLA latent, or (packed)
        K and V of all the rank's heads."""
        if self.mamba is not None:
            return self.computed_element_bytes
        return self.region_block_bytes // self.elements_per_block_region

    @property
    def regions_per_layer(self) -> int:
        return 2 if self.separate_kv_regions else 1

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies on one rank, all layers (K and V counted once each)."""
        per_layer = self.heads_per_rank * self.head_dim * self.dtype_size
        return per_layer * (1 if self.use_mla else 2) * self.num_layers


def mamba_state_layout(spec: EngineSpec) -> dict[str, tuple[int, int, int]]:
    """(units, bytes per unit, offset in page) of the x, B, C and SSM pieces on one rank."""
    m = spec.mamba
    if m is None:
        raise TopologyError(f"engine {spec.engine_id!r} is not a Mamba hybrid")
    t = spec.tp_size
    x_unit = m.ssm_head_dim * m.conv_width * m.conv_dtype_size
    bc_unit = m.state_size * m.conv_width * m.conv_dtype_size
    ssm_unit = m.ssm_head_dim * m.state_size * m.ssm_dtype_size
    heads = max(1, m.ssm_heads // t)
    groups = max(1, m.n_groups // t)
    x_bytes = heads * x_unit
    bc_bytes = groups * bc_unit
    return {
        "x": (m.ssm_heads, x_unit, 0),
        "B": (m.n_groups, bc_unit, x_bytes),
        "C": (m.n_groups, bc_unit, x_bytes + bc_bytes),
        "ssm": (m.ssm_heads, ssm_unit, x_bytes + 2 * bc_bytes),
    }


def mamba_state_bytes(spec: EngineSpec) -> int:
    """Bytes of one rank's conv + SSM state of one layer (before page padding)."""
    lay = mamba_state_layout(spec)
    units, unit, off = lay["ssm"]
    return off + max(1, units // spec.tp_size) * unit
