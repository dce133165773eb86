"""Push offers on the side channel: a decode engine tells a prefill engine where to write.

Push mode through an engine such as vLLM needs one message in the other direction
from the metadata handshake: the decode engine allocates a request's blocks first
and sends them, with the token its ranks expect, to the side channel of the
prefill engine that computes the request (:func:`send_push_offer`). The prefill
engine's :class:`~kvbridge.handshake.MetadataServer` hands the offer to the
engine's handler and answers with a :class:`~kvbridge.handshake.wire.PushAccept`
carrying the prefill facts the decode ranks plan with. Afterwards the prefill
ranks handshake with the decode engine as usual (fetching its metadata) and write.

With a shared secret both messages are authenticated like metadata requests: the
offer carries an HMAC (under its own subkey) over its fields, a fresh nonce and
the send time, and the server checks the time window and that the nonce is new;
the accept is bound to the offer's MAC.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

import msgspec

from . import auth, wire

#: what a server's owner provides: take an offer and return the accept, or raise
#: ValueError with the reason it is refused (sent back to the decode engine)
OfferHandler = Callable[[wire.PushOffer], wire.PushAccept]

_OFFER = b"kvbridge-push-offer\0"
_ACCEPT = b"kvbridge-push-accept\0"
_CANON = msgspec.msgpack.Encoder()


def _offer_fields(o: wire.PushOffer) -> bytes:
    return _CANON.encode([o.protocol_version, o.transfer_id, o.engine_id, o.host, o.port,
                          o.tp_size, o.block_size, o.block_ids, o.token, o.computed_tokens,
                          o.incarnation, o.request_id, o.nonce, o.sent_ms])


def _accept_fields(a: wire.PushAccept) -> bytes:
    return _CANON.encode([a.protocol_version, a.transfer_id, a.engine_id, a.tp_size, a.block_size,
                          a.kernel_blocks_per_block, a.head_order, a.incarnation, a.nonce])


def offer_mac(key: bytes, offer: wire.PushOffer) -> bytes:
    return hmac.new(auth.derive_key(key, "push-offer"), _OFFER + _offer_fields(offer),
                    hashlib.sha256).digest()


def accept_mac(key: bytes, offer_auth: bytes, accept: wire.PushAccept) -> bytes:
    return hmac.new(auth.derive_key(key, "push-accept"), _ACCEPT + offer_auth + _accept_fields(accept),
                    hashlib.sha256).digest()


def check_offer(offer: wire.PushOffer, key: bytes | None, replay: auth.ReplayGuard
                ) -> tuple[str, str] | None:
    """(error code, message) refusing an offer, or None when it is authentic and fresh
    (always None without a key)."""
    if key is None:
        return None
    if not offer.auth:
        return wire.AUTH_REQUIRED, "this side channel only takes authenticated offers; " + auth.HOW_TO_SET
    now = auth.now_ms()
    late = replay.time_problem(offer.sent_ms, now)
    if late is not None:
        return wire.AUTH_FAILED, late
    if not auth.macs_equal(offer_mac(key, offer), offer.auth):
        return wire.AUTH_FAILED, "the offer's authentication does not match this server's key; " + auth.HOW_TO_SET
    replayed = replay.admit(offer.nonce, now)
    if replayed is not None:
        return wire.AUTH_FAILED, replayed
    return None


def answer_offer(offer: wire.PushOffer, handler: OfferHandler | None, key: bytes | None
                 ) -> wire.PushAccept | wire.ErrorReply:
    """The server's reply to an authenticated offer: the handler's accept (signed when
    keyed, bound to the offer's nonce) or an error naming why it was refused."""
    if handler is None:
        return wire.ErrorReply(protocol_version=wire.PROTOCOL_VERSION, code=wire.PUSH_REFUSED,
                               message="this engine takes no push offers: run the prefill engine "
                               "with mode='push'", nonce=offer.nonce)
    try:
        acc = handler(offer)
    except ValueError as exc:
        return wire.ErrorReply(protocol_version=wire.PROTOCOL_VERSION, code=wire.PUSH_REFUSED,
                               message=str(exc)[:500], nonce=offer.nonce)
    acc = msgspec.structs.replace(acc, nonce=offer.nonce, auth=b"")
    if key is not None:
        acc = msgspec.structs.replace(acc, auth=accept_mac(key, offer.auth, acc))
    return acc
