"""kvbridge side-channel handshake: wire messages, server and client.

A prefill engine serves its ranks' :class:`AgentMetadata` with a
:class:`MetadataServer`; a decode rank calls :func:`fetch_metadata` for the
ranks its transfer plan names. Messages are msgspec Structs in msgpack (never
pickle), checked in two phases (envelope version and compatibility hash, then
the metadata bodies), and every wait is bounded. With an optional shared
secret (``auth_key`` on both sides) requests and replies are authenticated
(:mod:`kvbridge.handshake.auth`).
"""

from .auth import DEFAULT_REPLAY_WINDOW_S, derive_key, normalize_key
from .client import DEFAULT_MAX_REPLY_BYTES, fetch_metadata, send_push_offer
from .errors import (
    AuthenticationFailed,
    HandshakeError,
    HandshakeTimeout,
    IncompatiblePeer,
    InvalidMetadata,
    MalformedReply,
    PeerUnreachable,
    RequestRejected,
    UnknownRank,
    WrongEngine,
)
from .metadata import (
    MEMORY_TYPES,
    AgentMetadata,
    CacheGroupFacts,
    EngineFacts,
    MambaSpecFacts,
    check_metadata,
    decode_metadata,
    encode_metadata,
    metadata_problems,
)
from .offers import OfferHandler
from .server import MetadataServer, ServerStats
from .wire import (
    ERROR_CODES,
    PROTOCOL_VERSION,
    ErrorReply,
    MetadataReply,
    MetadataRequest,
    PushAccept,
    PushOffer,
    compat_fields,
    compatibility_hash,
    new_incarnation,
)

__all__ = [
    "DEFAULT_MAX_REPLY_BYTES", "DEFAULT_REPLAY_WINDOW_S", "AuthenticationFailed", "derive_key",
    "normalize_key", "ERROR_CODES", "MEMORY_TYPES", "PROTOCOL_VERSION", "AgentMetadata",
    "CacheGroupFacts", "EngineFacts", "ErrorReply", "HandshakeError", "HandshakeTimeout", "IncompatiblePeer",
    "InvalidMetadata", "MalformedReply", "MambaSpecFacts", "MetadataReply", "MetadataRequest",
    "MetadataServer", "PeerUnreachable", "RequestRejected", "ServerStats", "UnknownRank", "WrongEngine", "check_metadata",
    "compat_fields", "compatibility_hash", "decode_metadata", "encode_metadata",
    "fetch_metadata", "metadata_problems", "new_incarnation", "OfferHandler", "PushAccept",
    "PushOffer", "send_push_offer",
]
