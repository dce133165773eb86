"""Notification messages between decode and prefill ranks.

A notification travels as NIXL notification bytes, which are not
authenticated: anything that knows an agent's name can send anything. So
parsing never trusts its input: :func:`parse_notification` returns ``None``
for every malformed message instead of raising.

Wire form (ASCII header, UTF-8 request id last so it may contain ``|``)::

    kvb1|<kind>|<decode tp>|<decode rank>|<token>|<request id>

``kind`` is ``D`` (the rank finished reading, or has nothing to read),
``R`` (renew the lease: still waiting) or ``W`` (push mode: the prefill rank
finished writing).

With a shared secret (``EngineConfig.auth_key``) the sender proves it holds
the key and the request's token::

    kva1|<kind>|<decode tp>|<decode rank>|<token>|<proof>|<request id>

``proof`` is the first 128 bits (32 hex digits) of HMAC-SHA256, under a
subkey of the secret (:func:`notification_key`), over kind, TP, rank, token
and request id. A keyed receiver counts a notification without a valid
proof as unauthenticated and ignores it; a receiver without a key accepts
both forms (the proof is not checked).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from kvbridge.handshake import derive_key

MAGIC = b"kvb1"
AUTH_MAGIC = b"kva1"
PROOF_CHARS = 32
MAX_MESSAGE_BYTES = 1024
MAX_TOKEN_CHARS = 64
MAX_TP = 1 << 16


class Kind(str, enum.Enum):
    DONE = "D"
    RENEW = "R"
    WRITTEN = "W"
    #: push: the sending prefill rank gave the request up, so its part will never be written
    FAILED = "F"


@dataclass(frozen=True)
class Notification:
    """One decoded notification."""

    kind: Kind
    request_id: str
    decode_tp: int
    decode_rank: int
    token: str
    #: False when the receiver has a key and the proof is missing or wrong
    authentic: bool = True


def notification_key(auth_key: bytes) -> bytes:
    """The subkey that signs notifications (``auth_key``: the normalized shared secret)."""
    return derive_key(auth_key, "nixl-notification")


def _proof(key: bytes, kind: bytes, tp: bytes, rank: bytes, token: bytes, rid: bytes) -> bytes:
    mac = hmac.new(key, b"|".join((kind, tp, rank, token, rid)), hashlib.sha256)
    return mac.hexdigest()[:PROOF_CHARS].encode()


def new_token() -> str:
    """A fresh request token (128 random bits, hex)."""
    return secrets.token_hex(16)


def _check_token(token: str) -> None:
    if not token or len(token) > MAX_TOKEN_CHARS or not token.isascii() or "|" in token:
        raise ValueError(
            f"request tokens must be 1..{MAX_TOKEN_CHARS} ASCII characters without '|'; got {token!r}"
        )


def encode_notification(n: Notification, key: bytes | None = None) -> bytes:
    """Bytes for ``n`` (with a proof under ``key``, a :func:`notification_key`, when given);
    raises ValueError for values a peer could not parse back."""
    _check_token(n.token)
    if not 0 < n.decode_tp <= MAX_TP or not 0 <= n.decode_rank < n.decode_tp:
        raise ValueError(f"decode rank {n.decode_rank} / TP {n.decode_tp} out of range")
    if not n.request_id:
        raise ValueError("request id must be non-empty")
    fields = (Kind(n.kind).value.encode(), str(n.decode_tp).encode(), str(n.decode_rank).encode(),
              n.token.encode(), n.request_id.encode("utf-8"))
    if key is None:
        out = b"|".join((MAGIC, *fields))
    else:
        out = b"|".join((AUTH_MAGIC, *fields[:4], _proof(key, *fields), fields[4]))
    if len(out) > MAX_MESSAGE_BYTES:
        raise ValueError(f"request id too long: notification would be {len(out)} > {MAX_MESSAGE_BYTES} bytes")
    return out


def _small_int(b: bytes, hi: int) -> int | None:
    if not b or len(b) > 6 or not b.isdigit():
        return None
    v = int(b)
    return v if v <= hi else None


def parse_notification(raw: object, key: bytes | None = None) -> Notification | None:
    """Decode untrusted bytes; ``None`` for anything that is not a well-formed notification.

    With ``key`` (a :func:`notification_key`), a well-formed notification whose
    proof is missing or wrong comes back with ``authentic=False``.
    """
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        return None
    data = bytes(raw)
    if len(data) > MAX_MESSAGE_BYTES:
        return None
    proof = None
    if data.startswith(MAGIC + b"|"):
        parts = data.split(b"|", 5)
        if len(parts) != 6:
            return None
        _, kind_b, tp_b, rank_b, token_b, rid_b = parts
    elif data.startswith(AUTH_MAGIC + b"|"):
        parts = data.split(b"|", 6)
        if len(parts) != 7:
            return None
        _, kind_b, tp_b, rank_b, token_b, proof, rid_b = parts
    else:
        return None
    try:
        kind = Kind(kind_b.decode("ascii"))
        token = token_b.decode("ascii")
        rid = rid_b.decode("utf-8")
    except (UnicodeDecodeError, ValueError):
        return None
    tp = _small_int(tp_b, MAX_TP)
    rank = _small_int(rank_b, MAX_TP)
    if tp is None or rank is None or tp == 0 or rank >= tp:
        return None
    if not token or len(token) > MAX_TOKEN_CHARS or not rid:
        return None
    authentic = True
    if key is not None:
        authentic = proof is not None and hmac.compare_digest(
            proof, _proof(key, kind_b, tp_b, rank_b, token_b, rid_b))
    return Notification(kind, rid, tp, rank, token, authentic)
