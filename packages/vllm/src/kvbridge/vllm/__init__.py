"""kvbridge KV connector for vLLM (uses the vLLM and torch already installed).

The connector class itself (``KVBridgeConnector``) is loaded by vLLM through
``kv_connector_module_path="kvbridge.vllm"``. The modules exported here are its
vLLM-independent parts: they import without vLLM, torch or NIXL.
"""

from kvbridge.vllm.aggregate import MergedReport, OutputAggregator, WorkerReport, merge_stats
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

__all__ = [
    "CONFIG_KEYS",
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
