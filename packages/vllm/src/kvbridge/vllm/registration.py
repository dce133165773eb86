"""Registration: one rank's vLLM KV cache and configuration as kvbridge values.

vLLM hands each worker its KV-cache tensors (``register_kv_caches``); this
module turns them, with the model and cache facts of vLLM's configuration,
into the rank's :class:`kvbridge.topology.EngineSpec` (via
:mod:`kvbridge.vllm.cachespec`), its :class:`kvbridge.memory.CacheRegions`
and the :class:`kvbridge.nixl.EngineConfig` the worker's engines run with.

It reads vLLM's configuration objects by attribute and imports nothing from
vLLM; a new model family whose cache tensors have another shape is described
in :mod:`kvbridge.vllm.cachespec`, and its configuration facts here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvbridge.memory import CacheRegions, regions_from_kv_caches
from kvbridge.nixl import AgentConfig, EngineConfig, all_cpus
from kvbridge.topology import (
    EngineSpec,
    GroupKind,
    MambaSpec,
    TopologyError,
    canonical_dtype,
    dtype_size,
)
from kvbridge.vllm.cachespec import (
    CacheShapeError,
    LayerTensor,
    ModelFacts,
    dtype_name,
    engine_spec_for,
    layer_sort_key,
    model_identity,
)
from kvbridge.vllm.config import ConnectorConfig
from kvbridge.vllm.kv_cache_groups import (
    GroupFacts,
    attention_block_size,
    cache_groups,
    group_facts,
    mamba_spec_for,
    split_mamba_state,
)
from kvbridge.vllm.mamba_layers import mamba_layer_geometry, mamba_spec_from_layers

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvbridge.vllm")

__all__ = ["Registration", "configured_cache_dtype", "engine_config", "model_facts", "register_caches"]


@dataclass(frozen=True)
class Registration:
    """One rank's cache as the transfer engines take it."""

    spec: EngineSpec
    regions: CacheRegions
    engine_config: EngineConfig
    #: vLLM's layer names in model order (the order of the cache's layers)
    layer_names: tuple[str, ...] = ()
    #: vLLM's transfer groups (empty: one full-attention group)
    groups: tuple[GroupFacts, ...] = ()


