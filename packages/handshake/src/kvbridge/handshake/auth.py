"""Shared-secret authentication of the side channel (optional).

Both engines of a pair hold the same secret (``auth_key``). A keyed client
signs each metadata request with HMAC-SHA256 over its fields, a fresh random
nonce and its send time; a keyed server checks the time window, the MAC
(constant-time) and that the nonce was not seen before, and only then looks
at the request. Its reply carries an HMAC over the reply fields bound to the
request's MAC, so the client knows the reply comes from a keyed server and
answers this request. Other packages derive their own subkeys with
:func:`derive_key` (the NIXL notifications use one).

Authentication is not encryption: whoever can watch the traffic still sees
the metadata a keyed server sends to a keyed client.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable, Sequence
from itertools import islice

import msgspec

#: shortest secret accepted (bytes, after UTF-8 encoding of a text key)
MIN_KEY_BYTES = 16
#: longest secret accepted
MAX_KEY_BYTES = 4096
#: default: how far a request's send time may be from the server's clock (seconds)
DEFAULT_REPLAY_WINDOW_S = 60.0
#: nonces remembered at most (only requests with a valid MAC are remembered)
MAX_REMEMBERED_NONCES = 1 << 17
#: the MAC of a request or reply (HMAC-SHA256, full length)
MAC_BYTES = 32

_REQUEST = b"kvbridge-handshake-request\0"
_REPLY = b"kvbridge-handshake-reply\0"
_SUBKEY = b"kvbridge-subkey\0"
_CANON = msgspec.msgpack.Encoder()

HOW_TO_SET = ("set the same auth_key on both engines (EngineConfig.auth_key, or auth_key in "
              "the connector's kv_connector_extra_config, or the KVBRIDGE_AUTH_KEY environment "
              "variable)")


def normalize_key(key: str | bytes | None) -> bytes | None:
    """The secret as bytes (text keys are UTF-8 encoded), or None for no key.

    Raises ValueError for a key that is too short or too long; an empty string is
    refused too (leave the key out to run without authentication).
    """
    if key is None:
        return None
    if isinstance(key, str):
        raw = key.encode("utf-8")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
    else:
        raise ValueError(f"auth_key must be a string or bytes, got {type(key).__name__}")
    if not MIN_KEY_BYTES <= len(raw) <= MAX_KEY_BYTES:
        raise ValueError(
            f"auth_key must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes, got {len(raw)}; generate one "
            f"with: python -c 'import secrets; print(secrets.token_hex(32))' and give the same "
            f"value to both engines (or leave auth_key unset to run without authentication)")
    return raw


def derive_key(key: bytes, purpose: str) -> bytes:
    """A subkey of ``key`` for one purpose (so one secret never signs two kinds of message)."""
    return hmac.new(key, _SUBKEY + purpose.encode("utf-8"), hashlib.sha256).digest()


def now_ms() -> int:
    return int(time.time() * 1000)


def request_mac(key: bytes, protocol_version: int, ranks: Sequence[int], engine_id: str | None,
                nonce: int, sent_ms: int) -> bytes:
    """HMAC-SHA256 of a metadata request's fields."""
    body = _CANON.encode([protocol_version, list(ranks), engine_id, nonce, sent_ms])
    return hmac.new(key, _REQUEST + body, hashlib.sha256).digest()


def reply_mac(key: bytes, request_auth: bytes, protocol_version: int, compat_hash: str,
              engine_id: str, ranks: Sequence[int], metadata: Iterable[bytes], nonce: int,
              compat_info: dict[str, str]) -> bytes:
    """HMAC-SHA256 of a metadata reply, bound to the request it answers (its MAC)."""
    mac = hmac.new(key, _REPLY + request_auth, hashlib.sha256)
    mac.update(_CANON.encode([protocol_version, compat_hash, engine_id, list(ranks), nonce,
                              sorted(compat_info.items())]))
    for body in metadata:
        mac.update(len(body).to_bytes(8, "little"))
        mac.update(body)
    return mac.digest()


def macs_equal(a: bytes, b: bytes) -> bool:
    """Constant-time comparison."""
    return hmac.compare_digest(a, b)


class ReplayGuard:
    """The nonces of authenticated requests seen within the replay window.

    A request is accepted once: its send time must lie within ``window_s`` of
    this clock, and its nonce must not have been seen in the last ``2 *
    window_s`` (longer than any accepted send time can be old). Only requests
    whose MAC checked out are remembered, so a stranger cannot fill the table.
    """

    def __init__(self, window_s: float = DEFAULT_REPLAY_WINDOW_S,
                 max_nonces: int = MAX_REMEMBERED_NONCES) -> None:
        if not window_s > 0:
            raise ValueError(f"replay_window_s must be > 0 seconds, got {window_s!r}")
        self.window_ms = int(window_s * 1000)
        self._max = max_nonces
        self._seen: dict[int, int] = {}  # nonce -> forget after (ms); insertion-ordered

    def __len__(self) -> int:
        return len(self._seen)

    def time_problem(self, sent_ms: int, now: int) -> str | None:
        """Why a request sent at ``sent_ms`` is outside the window, or None."""
        skew = (now - sent_ms) / 1000
        if abs(now - sent_ms) <= self.window_ms:
            return None
        return (f"the request was sent {skew:+.1f} s from this server's clock, outside the "
                f"{self.window_ms / 1000:g} s replay window; synchronise the clocks of the two "
                f"hosts (NTP), or the request is a replay")

    def admit(self, nonce: int, now: int) -> str | None:
        """Remember ``nonce``; returns why it is refused (seen before, table full), or None."""
        self._forget(now)
        if nonce in self._seen:
            return "this request was already answered (replayed nonce)"
        if len(self._seen) >= self._max:
            return (f"more than {self._max} authenticated requests within "
                    f"{2 * self.window_ms / 1000:g} s; retry later")
        self._seen[nonce] = now + 2 * self.window_ms
        return None

    def _forget(self, now: int) -> None:
        # entries are inserted with non-decreasing expiry as long as the clock does not go back;
        # stop at the first live one (a clock step back only keeps entries longer)
        gone = []
        for nonce, until in islice(self._seen.items(), 1024):
            if until > now:
                break
            gone.append(nonce)
        for nonce in gone:
            del self._seen[nonce]
