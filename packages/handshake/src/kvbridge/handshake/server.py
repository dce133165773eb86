"""The side-channel server: one ZMQ ROUTER socket serving one engine's ranks."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping

import msgspec
import zmq

from . import auth, offers, wire
from .errors import HandshakeError, InvalidMetadata
from .metadata import AgentMetadata, check_metadata, decode_metadata, encode_metadata

log = logging.getLogger(__name__)

#: frames kept of one incoming message (identity, REQ delimiter, body, one extra to detect excess)
_MAX_FRAMES = 4
#: longest peer-controlled text echoed back in an error message
_ECHO = 120
#: poll interval of the serving thread; close() also wakes it at once
_POLL_MS = 500
_JOIN_TIMEOUT_S = 10.0
#: a new connection must complete the ZMTP greeting within this (ms)
_HANDSHAKE_IVL_MS = 5000
#: messages one connection may have queued at the server (a REQ client sends one at a time)
_RCV_HWM = 8
#: pending connections the kernel keeps for the server (capped by net.core.somaxconn)
_BACKLOG = 4096


class ServerStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters of a :class:`MetadataServer` (a snapshot)."""

    requests_served: int
    errors: dict[str, int]
    dropped: int
    ranks_served: int

    @property
    def total_errors(self) -> int:
        return sum(self.errors.values())


def tcp_endpoint(host: str, port: int | str) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def _short(text: object) -> str:
    s = str(text)
    return s if len(s) <= _ECHO else s[:_ECHO] + "..."


