"""What differs between vLLM versions, in one place.

Each function reads one fact from a vLLM object, or imports one vLLM name,
and knows the older spellings; the rest of the connector sees plain values.
Supported: vLLM 0.32 (tested), and the older spellings noted here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING

from kvbridge.topology import BlockIds
from kvbridge.vllm.modes import StepProgress

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

try:  # vLLM >= 0.11
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:  # vLLM >= 0.11 labels where external cache hits come from
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]

__all__ = [
    "CacheHitSource",
    "VllmAllocation",
    "KVConnectorTransferResults",
    "attention_backend_name",
    "computed_block_count",
    "conv_state_dim_first",
    "load_block_ids",
    "dp_index",
    "drop_last_prompt_token",
    "parallel_sizes",
    "request_completed",
    "required_kvcache_layout",
    "select_groups",
    "tp_rank",
    "transfer_group_ids",
    "transfer_groups",
    "unhashed_block_ids",
]

log = logging.getLogger("kvbridge.vllm")


def transfer_groups(kv_cache_config: KVCacheConfig | None) -> int:
    """How many KV-cache groups a connector transfers (vLLM >= 0.32 may exclude some)."""
    if kv_cache_config is None:
        return 1
    groups = getattr(kv_cache_config, "transfer_groups", None)
    if groups is None:
        groups = getattr(kv_cache_config, "kv_cache_groups", ())
    return len(groups)


def transfer_group_ids(kv_cache_config: KVCacheConfig | None) -> tuple[int, ...]:
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    return tuple(ids) if ids is not None else (0,)


def select_groups(kv_cache_config: KVCacheConfig | None,
                  block_ids: Sequence[Sequence[int]]) -> BlockIds:
    """Per-group block ids of the transfer groups (vLLM >= 0.32 may exclude some)."""
    sel = getattr(kv_cache_config, "select_transfer_block_ids", None)
    if sel is not None and block_ids:
        block_ids = sel(tuple(block_ids))
    return tuple(tuple(int(b) for b in g) for g in block_ids)


def unhashed_block_ids(blocks: KVCacheBlocks) -> list:
    """Per-group ids of the newly allocated blocks (the ones a load writes)."""
    if hasattr(blocks, "get_unhashed_block_ids_all_groups"):
        return blocks.get_unhashed_block_ids_all_groups()
    return [blocks.get_unhashed_block_ids()]  # pragma: no cover - older vLLM


def load_block_ids(blocks: KVCacheBlocks, kv_cache_config: KVCacheConfig | None,
                   computed: int) -> list:
    """Per-group ids of the blocks a load writes: the blocks after the ``computed`` leading
    prefix-cache hits. One group: the newly allocated (unhashed) blocks. Several groups:
    every block after the hits, vLLM's null blocks included (a sliding-window group pads
    the blocks outside its window with block 0; dropping them, as vLLM's
    ``get_unhashed_block_ids_all_groups`` does, would shift the pairing with the prefill
    engine's list), and a Mamba group's whole list (its blocks are of another size)."""
    if len(getattr(blocks, "blocks", ()) or ()) <= 1:
        return unhashed_block_ids(blocks)
    specs = [g.kv_cache_spec for g in getattr(kv_cache_config, "kv_cache_groups", ())]
    out = []
    for i, ids in enumerate(blocks.get_block_ids()):
        mamba = i < len(specs) and type(specs[i]).__name__ == "MambaSpec"
        out.append(list(ids) if mamba else list(ids)[computed:])
    return out


def computed_block_count(blocks: KVCacheBlocks, kv_cache_config: KVCacheConfig | None = None) -> int:
    """Leading blocks already present locally (prefix-cache hits), in blocks of the
    scheduler's block size: the most any full-attention group has (a sliding-window
    group's hits include null blocks; Mamba groups count in blocks of their own size)."""
    groups = getattr(blocks, "blocks", None) or ()
    specs = [g.kv_cache_spec for g in getattr(kv_cache_config, "kv_cache_groups", ())]
    if len(specs) != len(groups):
        specs = [None] * len(groups)
    counts = [sum(1 for b in g if b.block_hash is not None and not b.is_null)
              for g, spec in zip(groups, specs, strict=True)
              if spec is None or type(spec).__name__ == "FullAttentionSpec"]
    return max(counts, default=0) if len(groups) > 1 else (counts[0] if counts else 0)


