"""kvbridge KV connector for vLLM (uses the vLLM and torch already installed).

vLLM loads the connector class with ``kv_connector_module_path="kvbridge.vllm"``
and ``kv_connector="KVBridgeConnector"``. The names that import vLLM (the
connector facade, its wire values and metrics) are imported on first access,
so the vLLM-independent parts exported here (configuration,
``kv_transfer_params``, scheduler bookkeeping, cache description, stats data)
import without vLLM, torch or NIXL. The halves of the connector per mode
(:mod:`kvbridge.vllm.pull`, :mod:`kvbridge.vllm.push`; chosen by
:mod:`kvbridge.vllm.halves`) import no vLLM either; those that use the transfer
engines (torch, NIXL) or the side channel (ZMQ) are served lazily too.
"""

from kvbridge.vllm.cachespec import (
    CacheShapeError,
    LayerTensor,
    ModelFacts,
    engine_spec_for,
    layer_sort_key,
    model_identity,
)
from kvbridge.vllm.config import (
    CONFIG_KEYS,
    ConfigError,
    ConfigKey,
    ConnectorConfig,
    EngineRoles,
    check_engine_support,
    parse_connector_config,
)
from kvbridge.vllm.modes import Allocated, SchedulerMode, TransferResults
from kvbridge.vllm.params import (
    PARAMS_VERSION,
    ParamsError,
    RemotePrefill,
    decode_remote_prefill,
    encode_remote_prefill,
    is_prefill_request,
    is_remote_prefill,
    prefill_request_params,
)
from kvbridge.vllm.pull.orders import HoldOrder, LoadOrder, PullOrders
from kvbridge.vllm.pull.scheduler import PullScheduler
from kvbridge.vllm.pull.source import check_remote_blocks, check_remote_parallelism, tokens_to_load
from kvbridge.vllm.stats import merge_stats

#: names served on first access, by module (they import vLLM, or torch and NIXL)
_LAZY = {
    "KVBridgeConnector": "connector",
    "KVBridgeConnectorMetadata": "connector",
    "KVBridgeHandshake": "connector",
    "KVBridgePromMetrics": "metrics",
    "KVBridgeStats": "metrics",
    "PullWorker": "pull.worker",
    "PushOrders": "push.orders",
    "PushScheduler": "push.scheduler",
    "PushWorker": "push.worker",
    "RankEngines": "rank_engines",
    "Registration": "registration",
    "SideChannel": "side_channel",
    "register_caches": "registration",
    "scheduler_half": "halves",
    "worker_half": "halves",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"kvbridge.vllm.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kvbridge.vllm' has no attribute {name!r}")


__all__ = [
    "CONFIG_KEYS",
    "PARAMS_VERSION",
    "Allocated",
    "CacheShapeError",
    "ConfigError",
    "ConfigKey",
    "ConnectorConfig",
    "EngineRoles",
    "HoldOrder",
    "KVBridgeConnector",
    "KVBridgeConnectorMetadata",
    "KVBridgeHandshake",
    "KVBridgePromMetrics",
    "KVBridgeStats",
    "LayerTensor",
    "LoadOrder",
    "ModelFacts",
    "ParamsError",
    "PullOrders",
    "PullScheduler",
    "PullWorker",
    "PushOrders",
    "PushScheduler",
    "PushWorker",
    "RankEngines",
    "Registration",
    "RemotePrefill",
    "SchedulerMode",
    "SideChannel",
    "TransferResults",
    "check_engine_support",
    "check_remote_blocks",
    "check_remote_parallelism",
    "decode_remote_prefill",
    "encode_remote_prefill",
    "engine_spec_for",
    "is_prefill_request",
    "is_remote_prefill",
    "layer_sort_key",
    "merge_stats",
    "model_identity",
    "parse_connector_config",
    "prefill_request_params",
    "register_caches",
    "scheduler_half",
    "tokens_to_load",
    "worker_half",
]
