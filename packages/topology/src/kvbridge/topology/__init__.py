"""kvbridge transfer-topology math: engines, head placement, read plans, validation.

Standard library only, so operators can plan deployments without torch or NIXL.
It also holds the transfer engine's plain records (:mod:`~kvbridge.topology.records`:
``TransferParams``, ``BlockIds``, ...), so callers type them without importing NIXL.
"""

from .blocks import block_size_ratio, blocks_for_tokens, kernel_block_ids
from .compat import check_compatible
from .dtypes import DTYPE_ALIASES, DTYPE_SIZES, canonical_dtype, dtype_size
from .errors import TopologyError
from .groups import CacheGroup, GroupKind, effective_groups
from .heads import check_tp_heads, head_range, heads_per_rank, is_replicated, ranks_holding
from .layout import KIND_K, KIND_KV, KIND_V, ElementLayout, element_kinds, element_layout
from .mamba import MambaFacts, MambaPiece
from .plan import ProducerRankPlan, RankPlan, plan_rank, producer_plans
from .reads import DimRead, ReadOp, plan_dim, seed_handshake_ranks, tp_ratio
from .records import (
    BlockIds,
    DecodeEvents,
    Failed,
    FailureKind,
    Released,
    TransferParams,
    TransferRecord,
    per_group_block_ids,
)
from .render import plan_to_json, plan_to_svg, plan_to_text
from .shapes import add_shape_arguments, engines_from_args
from .spec import (
    ConvLayout,
    EngineSpec,
    HeadOrder,
    Layout,
    MambaSpec,
    mamba_state_bytes,
    mamba_state_layout,
)
from .transfer import PostProcess, TransferPlan, plan_transfer

__all__ = [
    "DTYPE_ALIASES", "DTYPE_SIZES", "KIND_K", "KIND_KV", "KIND_V",
    "BlockIds", "CacheGroup", "ConvLayout", "DecodeEvents", "DimRead", "ElementLayout", "EngineSpec",
    "Failed", "FailureKind", "GroupKind", "HeadOrder",
    "Layout", "MambaFacts", "MambaPiece", "MambaSpec", "PostProcess", "ProducerRankPlan", "RankPlan", "ReadOp",
    "Released", "TopologyError", "TransferParams", "TransferPlan", "TransferRecord", "add_shape_arguments", "block_size_ratio",
    "blocks_for_tokens", "canonical_dtype", "check_compatible", "check_tp_heads", "dtype_size",
    "effective_groups", "element_kinds", "element_layout", "engines_from_args", "head_range", "heads_per_rank",
    "is_replicated", "kernel_block_ids", "mamba_state_bytes", "mamba_state_layout", "per_group_block_ids",
    "plan_dim", "plan_rank",
    "plan_to_json", "plan_to_svg", "plan_to_text", "plan_transfer", "producer_plans",
    "ranks_holding", "seed_handshake_ranks", "tp_ratio",
]
