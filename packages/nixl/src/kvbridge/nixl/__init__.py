"""kvbridge transfer engine on NVIDIA NIXL.

One :class:`PrefillEngine` or :class:`DecodeEngine` per TP rank; see docs/nixl.md.
Engines take :class:`kvbridge.memory.CacheRegions` (or KV-cache tensors) and build
descriptors with :mod:`kvbridge.memory`, so importing this package imports torch.

The plain records it takes and reports (``TransferParams``, ``BlockIds``, ``Failed``,
``DecodeEvents``, ...) live in :mod:`kvbridge.topology` and are re-exported here.
Modules, by concept: :mod:`~kvbridge.nixl.config` (knobs), :mod:`~kvbridge.nixl.agent`
(one NIXL agent), :mod:`~kvbridge.nixl.peers` (remote engines), :mod:`~kvbridge.nixl.worker`
(the background thread), :mod:`~kvbridge.nixl.rank` (what both roles share),
:mod:`~kvbridge.nixl.decode` and :mod:`~kvbridge.nixl.prefill` (the two roles),
:mod:`~kvbridge.nixl.modes`, :mod:`~kvbridge.nixl.pull` and :mod:`~kvbridge.nixl.push`
(the two transfer directions), :mod:`~kvbridge.nixl.ledger` (request bookkeeping),
:mod:`~kvbridge.nixl.messages` (notifications), :mod:`~kvbridge.nixl.stats` (counters).
``kvbridge demo``, ``kvbridge bench``, the multi-process harness and the synthetic
caches live in the separate distribution kvbridge-tools (``kvbridge.tools``), which this
package never imports.
"""

from kvbridge.topology import (
    BlockIds,
    DecodeEvents,
    Failed,
    FailureKind,
    Released,
    TransferParams,
    TransferRecord,
)

from .agent import AgentConfig, NixlAgent, NixlError, PreparedList, Telemetry, Transfer
from .config import EngineConfig, HandshakeFailed, all_cpus, engine_compat_hash, engine_compat_info
from .decode import DecodeEngine
from .ledger import DecodeTracker, PrefillLedger
from .messages import (
    Kind,
    Notification,
    encode_notification,
    new_token,
    notification_key,
    parse_notification,
)
from .prefill import PrefillEngine
from .stats import Stats
from .timeline import LOGGER as TIMELINE_LOGGER
from .timeline import mark as timeline_mark

__all__ = [
    "AgentConfig", "BlockIds", "DecodeEngine", "DecodeEvents", "DecodeTracker", "EngineConfig",
    "Failed", "FailureKind", "HandshakeFailed", "Kind", "NixlAgent", "NixlError", "Notification",
    "PrefillEngine", "PrefillLedger", "PreparedList", "Released", "Stats", "Telemetry",
    "Transfer", "TransferParams", "TransferRecord", "encode_notification", "engine_compat_hash", "engine_compat_info", "new_token", "notification_key",
    "parse_notification", "all_cpus", "TIMELINE_LOGGER", "timeline_mark",
]
