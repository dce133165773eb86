"""Handshake round trip and metadata size, against a raw-ZMQ baseline measured in the same run.

The server runs in a separate process (as a prefill engine would). For an
80-layer model with K/V split (160 regions) at TP 8 it prints:

* encoded size of one rank's AgentMetadata and of 1- and 8-rank replies;
* fetch_metadata round trip p50/p99 for 1 rank and 8 ranks (private ZMQ
  context per call, the default, and a reused one);
* the baseline: a raw ZMQ REQ round trip on a connected socket carrying
  the same reply bytes with no encoding or validation (the transport floor),
  and a fresh REQ socket per request (what a one-shot handshake pays at least).

Usage: uv run python bench/bench_handshake.py [--iters N]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import msgspec
import zmq

from kvbridge.handshake import (
    AgentMetadata,
    EngineFacts,
    MetadataServer,
    compatibility_hash,
    encode_metadata,
    fetch_metadata,
    new_incarnation,
    wire,
)
from kvbridge.topology import EngineSpec, element_layout

TP = 8
LAYERS = 80
HASH = compatibility_hash(model="meta-llama/Llama-3.1-70B", dtype="bf16", cache_dtype="bf16",
                          layout="kv-first", attention_backend="FLASH_ATTN")


def agent_metadata_blob(regions: int) -> tuple[bytes, str]:
    """Real NIXL agent metadata with `regions` registered host regions when NIXL is here."""
    try:
        import numpy as np
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception:  # noqa: BLE001 - the bench also runs without NIXL
        return os.urandom(4096), "synthetic 4096 B (nixl not importable)"
    agent = nixl_agent("bench-handshake", nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(regions * 4096, dtype=np.uint8)
    base = buf.ctypes.data
    descs = agent.get_reg_descs([(base + i * 4096, 4096, 0, "") for i in range(regions)], "DRAM")
    agent.register_memory(descs)
    blob = agent.get_agent_metadata()
    agent.deregister_memory(descs)
    return bytes(blob), f"real NIXL agent metadata, {regions} DRAM regions registered"


def build_metadata(blob: bytes) -> dict[int, AgentMetadata]:
    spec = EngineSpec(engine_id="prefill-70b", tp_size=TP, num_kv_heads=8, head_dim=128,
                      num_layers=LAYERS, block_size=16)
    lay = element_layout(spec)
    num_blocks = 20_000
    inc = new_incarnation()
    out = {}
    for r in range(TP):
        size = num_blocks * lay.region_block_bytes
        base = 0x7F00_0000_0000 + r * (1 << 40)
        out[r] = AgentMetadata(
            engine_id=spec.engine_id, incarnation=inc, rank=r, tp_size=TP,
            agent_name=f"prefill-70b-{r}-{inc[:8]}", agent_metadata=blob, memory_type="VRAM",
            device_id=r, region_base_addrs=[base + i * size for i in range(lay.regions)],
            region_sizes=[size] * lay.regions, num_blocks=num_blocks,
            block_lens=[lay.region_block_bytes] * lay.regions, block_size=spec.block_size,
            kernel_blocks_per_block=1, layout="kv-first", head_order="HND",
            attention_backend="FLASH_ATTN", engine=EngineFacts.from_spec(spec))
    return out


def serve(blob: bytes, conn, stop) -> None:
    """Child process: the metadata server and two raw echo servers for the baselines."""
    mds = build_metadata(blob)
    replies = {n: wire.encode(wire.MetadataReply(
        protocol_version=wire.PROTOCOL_VERSION, compat_hash=HASH, engine_id="prefill-70b",
        ranks=list(range(n)), metadata=[encode_metadata(mds[r]) for r in range(n)]))
        for n in (1, TP)}
    ctx = zmq.Context()
    raw = ctx.socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    raw_port = raw.bind_to_random_port("tcp://127.0.0.1")
    with MetadataServer(mds, compat_hash=HASH) as server:
        conn.send((server.port, raw_port))
        while not stop.is_set():
            if raw.poll(50, zmq.POLLIN):
                ident, empty, body = raw.recv_multipart()
                raw.send_multipart([ident, empty, replies[int(body)]])
    raw.close(0)
    ctx.term()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def timed(fn, iters: int) -> list[float]:
    for _ in range(max(5, iters // 20)):
        fn()  # warm up
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=400)
    args = ap.parse_args()

    blob, blob_note = agent_metadata_blob(2 * LAYERS)
    mds = build_metadata(blob)
    one = encode_metadata(mds[0])
    reply1 = wire.encode(wire.MetadataReply(protocol_version=1, compat_hash=HASH,
                                            engine_id="prefill-70b", ranks=[0], metadata=[one]))
    reply8 = wire.encode(wire.MetadataReply(protocol_version=1, compat_hash=HASH,
                                            engine_id="prefill-70b", ranks=list(range(TP)),
                                            metadata=[encode_metadata(mds[r]) for r in range(TP)]))
    without_agent = msgspec.structs.replace(mds[0], agent_metadata=b"x")
    print(f"model: {LAYERS} layers, K/V split -> {len(mds[0].region_base_addrs)} regions, TP {TP}")
    print(f"agent metadata: {len(blob)} B ({blob_note})")
    print(f"encoded AgentMetadata, one rank: {len(one)} B "
          f"({len(encode_metadata(without_agent)) - 1} B without the NIXL agent blob)")
    print(f"reply envelope: 1 rank {len(reply1)} B, {TP} ranks {len(reply8)} B")

    # decode + validate cost alone (no network), the client's CPU work per reply
    from kvbridge.handshake.client import _validate

    t_dec1 = timed(lambda: _validate([reply1], "x", [0], None, HASH, 0), args.iters)
    t_dec8 = timed(lambda: _validate([reply8], "x", list(range(TP)), None, HASH, 0), args.iters)

    mpc = mp.get_context("spawn")
    parent, child = mpc.Pipe()
    stop = mpc.Event()
    proc = mpc.Process(target=serve, args=(blob, child, stop), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise SystemExit("server process did not start")
        port, raw_port = parent.recv()
        shared = zmq.Context()
        rows = []
        for n in (1, TP):
            ranks = list(range(n))
            rows.append((f"fetch_metadata, {n} rank(s), private context",
                         timed(lambda r=ranks: fetch_metadata("127.0.0.1", port, r,
                                                             compat_hash=HASH), args.iters)))
            rows.append((f"fetch_metadata, {n} rank(s), reused context",
                         timed(lambda r=ranks: fetch_metadata("127.0.0.1", port, r,
                                                             compat_hash=HASH, context=shared),
                               args.iters)))
            # baseline 1: fresh REQ socket per request, same bytes, no msgspec
            def fresh(n=n):
                s = shared.socket(zmq.REQ)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"tcp://127.0.0.1:{raw_port}")
                s.send(str(n).encode())
                s.recv()
                s.close(0)
            rows.append((f"baseline: raw fresh REQ, same {n}-rank bytes", timed(fresh, args.iters)))
            # baseline 2: connected REQ socket (transport floor)
            s = shared.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{raw_port}")
            def conn(n=n, s=s):
                s.send(str(n).encode())
                s.recv()
            rows.append((f"baseline: raw connected REQ, same {n}-rank bytes", timed(conn, args.iters)))
            s.close(0)
        shared.term()
    finally:
        stop.set()
        proc.join(10)

    print(f"\nround trips on 127.0.0.1, server in another process, {args.iters} iterations "
          f"(µs; 2 shared cores here, expect noise):")
    print(f"{'':58s} {'p50':>8s} {'p99':>8s} {'mean':>8s}")
    for name, xs in rows:
        print(f"{name:58s} {pct(xs, .5):8.0f} {pct(xs, .99):8.0f} {statistics.fmean(xs):8.0f}")
    for name, xs in (("client decode+validate only, 1 rank", t_dec1),
                     (f"client decode+validate only, {TP} ranks", t_dec8)):
        print(f"{name:58s} {pct(xs, .5):8.0f} {pct(xs, .99):8.0f} {statistics.fmean(xs):8.0f}")


if __name__ == "__main__":
    main()
