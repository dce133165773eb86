"""kvbridge KV connector for vLLM (uses the vLLM and torch already installed).

vLLM loads the connector class with ``kv_connector_module_path="kvbridge.vllm"``
and ``kv_connector="KVBridgeConnector"``; the class lives in
:mod:`kvbridge.vllm.connector` and is imported on first access, so the
vLLM-independent parts exported here (configuration, ``kv_transfer_params``,
scheduler bookkeeping, cache description, report aggregation) import without
vLLM, torch or NIXL.
"""

from kvbridge.vllm.aggregate import MergedReport, OutputAggregator, WorkerReport, merge_stats
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
    parse_connector_config,
)
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
from kvbridge.vllm.scheduling import (
    blocks_for_tokens,
    check_remote_blocks,
    matched_tokens,
    tokens_to_load,
)
from kvbridge.vllm.steps import HoldOrder, LoadOrder, SchedulerState, StepOrders

#: names served from kvbridge.vllm.connector on first access (they import vLLM)
_CONNECTOR_NAMES = ("KVBridgeConnector", "KVBridgeConnectorMetadata", "KVBridgeHandshake",
                    "KVBridgeStats")


def __getattr__(name: str):
    if name in _CONNECTOR_NAMES:
        from kvbridge.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvbridge.vllm' has no attribute {name!r}")


__all__ = [
    "CONFIG_KEYS",
    "CacheShapeError",
    "HoldOrder",
    "KVBridgeConnector",
    "LayerTensor",
    "LoadOrder",
    "ModelFacts",
    "SchedulerState",
    "StepOrders",
    "engine_spec_for",
    "layer_sort_key",
    "model_identity",
    "PARAMS_VERSION",
    "ConfigError",
    "ConfigKey",
    "ConnectorConfig",
    "MergedReport",
    "OutputAggregator",
    "ParamsError",
    "RemotePrefill",
    "WorkerReport",
    "blocks_for_tokens",
    "check_remote_blocks",
    "decode_remote_prefill",
    "encode_remote_prefill",
    "is_prefill_request",
    "is_remote_prefill",
    "matched_tokens",
    "merge_stats",
    "parse_connector_config",
    "prefill_request_params",
    "tokens_to_load",
]
