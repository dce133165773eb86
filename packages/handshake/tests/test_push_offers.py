"""Push offers over a real side channel (ZMQ on 127.0.0.1): a decode engine's blocks reach
the prefill engine's handler, its facts come back; refusals, keys and bad input."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from handshake_helpers import HASH, engine_metadata

from kvbridge.handshake import (
    AuthenticationFailed,
    MetadataServer,
    PushAccept,
    PushOffer,
    RequestRejected,
    send_push_offer,
    wire,
)

KEY = "k" * 32


def _accept(offer: PushOffer) -> PushAccept:
    if offer.transfer_id == "bad":
        raise ValueError("transfer 'bad' is unknown here")
    return PushAccept(protocol_version=1, transfer_id=offer.transfer_id, engine_id="prefill-0",
                      tp_size=2, block_size=16, kernel_blocks_per_block=2, head_order="HND",
                      incarnation="inc-1")


def _offer(port, transfer_id="t-1", **kw):
    args = dict(transfer_id=transfer_id, engine_id="decode-0", address=("127.0.0.1", 4321), tp_size=1,
                block_size=32, block_ids=[[7, 3, 9]], token="tok", computed_tokens=32,
                incarnation="d-inc", request_id="req-7", timeout=2.0, retries=0)
    args.update(kw)
    return send_push_offer("127.0.0.1", port, **args)


@pytest.fixture
def taken():
    return []


def _server(taken, **kw):
    def handler(offer):
        taken.append(offer)
        return _accept(offer)
    return MetadataServer(engine_metadata(2), compat_hash=HASH, on_offer=handler, **kw)


def test_an_offer_reaches_the_handler_and_the_accept_comes_back(taken):
    with _server(taken) as srv:
        acc = _offer(srv.port)
    assert (acc.engine_id, acc.tp_size, acc.block_size, acc.kernel_blocks_per_block) == ("prefill-0", 2, 16, 2)
    (o,) = taken
    assert (o.transfer_id, o.engine_id, o.host, o.port, o.tp_size, o.block_size) == (
        "t-1", "decode-0", "127.0.0.1", 4321, 1, 32)
    assert (o.block_ids, o.token, o.computed_tokens, o.incarnation, o.request_id) == (
        [[7, 3, 9]], "tok", 32, "d-inc", "req-7")


def test_a_refused_offer_says_why(taken):
    with _server(taken) as srv, pytest.raises(RequestRejected, match="transfer 'bad' is unknown here"):
        _offer(srv.port, "bad")


def test_a_server_without_a_handler_refuses_offers():
    with MetadataServer(engine_metadata(1), compat_hash=HASH) as srv, pytest.raises(
            RequestRejected, match="takes no push offers"):
        _offer(srv.port)


def test_keyed_offers_need_the_same_key(taken):
    with _server(taken, auth_key=KEY) as srv:
        assert _offer(srv.port, auth_key=KEY).engine_id == "prefill-0"
        with pytest.raises(RequestRejected, match="authenticated offers"):
            _offer(srv.port)
        with pytest.raises(RequestRejected, match="does not match"):
            _offer(srv.port, auth_key="x" * 32)
    assert len(taken) == 1
    # a keyed decode engine refuses an accept nobody signed
    with _server(taken) as srv, pytest.raises(AuthenticationFailed):
        _offer(srv.port, auth_key=KEY)


def test_a_replayed_keyed_offer_is_refused(taken):
    with _server(taken, auth_key=KEY) as srv:
        _offer(srv.port, auth_key=KEY)
        raw = msgspec.msgpack.encode(taken[0])
        ctx = zmq.Context()
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{srv.port}")
        s.send(raw)
        assert s.poll(3000)
        reply = wire.MESSAGE_DECODER.decode(s.recv())
        s.close()
        ctx.term()
    assert isinstance(reply, wire.ErrorReply) and reply.code == wire.AUTH_FAILED
    assert len(taken) == 1


def test_offers_with_bad_fields_are_refused_before_sending(taken):
    with _server(taken) as srv:
        for kw in (dict(block_ids=[[-1]]), dict(token=""), dict(tp_size=0), dict(transfer_id="")):
            with pytest.raises(ValueError, match="invalid push offer"):
                _offer(srv.port, **kw)
    assert taken == []
