"""Test helpers: realistic metadata and raw ZMQ peers (imported by the test modules)."""

from __future__ import annotations

import os
import threading

import msgspec
import zmq

from kvbridge.handshake import AgentMetadata, EngineFacts, compatibility_hash, new_incarnation
from kvbridge.topology import EngineSpec, Layout, MambaSpec, element_layout

HASH = compatibility_hash(model="meta-llama/Llama-3.1-8B", dtype="bf16", cache_dtype="bf16",
                          layout="kv-first", attention_backend="FLASH_ATTN")


def make_spec(tp: int = 2, *, engine_id: str = "prefill-0", layers: int = 4,
              **changes: object) -> EngineSpec:
    kw: dict[str, object] = dict(engine_id=engine_id, tp_size=tp, num_kv_heads=16, head_dim=128,
                                 num_layers=layers, block_size=16)
    kw.update(changes)
    return EngineSpec(**kw)  # type: ignore[arg-type]


def make_metadata(spec: EngineSpec, rank: int, *, incarnation: str = "inc-1",
                  num_blocks: int = 64, backend: str = "FLASH_ATTN") -> AgentMetadata:
    lay = element_layout(spec)
    blen = lay.region_block_bytes
    base = 0x7F00_0000_0000 + rank * (1 << 36)
    size = num_blocks * blen
    return AgentMetadata(
        engine_id=spec.engine_id,
        incarnation=incarnation,
        rank=rank,
        tp_size=spec.tp_size,
        agent_name=f"{spec.engine_id}-rank{rank}-{incarnation}",
        agent_metadata=os.urandom(64) + f"agent {rank}".encode(),
        memory_type="DRAM",
        device_id=0,
        region_base_addrs=[base + i * size for i in range(lay.regions)],
        region_sizes=[size] * lay.regions,
        num_blocks=num_blocks,
        block_lens=[blen] * lay.regions,
        block_size=spec.block_size,
        kernel_blocks_per_block=spec.kernel_blocks_per_block,
        layout=Layout(spec.layout).value,
        head_order=spec.head_order.value,
        attention_backend=backend,
        engine=EngineFacts.from_spec(spec),
    )


def engine_metadata(tp: int, ranks: list[int] | None = None, *, incarnation: str | None = None,
                    **spec_changes: object) -> dict[int, AgentMetadata]:
    spec = make_spec(tp, **spec_changes)
    inc = incarnation or new_incarnation()
    return {r: make_metadata(spec, r, incarnation=inc) for r in (ranks if ranks is not None
                                                                 else range(tp))}


def mamba_spec(tp: int = 2) -> EngineSpec:
    return make_spec(tp, engine_id="hybrid", num_kv_heads=8, layout=Layout.BLOCKS_FIRST,
                     mamba=MambaSpec(ssm_heads=64, ssm_head_dim=64, state_size=128, n_groups=8,
                                     conv_width=4))


class RawPeer:
    """A DEALER that talks to a server frame by frame (what a broken or hostile peer does)."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout: float = 2.0) -> list[bytes] | None:
        if self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            return self.sock.recv_multipart()
        return None

    def ask(self, body: bytes, timeout: float = 2.0) -> list[bytes] | None:
        """Send like a REQ socket ([b'', body]) and return the reply frames after the delimiter."""
        self.send([b"", body])
        reply = self.recv(timeout)
        if reply is None:
            return None
        assert reply[0] == b"", reply
        return reply[1:]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FakeServer:
    """A ROUTER that answers every request with a scripted reply body (or not at all).

    ``reply`` maps the decoded request (a dict) to the body bytes, or None to stay silent.
    """

    def __init__(self, reply) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.reply = reply
        self.requests: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.sock.poll(20, zmq.POLLIN):
                    continue
                frames = self.sock.recv_multipart()
                req = msgspec.msgpack.decode(frames[-1])
                self.requests.append(req)
                body = self.reply(req)
                if body is not None:
                    self.sock.send_multipart([*frames[:-1], *([body] if isinstance(body, bytes)
                                                                else body)])
        finally:
            self.sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.ctx.term()

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None




def flood(port: int, kind: str, seconds: float, seed: int, out) -> None:
    """A flooder process (spawn target): hostile traffic to 127.0.0.1:``port`` for ``seconds``,
    at most 200,000 sends. ``zmq``: new and held DEALER connections sending garbage and
    unauthenticated requests; ``tcp``: raw TCP connections sending non-ZMTP bytes or nothing.
    Sends (sent, connections) on ``out``."""
    import random
    import socket
    import time

    rng = random.Random(seed)
    end = time.monotonic() + seconds
    sent = conns = 0
    ctx = zmq.Context(io_threads=1)
    held: list = []
    try:
        while time.monotonic() < end and sent < 200_000:
            if kind == "zmq":
                if len(held) < 4 or rng.random() < 0.05:
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    s.setsockopt(zmq.SNDHWM, 50)
                    s.connect(f"tcp://127.0.0.1:{port}")
                    held.append(s)
                    conns += 1
                    if len(held) > 8:
                        held.pop(0).close(0)
                s = held[rng.randrange(len(held))]
                body = (rng.randbytes(rng.randrange(1, 300)) if rng.random() < 0.5 else
                        msgspec.msgpack.encode({"kind": "metadata-request", "protocol_version": 1,
                                                "ranks": [0], "nonce": rng.randrange(1 << 60),
                                                "sent_ms": int(time.time() * 1000),
                                                "auth": rng.randbytes(32)}))
                try:
                    s.send_multipart([b"", body], zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    time.sleep(0.001)
            else:
                c = socket.socket()
                c.settimeout(1.0)
                try:
                    c.connect(("127.0.0.1", port))
                    conns += 1
                    if rng.random() < 0.5:
                        c.send(rng.randbytes(rng.randrange(1, 200)))
                        sent += 1
                except OSError:
                    pass
                held.append(c)
                if len(held) > 100:
                    held.pop(0).close()
    finally:
        for h in held:
            h.close(0) if kind == "zmq" else h.close()
        ctx.term()
        out.send((sent, conns))
