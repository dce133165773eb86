"""A seeded fault injector for soak runs: when faults happen, and the hostile traffic itself.

:func:`schedule` decides, from a seed, which faults happen at which wave of
requests (every kind at least once). The destructive faults (signals to
engine processes) are carried out by the soak driver through the harness
(:meth:`kvbridge.tools.harness.EngineGroup.signal`); this module sends
the hostile traffic: garbage to a metadata server (:func:`garbage_side_channel`)
and forged NIXL notifications from an agent of its own (:func:`forge_notifications`).
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable, Sequence

import msgspec
import zmq

from kvbridge.handshake import fetch_metadata
from kvbridge.nixl import AgentConfig, Kind, NixlAgent, Notification, encode_notification, new_token

KILL_PREFILL_RANK = "kill-prefill-rank"  # SIGKILL one prefill process right after a wave is posted
FREEZE_PREFILL_RANK = "freeze-prefill-rank"  # SIGSTOP one, longer than the transfer timeout
RESTART_PREFILL = "restart-prefill"  # the whole prefill engine replaced by a new incarnation
KILL_DECODE_RANK = "kill-decode-rank"  # SIGKILL one decode process (the engine then restarts)
HOSTILE_SIDE_CHANNEL = "hostile-side-channel"  # garbage to the metadata port
FORGED_NOTIFICATIONS = "forged-notifications"  # wrong tokens / unknown ids from a stranger agent
KINDS = (KILL_PREFILL_RANK, FREEZE_PREFILL_RANK, RESTART_PREFILL, KILL_DECODE_RANK,
         HOSTILE_SIDE_CHANNEL, FORGED_NOTIFICATIONS)


def schedule(seed: int, waves: int, per_kind: dict[str, int], *, first: int = 1,
             windows: dict[str, tuple[int, int]] | None = None) -> dict[int, list[str]]:
    """Waves (index -> fault kinds) at which each kind strikes ``per_kind[kind]`` times.

    Waves are drawn uniformly from ``[first, waves)``, or from ``windows[kind]``
    (a half-open wave range) for the kinds named there; one wave gets at most
    one fault, so counts above the free waves are cut. Deterministic in ``seed``.
    """
    rng = random.Random(seed)
    windows = windows or {}
    taken: dict[int, list[str]] = {}
    for kind in KINDS:
        lo, hi = windows.get(kind, (first, waves))
        lo, hi = max(lo, first), min(hi, waves)
        free = [w for w in range(lo, hi) if w not in taken]
        for w in rng.sample(free, min(per_kind.get(kind, 0), len(free))):
            taken[w] = [kind]
    return dict(sorted(taken.items()))


def garbage_side_channel(host: str, port: int, rng: random.Random, messages: int = 40,
                         context: zmq.Context | None = None) -> int:
    """Send ``messages`` malformed messages to the metadata server at ``host:port``: random
    bytes, empty and many-frame messages, msgpack of the wrong shape, requests with absurd
    fields, and plain TCP garbage that is not ZMQ at all. Nothing waits for an answer.
    Returns the number of messages sent."""
    ctx = context or zmq.Context.instance()
    endpoint = f"tcp://{host}:{port}"
    shapes = [
        lambda: [rng.randbytes(rng.randint(1, 512))],
        lambda: [b""],
        lambda: [rng.randbytes(8) for _ in range(rng.randint(2, 40))],
        lambda: [msgspec.msgpack.encode({"kind": "metadata-request", "protocol_version": 1,
                                         "ranks": [rng.randint(-5, 1 << 40)], "engine_id": 7})],
        lambda: [msgspec.msgpack.encode({"kind": "metadata-request", "protocol_version": 99,
                                         "ranks": list(range(10000))})],
        lambda: [msgspec.msgpack.encode([1, 2, {"kind": None}])],
        lambda: [msgspec.msgpack.encode({"kind": "metadata-reply", "metadata": [b"\x00" * 64]})],
        lambda: [b"\xc1" * rng.randint(1, 64)],  # bytes msgpack never uses
    ]
    sent = 0
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 200)
    try:
        sock.connect(endpoint)
        for _ in range(messages - messages // 8):
            frames = rng.choice(shapes)()
            sock.send_multipart([b"", *frames] if rng.random() < 0.5 else frames)
            sent += 1
    finally:
        sock.close()
    for _ in range(messages // 8):  # not even ZMQ: a raw connection writing noise
        try:
            with socket.create_connection((host, port), timeout=1.0) as raw:
                raw.sendall(rng.randbytes(rng.randint(1, 256)))
                sent += 1
        except OSError:
            pass
    return sent


def forge_notifications(host: str, port: int, ranks: Sequence[int], engine_id: str,
                        compat_hash: str, in_flight: Sequence[str], rng: random.Random,
                        kind: Kind = Kind.DONE, sender_tp: int = 1,
                        delivered: Callable[[dict[int, int]], bool] | None = None,
                        wait_s: float = 10.0) -> dict[int, int]:
    """From a NIXL agent of its own, send each rank of the engine at ``host:port`` forged
    notifications: ``kind`` messages for the request ids ``in_flight`` with wrong tokens,
    for request ids nobody holds, renewals with wrong tokens, and malformed bytes.

    The stranger learns the ranks' agents from the side channel as any peer can (no
    authentication yet). A notification has no completion to wait for, and closing the
    agent cancels the ones not sent yet, so the agent stays and progresses until
    ``delivered(sent)`` says they arrived (at most ``wait_s``; without ``delivered``, for
    100 ms). Returns the number of messages sent to each rank.
    """
    infos = fetch_metadata(host, port, list(ranks), engine_id=engine_id, compat_hash=compat_hash,
                           timeout=2.0, retries=1)
    sent: dict[int, int] = {}
    with NixlAgent(f"stranger-{new_token()[:8]}", AgentConfig(num_threads=1)) as agent:
        for r in ranks:
            peer = agent.add_remote(infos[r].agent_metadata)
            msgs = [encode_notification(Notification(kind, rid, sender_tp, rng.randrange(sender_tp),
                                                     new_token())) for rid in in_flight]
            msgs += [encode_notification(Notification(kind, f"nobody-{rng.randrange(1 << 30)}",
                                                      sender_tp, 0, new_token())) for _ in range(3)]
            msgs += [encode_notification(Notification(Kind.RENEW, rid, sender_tp, 0, new_token()))
                     for rid in in_flight[:2]]
            msgs += [b"kvb1|D|x|y|z", rng.randbytes(32), b"kvb1|" + b"A" * 2000]
            for m in msgs:
                agent.notify(peer, m)
            sent[r] = len(msgs)
        deadline = time.monotonic() + (wait_s if delivered else 0.1)
        while time.monotonic() < deadline:
            for _ in range(4):
                agent.progress()
                time.sleep(0.005)
            if delivered and delivered(sent):
                break
    return sent