def drop_last_prompt_token(request: Request) -> bool:
    """Drop a request's last prompt token (a prefill request for a remote decode on a Mamba
    hybrid, once), so the state it leaves is the one before that token, which the decode
    engine then computes itself (as vLLM's NixlConnector does). True if dropped."""
    if request.num_prompt_tokens <= 1:
        return False
    skip = getattr(request, "get_skip_reading_prefix_cache", None)
    if skip is not None and skip():
        return False  # prompt logprobs: decode recomputes the whole prompt anyway
    if request.prompt_token_ids is not None:
        del request.prompt_token_ids[-1:]
    elif getattr(request, "prompt_embeds", None) is not None:
        request.prompt_embeds = request.prompt_embeds[:-1]
    else:  # pragma: no cover - nothing to drop
        return False
    del request._all_token_ids[-1:]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    return True


def conv_state_dim_first() -> bool:
    """True when vLLM stores Mamba conv states dimension-first (``VLLM_SSM_CONV_STATE_LAYOUT=DS``),
    so a TP shard's channels are contiguous."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:  # pragma: no cover - older vLLM: token-first only
        return False
    return bool(is_conv_state_dim_first())


def request_completed(request: Request) -> bool:
    """True when a request finished normally (length or stop), not aborted or failed."""
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def dp_index(vllm_config: VllmConfig) -> int:
    """This engine's data-parallel index."""
    pc = vllm_config.parallel_config
    return int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)


def parallel_sizes(vllm_config: VllmConfig) -> dict[str, int]:
    """The parallel sizes kvbridge refuses above 1, by vLLM's setting name (a setting an
    older vLLM lacks reads as 1)."""
    pc = vllm_config.parallel_config
    return {name: int(getattr(pc, name, 1) or 1)
            for name in ("pipeline_parallel_size", "decode_context_parallel_size",
                         "prefill_context_parallel_size")}


def tp_rank() -> int:
    """This worker's tensor-parallel rank."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def attention_backend_name(vllm_config: VllmConfig) -> str:
    """The attention backend's name (part of the compatibility hash: caches of different
    backends can order bytes differently inside a block)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        names = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})
        return ",".join(names) or "unknown"
    except Exception:  # pragma: no cover - older vLLM
        return "unknown"


def required_kvcache_layout(use_mla: bool) -> str | None:
    """The cache layout to ask vLLM for: heads contiguous per block (so they can be split
    between TP sizes); MLA caches have one head and need none."""
    if use_mla:
        return None
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: F401 - vLLM >= 0.32

        return "LBHNC"
    except ImportError:  # pragma: no cover - older vLLM
        return "HND"


def step_progress(scheduler_output: SchedulerOutput) -> list[StepProgress]:
    """This step's scheduled requests as (id, tokens computed before the step, tokens
    scheduled in it, newly allocated block ids per group or None)."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    out = []
    for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        out.append((r.req_id, int(r.num_computed_tokens), int(scheduled.get(r.req_id, 0)),
                    _block_ids(r.block_ids)))
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        for i, rid in enumerate(cached.req_ids):
            out.append((rid, int(cached.num_computed_tokens[i]), int(scheduled.get(rid, 0)),
                        _block_ids(cached.new_block_ids[i])))
    return out


def step_is_idle(scheduler_output: SchedulerOutput) -> bool:
    """Whether the step runs no tokens at all (every request waits, e.g. for remote KV);
    False where vLLM does not say."""
    n = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    return isinstance(n, int) and n == 0


def _block_ids(groups: Sequence[Sequence[int]] | None) -> BlockIds | None:
    return None if groups is None else tuple(tuple(int(b) for b in g) for g in groups)


class VllmAllocation:
    """A request's blocks as :class:`kvbridge.vllm.modes.Allocation`, read from vLLM's
    ``KVCacheBlocks`` on first use (most requests never need them), transfer groups only."""

    def __init__(self, blocks: KVCacheBlocks, kv_cache_config: KVCacheConfig | None) -> None:
        self._blocks = blocks
        self._config = kv_cache_config

    @cached_property
    def block_ids(self) -> BlockIds:
        return select_groups(self._config, self._blocks.get_block_ids())

    @cached_property
    def prefix_hits(self) -> int:
        return computed_block_count(self._blocks, self._config)

    @cached_property
    def first_group_hits(self) -> int:
        return computed_block_count(self._blocks)

    @cached_property
    def new_block_ids(self) -> BlockIds:
        return select_groups(self._config, load_block_ids(self._blocks, self._config,
                                                          self.prefix_hits))