class MetadataServer:
    """Serves the :class:`AgentMetadata` of the local ranks of one engine.

    Each rank's metadata is given either as an :class:`AgentMetadata` (checked,
    then encoded once) or as the bytes :func:`encode_metadata` made of it
    (decoded and checked once, then served exactly as given): a caller that
    already holds the encoded form never has it decoded, re-encoded and
    copied again.

    Binds one ROUTER socket on ``host``:``port`` in the constructor (``port=0``
    picks a free port; read :attr:`port`), answers requests from any number of
    clients on a background thread, and stops in :meth:`close` (or on leaving a
    ``with`` block) without leaking sockets or threads.

    Whatever a peer sends (empty or extra frames, random bytes, truncated or
    mistyped msgpack, oversized frames, unknown ranks), the server answers with
    an :class:`~kvbridge.handshake.wire.ErrorReply` or drops the message and
    serves the next one. Incoming frames above ``max_frame_bytes`` are refused
    by ZMQ itself (``MAXMSGSIZE``, the peer is disconnected) and the total of a
    multi-frame message is checked again here.
    """

    def __init__(
        self,
        metadata: Mapping[int, AgentMetadata | bytes],
        *,
        compat_hash: str,
        host: str = "127.0.0.1",
        port: int = 0,
        max_frame_bytes: int = 1 << 16,
        compat_info: Mapping[str, str] | None = None,
        auth_key: str | bytes | None = None,
        replay_window_s: float = auth.DEFAULT_REPLAY_WINDOW_S,
        on_offer: offers.OfferHandler | None = None,
    ) -> None:
        if not isinstance(compat_hash, str) or not compat_hash:
            raise InvalidMetadata("compat_hash must be a non-empty string (see compatibility_hash)")
        if not isinstance(max_frame_bytes, int) or max_frame_bytes < 256:
            raise InvalidMetadata(f"max_frame_bytes must be an integer >= 256, got {max_frame_bytes!r}")
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise InvalidMetadata(f"port must be in 0..65535 (0 picks a free one), got {port!r}")
        try:
            self._key = auth.normalize_key(auth_key)
            self._replay = auth.ReplayGuard(replay_window_s)
        except ValueError as exc:
            raise InvalidMetadata(str(exc)) from None
        self._compat_hash = compat_hash
        #: push mode: takes a decode engine's offer (see kvbridge.handshake.offers)
        self.on_offer = on_offer
        self._compat_info = {str(k): str(v) for k, v in (compat_info or {}).items()}
        self._max_frame_bytes = max_frame_bytes
        self._lock = threading.Lock()
        self._metadata: dict[int, AgentMetadata] = {}
        self._encoded: dict[int, bytes] = {}
        for rank, md in dict(metadata).items():
            self._install(rank, md)
        if not self._metadata:
            raise InvalidMetadata("a MetadataServer needs the metadata of at least one rank")

        self._served = 0
        self._dropped = 0
        self._errors: Counter[str] = Counter()
        self._closed = False
        self._host = host

        self._ctx = zmq.Context(io_threads=1)
        router = wake_rx = wake_tx = None
        try:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
            # bounded work per stranger: a connection that has not finished the ZMTP greeting
            # in a few seconds is dropped (libzmq's default keeps it, and its fd, for 30 s), and
            # each connection may queue only a few messages here (the rest waits in its TCP
            # window), so a flood costs at most _RCV_HWM * max_frame_bytes per connection
            router.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_IVL_MS)
            router.setsockopt(zmq.RCVHWM, _RCV_HWM)
            # libzmq's listen backlog is 100: a connection flood overflows it and a valid
            # client's SYN is dropped, to be retried by TCP one second later
            router.setsockopt(zmq.BACKLOG, _BACKLOG)
            # a ZAP domain makes libzmq refuse ZMTP 1.0/2.0 peers at the greeting: random bytes
            # otherwise pass as an unversioned ZMTP 1.0 peer, a path on which libzmq 4.3.5
            # aborted the process under a connection flood here (zmtp_engine.cpp:422, EAGAIN).
            # Without a ZAP handler bound, NULL-mechanism peers (every kvbridge client) pass.
            router.setsockopt(zmq.ZAP_DOMAIN, b"kvbridge-side-channel")
            if ":" in host:
                router.setsockopt(zmq.IPV6, 1)
            try:
                router.bind(tcp_endpoint(host, "*" if port == 0 else port))
            except zmq.ZMQError as exc:
                raise HandshakeError(
                    f"cannot bind the side channel on {tcp_endpoint(host, port)}: {exc}; another "
                    f"engine may hold this port (give each engine and data-parallel replica its own "
                    f"side_channel_port) or the host is not a local address"
                ) from exc
            endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._port = int(endpoint.rsplit(":", 1)[1])
            wake_rx = self._ctx.socket(zmq.PAIR)
            wake_rx.setsockopt(zmq.LINGER, 0)
            wake_rx.bind("inproc://wake")
            wake_tx = self._ctx.socket(zmq.PAIR)
            wake_tx.setsockopt(zmq.LINGER, 0)
            wake_tx.connect("inproc://wake")
        except BaseException:
            for s in (router, wake_rx, wake_tx):
                if s is not None:
                    s.close(linger=0)
            self._ctx.term()
            raise
        self._router = router
        self._wake_rx = wake_rx
        self._wake_tx = wake_tx
        self._thread = threading.Thread(
            target=self._serve, name=f"kvbridge-handshake:{self._port}", daemon=True
        )
        self._thread.start()

    # ----- public API ------------------------------------------------------
    @property
    def port(self) -> int:
        """The TCP port actually bound."""
        return self._port

    @property
    def host(self) -> str:
        return self._host

    @property
    def address(self) -> str:
        """``tcp://host:port`` of the socket."""
        return tcp_endpoint(self._host, self._port)

    @property
    def compat_hash(self) -> str:
        return self._compat_hash

    @property
    def engine_id(self) -> str:
        return next(iter(self._metadata.values())).engine_id

    @property
    def incarnation(self) -> str:
        """The incarnation of the engine served (the same for every rank)."""
        return next(iter(self._metadata.values())).incarnation

    @property
    def ranks(self) -> list[int]:
        """The ranks served, ascending."""
        return sorted(self._metadata)

    @property
    def authenticated(self) -> bool:
        """Whether this server requires authenticated requests (it has an ``auth_key``)."""
        return self._key is not None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stats(self) -> ServerStats:
        with self._lock:
            return ServerStats(
                requests_served=self._served,
                errors=dict(self._errors),
                dropped=self._dropped,
                ranks_served=len(self._metadata),
            )

    def set_metadata(self, rank: int, md: AgentMetadata | bytes) -> None:
        """Add or replace the metadata of ``rank`` (same engine, TP size and incarnation);
        ``md`` may be the encoded bytes (see the class docstring)."""
        if self._closed:
            raise HandshakeError("set_metadata on a closed MetadataServer")
        self._install(rank, md)

    def close(self) -> None:
        """Stop the serving thread and close the socket (idempotent, bounded)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the thread also polls self._closed
        self._thread.join(_JOIN_TIMEOUT_S)
        self._wake_tx.close(linger=0)
        if self._thread.is_alive():  # pragma: no cover - would need a wedged libzmq
            log.error("kvbridge handshake server thread on port %d did not stop", self._port)
            return
        self._ctx.term()

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "serving"
        return f"MetadataServer({self.address}, engine={self.engine_id!r}, ranks={self.ranks}, {state})"

    # ----- metadata --------------------------------------------------------
    def _install(self, rank: int, md: AgentMetadata | bytes) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise InvalidMetadata(f"ranks must be non-negative integers, got {rank!r}")
        encoded: bytes | None = None
        if isinstance(md, (bytes, bytearray, memoryview)):
            encoded = bytes(md)
            try:
                md = decode_metadata(encoded)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise InvalidMetadata(
                    f"the encoded metadata of rank {rank} does not decode: {exc}; pass the bytes "
                    f"encode_metadata() made of an AgentMetadata"
                ) from None
        check_metadata(md)
        if md.rank != rank:
            raise InvalidMetadata(f"metadata filed under rank {rank} says rank {md.rank}")
        with self._lock:
            others = [m for r, m in self._metadata.items() if r != rank]
            if others:
                ref = others[0]
                for name in ("engine_id", "incarnation", "tp_size", "engine"):
                    if getattr(md, name) != getattr(ref, name):
                        raise InvalidMetadata(
                            f"rank {rank} has {name}={_short(getattr(md, name))!s} but rank "
                            f"{ref.rank} has {_short(getattr(ref, name))!s}; one server serves the "
                            f"ranks of one engine incarnation"
                        )
            if encoded is None:
                encoded = encode_metadata(md)
            # copy-on-write so the serving thread always sees consistent dicts
            self._metadata = {**self._metadata, rank: md}
            self._encoded = {**self._encoded, rank: encoded}

    # ----- serving thread --------------------------------------------------
    def _serve(self) -> None:
        router, wake = self._router, self._wake_rx
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while not self._closed:
                try:
                    events = dict(poller.poll(_POLL_MS))
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.ETERM:
                        break
                    self._count_error(wire.INTERNAL)
                    continue
                if wake in events or self._closed:
                    break
                if router in events:
                    self._drain(router)
        except Exception:  # noqa: BLE001 - nothing may escape the thread
            log.exception("kvbridge handshake server loop failed")
        finally:
            router.close(linger=0)
            wake.close(linger=0)

    def _drain(self, router: zmq.Socket) -> None:
        for _ in range(256):  # bounded batch, then re-check the wake socket
            try:
                frames, total, excess = self._recv_bounded(router)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    raise
                self._count_error(wire.INTERNAL)
                return
            try:
                self._handle(router, frames, total, excess)
            except Exception:  # noqa: BLE001 - never let one message stop the server
                log.exception("kvbridge handshake: failed to handle a message")
                self._count_error(wire.INTERNAL)

    @staticmethod
    def _recv_bounded(sock: zmq.Socket) -> tuple[list[bytes], int, bool]:
        frames: list[bytes] = []
        total = 0
        excess = False
        flags = zmq.NOBLOCK
        while True:
            frame = sock.recv(flags)
            flags = 0  # the remaining parts of a message are already here
            total += len(frame)
            if len(frames) < _MAX_FRAMES:
                frames.append(frame)
            else:
                excess = True
            if not sock.getsockopt(zmq.RCVMORE):
                return frames, total, excess

    def _handle(self, router: zmq.Socket, frames: list[bytes], total: int, excess: bool) -> None:
        identity = frames[0]
        rest = frames[1:]
        if rest and rest[0] == b"":  # REQ envelope delimiter
            prefix = [identity, b""]
            body = rest[1:]
        else:  # a DEALER without a delimiter
            prefix = [identity]
            body = rest
        if total - len(identity) > self._max_frame_bytes:
            return self._error(router, prefix, wire.TOO_LARGE,
                               f"message of {total - len(identity)} bytes exceeds the server limit "
                               f"of {self._max_frame_bytes}")
        if excess or len(body) != 1:
            n = "more than 2" if excess else str(len(body))
            return self._error(router, prefix, wire.BAD_REQUEST,
                               f"expected exactly one message frame, got {n}; use a REQ socket or "
                               f"a DEALER sending [b'', request]")
        try:
            msg = wire.MESSAGE_DECODER.decode(body[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._error(router, prefix, wire.BAD_REQUEST,
                               f"could not decode a request: {_short(exc)}")
        if isinstance(msg, wire.PushOffer):
            refused = offers.check_offer(msg, self._key, self._replay)
            if refused is not None:
                return self._error(router, prefix, *refused, msg.nonce)
            self._send(router, prefix, wire.encode(offers.answer_offer(msg, self.on_offer, self._key)))
            return None
        if not isinstance(msg, wire.MetadataRequest):
            return self._error(router, prefix, wire.BAD_REQUEST,
                               f"expected a metadata-request, got a {type(msg).__name__}")
        nonce = msg.nonce
        if msg.protocol_version < 1:
            return self._error(router, prefix, wire.BAD_REQUEST,
                               f"protocol_version must be >= 1, got {msg.protocol_version}",
                               nonce)
        if self._key is not None:
            refused = self._authenticate(msg)
            if refused is not None:
                return self._error(router, prefix, *refused, nonce)
        encoded = self._encoded
        engine_id = self.engine_id
        if msg.engine_id is not None and msg.engine_id != engine_id:
            return self._error(router, prefix, wire.WRONG_ENGINE,
                               f"this side channel serves engine {engine_id!r}, not "
                               f"{_short(msg.engine_id)!r}", nonce)
        missing = [r for r in msg.ranks if r not in encoded]
        if missing:
            return self._error(router, prefix, wire.UNKNOWN_RANK,
                               f"ranks {_short(missing)} are not served here; this side channel "
                               f"serves ranks {sorted(encoded)} of engine {engine_id!r}", nonce)
        bodies = [encoded[r] for r in msg.ranks]
        mac = b""
        if self._key is not None:
            mac = auth.reply_mac(self._key, msg.auth, wire.PROTOCOL_VERSION, self._compat_hash,
                                 engine_id, msg.ranks, bodies, nonce, self._compat_info)
        reply = wire.MetadataReply(
            protocol_version=wire.PROTOCOL_VERSION,
            compat_hash=self._compat_hash,
            engine_id=engine_id,
            ranks=list(msg.ranks),
            metadata=bodies,
            nonce=nonce,
            compat_info=self._compat_info,
            auth=mac,
        )
        if self._send(router, prefix, wire.encode(reply)):
            with self._lock:
                self._served += 1

    def _authenticate(self, msg: wire.MetadataRequest) -> tuple[str, str] | None:
        """(code, message) refusing ``msg``, or None when it is authentic and fresh.

        Checked in order of cost: present, within the time window, the MAC
        (constant time), then the nonce (only authentic requests are remembered).
        The messages name nothing of this engine.
        """
        key = self._key
        if key is None:
            return None
        if not msg.auth:
            return (wire.AUTH_REQUIRED, "this side channel only answers authenticated requests; "
                    + auth.HOW_TO_SET)
        now = auth.now_ms()
        late = self._replay.time_problem(msg.sent_ms, now)
        if late is not None:
            return wire.AUTH_FAILED, late
        want = auth.request_mac(key, msg.protocol_version, msg.ranks, msg.engine_id, msg.nonce,
                                msg.sent_ms)
        if not auth.macs_equal(want, msg.auth):
            return (wire.AUTH_FAILED, "the request's authentication does not match this "
                    "server's key; " + auth.HOW_TO_SET)
        replayed = self._replay.admit(msg.nonce, now)
        if replayed is not None:
            return wire.AUTH_FAILED, replayed
        return None

    def _error(self, router: zmq.Socket, prefix: list[bytes], code: str, message: str,
               nonce: int = 0) -> None:
        self._count_error(code)
        reply = wire.ErrorReply(protocol_version=wire.PROTOCOL_VERSION, code=code,
                                message=message, nonce=nonce)
        self._send(router, prefix, wire.encode(reply))

    def _send(self, router: zmq.Socket, prefix: list[bytes], payload: bytes) -> bool:
        try:
            router.send_multipart([*prefix, payload], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:  # peer gone or its queue full: ROUTER drops
            with self._lock:
                self._dropped += 1
            return False

    def _count_error(self, code: str) -> None:
        with self._lock:
            self._errors[code] += 1
