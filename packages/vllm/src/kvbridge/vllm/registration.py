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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbridge.memory import CacheRegions, regions_from_kv_caches
from kvbridge.nixl import AgentConfig, EngineConfig, all_cpus
from kvbridge.topology import EngineSpec, TopologyError, canonical_dtype, dtype_size
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

if TYPE_CHECKING:
    import torch

__all__ = ["Registration", "configured_cache_dtype", "engine_config", "model_facts", "register_caches"]


@dataclass(frozen=True)
class Registration:
    """One rank's cache as the transfer engines take it."""

    spec: EngineSpec
    regions: CacheRegions
    engine_config: EngineConfig
    #: vLLM's layer names in model order (the order of the cache's layers)
    layer_names: tuple[str, ...] = ()


def model_facts(vllm_config: Any, kv_cache_config: Any, engine_id: str,
                kv_caches: Mapping[str, torch.Tensor]) -> ModelFacts:
    """The model and cache facts of vLLM's configuration (``VllmConfig``, ``KVCacheConfig``)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    num_blocks = (int(kv_cache_config.num_blocks) if kv_cache_config is not None
                  else int(next(iter(kv_caches.values())).shape[0]))
    return ModelFacts(
        engine_id=engine_id, tp_size=pc.tensor_parallel_size,
        num_kv_heads=1 if mc.use_mla else mc.get_total_num_kv_heads(),
        head_dim=mc.get_head_size(), block_size=vllm_config.cache_config.block_size,
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
                  attention_backend: str, kv_cache_dtype: str | None = None) -> EngineConfig:
    """The transfer engines' settings from the connector's."""
    return EngineConfig(
        agent=AgentConfig(backends=cfg.backends, num_threads=cfg.ucx_threads,
                          progress_thread=cfg.progress_thread),
        mode=cfg.mode, lease_s=cfg.lease_seconds, renew_interval_s=cfg.heartbeat_seconds,
        handshake_timeout_s=cfg.handshake_timeout_seconds,
        transfer_timeout_s=cfg.transfer_timeout_seconds, mem_type=mem_type,
        model=model, attention_backend=attention_backend, enforce_compat=cfg.enforce_compat,
        record_transfers=True, huge_pages=cfg.huge_pages, auth_key=cfg.auth_key,
        worker_cpus=(all_cpus() if cfg.transfer_cpus == "all" else
                     None if cfg.transfer_cpus == "inherit" else tuple(cfg.transfer_cpus)),
        complete_in_background_s=0.5 if cfg.complete_in_background else 0.0,
        kv_cache_dtype=kv_cache_dtype,
    )


def register_caches(vllm_config: Any, kv_cache_config: Any, kv_caches: Mapping[str, torch.Tensor],
                    cfg: ConnectorConfig, *, engine_id: str, attention_backend: str) -> Registration:
    """Describe one rank's KV-cache tensors (one per attention layer, any order)."""
    facts = model_facts(vllm_config, kv_cache_config, engine_id, kv_caches)
    names = sorted(kv_caches, key=layer_sort_key)
    layers = [LayerTensor(n, tuple(kv_caches[n].shape), tuple(kv_caches[n].stride()),
                          dtype_name(kv_caches[n].dtype)) for n in names]
    spec = engine_spec_for(facts, layers)
    regions = regions_from_kv_caches({n: kv_caches[n] for n in names}, spec)
    mc = vllm_config.model_config
    hf = mc.hf_config
    identity = model_identity(
        getattr(hf, "architectures", None), hidden_size=getattr(hf, "hidden_size", 0),
        num_layers=spec.num_layers, num_heads=getattr(hf, "num_attention_heads", 0),
        num_kv_heads=facts.num_kv_heads, head_dim=facts.head_dim,
        vocab_size=mc.get_vocab_size())
    kv_dtype = configured_cache_dtype(vllm_config.cache_config, spec.dtype)
    return Registration(spec, regions, engine_config(cfg, mem_type=regions.mem_type,
                                                     model=identity,
                                                     attention_backend=attention_backend,
                                                     kv_cache_dtype=kv_dtype),
                        tuple(names))
