"""The side-channel client: fetch and validate a remote engine's rank metadata."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from . import auth, offers, wire
from .errors import (
    AuthenticationFailed,
    HandshakeError,
    HandshakeTimeout,
    IncompatiblePeer,
    MalformedReply,
    PeerUnreachable,
    RequestRejected,
    UnknownRank,
    WrongEngine,
)
from .metadata import AgentMetadata, decode_metadata, metadata_problems
from .server import tcp_endpoint

#: default bound on one reply (16 ranks of a 160-region model are ~100 KiB)
DEFAULT_MAX_REPLY_BYTES = 64 << 20


def fetch_metadata(
    host: str,
    port: int,
    ranks: Sequence[int],
    *,
    engine_id: str | None = None,
    compat_hash: str | None,
    timeout: float = 5.0,
    retries: int = 3,
    backoff: float = 0.05,
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
    context: zmq.Context | None = None,
    refused_grace: float = 1.0,
    auth_key: str | bytes | None = None,
    compat_info: Mapping[str, str] | None = None,
) -> dict[int, AgentMetadata]:
    """Fetch and validate the metadata of ``ranks`` from the side channel at ``host:port``.

    One request names every rank; the reply is checked in two phases: the
    envelope's protocol version and compatibility hash first, then each
    rank's metadata body is decoded and checked (engine id, rank, TP size and
    incarnation agree across ranks, regions are internally consistent).

    Every wait is bounded: each attempt waits at most ``timeout`` seconds for
    the reply; on a timeout the socket is discarded (closed with linger 0) and
    the request is retried up to ``retries`` more times after sleeping
    ``backoff * 2**attempt`` seconds. The worst case before
    :class:`HandshakeTimeout` is about ``(retries + 1) * timeout + backoff * (2**retries - 1)``.

    A peer that refuses connections (nothing listens: the engine is not
    running, or the port is wrong) is given up on after ``refused_grace``
    seconds of refusals, with :class:`PeerUnreachable`, instead of waiting for
    the timeout: a dead prefill engine is detected in about a second while a
    slow but living one still gets the whole ``timeout``.

    ``compat_hash=None`` turns the compatibility check off (expert option: the
    caller then vouches that model, dtypes, layout and backend match).
    ``compat_info`` (this side's :func:`~kvbridge.handshake.compat_fields`) names, in
    the refusal of a peer with another hash that serves its fields too, each field
    that differs with both values.

    With ``auth_key`` (the same secret as the server's) every attempt is signed
    with a fresh nonce and the send time, and a reply counts only if it is
    authenticated with the same key: a server with another key, or none,
    raises :class:`AuthenticationFailed`.
    ``context`` lets a caller reuse a ZMQ context (faster); by default a
    private one is created and terminated.
    """
    want = _check_args(host, port, ranks, timeout, retries, backoff, max_reply_bytes)
    key = auth.normalize_key(auth_key)
    own_ctx = context is None
    ctx = zmq.Context(io_threads=1) if own_ctx else context
    endpoint = tcp_endpoint(host, port)
    # keyless: one request (one nonce) for every attempt, as always; keyed: a fresh signed
    # request per attempt, since a keyed server answers each nonce once
    plain = _new_request(want, engine_id, None) if key is None else None
    try:
        reply, request = _request(ctx, endpoint, lambda: plain or _new_request(want, engine_id, key),
                                  timeout, retries, backoff, max_reply_bytes, want, engine_id,
                                  refused_grace)
    finally:
        if own_ctx:
            ctx.term()
    return _validate(reply, endpoint, want, engine_id, compat_hash, request, key, compat_info)


def request_reply(host: str, port: int, make_request, *, timeout: float, retries: int,
                  context: zmq.Context | None = None, what: str = "request",
                  backoff: float = 0.05, refused_grace: float = 1.0,
                  max_reply_bytes: int = 1 << 20) -> tuple[list[bytes], object]:
    """One bounded REQ round trip to a side channel (as :func:`fetch_metadata` makes them):
    ``make_request()`` builds each attempt's message; returns (reply frames, the message
    that was answered)."""
    _check_args(host, port, [0], timeout, retries, backoff, max_reply_bytes)
    ctx = zmq.Context(io_threads=1) if context is None else context
    try:
        return _request(ctx, tcp_endpoint(host, port), make_request, timeout, retries, backoff,
                        max_reply_bytes, [0], what, refused_grace)
    finally:
        if context is None:
            ctx.term()


def _new_request(want: list[int], engine_id: str | None, key: bytes | None) -> wire.MetadataRequest:
    """A request with a fresh nonce, signed when there is a key."""
    nonce = int.from_bytes(os.urandom(8), "little") >> 1
    if key is None:
        return wire.MetadataRequest(protocol_version=wire.PROTOCOL_VERSION, ranks=want,
                                    engine_id=engine_id, nonce=nonce)
    sent = auth.now_ms()
    mac = auth.request_mac(key, wire.PROTOCOL_VERSION, want, engine_id, nonce, sent)
    return wire.MetadataRequest(protocol_version=wire.PROTOCOL_VERSION, ranks=want,
                                engine_id=engine_id, nonce=nonce, sent_ms=sent, auth=mac)


def _check_args(host: object, port: object, ranks: Sequence[int], timeout: float, retries: int,
                backoff: float, max_reply_bytes: int) -> list[int]:
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty string, got {host!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"port must be in 1..65535, got {port!r}")
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise ValueError(f"ranks must be a sequence of integers, got {ranks!r}")
    want: list[int] = []
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ValueError(f"ranks must be non-negative integers, got {r!r}")
        if r not in want:
            want.append(r)
    if not want:
        raise ValueError("ranks is empty: name at least one remote rank")
    if len(want) > wire.MAX_RANKS_PER_REQUEST:
        raise ValueError(f"at most {wire.MAX_RANKS_PER_REQUEST} ranks per request")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
    if not backoff >= 0:
        raise ValueError(f"backoff must be >= 0 seconds, got {backoff!r}")
    if not isinstance(max_reply_bytes, int) or max_reply_bytes < 1024:
        raise ValueError(f"max_reply_bytes must be an integer >= 1024, got {max_reply_bytes!r}")
    return want


_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED


def _await_reply(sock: zmq.Socket, mon: zmq.Socket, timeout: float, refused_grace: float,
                 endpoint: str, who: str) -> list[bytes] | None:
    """The reply to the request sent on ``sock``, or None after ``timeout``; raises
    PeerUnreachable when every connection attempt for ``refused_grace`` s was refused
    (``mon``: the monitor socket of ``sock``)."""
    try:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        start = time.monotonic()
        deadline = start + timeout
        connected, first_refusal = False, None
        while (left := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(max(1, int(left * 1000))))
            if sock in events:
                return sock.recv_multipart(zmq.NOBLOCK)
            if mon in events:
                ev = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
                if ev == zmq.EVENT_CONNECTED:
                    connected = True
                elif ev == zmq.EVENT_CONNECT_RETRIED and not connected:
                    now = time.monotonic()
                    first_refusal = first_refusal or now
                    if now - first_refusal >= refused_grace:
                        raise PeerUnreachable(
                            f"nothing accepts connections at {endpoint} (refused for "
                            f"{now - start:.1f} s): {who} is not running, or its side channel "
                            f"is on another host or port (check its side_channel_port setting)")
        return None
    finally:
        mon.close(linger=0)


def _request(ctx: zmq.Context, endpoint: str, make_request, timeout: float, retries: int,
             backoff: float, max_reply_bytes: int, want: list[int],
             engine_id: str | None, refused_grace: float
             ) -> tuple[list[bytes], wire.MetadataRequest]:
    who = f"engine {engine_id!r}" if engine_id else "the prefill engine"
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * (2 ** (attempt - 1)))
        sock = ctx.socket(zmq.REQ)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            # Monitor before connect, to see every attempt. The monitor endpoint must be
            # unique: pyzmq's default name derives from the socket's file descriptor, which
            # the next socket reuses while libzmq may still hold the old endpoint (a closed
            # socket's monitor is torn down asynchronously), and the bind then fails with
            # EADDRINUSE.
            try:
                mon = sock.get_monitor_socket(
                    _MONITORED, addr=f"inproc://kvbridge-handshake-monitor-{uuid.uuid4().hex}")
            except zmq.ZMQError as exc:
                raise HandshakeError(f"cannot monitor the side-channel socket for {endpoint}: "
                                     f"{exc}") from exc
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                mon.close(linger=0)
                raise HandshakeError(f"cannot connect to {endpoint}: {exc}; check the host "
                                     f"name and port") from exc
            request = make_request()
            try:
                sock.send(wire.encode(request), zmq.NOBLOCK)  # queued until the connection is up
            except zmq.Again:
                mon.close(linger=0)
                continue
            reply = _await_reply(sock, mon, timeout, refused_grace, endpoint, who)
            if reply is not None:
                return reply, request
        finally:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass  # the monitor never started
            sock.close(linger=0)  # a REQ socket that timed out can never be reused
    raise HandshakeTimeout(
        f"no handshake reply from {endpoint} for ranks {want} within {timeout} s, "
        f"{retries + 1} attempts; check that {who} is running and serves its side channel on this "
        f"host and port (its side_channel_port setting), and that the host is reachable"
    )


_COMPAT_NAMES = {"cache_dtype": "KV-cache dtype", "dtype": "cache element dtype",
                 "attention_backend": "attention backend", "protocol_version": "protocol version"}


def _compat_differences(peer: Mapping[str, str], ours: Mapping[str, str] | None) -> str:
    """The compatibility fields that differ, with both values ("" when unknown)."""
    if not peer or not ours:
        return ""
    keys = sorted(set(peer) | set(ours), key=lambda k: (k != "cache_dtype", k))
    return "; ".join(f"{_COMPAT_NAMES.get(k, k)} differs: peer {peer.get(k, '(none)')!r}, "
                     f"this side {ours.get(k, '(none)')!r}"
                     for k in keys if peer.get(k) != ours.get(k))


def _validate(frames: list[bytes], endpoint: str, want: list[int], engine_id: str | None,
              compat_hash: str | None, request: wire.MetadataRequest,
              key: bytes | None, compat_info: Mapping[str, str] | None = None
              ) -> dict[int, AgentMetadata]:
    nonce = request.nonce
    if len(frames) != 1:
        raise MalformedReply(f"reply from {endpoint} has {len(frames)} frames, expected 1; the "
                             f"peer is not a kvbridge side channel")
    body = frames[0]
    # Phase one: the envelope only.
    try:
        env = wire.ENVELOPE_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedReply(f"reply from {endpoint} is not a kvbridge message ({exc}); check "
                             f"that the port belongs to a kvbridge side channel") from exc
    if env.protocol_version != wire.PROTOCOL_VERSION:
        raise IncompatiblePeer(
            f"peer {endpoint} speaks handshake protocol {env.protocol_version}, this side "
            f"{wire.PROTOCOL_VERSION}; run the same kvbridge version on prefill and decode")
    try:
        msg = wire.MESSAGE_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedReply(f"reply from {endpoint} could not be decoded: {exc}") from exc
    if isinstance(msg, wire.ErrorReply):
        _raise_error_reply(msg, endpoint)
    if not isinstance(msg, wire.MetadataReply):
        raise MalformedReply(f"peer {endpoint} answered with a {type(msg).__name__}, expected a "
                             f"metadata-reply")
    if key is not None:
        _check_reply_auth(msg, request, key, endpoint)
    if msg.nonce != nonce:
        raise MalformedReply(f"reply from {endpoint} answers another request (nonce mismatch)")
    if compat_hash is not None and msg.compat_hash != compat_hash:
        differ = _compat_differences(msg.compat_info, compat_info)
        if differ:
            raise IncompatiblePeer(
                f"peer {endpoint} (engine {msg.engine_id!r}) is incompatible: {differ}; run "
                "both engines with the same model, dtype, KV-cache dtype, attention backend and "
                "kvbridge version")
        info = ", ".join(f"{k}={v}" for k, v in sorted(msg.compat_info.items()))
        raise IncompatiblePeer(
            f"peer {endpoint} (engine {msg.engine_id!r}) has compatibility hash "
            f"{msg.compat_hash[:16]}..., this side {compat_hash[:16]}...; model, dtype, KV-cache "
            f"dtype, cache layout, attention backend and kvbridge protocol must match"
            + (f" (peer: {info})" if info else "")
            + "; pass compat_hash=None only if you know they do")
    if engine_id is not None and msg.engine_id != engine_id:
        raise WrongEngine(f"peer {endpoint} serves engine {msg.engine_id!r}, not {engine_id!r}; "
                          f"check the side-channel host and port of {engine_id!r}")
    if msg.ranks != want or len(msg.metadata) != len(want):
        raise MalformedReply(f"reply from {endpoint} carries ranks {msg.ranks[:32]} "
                             f"({len(msg.metadata)} bodies) for a request of ranks {want}")
    # Phase two: the bodies.
    out: dict[int, AgentMetadata] = {}
    first: AgentMetadata | None = None
    for rank, data in zip(want, msg.metadata, strict=True):
        try:
            md = decode_metadata(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedReply(f"metadata of rank {rank} from {endpoint} does not decode: "
                                 f"{exc}") from exc
        if md.engine_id != msg.engine_id:
            raise WrongEngine(f"metadata of rank {rank} from {endpoint} names engine "
                              f"{md.engine_id!r}, the reply {msg.engine_id!r}")
        if md.rank != rank:
            raise MalformedReply(f"{endpoint} answered rank {rank} with the metadata of rank "
                                 f"{md.rank}")
        # engine facts equal to an already checked rank's need not be rebuilt again
        same_engine = first is not None and md.engine == first.engine
        problems = metadata_problems(md, check_engine=not same_engine)
        if problems:
            raise MalformedReply(f"metadata of rank {rank} from {endpoint} is inconsistent: "
                                 + "; ".join(problems))
        if first is None:
            first = md
        else:
            for name in ("incarnation", "tp_size", "engine"):
                if getattr(md, name) != getattr(first, name):
                    raise MalformedReply(
                        f"ranks {first.rank} and {rank} from {endpoint} disagree on {name}; the "
                        f"peer engine may be restarting, retry the handshake")
        out[rank] = md
    return out


def _check_reply_auth(msg: wire.MetadataReply, request: wire.MetadataRequest, key: bytes,
                      endpoint: str) -> None:
    if not msg.auth:
        raise AuthenticationFailed(
            f"peer {endpoint} answered without authentication: its side channel has no auth_key "
            f"while this side has one; " + auth.HOW_TO_SET)
    want = auth.reply_mac(key, request.auth, msg.protocol_version, msg.compat_hash, msg.engine_id,
                          msg.ranks, msg.metadata, msg.nonce, msg.compat_info)
    if not auth.macs_equal(want, msg.auth):
        raise AuthenticationFailed(
            f"the reply from {endpoint} is not authenticated with this side's key (another key, "
            f"or altered on the way); " + auth.HOW_TO_SET)


def _raise_error_reply(msg: wire.ErrorReply, endpoint: str) -> None:
    text = f"peer {endpoint} refused the request ({msg.code}): {msg.message}"
    if msg.code in (wire.AUTH_REQUIRED, wire.AUTH_FAILED):
        raise AuthenticationFailed(text)
    if msg.code == wire.UNKNOWN_RANK:
        raise UnknownRank(text + "; check the remote TP size and which ranks this host serves")
    if msg.code == wire.WRONG_ENGINE:
        raise WrongEngine(text + "; check the side-channel host and port of the engine")
    raise RequestRejected(text)


def send_push_offer(
    host: str,
    port: int,
    *,
    transfer_id: str,
    engine_id: str,
    address: tuple[str, int],
    tp_size: int,
    block_size: int,
    block_ids: Sequence[Sequence[int]],
    token: str,
    computed_tokens: int = 0,
    incarnation: str = "",
    request_id: str = "",
    timeout: float = 5.0,
    retries: int = 2,
    auth_key: str | bytes | None = None,
    context: zmq.Context | None = None,
) -> wire.PushAccept:
    """Offer the prefill engine at ``host:port`` this decode engine's blocks for one request.

    ``engine_id`` / ``address`` / ``tp_size`` / ``block_size`` / ``incarnation``
    describe this (decode) engine and its side channel; ``block_ids`` hold one
    list per KV-cache group; ``request_id`` is this engine's id of the request
    (named in the prefill ranks' WRITTEN notifications). Returns the prefill engine's accept. Raises
    :class:`~kvbridge.handshake.RequestRejected` when it refuses the offer (the
    message says why), :class:`~kvbridge.handshake.HandshakeTimeout` /
    :class:`~kvbridge.handshake.PeerUnreachable` when it does not answer, and
    :class:`~kvbridge.handshake.AuthenticationFailed` for an unauthenticated reply
    to a keyed offer. Every wait is bounded as in
    :func:`~kvbridge.handshake.fetch_metadata`.
    """
    key = auth.normalize_key(auth_key)
    fields = dict(protocol_version=wire.PROTOCOL_VERSION, transfer_id=transfer_id,
                  engine_id=engine_id, host=address[0], port=int(address[1]), tp_size=tp_size,
                  block_size=block_size, block_ids=[[int(b) for b in g] for g in block_ids],
                  token=token, computed_tokens=computed_tokens, incarnation=incarnation,
                  request_id=request_id)

    def make() -> wire.PushOffer:
        offer = wire.PushOffer(nonce=int.from_bytes(os.urandom(8), "little") >> 1,
                               sent_ms=auth.now_ms() if key is not None else 0, **fields)
        if key is not None:
            offer = msgspec.structs.replace(offer, auth=offers.offer_mac(key, offer))
        return offer

    try:  # field bounds are checked (as the server will) before anything is sent
        msgspec.msgpack.decode(wire.encode(make()), type=wire.PushOffer)
    except (msgspec.ValidationError, TypeError) as exc:
        raise ValueError(f"invalid push offer: {exc}") from None
    frames, offer = request_reply(host, port, make, timeout=timeout, retries=retries,
                                  context=context, what=f"push offer {transfer_id!r}")
    try:
        msg = wire.MESSAGE_DECODER.decode(frames[0]) if len(frames) == 1 else None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedReply(f"undecodable reply to a push offer from {host}:{port}: {exc}") from None
    if isinstance(msg, wire.ErrorReply):
        raise RequestRejected(f"{host}:{port} refused push offer {transfer_id!r} "
                              f"({msg.code}): {msg.message}")
    if not isinstance(msg, wire.PushAccept) or msg.nonce != offer.nonce or msg.transfer_id != transfer_id:
        raise MalformedReply(f"{host}:{port} did not answer push offer {transfer_id!r} with its accept")
    if key is not None and not (msg.auth and auth.macs_equal(
            offers.accept_mac(key, offer.auth, msgspec.structs.replace(msg, auth=b"")), msg.auth)):
        raise AuthenticationFailed(f"the accept from {host}:{port} is not authenticated with this "
                                   "engine's key; " + auth.HOW_TO_SET)
    return msg
