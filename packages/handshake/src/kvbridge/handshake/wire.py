"""Wire messages of the side channel and the compatibility hash.

Every message is one msgpack map with a ``kind`` tag (a msgspec tagged union),
so kinds and fields can be added later without breaking older peers. A reply
carries the agent metadata as *opaque bytes*: the client checks the protocol
version and the compatibility hash of the envelope before it decodes a body.
Nothing here ever unpickles.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Annotated, Union

import msgspec

from kvbridge.topology import TopologyError, canonical_dtype

#: Bumped only on incompatible wire changes; additive fields with defaults keep it.
PROTOCOL_VERSION = 1

#: Most ranks one request may name (a bound on what a peer can make the server do).
MAX_RANKS_PER_REQUEST = 4096

Rank = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]


class MetadataRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind",
                      tag="metadata-request"):
    """Ask for the metadata of ``ranks`` of the engine ``engine_id`` (None: any engine)."""

    protocol_version: int
    ranks: Annotated[list[Rank], msgspec.Meta(min_length=1, max_length=MAX_RANKS_PER_REQUEST)]
    engine_id: str | None = None
    nonce: int = 0
    #: authenticated requests only (see kvbridge.handshake.auth): send time (ms since the
    #: epoch) and HMAC-SHA256 over the fields; empty from a client without a key
    sent_ms: int = 0
    auth: bytes = b""


class MetadataReply(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind",
                    tag="metadata-reply"):
    """The encoded metadata of each requested rank, in request order."""

    protocol_version: int
    compat_hash: str
    engine_id: str
    ranks: list[int]
    metadata: list[bytes]
    nonce: int = 0
    #: what the hash was computed from (diagnostics for a mismatch), may be empty
    compat_info: dict[str, str] = msgspec.field(default_factory=dict)
    #: from a keyed server: HMAC-SHA256 over the reply, bound to the request's MAC
    auth: bytes = b""


#: longest transfer id a push offer may carry
MAX_TRANSFER_ID_CHARS = 256

BlockIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=(1 << 40))]],
                     msgspec.Meta(max_length=1 << 20)]


class PushOffer(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="push-offer"):
    """Push mode: a decode engine tells a prefill engine where to write one request.

    Sent by the decode engine once it allocated the request's blocks, to the side
    channel of the prefill engine that computes the request; ``transfer_id`` is
    the id the router gave both requests. ``block_ids`` holds one list per
    KV-cache group, for the tokens from ``computed_tokens`` on; ``token`` is what
    the decode ranks expect in the WRITTEN notifications.
    """

    protocol_version: int
    transfer_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TRANSFER_ID_CHARS)]
    engine_id: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    block_ids: Annotated[list[BlockIds], msgspec.Meta(max_length=64)]
    token: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    computed_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    incarnation: Annotated[str, msgspec.Meta(max_length=256)] = ""
    #: the decode engine's id of the request (its WRITTEN notifications name it)
    request_id: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    nonce: int = 0
    sent_ms: int = 0
    auth: bytes = b""


class PushAccept(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="push-accept"):
    """The prefill engine took a :class:`PushOffer`: its facts the decode ranks plan with."""

    protocol_version: int
    transfer_id: str
    engine_id: str
    tp_size: int
    block_size: int
    kernel_blocks_per_block: int = 1
    head_order: str = "HND"
    incarnation: str = ""
    nonce: int = 0
    auth: bytes = b""


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="error"):
    """The server could not answer: ``code`` is one of :data:`ERROR_CODES`."""

    protocol_version: int
    code: str
    message: str
    nonce: int = 0


Message = Union[MetadataRequest, MetadataReply, ErrorReply, PushOffer, PushAccept]  # noqa: UP007 (msgspec type arg)

#: error codes a server sends
BAD_REQUEST = "bad-request"
TOO_LARGE = "too-large"
UNKNOWN_RANK = "unknown-rank"
WRONG_ENGINE = "wrong-engine"
INTERNAL = "internal"
#: a keyed server got a request without authentication
AUTH_REQUIRED = "auth-required"
#: wrong MAC (another key), send time outside the replay window, or a replayed nonce
AUTH_FAILED = "auth-failed"
#: a push offer the server does not take (no push-mode engine here, or it refused the offer)
PUSH_REFUSED = "push-refused"
ERROR_CODES = (BAD_REQUEST, TOO_LARGE, UNKNOWN_RANK, WRONG_ENGINE, INTERNAL, AUTH_REQUIRED,
               AUTH_FAILED, PUSH_REFUSED)


class Envelope(msgspec.Struct, kw_only=True):
    """Phase one of decoding: only what must be checked before anything else.

    Decodes from any map (unknown keys are skipped, missing keys are None), so a
    reply from another protocol version still yields its version and kind.
    """

    kind: str | None = None
    protocol_version: int | None = None
    compat_hash: str | None = None
    nonce: int | None = None


#: What msgspec's msgpack decoder raises for bytes it cannot decode: its own errors
#: (``msgspec.DecodeError``, and ``msgspec.ValidationError`` for wrong types or bounds),
#: ``UnicodeDecodeError`` for a ``str`` that is not UTF-8 (whether the field is read or
#: skipped), and ``RecursionError`` for arrays or maps nested deeper than the interpreter's
#: recursion limit (msgspec 0.22; found by fuzzing damaged real encodings).
DECODE_FAILURES = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


class Decoder:
    """A msgpack decoder of ``type_`` that fails only with ``msgspec.DecodeError``.

    The one place where the side channel turns bytes into values: every decoder
    of this package is one of these, so server and client handle anything a peer
    can send by catching ``msgspec.DecodeError`` alone (``msgspec.ValidationError``,
    a subclass, passes through unchanged and keeps its message naming the field).
    """

    __slots__ = ("_decoder", "type")

    def __init__(self, type_: object) -> None:
        self.type = type_
        self._decoder = msgspec.msgpack.Decoder(type_)

    def decode(self, data: bytes):  # noqa: ANN201 - an instance of self.type
        try:
            return self._decoder.decode(data)
        except msgspec.DecodeError:
            raise
        except UnicodeDecodeError as exc:
            raise msgspec.DecodeError(f"invalid UTF-8 in a string: {exc.reason} at byte "
                                      f"{exc.start} of the string") from None
        except RecursionError:
            raise msgspec.DecodeError("arrays or maps nested too deeply") from None


ENCODER = msgspec.msgpack.Encoder()
MESSAGE_DECODER = Decoder(Message)
ENVELOPE_DECODER = Decoder(Envelope)


def encode(message: MetadataRequest | MetadataReply | ErrorReply | PushOffer | PushAccept) -> bytes:
    return ENCODER.encode(message)


def _hash_dtype(name: str) -> str:
    """A dtype as the hash sees it: canonical when kvbridge knows it (``bfloat16`` ==
    ``bf16``), else as spelled, lower-cased (an engine-specific value such as ``auto``)."""
    try:
        return canonical_dtype(name)
    except TopologyError:
        return str(name).strip().lower()


def compat_fields(
    *,
    model: str,
    dtype: str,
    cache_dtype: str,
    layout: str,
    attention_backend: str,
    protocol_version: int = PROTOCOL_VERSION,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The canonical inputs of :func:`compatibility_hash` (sent along for diagnostics)."""
    fields = {
        "model": str(model),
        "dtype": _hash_dtype(dtype),
        "cache_dtype": _hash_dtype(cache_dtype),
        "layout": str(getattr(layout, "value", layout)),
        "attention_backend": str(attention_backend).strip().upper(),
        "protocol_version": str(int(protocol_version)),
    }
    for key, value in sorted((extra or {}).items()):
        k = f"extra.{key}"
        fields[k] = str(value)
    return fields


def compatibility_hash(
    *,
    model: str,
    dtype: str,
    cache_dtype: str,
    layout: str,
    attention_backend: str,
    protocol_version: int = PROTOCOL_VERSION,
    extra: Mapping[str, str] | None = None,
) -> str:
    """SHA-256 (hex) over what must match between prefill and decode.

    Covers model identity, dtype, KV-cache dtype, cache layout, attention
    backend, protocol version and any ``extra`` pairs. It never includes the
    TP size (prefill and decode may differ there). Dtype names are
    canonicalized (``bfloat16`` == ``bf16``), the backend name is compared
    case-insensitively.
    """
    fields = compat_fields(model=model, dtype=dtype, cache_dtype=cache_dtype, layout=layout,
                           attention_backend=attention_backend,
                           protocol_version=protocol_version, extra=extra)
    blob = msgspec.json.encode(sorted(fields.items()))
    return hashlib.sha256(b"kvbridge-compat\0" + blob).hexdigest()


def new_incarnation() -> str:
    """A fresh engine incarnation id (128 random bits, hex)."""
    return os.urandom(16).hex()
