"""Handshake round trip and metadata size, against a raw-ZMQ baseline measured in the same run.

The server runs in a separate process (as a prefill engine would). For an
80-layer model with K/V split (160 regions) at TP 8 it prints:

* encoded size of one rank's AgentMetadata and of 1- and 8-rank replies;
* fetch_metadata round trip p50/p99 for 1 rank and 8 ranks (private ZMQ
  context per call, the default, and a reused one);
* the baseline: a raw ZMQ REQ round trip on a connected socket carrying
  the same reply bytes with no encoding or validation (the transport floor),
  and a fresh REQ socket per request (what a one-shot handshake pays at least);
* authentication: the same round trips against a server with an ``auth_key``
  (signed request, checked reply) beside the keyless ones, and the CPU cost
  of each authentication step alone;
* limits under load: valid fetch p50/p99 with no flood and while flooder
  processes (``--flooders``, bounded by ``--flood-seconds`` and a message
  budget, 127.0.0.1 only) churn connections, send garbage and unauthenticated
  requests and hold raw TCP connections open, against the keyless and the keyed
  server; the flood's rates and what the server counted are printed beside them.

Usage: uv run python bench/bench_handshake.py [--iters N] [--flooders N] [--flood-seconds S]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import socket
import statistics
import time

import msgspec
import zmq

from kvbridge.handshake import (
    AgentMetadata,
    EngineFacts,
    MetadataServer,
    auth,
    compatibility_hash,
    encode_metadata,
    fetch_metadata,
    new_incarnation,
    wire,
)
from kvbridge.topology import EngineSpec, element_layout

TP = 8
LAYERS = 80
KEY = "bench-handshake-shared-secret-0123456789"
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
    """Child process: the metadata servers (keyless and keyed) and a raw echo server for the
    baselines; answers "stats" on ``conn`` with both servers' counters."""
    mds = build_metadata(blob)
    replies = {n: wire.encode(wire.MetadataReply(
        protocol_version=wire.PROTOCOL_VERSION, compat_hash=HASH, engine_id="prefill-70b",
        ranks=list(range(n)), metadata=[encode_metadata(mds[r]) for r in range(n)]))
        for n in (1, TP)}
    ctx = zmq.Context()
    raw = ctx.socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    raw_port = raw.bind_to_random_port("tcp://127.0.0.1")
    with MetadataServer(mds, compat_hash=HASH) as server, \
            MetadataServer(mds, compat_hash=HASH, auth_key=KEY) as keyed:
        conn.send((server.port, raw_port, keyed.port))
        while not stop.is_set():
            if conn.poll(0):
                conn.recv()
                conn.send({"open": server.stats, "keyed": keyed.stats})
            if raw.poll(20, zmq.POLLIN):
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


# ----------------------------------------------------------------------------- flood
#: most messages (or connections) one flooder sends in one flood, whatever the time left
FLOOD_BUDGET = 400_000
#: raw TCP connections a flooder holds open at once
TCP_HELD = 200


def _garbage(rng: random.Random) -> bytes:
    """One hostile request body: random bytes, truncated or mistyped msgpack, an unsigned or
    wrongly signed request, or a request for ranks nobody serves."""
    pick = rng.randrange(6)
    if pick == 0:
        return rng.randbytes(rng.randrange(1, 512))
    if pick == 1:
        return wire.encode(wire.MetadataRequest(protocol_version=1, ranks=[0]))[:rng.randrange(1, 12)]
    if pick == 2:
        return msgspec.msgpack.encode({"kind": "metadata-request", "protocol_version": "x",
                                       "ranks": "all"})
    if pick == 3:
        return wire.encode(wire.MetadataRequest(protocol_version=1, ranks=list(range(64)),
                                                nonce=rng.randrange(1 << 62)))
    if pick == 4:
        return wire.encode(wire.MetadataRequest(protocol_version=1, ranks=[0], nonce=1,
                                                sent_ms=auth.now_ms(), auth=rng.randbytes(32)))
    return wire.encode(wire.MetadataRequest(protocol_version=1, ranks=[4096 + rng.randrange(99)]))


