"""MetadataServer and fetch_metadata over real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq
from handshake_helpers import (
    HASH,
    FakeServer,
    engine_metadata,
    make_metadata,
    make_spec,
    mamba_spec,
    open_fds,
)

from kvbridge.handshake import (
    PROTOCOL_VERSION,
    HandshakeError,
    HandshakeTimeout,
    IncompatiblePeer,
    InvalidMetadata,
    MalformedReply,
    MetadataServer,
    PeerUnreachable,
    RequestRejected,
    UnknownRank,
    WrongEngine,
    compat_fields,
    compatibility_hash,
    encode_metadata,
    fetch_metadata,
    new_incarnation,
    wire,
)

HOST = "127.0.0.1"


def fetch(server_or_port, ranks, **kw):
    port = server_or_port if isinstance(server_or_port, int) else server_or_port.port
    kw.setdefault("compat_hash", HASH)
    kw.setdefault("timeout", 2.0)
    return fetch_metadata(HOST, port, ranks, **kw)


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_fetch_every_rank_and_subsets(tp):
    mds = engine_metadata(tp)
    with MetadataServer(mds, compat_hash=HASH) as server:
        assert server.port > 0 and server.address == f"tcp://{HOST}:{server.port}"
        got = fetch(server, list(range(tp)), engine_id="prefill-0")
        assert got == mds
        assert list(got) == list(range(tp))
        # a decode rank of a smaller TP asks for a slice, in its own order
        want = list(range(tp))[::-1][: max(1, tp // 2)]
        part = fetch(server, want)
        assert list(part) == want and all(part[r] == mds[r] for r in want)
        # the remote engine description can be rebuilt from the reply alone
        assert got[0].spec() == make_spec(tp)
        assert server.stats.requests_served == 2
        assert server.stats.errors == {}


def test_hybrid_engine_metadata_round_trips():
    spec = mamba_spec(2)
    mds = {r: make_metadata(spec, r) for r in range(2)}
    with MetadataServer(mds, compat_hash=HASH) as server:
        got = fetch(server, [1, 0])
    assert got == mds and got[1].spec() == spec


def test_server_serves_encoded_metadata_as_given():
    mds = engine_metadata(2)
    blobs = {r: encode_metadata(md) for r, md in mds.items()}
    # a blob no re-encoding could produce (a newer peer's extra field): served byte for byte
    d = msgspec.msgpack.decode(blobs[0])
    d["later_field"] = [1, 2, 3]
    blobs[0] = msgspec.msgpack.encode(d)
    with MetadataServer(blobs, compat_hash=HASH) as server:
        assert server.incarnation == mds[0].incarnation and server.ranks == [0, 1]
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.connect(f"tcp://{HOST}:{server.port}")
            sock.send(wire.encode(wire.MetadataRequest(protocol_version=PROTOCOL_VERSION,
                                                       ranks=[0, 1])))
            reply = wire.MESSAGE_DECODER.decode(sock.recv())
            sock.close(linger=0)
        finally:
            ctx.term()
        assert reply.metadata == [blobs[0], blobs[1]]
        assert fetch(server, [1, 0]) == {1: mds[1], 0: mds[0]}
        replaced = msgspec.structs.replace(mds[1], num_blocks=32)
        server.set_metadata(1, encode_metadata(replaced))
        assert fetch(server, [1]) == {1: replaced}
        with pytest.raises(InvalidMetadata, match="does not decode"):
            server.set_metadata(1, b"\x93garbage")
        bad = msgspec.structs.replace(mds[1], region_base_addrs=[])
        with pytest.raises(InvalidMetadata, match="region"):
            server.set_metadata(1, encode_metadata(bad))
        assert fetch(server, [1]) == {1: replaced}  # a refused update loses nothing
    with pytest.raises(InvalidMetadata, match="incarnation"):
        MetadataServer({0: blobs[0], 1: encode_metadata(engine_metadata(2)[1])}, compat_hash=HASH)


def test_duplicate_ranks_are_asked_once():
    mds = engine_metadata(4)
    with MetadataServer(mds, compat_hash=HASH) as server:
        got = fetch(server, [2, 2, 3])
    assert list(got) == [2, 3]


def test_server_serving_part_of_an_engine():
    mds = engine_metadata(8, ranks=[4, 5, 6, 7])  # second node of a TP-8 engine
    with MetadataServer(mds, compat_hash=HASH) as server:
        assert server.ranks == [4, 5, 6, 7]
        assert fetch(server, [5])[5] == mds[5]
        with pytest.raises(UnknownRank, match=r"serves ranks \[4, 5, 6, 7\]"):
            fetch(server, [3])


# ----- every error type ------------------------------------------------------

def test_unknown_rank():
    with MetadataServer(engine_metadata(2), compat_hash=HASH) as server:
        with pytest.raises(UnknownRank, match="TP size") as info:
            fetch(server, [0, 2])
        assert isinstance(info.value, HandshakeError)
        assert server.stats.errors == {"unknown-rank": 1}


def test_wrong_engine_refused_by_server():
    with MetadataServer(engine_metadata(2), compat_hash=HASH) as server:
        with pytest.raises(WrongEngine, match="'prefill-0'.*not 'prefill-7'"):
            fetch(server, [0], engine_id="prefill-7")
        assert server.stats.errors == {"wrong-engine": 1}


def test_incompatible_hash_names_what_to_check():
    other = compatibility_hash(model="meta-llama/Llama-3.1-8B", dtype="bf16", cache_dtype="fp8",
                               layout="kv-first", attention_backend="FLASH_ATTN")
    info = {"cache_dtype": "fp8", "model": "meta-llama/Llama-3.1-8B"}
    with MetadataServer(engine_metadata(2), compat_hash=other, compat_info=info) as server:
        with pytest.raises(IncompatiblePeer, match="KV-cache dtype.*cache_dtype=fp8"):
            fetch(server, [0])
        # the expert switch turns the check off
        assert fetch(server, [0], compat_hash=None)[0].rank == 0


def test_incompatible_hash_with_both_sides_fields_names_each_difference():
    """Given this side's fields too, the refusal names what differs with both values:
    two FP8 formats stored alike as bytes must not pass as "the same dtype"."""
    fields = dict(model="m", dtype="uint8", layout="kvbridge-planned", attention_backend="CPU")
    theirs = compat_fields(cache_dtype="fp8_e4m3", **fields)
    ours = compat_fields(cache_dtype="fp8_e5m2", **fields)
    other = compatibility_hash(cache_dtype="fp8_e4m3", **fields)
    with MetadataServer(engine_metadata(2), compat_hash=other, compat_info=theirs) as server:
        with pytest.raises(IncompatiblePeer) as info:
            fetch(server, [0], compat_hash=compatibility_hash(cache_dtype="fp8_e5m2", **fields),
                  compat_info=ours)
        msg = str(info.value)
        assert "KV-cache dtype differs: peer 'fp8_e4m3', this side 'fp8_e5m2'" in msg, msg
        assert "model" not in msg.split("incompatible:")[1].split(";")[0]  # equal fields unnamed
    # a peer that serves no fields gets the old message
    with MetadataServer(engine_metadata(2), compat_hash=other) as server:
        with pytest.raises(IncompatiblePeer, match="compatibility hash"):
            fetch(server, [0], compat_info=ours)


def test_timeout_on_nonexistent_server_is_bounded():
    with MetadataServer(engine_metadata(1), compat_hash=HASH) as server:
        port = server.port
    # nothing listens on port any more
    t0 = time.monotonic()
    with pytest.raises(HandshakeTimeout, match="side_channel_port") as info:
        fetch(port, [0], timeout=0.2, retries=2, backoff=0.05, refused_grace=5.0)
    elapsed = time.monotonic() - t0
    bound = 3 * 0.2 + 0.05 + 0.1
    assert 3 * 0.2 <= elapsed < bound + 0.5, elapsed
    assert isinstance(info.value, TimeoutError)


def test_refused_connections_fail_fast_with_their_own_error():
    """A dead engine (nothing listens) is reported in about refused_grace, not after the timeout."""
    with MetadataServer(engine_metadata(1), compat_hash=HASH) as server:
        port = server.port
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable, match="not running") as info:
        fetch(port, [0], timeout=30, retries=3, refused_grace=0.5)
    assert 0.4 < time.monotonic() - t0 < 3.0
    assert isinstance(info.value, ConnectionError) and not isinstance(info.value, TimeoutError)


def test_an_engine_that_starts_within_the_grace_is_reached():
    with MetadataServer(engine_metadata(1), compat_hash=HASH) as server:
        port = server.port
    result: dict = {}

    def client():
        result["md"] = fetch(port, [0], timeout=10, retries=0, refused_grace=3.0)

    t = threading.Thread(target=client)
    t.start()
    time.sleep(0.5)  # refused meanwhile
    with MetadataServer(engine_metadata(1), compat_hash=HASH, port=port):
        t.join(10)
    assert result["md"][0].rank == 0


def test_timeout_on_silent_server_retries_with_fresh_sockets():
    with FakeServer(lambda req: None) as dead:
        t0 = time.monotonic()
        with pytest.raises(HandshakeTimeout):
            fetch(dead.port, [0], timeout=0.15, retries=3, backoff=0.01)
        assert time.monotonic() - t0 < 4 * 0.15 + 0.07 + 2.0  # bounded (slack for a loaded 2-core machine)
        deadline = time.monotonic() + 1
        while len(dead.requests) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    # one request per attempt: a timed-out REQ socket was replaced, not reused
    assert len(dead.requests) == 4
    assert len({r["nonce"] for r in dead.requests}) == 1


def _good_reply(req: dict, mds: dict, **overrides) -> bytes:
    body = {
        "kind": "metadata-reply", "protocol_version": PROTOCOL_VERSION, "compat_hash": HASH,
        "engine_id": "prefill-0", "ranks": req["ranks"],
        "metadata": [encode_metadata(mds[r]) for r in req["ranks"]], "nonce": req["nonce"],
    }
    body.update(overrides)
    return msgspec.msgpack.encode(body)


def test_protocol_version_checked_before_body():
    mds = engine_metadata(2)
    # a future server whose body this client could not decode at all
    reply = lambda req: msgspec.msgpack.encode({  # noqa: E731
        "kind": "metadata-reply-v2", "protocol_version": PROTOCOL_VERSION + 1,
        "payload": b"\x00\x01", "compat_hash": HASH})
    with FakeServer(reply) as fake:
        with pytest.raises(IncompatiblePeer, match=f"protocol {PROTOCOL_VERSION + 1}"):
            fetch(fake.port, [0])
    # a bad hash with an undecodable body: the hash is reported, the body never decoded
    bad = lambda req: _good_reply(req, mds, compat_hash="f" * 64,  # noqa: E731
                                  metadata=[b"\xc1garbage"] * len(req["ranks"]))
    with FakeServer(bad) as fake:
        with pytest.raises(IncompatiblePeer, match="compatibility hash"):
            fetch(fake.port, [0])


@pytest.mark.parametrize("case", [
    "not-msgpack", "two-frames", "wrong-kind", "nonce", "ranks", "body-garbage",
    "body-wrong-rank", "inconsistent-body", "mixed-incarnations", "missing-field",
])
def test_malformed_replies(case):
    mds = engine_metadata(2)
    other_inc = engine_metadata(2)

    def reply(req):
        if case == "not-msgpack":
            return b"\xc1\xc1 this is not msgpack"
        if case == "two-frames":
            return [_good_reply(req, mds), b"extra"]
        if case == "wrong-kind":
            return msgspec.msgpack.encode({"kind": "metadata-request", "protocol_version": 1,
                                           "ranks": [0]})
        if case == "nonce":
            return _good_reply(req, mds, nonce=req["nonce"] + 1)
        if case == "ranks":
            return _good_reply(req, mds, ranks=[1])
        if case == "body-garbage":
            return _good_reply(req, mds, metadata=[b"\x93\x01\x02"])
        if case == "body-wrong-rank":
            return _good_reply(req, mds, metadata=[encode_metadata(mds[1])])
        if case == "inconsistent-body":
            bad = msgspec.structs.replace(mds[0], num_blocks=10**6)
            return _good_reply(req, mds, metadata=[encode_metadata(bad)])
        if case == "mixed-incarnations":
            return _good_reply(req, mds, metadata=[encode_metadata(mds[0]),
                                                   encode_metadata(other_inc[1])])
        if case == "missing-field":
            d = msgspec.msgpack.decode(_good_reply(req, mds))
            del d["engine_id"]
            return msgspec.msgpack.encode(d)
        raise AssertionError(case)

    ranks = [0, 1] if case == "mixed-incarnations" else [0]
    with FakeServer(reply) as fake:
        with pytest.raises(MalformedReply) as info:
            fetch(fake.port, ranks)
    assert "127.0.0.1" in str(info.value)


def test_wrong_engine_detected_in_reply():
    mds = engine_metadata(2)
    with FakeServer(lambda req: _good_reply(req, mds, engine_id="decode-3")) as fake:
        with pytest.raises(WrongEngine, match="decode-3"):
            fetch(fake.port, [0], engine_id="prefill-0")
    # the envelope claims the right engine but a body names another
    foreign = engine_metadata(2, engine_id="prefill-9")
    with FakeServer(lambda req: _good_reply(req, foreign)) as fake:
        with pytest.raises(WrongEngine, match="prefill-9"):
            fetch(fake.port, [0], engine_id="prefill-0")


def test_request_rejected_maps_server_error_codes():
    reply = lambda req: msgspec.msgpack.encode(wire.ErrorReply(  # noqa: E731
        protocol_version=PROTOCOL_VERSION, code="internal", message="boom"))
    with FakeServer(reply) as fake:
        with pytest.raises(RequestRejected, match="internal.*boom"):
            fetch(fake.port, [0])


def test_schema_evolution_end_to_end():
    """An older server (no compat_info, bodies with the dropped ssm_sizes and without the
    engine's later ``extra``) and a newer one (extra fields)."""
    mds = engine_metadata(2)

    def older(req):
        bodies = []
        for r in req["ranks"]:
            d = msgspec.msgpack.decode(encode_metadata(mds[r]))
            d["ssm_sizes"] = [4096]
            del d["engine"]["extra"]
            bodies.append(msgspec.msgpack.encode(d))
        return _good_reply(req, mds, metadata=bodies)

    def newer(req):
        bodies = []
        for r in req["ranks"]:
            d = msgspec.msgpack.decode(encode_metadata(mds[r]))
            d["rkeys"] = {"ucx": b"\x01" * 32}
            bodies.append(msgspec.msgpack.encode(d))
        return _good_reply(req, mds, metadata=bodies, compat_info={"model": "m"},
                           trace_id="abc", ttl_s=30)

    for script in (older, newer):
        with FakeServer(script) as fake:
            assert fetch(fake.port, [0, 1]) == mds


def test_argument_errors_are_value_errors():
    for kwargs in (dict(ranks=[]), dict(ranks=[-1]), dict(ranks="01"), dict(timeout=0),
                   dict(retries=-1), dict(port=0), dict(host="")):
        args = dict(host=HOST, port=5555, ranks=[0], compat_hash=HASH)
        args.update(kwargs)
        with pytest.raises(ValueError):
            fetch_metadata(**args)


# ----- lifecycle -------------------------------------------------------------

def test_restarted_server_is_seen_as_new_incarnation():
    first = engine_metadata(2, incarnation="inc-A")
    with MetadataServer(first, compat_hash=HASH) as server:
        port = server.port
        assert fetch(port, [0, 1])[1].incarnation == "inc-A"
    second = engine_metadata(2, incarnation="inc-B")
    with MetadataServer(second, compat_hash=HASH, port=port) as server:
        got = fetch(port, [0, 1])
    assert {md.incarnation for md in got.values()} == {"inc-B"}
    assert got[0].agent_name != first[0].agent_name


def test_client_retries_across_a_restart_gap():
    mds = engine_metadata(2, incarnation="inc-old")
    with MetadataServer(mds, compat_hash=HASH) as server:
        port = server.port
    fresh = engine_metadata(2, incarnation="inc-new")
    result: dict = {}

    def client():
        result["md"] = fetch(port, [1], timeout=0.2, retries=8, backoff=0.05, refused_grace=5.0)

    t = threading.Thread(target=client)
    t.start()
    time.sleep(0.3)  # the first attempt times out while nothing listens
    with MetadataServer(fresh, compat_hash=HASH, port=port):
        t.join(5)
    assert result["md"][1].incarnation == "inc-new"


def test_many_sequential_fetches_on_one_context():
    """A decode engine handshakes for its whole life on one ZMQ context. Each fetch opens
    a socket and its monitor; the monitor's endpoint must not collide with the one of an
    earlier, closed socket (pyzmq's default name derives from a reused file descriptor,
    which failed with EADDRINUSE after a few hundred fetches)."""
    mds = engine_metadata(2)
    ctx = zmq.Context()
    try:
        with MetadataServer(mds, compat_hash=HASH) as server:
            for j in range(3000):
                got = fetch(server, [j % 2], context=ctx)
                assert got[j % 2] == mds[j % 2]
    finally:
        ctx.term()


def test_concurrent_clients():
    mds = engine_metadata(8)
    errors: list[BaseException] = []
    per_thread = 25

    def worker(i: int) -> None:
        try:
            ctx = zmq.Context()
            try:
                for j in range(per_thread):
                    ranks = [(i + j) % 8, (i * 3 + j) % 8]
                    got = fetch(server, ranks, context=ctx)
                    assert all(got[r] == mds[r] for r in ranks)
            finally:
                ctx.term()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    with MetadataServer(mds, compat_hash=HASH) as server:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors[:3]
        assert server.stats.requests_served == 12 * per_thread


def test_set_metadata_replaces_and_adds_ranks():
    mds = engine_metadata(4, ranks=[0, 1])
    spec = make_spec(4)
    inc = mds[0].incarnation
    with MetadataServer(mds, compat_hash=HASH) as server:
        with pytest.raises(UnknownRank):
            fetch(server, [2])
        new2 = make_metadata(spec, 2, incarnation=inc)
        server.set_metadata(2, new2)
        assert fetch(server, [2])[2] == new2
        bigger = make_metadata(spec, 0, incarnation=inc, num_blocks=128)
        server.set_metadata(0, bigger)
        assert fetch(server, [0])[0].num_blocks == 128
        with pytest.raises(InvalidMetadata, match="incarnation"):
            server.set_metadata(3, make_metadata(spec, 3, incarnation="other"))
        with pytest.raises(InvalidMetadata, match="rank 1"):
            server.set_metadata(3, make_metadata(spec, 1, incarnation=inc))
    with pytest.raises(HandshakeError, match="closed"):
        server.set_metadata(3, make_metadata(spec, 3, incarnation=inc))


def test_server_refuses_inconsistent_metadata():
    good = engine_metadata(2)
    with pytest.raises(InvalidMetadata, match="at least one"):
        MetadataServer({}, compat_hash=HASH)
    with pytest.raises(InvalidMetadata, match="says rank 1"):
        MetadataServer({0: good[1]}, compat_hash=HASH)
    mixed = {0: good[0], 1: engine_metadata(2)[1]}
    with pytest.raises(InvalidMetadata, match="incarnation"):
        MetadataServer(mixed, compat_hash=HASH)
    with pytest.raises(InvalidMetadata, match="num_blocks"):
        MetadataServer({0: msgspec.structs.replace(good[0], num_blocks=10**9)}, compat_hash=HASH)
    with pytest.raises(InvalidMetadata, match="compat_hash"):
        MetadataServer(good, compat_hash="")


def test_port_in_use_is_a_clear_error():
    with MetadataServer(engine_metadata(1), compat_hash=HASH) as server:
        fds0 = open_fds()
        for _ in range(5):
            with pytest.raises(HandshakeError, match="side_channel_port"):
                MetadataServer(engine_metadata(1), compat_hash=HASH, port=server.port)
        if fds0 is not None:  # the failed constructor released its context and sockets
            assert open_fds() == fds0


def test_clean_shutdown_leaks_no_threads_or_sockets():
    threads0 = threading.active_count()
    fds0 = open_fds()
    for _ in range(15):
        server = MetadataServer(engine_metadata(2), compat_hash=HASH)
        assert threading.active_count() == threads0 + 1
        fetch(server, [0, 1])
        t0 = time.monotonic()
        server.close()
        assert time.monotonic() - t0 < 2.0  # woken at once, not after a poll interval
        server.close()  # idempotent
        assert server.closed
    assert threading.active_count() == threads0
    if fds0 is not None:
        assert open_fds() <= fds0 + 2, (fds0, open_fds())


def test_new_incarnations_differ():
    assert len({new_incarnation() for _ in range(100)}) == 100
