"""Rank metadata and the ZMQ side channel the engine uses to exchange it.

This is the engine's own narrow view of a handshake: :class:`RankInfo` is what
a peer rank must tell us (its engine description, NIXL agent metadata, cache
addresses and an incarnation id that changes on restart). It is served by
:class:`MetadataServer` and fetched with :func:`fetch_rank_info`.

Untrusted input: replies are decoded with msgspec into typed structs (never
unpickled), size-bounded, and every wait is bounded by a timeout.
"""

from __future__ import annotations

import threading
import time

import msgspec
import zmq
from kvbridge.topology import EngineSpec

PROTOCOL = 1
MAX_REPLY_BYTES = 16 << 20


class HandshakeFailed(RuntimeError):
    """Fetching a peer's metadata failed (timeout, refusal, malformed or incompatible reply)."""


class RankInfo(msgspec.Struct, frozen=True):
    """What one rank tells its peers about itself."""

    protocol: int
    engine_id: str
    incarnation: str
    rank: int
    spec: EngineSpec
    agent_name: str
    agent_metadata: bytes
    region_bases: tuple[int, ...]
    num_blocks: int
    block_bytes: int
    device: int = 0
    host: str = "127.0.0.1"
    port: int = 0  # this rank's metadata server (push mode: the prefill side fetches decode ranks)


class _Request(msgspec.Struct, frozen=True):
    protocol: int
    rank: int
    engine_id: str = ""


class _Reply(msgspec.Struct, frozen=True):
    ok: bool
    error: str = ""
    info: RankInfo | None = None


_req_dec = msgspec.msgpack.Decoder(_Request)
_reply_dec = msgspec.msgpack.Decoder(_Reply)
_enc = msgspec.msgpack.Encoder()


class MetadataServer:
    """Serves the :class:`RankInfo` of one or more ranks of an engine on one ZMQ port.

    Runs a ROUTER socket in a daemon thread; malformed requests get an error
    reply, never a crash. ``port=0`` picks a free port (see :attr:`port`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4096)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host, self.port = host, int(port)
        self._infos: dict[int, bytes] = {}
        self._engine_id = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvbridge-metadata", daemon=True)
        self._thread.start()

    def publish(self, info: RankInfo) -> None:
        with self._lock:
            if self._engine_id and info.engine_id != self._engine_id:
                raise ValueError(
                    f"this server serves engine {self._engine_id!r}; cannot publish {info.engine_id!r}"
                )
            self._engine_id = info.engine_id
            self._infos[info.rank] = _enc.encode(_Reply(True, info=info))

    def withdraw(self, rank: int) -> None:
        with self._lock:
            self._infos.pop(rank, None)

    def _answer(self, body: bytes) -> bytes:
        try:
            req = _req_dec.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _enc.encode(_Reply(False, f"malformed request: {exc}"))
        if req.protocol != PROTOCOL:
            return _enc.encode(_Reply(False, f"protocol {req.protocol} unsupported; server speaks {PROTOCOL}"))
        with self._lock:
            if req.engine_id and self._engine_id and req.engine_id != self._engine_id:
                return _enc.encode(_Reply(False, f"this is engine {self._engine_id!r}, not {req.engine_id!r}"))
            reply = self._infos.get(req.rank)
        if reply is None:
            return _enc.encode(_Reply(False, f"rank {req.rank} is not served here"))
        return reply

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(50):
                    continue
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                continue
            if len(frames) < 2:
                continue
            ident, body = frames[0], frames[-1]
            try:
                self._sock.send_multipart([ident, b"", self._answer(body)], zmq.NOBLOCK)
            except zmq.ZMQError:  # the client went away
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        self._ctx.term()


def fetch_rank_info(host: str, port: int, rank: int, timeout_s: float, engine_id: str = "") -> RankInfo:
    """Ask a :class:`MetadataServer` for one rank's info; raises :class:`HandshakeFailed`."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    where = f"{host}:{port} rank {rank}"
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send_multipart([b"", _enc.encode(_Request(PROTOCOL, rank, engine_id))])
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise HandshakeFailed(f"no metadata reply from {where} within {timeout_s:.1f} s")
            frames = sock.recv_multipart()
            if frames:
                break
        try:
            reply = _reply_dec.decode(frames[-1])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HandshakeFailed(f"malformed metadata reply from {where}: {exc}") from exc
        if not reply.ok or reply.info is None:
            raise HandshakeFailed(f"{where} refused: {reply.error or 'no info'}")
        info = reply.info
        if info.rank != rank or (engine_id and info.engine_id != engine_id):
            raise HandshakeFailed(
                f"{where} answered for engine {info.engine_id!r} rank {info.rank}; expected "
                f"{engine_id or 'any'!r} rank {rank}"
            )
        if info.protocol != PROTOCOL:
            raise HandshakeFailed(f"{where} speaks protocol {info.protocol}, expected {PROTOCOL}")
        return info
    except zmq.ZMQError as exc:
        raise HandshakeFailed(f"side channel error with {where}: {exc}") from exc
    finally:
        sock.close(0)