def model_facts(vllm_config: Any, kv_cache_config: Any, engine_id: str,
                kv_caches: Mapping[str, torch.Tensor], block_size: int | None = None) -> ModelFacts:
    """The model and cache facts of vLLM's configuration (``VllmConfig``, ``KVCacheConfig``);
    ``block_size``: the attention groups' (default ``cache_config.block_size``)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    num_blocks = (int(kv_cache_config.num_blocks) if kv_cache_config is not None
                  else int(next(iter(kv_caches.values())).shape[0]))
    return ModelFacts(
        engine_id=engine_id, tp_size=pc.tensor_parallel_size,
        num_kv_heads=1 if mc.use_mla else mc.get_total_num_kv_heads(),
        head_dim=mc.get_head_size(),
        block_size=block_size or vllm_config.cache_config.block_size,
        num_blocks=num_blocks, use_mla=bool(mc.use_mla),
    )


def configured_cache_dtype(cache_config: Any, tensor_dtype: str) -> str | None:
    """vLLM's ``kv_cache_dtype`` as kvbridge names it, None for ``auto`` (the tensors'
    dtype says it). vLLM keeps FP8 caches in uint8 tensors whatever the FP8 format, so
    the configured name is what tells two formats apart in the handshake."""
    name = str(getattr(cache_config, "cache_dtype", None) or "auto")
    if name == "auto":
        return None
    try:
        dtype = canonical_dtype(name)
    except TopologyError:
        raise CacheShapeError(f"kv_cache_dtype {name!r} is not supported by kvbridge; use auto, "
                              "float16, bfloat16, fp8, fp8_e4m3 or fp8_e5m2") from None
    if dtype_size(dtype) != dtype_size(tensor_dtype):
        raise CacheShapeError(f"kv_cache_dtype {name!r} has {dtype_size(dtype)}-byte elements but "
                              f"the cache tensors hold {tensor_dtype} ({dtype_size(tensor_dtype)} bytes)")
    return dtype


def engine_config(cfg: ConnectorConfig, *, mem_type: str, model: str,
                  attention_backend: str, null_block_id: int | None = 0,
                  kv_cache_dtype: str | None = None) -> EngineConfig:
    """The transfer engines' settings from the connector's."""
    return EngineConfig(
        agent=AgentConfig(backends=cfg.backends, num_threads=cfg.ucx_threads,
                          progress_thread=cfg.progress_thread),
        mode=cfg.mode, lease_s=cfg.lease_seconds, renew_interval_s=cfg.heartbeat_seconds,
        handshake_timeout_s=cfg.handshake_timeout_seconds,
        transfer_timeout_s=cfg.transfer_timeout_seconds, mem_type=mem_type,
        model=model, attention_backend=attention_backend, enforce_compat=cfg.enforce_compat,
        record_transfers=True, huge_pages=cfg.huge_pages, auth_key=cfg.auth_key,
        staging_mib=cfg.staging_mib,
        worker_cpus=(all_cpus() if cfg.transfer_cpus == "all" else
                     None if cfg.transfer_cpus == "inherit" else tuple(cfg.transfer_cpus)),
        complete_in_background_s=0.5 if cfg.complete_in_background else 0.0,
        gil_handoff_s=cfg.gil_handoff_us / 1e6,
        warm_up=cfg.warm_up,
        null_block_id=null_block_id,  # vLLM's null block: ids outside a sliding window
        kv_cache_dtype=kv_cache_dtype,
    )


def _mamba_spec(groups: tuple[GroupFacts, ...], vllm_config: Any, tp_size: int,
                conv_dim_first: bool) -> MambaSpec | None:
    """One MambaSpec for every Mamba group (they must agree), or None without any.

    The geometry is what vLLM computed for this engine: its Mamba layer objects
    (:mod:`kvbridge.vllm.mamba_layers`), checked against the KV-cache spec's state
    shapes. Without them (a layer class kvbridge cannot read), the state shapes alone
    describe it: exact at TP 1; at a larger TP one group per rank is taken as sharded
    groups, so an engine whose single group vLLM replicates then moves state between
    equal TP sizes only (the handshake refuses another TP size, naming the groups)."""
    mamba = [g for g in groups if g.kind is GroupKind.MAMBA]
    if not mamba:
        return None
    kinds = {(g.state_shapes, g.state_dtypes, g.mamba_type) for g in mamba}
    if len(kinds) > 1:
        raise CacheShapeError(
            f"the model's Mamba groups hold states of different shapes {sorted(kinds)}; "
            "KVBridgeConnector moves one Mamba state shape per engine"
        )
    names = [n for g in mamba for n in g.layer_names]
    layers = mamba_layer_geometry(vllm_config, names)
    if layers:
        missing = [n for n in names if n not in layers]
        if missing:
            raise CacheShapeError(f"vLLM's Mamba layers {missing[:3]} cannot be described (other "
                                  f"layer classes than {sorted({type(x).__name__ for x in layers.values()})})")
        g = mamba[0]
        geo = next(iter(layers.values()))
        log.info("kvbridge: Mamba geometry from vLLM's %d %s layers: %d heads of %d, %d B/C "
                 "group(s)%s, state %d, TP %d", len(layers), geo.mamba_type, geo.heads,
                 geo.head_dim, geo.n_groups, " (replicated on every rank)" if geo.replicated else "",
                 geo.state_size, geo.tp_size)
        return mamba_spec_from_layers(layers, tp_size=tp_size, state_shapes=g.state_shapes,
                                      state_dtypes=g.state_dtypes, mamba_type=g.mamba_type,
                                      dim_first=conv_dim_first)
    if tp_size > 1:
        log.warning("kvbridge: vLLM's Mamba layers %s are not readable; their geometry is taken "
                    "from the KV-cache state shapes (heterogeneous TP may be refused)", names[:2])
    return mamba_spec_for(mamba[0], tp_size=tp_size, dim_first=conv_dim_first)


def register_caches(vllm_config: Any, kv_cache_config: Any, kv_caches: Mapping[str, Any],
                    cfg: ConnectorConfig, *, engine_id: str, attention_backend: str,
                    conv_dim_first: bool = False) -> Registration:
    """Describe one rank's KV-cache tensors (one per attention layer, one byte view of the
    pages per Mamba layer, any order) and every KV-cache group of a hybrid model.

    ``conv_dim_first``: vLLM stores Mamba conv states dimension-first (DS layout).
    """
    groups = group_facts(kv_cache_config) if kv_cache_config is not None else ()
    facts = model_facts(vllm_config, kv_cache_config, engine_id, kv_caches,
                        attention_block_size(groups, vllm_config.cache_config.block_size))
    names = sorted(kv_caches, key=layer_sort_key)
    mamba_of = {n: g for g in groups if g.kind is GroupKind.MAMBA for n in g.layer_names}
    caches: dict[str, Any] = {n: (split_mamba_state(kv_caches[n], mamba_of[n], n)
                                  if n in mamba_of else kv_caches[n]) for n in names}
    attention = [n for n in names if n not in mamba_of]
    if not attention:
        raise CacheShapeError("the model has no attention layer (a pure Mamba model); "
                              "KVBridgeConnector moves attention caches with their Mamba state")
    layers = [LayerTensor(n, tuple(caches[n].shape), tuple(caches[n].stride()),
                          dtype_name(caches[n].dtype)) for n in attention]
    # vLLM's KV-cache groups share pages: the layers of different groups view one tensor,
    # which kvbridge registers once (one region, the layers' roles in it)
    spec = engine_spec_for(facts, layers, len({caches[n].data_ptr() for n in attention}))
    if len(groups) > 1 or any(g.kind is not GroupKind.FULL for g in groups):
        try:
            spec = replace(spec, groups=cache_groups(groups, names),
                           mamba=_mamba_spec(groups, vllm_config, facts.tp_size, conv_dim_first))
        except TopologyError as exc:
            raise CacheShapeError(f"the hybrid KV cache cannot be described: {exc}") from exc
    regions = regions_from_kv_caches({n: caches[n] for n in names}, spec)
    mc = vllm_config.model_config
    hf = mc.hf_config
    identity = model_identity(
        getattr(hf, "architectures", None), hidden_size=getattr(hf, "hidden_size", 0),
        num_layers=len(names), num_heads=getattr(hf, "num_attention_heads", 0),
        num_kv_heads=facts.num_kv_heads, head_dim=facts.head_dim,
        vocab_size=mc.get_vocab_size())
    kv_dtype = configured_cache_dtype(vllm_config.cache_config, spec.dtype)
    return Registration(spec, regions, engine_config(cfg, mem_type=regions.mem_type,
                                                     model=identity,
                                                     attention_backend=attention_backend,
                                                     kv_cache_dtype=kv_dtype),
                        tuple(names), groups)
