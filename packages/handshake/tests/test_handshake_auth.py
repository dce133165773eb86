"""Side-channel authentication over real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import msgspec
import pytest
from handshake_helpers import HASH, RawPeer, engine_metadata

from kvbridge.handshake import (
    AuthenticationFailed,
    InvalidMetadata,
    MetadataServer,
    auth,
    fetch_metadata,
    wire,
)

HOST = "127.0.0.1"
KEY = "k" * 16 + "-shared-secret"
OTHER = "o" * 16 + "-another-secret"


def fetch(server, ranks=(0, 1), **kw):
    kw.setdefault("compat_hash", HASH)
    kw.setdefault("timeout", 2.0)
    kw.setdefault("retries", 0)
    return fetch_metadata(HOST, server.port, list(ranks), **kw)


def signed(key: str, *, ranks=(0, 1), nonce: int = 12345, sent_ms: int | None = None,
           engine_id=None) -> wire.MetadataRequest:
    sent = auth.now_ms() if sent_ms is None else sent_ms
    raw = auth.normalize_key(key)
    return wire.MetadataRequest(protocol_version=wire.PROTOCOL_VERSION, ranks=list(ranks),
                                engine_id=engine_id, nonce=nonce, sent_ms=sent,
                                auth=auth.request_mac(raw, wire.PROTOCOL_VERSION, list(ranks),
                                                      engine_id, nonce, sent))


def ask(server, request: wire.MetadataRequest | bytes) -> wire.Message:
    body = request if isinstance(request, bytes) else wire.encode(request)
    with RawPeer(server.port) as peer:
        reply = peer.ask(body)
    assert reply is not None and len(reply) == 1
    return wire.MESSAGE_DECODER.decode(reply[0])


def assert_no_metadata(msg, mds) -> None:
    """An error reply, and not one byte of any rank's metadata in it."""
    assert isinstance(msg, wire.ErrorReply), msg
    blob = wire.encode(msg)
    for md in mds.values():
        assert md.agent_metadata not in blob and md.agent_name.encode() not in blob
        assert md.engine_id.encode() not in blob  # not even the engine's name


@pytest.fixture
def keyed():
    mds = engine_metadata(2)
    with MetadataServer(mds, compat_hash=HASH, auth_key=KEY) as server:
        yield server, mds


def test_right_key_works_and_the_reply_is_authenticated(keyed):
    server, mds = keyed
    assert server.authenticated
    assert fetch(server, auth_key=KEY, engine_id="prefill-0") == mds
    assert fetch(server, [1], auth_key=KEY.encode()) == {1: mds[1]}  # bytes key, same secret
    reply = ask(server, signed(KEY))
    assert isinstance(reply, wire.MetadataReply) and len(reply.auth) == auth.MAC_BYTES
    assert server.stats.requests_served == 3 and server.stats.errors == {}


def test_keyless_client_gets_nothing_and_is_told_to_set_the_key(keyed):
    server, mds = keyed
    with pytest.raises(AuthenticationFailed, match="auth_key on both engines"):
        fetch(server)
    assert_no_metadata(ask(server, wire.MetadataRequest(protocol_version=1, ranks=[0])), mds)
    # an unknown rank or engine is not even acknowledged before authentication
    msg = ask(server, wire.MetadataRequest(protocol_version=1, ranks=[7], engine_id="x"))
    assert msg.code == wire.AUTH_REQUIRED
    assert server.stats.errors == {wire.AUTH_REQUIRED: 3} and server.stats.requests_served == 0


def test_wrong_key_gets_nothing(keyed):
    server, mds = keyed
    with pytest.raises(AuthenticationFailed, match="does not match this server's key"):
        fetch(server, auth_key=OTHER)
    msg = ask(server, signed(OTHER))
    assert_no_metadata(msg, mds)
    assert msg.code == wire.AUTH_FAILED


def test_forged_fields_break_the_mac(keyed):
    server, mds = keyed
    good = signed(KEY, ranks=[0])
    for forged in (msgspec.structs.replace(good, ranks=[0, 1]),
                   msgspec.structs.replace(good, engine_id="prefill-0"),
                   msgspec.structs.replace(good, nonce=good.nonce + 1),
                   msgspec.structs.replace(good, sent_ms=good.sent_ms - 1),
                   msgspec.structs.replace(good, auth=bytes(32))):
        assert_no_metadata(ask(server, forged), mds)
    assert server.stats.requests_served == 0


def test_replayed_request_gets_nothing(keyed):
    server, mds = keyed
    body = wire.encode(signed(KEY, nonce=99))
    first = ask(server, body)
    assert isinstance(first, wire.MetadataReply)
    for _ in range(3):  # from the same or any other connection
        again = ask(server, body)
        assert_no_metadata(again, mds)
        assert again.code == wire.AUTH_FAILED and "replayed" in again.message
    assert server.stats.requests_served == 1


def test_old_or_future_requests_are_refused(keyed):
    server, mds = keyed
    for skew in (-61_000, 61_000, -10**12):
        msg = ask(server, signed(KEY, sent_ms=auth.now_ms() + skew, nonce=1000 + skew))
        assert_no_metadata(msg, mds)
        assert "replay window" in msg.message


def test_keyless_server_is_refused_by_a_keyed_client():
    mds = engine_metadata(2)
    with MetadataServer(mds, compat_hash=HASH) as server:
        assert not server.authenticated
        with pytest.raises(AuthenticationFailed, match="answered without authentication"):
            fetch(server, auth_key=KEY)
        assert fetch(server) == mds  # keyless stays as it was


def test_reply_from_a_server_with_another_key_is_refused():
    """A server that signs with another key (it accepted the request: it does not check,
    or it is an impostor) does not fool the client."""
    mds = engine_metadata(2)
    with MetadataServer(mds, compat_hash=HASH, auth_key=OTHER) as server:
        server._key = auth.normalize_key(KEY)  # accepts KEY requests, signs replies with KEY...
        assert fetch(server, auth_key=KEY) == mds
        server._key = None  # ...or answers without checking: unsigned reply
        with pytest.raises(AuthenticationFailed):
            fetch(server, auth_key=KEY)


def test_retries_use_fresh_nonces(keyed):
    """Each attempt is signed anew, so a retry is never refused as a replay."""
    server, mds = keyed
    for _ in range(5):
        assert fetch(server, auth_key=KEY, retries=2) == mds


def test_replay_guard_bounds():
    g = auth.ReplayGuard(window_s=1.0, max_nonces=3)
    assert [g.admit(n, 0) for n in (1, 2, 3)] == [None, None, None]
    assert "replayed" in g.admit(1, 0)
    assert "retry later" in g.admit(4, 1)
    assert g.admit(4, 2001) is None and len(g) == 1  # the old ones lapsed after 2 windows
    assert g.time_problem(0, 1000) is None and g.time_problem(0, 1001) is not None


@pytest.mark.parametrize("bad", ["", "short", b"x" * 15, 12345, "x" * 5000])
def test_bad_keys_are_refused_with_advice(bad):
    with pytest.raises(ValueError, match="auth_key"):
        auth.normalize_key(bad)
    with pytest.raises(InvalidMetadata, match="auth_key"):
        MetadataServer(engine_metadata(1), compat_hash=HASH, auth_key=bad)
    with pytest.raises(ValueError, match="auth_key"):
        fetch_metadata(HOST, 1, [0], compat_hash=HASH, auth_key=bad)
