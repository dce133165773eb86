"""kvbridge transfer engine on NVIDIA NIXL, ``kvbridge demo`` and ``kvbridge bench``.

One :class:`PrefillEngine` or :class:`DecodeEngine` per TP rank; see docs/nixl.md.
Engines take :class:`kvbridge.memory.CacheRegions` (or KV-cache tensors) and build
descriptors with :mod:`kvbridge.memory`, so importing this package imports torch.
The synthetic caches used by the demo, bench and tests live in
:mod:`kvbridge.nixl.synthetic`.
"""

from .agent import AgentConfig, NixlAgent, NixlError, PreparedList, Telemetry, Transfer
from .engine import (
    DecodeEngine,
    DecodeEvents,
    EngineConfig,
    HandshakeFailed,
    PrefillEngine,
    PushTarget,
    TransferParams,
    TransferRecord,
    engine_compat_hash,
)
from .ledger import DecodeTracker, Failed, FailureKind, PrefillLedger, Released
from .messages import Kind, Notification, encode_notification, new_token, parse_notification
from .stats import Stats

__all__ = [
    "AgentConfig", "DecodeEngine", "DecodeEvents", "DecodeTracker", "EngineConfig",
    "Failed", "FailureKind", "HandshakeFailed", "Kind", "NixlAgent", "NixlError", "Notification",
    "PrefillEngine", "PrefillLedger", "PreparedList", "PushTarget", "Released", "Stats", "Telemetry",
    "Transfer", "TransferParams", "TransferRecord", "encode_notification", "engine_compat_hash", "new_token",
    "parse_notification",
]