def flooder(kind: str, port: int, seconds: float, seed: int, out) -> None:
    """Child process: flood 127.0.0.1:port for ``seconds`` (and at most FLOOD_BUDGET sends).

    ``churn``: a new DEALER connection per garbage message; ``garbage``: 4 held DEALER
    connections sending garbage as fast as the socket takes it, with now and then a
    frame over the server's size limit (the server drops that connection, ZMQ
    reconnects); ``tcp``: raw TCP connections that send non-ZMTP bytes or nothing at all,
    up to TCP_HELD held open, replaced as they are closed; ``burn``: no traffic, only
    CPU (the control: what the same number of busy processes costs the valid clients).
    """
    rng = random.Random(seed)
    end = time.monotonic() + seconds
    sent = conns = 0
    ctx = zmq.Context()
    try:
        if kind == "churn":
            while time.monotonic() < end and sent < FLOOD_BUDGET:
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"tcp://127.0.0.1:{port}")
                s.send_multipart([b"", _garbage(rng)])
                conns += 1
                sent += 1
                s.poll(1, zmq.POLLIN)  # give the message a moment to leave, then drop it all
                s.close(0)
        elif kind == "garbage":
            socks = []
            for _ in range(4):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 100)
                s.connect(f"tcp://127.0.0.1:{port}")
                socks.append(s)
            conns = len(socks)
            big = rng.randbytes(70_000)
            while time.monotonic() < end and sent < FLOOD_BUDGET:
                s = socks[sent % len(socks)]
                body = big if sent % 997 == 0 else _garbage(rng)
                try:
                    s.send_multipart([b"", body], zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    time.sleep(0.0005)
                while s.poll(0, zmq.POLLIN):  # read replies now and then, like a client would
                    s.recv_multipart()
            for s in socks:
                s.close(0)
        elif kind == "tcp":
            held: list[socket.socket] = []
            while time.monotonic() < end and sent < FLOOD_BUDGET:
                while len(held) < TCP_HELD:
                    c = socket.socket()
                    c.setblocking(False)
                    try:
                        c.connect_ex(("127.0.0.1", port))
                    except OSError:
                        c.close()
                        break
                    held.append(c)
                    conns += 1
                c = held.pop(rng.randrange(len(held)))
                try:
                    if rng.random() < 0.5:
                        c.send(rng.randbytes(rng.randrange(1, 200)))
                        sent += 1
                except OSError:
                    pass
                if rng.random() < 0.5:
                    c.close()
                else:
                    held.append(c)
            for c in held:
                c.close()
        elif kind == "burn":  # the control: as much CPU as a flooder, no traffic
            while time.monotonic() < end:
                sum(range(10_000))
        else:
            raise ValueError(kind)
    finally:
        ctx.term()
    out.send((kind, sent, conns, seconds))


def flood_run(name: str, port: int, key: str | None, server_conn, ctx: zmq.Context, args,
              kinds: tuple[str, ...] = ("churn", "garbage", "tcp")):
    """Valid 1-rank fetches (generous timeout) before and during a flood of ``port``."""
    def fetch():
        fetch_metadata("127.0.0.1", port, [0], compat_hash=HASH, context=ctx, auth_key=key,
                       timeout=10.0, retries=0)

    quiet = timed(fetch, args.iters)
    server_conn.send("stats")
    before = server_conn.recv()
    mpc = mp.get_context("spawn")
    pipes, procs = [], []
    for i in range(args.flooders):
        rx, tx = mpc.Pipe(duplex=False)
        proc = mpc.Process(target=flooder, args=(kinds[i % len(kinds)], port, args.flood_seconds, i, tx),
                           daemon=True)
        proc.start()
        pipes.append(rx)
        procs.append(proc)
    time.sleep(min(1.0, args.flood_seconds / 4))  # let the flood build up (and the children start)
    loud, failures = [], 0
    t_end = time.monotonic() + args.flood_seconds * 0.6
    while time.monotonic() < t_end and len(loud) < args.iters:
        t0 = time.perf_counter()
        try:
            fetch()
            loud.append((time.perf_counter() - t0) * 1e6)
        except Exception:  # noqa: BLE001 - counted and printed
            failures += 1
    results = []
    for rx, proc in zip(pipes, procs, strict=True):
        if rx.poll(args.flood_seconds + 30):
            results.append(rx.recv())
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    server_conn.send("stats")
    after = server_conn.recv()
    return name, quiet, loud, failures, results, before, after


def print_flood(rows, args) -> None:
    print(f"\nlimits under load: valid 1-rank fetch_metadata (reused context, timeout 10 s) "
          f"without and during a flood by {args.flooders} processes for {args.flood_seconds:g} s "
          f"(µs):")
    print(f"{'':58s} {'p50':>8s} {'p99':>8s} {'n':>6s} {'failed':>6s}")
    for name, quiet, loud, failures, results, before, after in rows:
        label = "busy" if "control" in name else "under flood"
        print(f"{'no flood, ' + name:58s} {pct(quiet, .5):8.0f} {pct(quiet, .99):8.0f} "
              f"{len(quiet):6d} {0:6d}")
        if loud:
            print(f"{label + ', ' + name:58s} {pct(loud, .5):8.0f} {pct(loud, .99):8.0f} "
                  f"{len(loud):6d} {failures:6d}")
        else:
            print(f"{label + ', ' + name:58s} {'-':>8s} {'-':>8s} {0:6d} {failures:6d}")
        side = "keyed" if name == "auth_key" else "open"
        b, a = before[side], after[side]
        errs = {k: a.errors.get(k, 0) - b.errors.get(k, 0) for k in a.errors}
        errs = {k: v for k, v in errs.items() if v}
        for kind, sent, conns, secs in results:
            print(f"    flooder {kind:8s}: {sent / secs:9.0f} messages/s, {conns / secs:8.0f} "
                  f"connections/s")
        print(f"    server during the flood: {a.requests_served - b.requests_served} served, "
              f"errors {errs}, {a.dropped - b.dropped} replies dropped")


def auth_cpu_costs(mds: dict[int, AgentMetadata], iters: int) -> list[tuple[str, list[float]]]:
    """CPU cost of each authentication step alone (no network)."""
    key = auth.normalize_key(KEY)
    bodies = [encode_metadata(mds[r]) for r in range(TP)]
    mac = auth.request_mac(key, 1, list(range(TP)), "prefill-70b", 1, auth.now_ms())
    guard = auth.ReplayGuard()
    nonce = iter(range(1 << 60))
    return [
        ("auth: sign or check a request (HMAC-SHA256)",
         timed(lambda: auth.request_mac(key, 1, list(range(TP)), "prefill-70b", 1, 2), iters)),
        ("auth: replay guard admit (one nonce)",
         timed(lambda: guard.admit(next(nonce), auth.now_ms()), iters)),
        ("auth: sign or check a 1-rank reply",
         timed(lambda: auth.reply_mac(key, mac, 1, HASH, "prefill-70b", [0], bodies[:1], 1, {}),
               iters)),
        (f"auth: sign or check a {TP}-rank reply",
         timed(lambda: auth.reply_mac(key, mac, 1, HASH, "prefill-70b", list(range(TP)), bodies,
                                      1, {}), iters)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--flooders", type=int, default=3, help="flooder processes (1..8)")
    ap.add_argument("--flood-seconds", type=float, default=5.0,
                    help="how long each flood runs (0.5..30 s)")
    args = ap.parse_args()
    if not 1 <= args.flooders <= 8 or not 0.5 <= args.flood_seconds <= 30:
        ap.error("--flooders must be 1..8 and --flood-seconds 0.5..30")

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

    req0 = wire.MetadataRequest(protocol_version=1, ranks=[0], nonce=0)
    t_dec1 = timed(lambda: _validate([reply1], "x", [0], None, HASH, req0, None), args.iters)
    t_dec8 = timed(lambda: _validate([reply8], "x", list(range(TP)), None, HASH,
                                     msgspec.structs.replace(req0, ranks=list(range(TP))), None),
                   args.iters)
    auth_rows = auth_cpu_costs(mds, args.iters)

    mpc = mp.get_context("spawn")
    parent, child = mpc.Pipe()
    stop = mpc.Event()
    proc = mpc.Process(target=serve, args=(blob, child, stop), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise SystemExit("server process did not start")
        port, raw_port, keyed_port = parent.recv()
        shared = zmq.Context()
        rows = []
        for n in (1, TP):
            ranks = list(range(n))
            for name, p, key in (("no key", port, None), ("auth_key", keyed_port, KEY)):
                rows.append((f"fetch_metadata, {n} rank(s), reused context, {name}",
                             timed(lambda r=ranks, p=p, key=key: fetch_metadata(
                                 "127.0.0.1", p, r, compat_hash=HASH, context=shared,
                                 auth_key=key), args.iters)))
        for n in (1, TP):
            ranks = list(range(n))
            rows.append((f"fetch_metadata, {n} rank(s), private context",
                         timed(lambda r=ranks: fetch_metadata("127.0.0.1", port, r,
                                                             compat_hash=HASH), args.iters)))
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
        flood_rows = [flood_run("no key, control: busy processes, no traffic", port, None,
                                parent, shared, args, kinds=("burn",))]
        for name, p, key in (("no key", port, None), ("auth_key", keyed_port, KEY)):
            flood_rows.append(flood_run(name, p, key, parent, shared, args))
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
                     (f"client decode+validate only, {TP} ranks", t_dec8), *auth_rows):
        print(f"{name:58s} {pct(xs, .5):8.0f} {pct(xs, .99):8.0f} {statistics.fmean(xs):8.0f}")
    print_flood(flood_rows, args)


if __name__ == "__main__":
    main()
