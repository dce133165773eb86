"""Exceptions of kvbridge.handshake.

Every error a peer or a caller can cause is a :class:`HandshakeError`; the
message says what to check.
"""

from __future__ import annotations


class HandshakeError(Exception):
    """Base class of every handshake failure."""


class HandshakeTimeout(HandshakeError, TimeoutError):
    """No reply came from the side-channel server within the bounded wait (after retries)."""


class PeerUnreachable(HandshakeError, ConnectionError):
    """Nothing accepts connections at the side-channel address (connection refused)."""


class IncompatiblePeer(HandshakeError):
    """The peer speaks another protocol version or serves an incompatible model/cache."""


class WrongEngine(HandshakeError):
    """The peer serves another engine than the one asked for."""


class MalformedReply(HandshakeError):
    """The peer's reply could not be decoded or is internally inconsistent."""


class UnknownRank(HandshakeError):
    """The peer does not serve (one of) the requested rank(s)."""


class RequestRejected(HandshakeError):
    """The peer refused the request itself (bad request, too large, internal error)."""


class AuthenticationFailed(HandshakeError):
    """The two sides do not share the same ``auth_key``: the server refused this client's
    request, or the reply is not authenticated with this client's key."""


class InvalidMetadata(HandshakeError, ValueError):
    """Local metadata handed to the server is inconsistent; the message says which field."""
