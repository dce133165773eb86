"""kvbridge transfer-topology math: engines, head placement, read plans, validation.

Standard library only, so operators can plan deployments without torch or NIXL.
"""

from .blocks import (
    UnitMatch,
    block_size_ratio,
    blocks_for_tokens,
    kernel_block_ids,
    logical_block_ids,
    match_units,
)
from .dtypes import DTYPE_ALIASES, DTYPE_SIZES, canonical_dtype, dtype_size
from .errors import TopologyError
from .heads import check_tp_heads, head_range, heads_per_rank, is_replicated, ranks_holding
from .layout import KIND_K, KIND_KV, KIND_V, ElementLayout, element_kinds, element_layout
from .parallel import TransferKey, receive_sources, send_targets
from .plan import (
    DimRead,
    MambaFacts,
    MambaPiece,
    ProducerRankPlan,
    RankPlan,
    ReadOp,
    check_compatible,
    mamba_state_bytes,
    notifications_expected,
    plan_dim,
    plan_rank,
    producer_plans,
    seed_handshake_ranks,
    tp_ratio,
)
from .spec import ConvLayout, EngineSpec, HeadOrder, Layout, MambaSpec
from .transfer import PostProcess, TransferPlan, plan_transfer

__all__ = [
    "DTYPE_ALIASES", "DTYPE_SIZES", "KIND_K", "KIND_KV", "KIND_V",
    "ConvLayout", "DimRead", "ElementLayout", "EngineSpec", "HeadOrder", "Layout", "MambaFacts",
    "MambaPiece", "MambaSpec", "PostProcess", "ProducerRankPlan", "RankPlan", "ReadOp",
    "TopologyError", "TransferKey", "TransferPlan", "UnitMatch", "block_size_ratio",
    "blocks_for_tokens", "canonical_dtype", "check_compatible", "check_tp_heads", "dtype_size", "element_kinds", "element_layout",
    "head_range", "heads_per_rank", "is_replicated", "kernel_block_ids", "logical_block_ids",
    "mamba_state_bytes", "match_units", "notifications_expected", "plan_dim", "plan_rank",
    "plan_transfer", "producer_plans", "ranks_holding", "receive_sources", "seed_handshake_ranks",
    "send_targets", "tp_ratio",
]
