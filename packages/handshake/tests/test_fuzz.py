"""A live server against thousands of hostile messages; afterwards it still answers correctly."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter

import damage
import msgspec
import pytest
import zmq
from handshake_helpers import HASH, FakeServer, RawPeer, engine_metadata
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.handshake import (
    ERROR_CODES,
    PROTOCOL_VERSION,
    HandshakeError,
    InvalidMetadata,
    MalformedReply,
    MetadataServer,
    auth,
    encode_metadata,
    fetch_metadata,
    normalize_key,
    offers,
    send_push_offer,
    wire,
)

TP = 4
MAX_FRAME = 1 << 16  # the default


def _threads_back_to(count: int) -> None:
    """The thread-leak check of a module-scoped fixture (conftest's ``no_leaked_threads`` checks
    each test; a module-scoped server is set up before it and closed after it)."""
    deadline = time.monotonic() + 3.0
    while threading.active_count() > count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == count, [t.name for t in threading.enumerate()]


@pytest.fixture(scope="module")
def live():
    threads = threading.active_count()
    mds = engine_metadata(TP)
    server = MetadataServer(mds, compat_hash=HASH)
    peer = RawPeer(server.port)
    yield server, peer, mds
    peer.close()
    server.close()
    _threads_back_to(threads)


def _still_good(server, mds) -> None:
    got = fetch_metadata("127.0.0.1", server.port, list(range(TP)), compat_hash=HASH,
                         engine_id="prefill-0", timeout=2.0)
    assert got == mds


def _decode_reply(frames: list[bytes] | None):
    assert frames is not None, "the server did not answer"
    assert len(frames) == 1
    return wire.MESSAGE_DECODER.decode(frames[0])


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
    st.text(max_size=20), st.binary(max_size=40),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=12)
rank_lists = st.one_of(
    st.lists(st.integers(0, TP - 1), min_size=1, max_size=6),
    st.lists(st.integers(-5, 10**12), max_size=6),
    values,
)


@st.composite
def requests(draw) -> dict:
    """Mostly request-shaped maps, with every field possibly wrong, missing or extra."""
    d: dict = {}
    if draw(st.integers(0, 9)):
        d["kind"] = draw(st.sampled_from(["metadata-request", "metadata-reply", "error", "x"])
                         | st.text(max_size=8) | values)
    if draw(st.integers(0, 9)):
        d["protocol_version"] = draw(st.sampled_from([PROTOCOL_VERSION, 0, -1, 2, 2**40])
                                     | values)
    if draw(st.integers(0, 9)):
        d["ranks"] = draw(rank_lists)
    if draw(st.booleans()):
        d["engine_id"] = draw(st.sampled_from(["prefill-0", "other", ""]) | values)
    if draw(st.booleans()):
        d["nonce"] = draw(st.integers(-(2**63), 2**64 - 1) | values)
    d.update(draw(st.dictionaries(st.text(max_size=6), values, max_size=3)))
    return d


@st.composite
def near_valid_requests(draw) -> dict:
    """Valid requests, some with unknown extra keys (a newer client) or one field broken."""
    d: dict = {"kind": "metadata-request", "protocol_version": draw(st.integers(1, 3)),
               "ranks": draw(st.lists(st.integers(0, TP - 1), min_size=1, max_size=8))}
    if draw(st.booleans()):
        d["engine_id"] = "prefill-0"
    if draw(st.booleans()):
        d["nonce"] = draw(st.integers(-(2**63), 2**64 - 1))
    if draw(st.booleans()):
        d.update(draw(st.dictionaries(st.text(max_size=6).filter(lambda k: k not in d), values,
                                      max_size=3)))
    if draw(st.integers(0, 3)) == 0:  # break one field
        key = draw(st.sampled_from(sorted(d)))
        d[key] = draw(values)
    return d


def _is_valid_request(d: dict) -> bool:
    ranks = d.get("ranks")
    return (
        d.get("kind") == "metadata-request"
        and type(d.get("protocol_version")) is int and d["protocol_version"] >= 1
        and d["protocol_version"] < 2**64
        and type(ranks) is list and 1 <= len(ranks)
        and all(type(r) is int and 0 <= r < TP for r in ranks)
        and d.get("engine_id", None) in (None, "prefill-0")
        and type(d.get("nonce", 0)) is int
        and type(d.get("sent_ms", 0)) is int and -(2**63) <= d.get("sent_ms", 0) < 2**64
        and type(d.get("auth", b"")) is bytes
    )


@settings(max_examples=700, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(requests(), near_valid_requests()))
def test_structured_fuzz_always_gets_exactly_one_sane_reply(live, request_map):
    server, peer, mds = live
    body = msgspec.msgpack.encode(request_map)
    reply = _decode_reply(peer.ask(body))
    if _is_valid_request(request_map):
        assert isinstance(reply, wire.MetadataReply), reply
        assert reply.ranks == request_map["ranks"]
        assert [msgspec.msgpack.decode(b) for b in reply.metadata] == [
            msgspec.msgpack.decode(msgspec.msgpack.encode(mds[r])) for r in reply.ranks]
        assert reply.nonce == request_map.get("nonce", 0)
    else:
        assert isinstance(reply, wire.ErrorReply), (request_map, reply)
        assert reply.code in ERROR_CODES
        assert reply.message
        assert reply.protocol_version == PROTOCOL_VERSION


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=300))
def test_random_bytes_get_an_error_reply(live, body):
    server, peer, mds = live
    reply = _decode_reply(peer.ask(body))
    assert isinstance(reply, (wire.ErrorReply, wire.MetadataReply))
    if isinstance(reply, wire.ErrorReply):
        assert reply.code == wire.BAD_REQUEST


def test_truncated_and_wrong_typed_requests(live):
    server, peer, mds = live
    good = wire.encode(wire.MetadataRequest(protocol_version=PROTOCOL_VERSION, ranks=[0, 1, 2],
                                            engine_id="prefill-0", nonce=7))
    for cut in range(len(good)):
        reply = _decode_reply(peer.ask(good[:cut]))
        assert isinstance(reply, wire.ErrorReply) and reply.code == wire.BAD_REQUEST
    wrong = [
        {"kind": "metadata-request", "protocol_version": 1, "ranks": "0"},
        {"kind": "metadata-request", "protocol_version": "1", "ranks": [0]},
        {"kind": "metadata-request", "protocol_version": 1, "ranks": [0.0]},
        {"kind": "metadata-request", "protocol_version": 1, "ranks": []},
        {"kind": "metadata-request", "protocol_version": 1, "ranks": list(range(5000))},
        {"kind": "metadata-request", "protocol_version": 1, "ranks": [0], "engine_id": 5},
        {"kind": "error", "protocol_version": 1, "code": "x", "message": "y"},
        [1, 2, 3],
        "metadata-request",
    ]
    for d in wrong:
        reply = _decode_reply(peer.ask(msgspec.msgpack.encode(d)))
        assert isinstance(reply, wire.ErrorReply), d
        assert reply.code in (wire.BAD_REQUEST, wire.TOO_LARGE), (d, reply)
    reply = _decode_reply(peer.ask(good))
    assert isinstance(reply, wire.MetadataReply) and reply.nonce == 7
    _still_good(server, mds)


def test_frame_shapes(live):
    server, peer, mds = live
    good = wire.encode(wire.MetadataRequest(protocol_version=PROTOCOL_VERSION, ranks=[3]))
    cases = [
        [b""],                        # delimiter, no body
        [b"", b""],                   # empty body
        [b"", good, b"extra"],        # extra frame
        [b"", good, b"", b"", b"x"],  # many extra frames
        [b"", b"", good],             # double delimiter
    ]
    for frames in cases:
        peer.send(frames)
        reply = peer.recv()
        assert reply is not None and reply[0] == b"", frames
        msg = wire.MESSAGE_DECODER.decode(reply[1])
        assert isinstance(msg, wire.ErrorReply) and msg.code == wire.BAD_REQUEST, frames
    # a DEALER without the REQ delimiter is answered without one
    peer.send([good])
    reply = peer.recv()
    assert reply is not None and len(reply) == 1
    assert wire.MESSAGE_DECODER.decode(reply[0]).ranks == [3]
    _still_good(server, mds)


def test_oversized_messages(live):
    server, _, mds = live
    before = server.stats
    # one frame above MAXMSGSIZE: libzmq drops the connection, nothing reaches the thread
    with RawPeer(server.port) as hog:
        hog.send([b"", b"\x00" * (MAX_FRAME + 1)])
        assert hog.recv(timeout=0.3) is None
    # frames each under the limit but together over it: refused by the server's own check
    with RawPeer(server.port) as split:
        split.send([b"", b"\x00" * (MAX_FRAME - 10), b"\x00" * (MAX_FRAME - 10)])
        reply = split.recv()
        assert reply is not None
        msg = wire.MESSAGE_DECODER.decode(reply[1])
        assert isinstance(msg, wire.ErrorReply) and msg.code == wire.TOO_LARGE
    assert server.stats.errors.get("too-large", 0) == before.errors.get("too-large", 0) + 1
    _still_good(server, mds)


def test_random_frame_blast_then_good_requests(live):
    """Thousands of random multi-frame messages from several peers, without waiting for replies."""
    server, _, mds = live
    rng = random.Random(1234)
    peers = [RawPeer(server.port) for _ in range(4)]
    sent = 0
    try:
        for i in range(3000):
            n = rng.choice([0, 1, 1, 1, 2, 3, 6])
            frames = [rng.randbytes(rng.choice([0, 1, 5, 40, 300, 3000])) for _ in range(n)]
            if rng.random() < 0.5:
                frames.insert(0, b"")
            if not frames:
                frames = [b""]
            peers[i % 4].send(frames)
            sent += 1
        # drain the replies so that the server is not held back by full queues
        got = 0
        for p in peers:
            while p.recv(timeout=0.5) is not None:
                got += 1
    finally:
        for p in peers:
            p.close()
    assert got > 0.9 * sent  # nearly everything was answered (each is an error reply)
    _still_good(server, mds)
    stats = server.stats
    assert stats.total_errors >= got - 1
    assert sum(stats.errors.get(c, 0) for c in ("internal",)) == 0


# ----- damaged real encodings ---------------------------------------------------------------
# Generated values (above) decode as msgpack and fail on their types. A peer can also send a
# real message damaged on the way or on purpose: invalid UTF-8 inside a string, nesting
# deeper than the decoder's recursion limit, a truncated message, a length that promises
# more than follows. Every such message must get bad-request from a server (keyed or not:
# decoding comes before authentication), without an error logged or an internal error
# counted, and MalformedReply from a client. Seeded, with a fixed budget of messages.

FUZZ_KEY = "fuzz-shared-secret-0123456789"
#: string values of the real encodings that damage may hit (a tag or a field's value: a key
#: that is not UTF-8 is only a key this side does not know, which it skips as it should)
REQUEST_TEXTS = ["metadata-request", "push-offer", "prefill-0", "decode-7", "t-17", "127.0.0.1",
                 "tok-0123", "inc-9", "r-1"]
REPLY_TEXTS = ["metadata-reply", "push-accept", HASH, "prefill-0", "model", "m", "t-17", "HND"]
BODY_TEXTS = ["prefill-0", "DRAM", "kv-first", "HND", "FLASH_ATTN", "bf16"]


def _accept(offer: wire.PushOffer) -> wire.PushAccept:
    return wire.PushAccept(protocol_version=PROTOCOL_VERSION, transfer_id=offer.transfer_id,
                           engine_id="prefill-0", tp_size=TP, block_size=16)


def _client_messages(key: bytes | None, rng: random.Random) -> list[bytes]:
    """What a real client sends this server: a metadata request and a push offer (signed
    when keyed), each with a fresh nonce."""
    sent = auth.now_ms() if key else 0
    nonce = rng.randrange(1 << 62)
    mac = auth.request_mac(key, PROTOCOL_VERSION, [0, 2], "prefill-0", nonce, sent) if key else b""
    request = wire.MetadataRequest(protocol_version=PROTOCOL_VERSION, ranks=[0, 2],
                                   engine_id="prefill-0", nonce=nonce, sent_ms=sent, auth=mac)
    offer = wire.PushOffer(protocol_version=PROTOCOL_VERSION, transfer_id="t-17", engine_id="decode-7",
                           host="127.0.0.1", port=5600, tp_size=2, block_size=16,
                           block_ids=[[1, 2, 3]], token="tok-0123", incarnation="inc-9",
                           request_id="r-1", nonce=rng.randrange(1 << 62), sent_ms=sent)
    if key:
        offer = msgspec.structs.replace(offer, auth=offers.offer_mac(key, offer))
    return [wire.encode(request), wire.encode(offer)]


@pytest.fixture(scope="module", params=[None, FUZZ_KEY], ids=["keyless", "keyed"])
def target(request):
    threads = threading.active_count()
    mds = engine_metadata(TP)
    server = MetadataServer(mds, compat_hash=HASH, auth_key=request.param, on_offer=_accept)
    peer = RawPeer(server.port)
    yield server, peer, mds, normalize_key(request.param)
    peer.close()
    server.close()
    _threads_back_to(threads)


def _errors_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_undecodable_requests_get_bad_request(target, caplog):
    server, peer, mds, key = target
    rng = random.Random(20261126)
    before = server.stats
    kinds: Counter = Counter()
    with caplog.at_level(logging.WARNING):
        for _ in range(200):
            name, body = damage.undecodable(rng.choice(_client_messages(key, rng)), REQUEST_TEXTS, rng)
            kinds[name] += 1
            reply = _decode_reply(peer.ask(body))
            assert isinstance(reply, wire.ErrorReply), (name, body[:80], reply)
            assert reply.code == wire.BAD_REQUEST, (name, body[:80], reply)
    assert set(kinds) == {"utf8", "nesting", "truncation", "length"}, kinds
    after = server.stats
    assert after.errors.get(wire.BAD_REQUEST, 0) - before.errors.get(wire.BAD_REQUEST, 0) == 200
    assert after.errors.get(wire.INTERNAL, 0) == 0
    assert _errors_logged(caplog) == []
    fetch_metadata("127.0.0.1", server.port, [0, 1], compat_hash=HASH, timeout=2.0,
                   auth_key=key)  # still serves


def test_damaged_requests_get_exactly_one_sane_reply(target, caplog):
    """Bytes flipped anywhere in real requests and offers: whatever they decode to, one reply."""
    server, peer, mds, key = target
    rng = random.Random(7)
    with caplog.at_level(logging.WARNING):
        for _ in range(300):
            body = damage.flip(rng.choice(_client_messages(key, rng)), rng)
            reply = _decode_reply(peer.ask(body))
            assert isinstance(reply, (wire.ErrorReply, wire.MetadataReply, wire.PushAccept)), reply
            if isinstance(reply, wire.ErrorReply):
                assert reply.code in ERROR_CODES and reply.code != wire.INTERNAL, reply
    assert server.stats.errors.get(wire.INTERNAL, 0) == 0
    assert _errors_logged(caplog) == []


def test_undecodable_metadata_is_invalid_metadata():
    mds = engine_metadata(TP)
    rng = random.Random(3)
    for i in range(60):
        good = encode_metadata(mds[i % TP])
        name, bad = damage.undecodable(good, BODY_TEXTS, rng)
        with pytest.raises(InvalidMetadata, match="does not decode"):
            MetadataServer({i % TP: bad}, compat_hash=HASH)


class Hostile:
    """A hostile side channel: answers each request with a real reply (metadata or push
    accept), damaged by ``self.damage``."""

    def __init__(self) -> None:
        self.mds = engine_metadata(TP)
        self.bodies = {r: encode_metadata(md) for r, md in self.mds.items()}
        self.damage = lambda reply: reply
        self.fake = FakeServer(self._reply)

    def _reply(self, req: dict) -> bytes:
        if req.get("kind") == "push-offer":
            real = wire.PushAccept(protocol_version=PROTOCOL_VERSION, transfer_id=req["transfer_id"],
                                   engine_id="prefill-0", tp_size=TP, block_size=16,
                                   nonce=req["nonce"])
        else:
            real = wire.MetadataReply(protocol_version=PROTOCOL_VERSION, compat_hash=HASH,
                                      engine_id="prefill-0", ranks=req["ranks"],
                                      metadata=[self.bodies[r] for r in req["ranks"]],
                                      nonce=req["nonce"], compat_info={"model": "m"})
        return self.damage(wire.encode(real))


@pytest.fixture(scope="module")
def hostile():
    threads = threading.active_count()
    h = Hostile()
    ctx = zmq.Context(io_threads=1)
    yield h, ctx
    ctx.term()
    h.fake.close()
    _threads_back_to(threads)


def _fetch(h: Hostile, ctx) -> dict:
    return fetch_metadata("127.0.0.1", h.fake.port, [0, 2], engine_id="prefill-0", compat_hash=HASH,
                          timeout=2.0, retries=0, context=ctx)


def _offer(h: Hostile, ctx) -> wire.PushAccept:
    return send_push_offer("127.0.0.1", h.fake.port, transfer_id="t-17", engine_id="decode-7",
                           address=("127.0.0.1", 5600), tp_size=2, block_size=16,
                           block_ids=[[1, 2]], token="tok-0123", timeout=2.0, retries=0, context=ctx)


def _damaged_body(reply: bytes, rng: random.Random) -> bytes:
    """The reply with one metadata body (opaque bytes inside it) replaced by an undecodable one."""
    msg = wire.MESSAGE_DECODER.decode(reply)
    i = rng.randrange(len(msg.metadata))
    bodies = list(msg.metadata)
    bodies[i] = damage.undecodable(bodies[i], BODY_TEXTS, rng)[1]
    return wire.encode(msgspec.structs.replace(msg, metadata=bodies))


def test_undecodable_replies_raise_malformed_reply(hostile):
    h, ctx = hostile
    assert sorted(_fetch(h, ctx)) == [0, 2]  # undamaged, the client takes it
    rng = random.Random(11)
    for i in range(150):
        where = ("push accept", "reply", "metadata body")[i % 3]
        if where == "metadata body":
            h.damage = lambda reply: _damaged_body(reply, rng)
        else:
            h.damage = lambda reply: damage.undecodable(reply, REPLY_TEXTS, rng)[1]
        with pytest.raises(MalformedReply):
            _offer(h, ctx) if where == "push accept" else _fetch(h, ctx)


def test_damaged_replies_raise_handshake_errors_only(hostile):
    """Bytes flipped anywhere in real replies: the client returns metadata that passed every
    check or raises a HandshakeError, never anything else."""
    h, ctx = hostile
    rng = random.Random(5)
    outcomes: Counter = Counter()
    for i in range(150):
        h.damage = lambda reply: damage.flip(reply, rng)
        try:
            got = _offer(h, ctx) if i % 3 == 0 else _fetch(h, ctx)
            outcomes["answer"] += 1
            if isinstance(got, dict):
                assert sorted(got) == [0, 2]
        except HandshakeError as exc:
            outcomes[type(exc).__name__] += 1
    assert outcomes["MalformedReply"] > 0, outcomes
