"""kvbridge's throughput between two namespace hosts, next to raw TCP (iperf3) over the same
link in the same run. A benchmark that prints figures: it asserts that the bytes arrived
right and that both measurements ran, never a speed (run with ``-rP`` or ``-s`` to see them).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time

import pytest
from netns_cluster import NetnsCluster, check_transports, spec_pair, ucx_env

from kvbridge.nixl import AgentConfig, EngineConfig

pytestmark = pytest.mark.timeout(300)

REQUESTS, BLOCKS, ROUNDS = 8, 32, 3  # the demo's batch: 8 requests x 32 blocks, 3 rounds
IPERF_SECONDS = 3


def iperf3_gbps(sender, receiver, streams: int) -> float:
    """Raw TCP from ``sender`` to ``receiver`` for IPERF_SECONDS with ``streams`` streams,
    in GB/s received (iperf3 server on the receiver, client on the sender)."""
    server = receiver.popen("iperf3", "-s", "-1", "-B", receiver.address, "-p", "5201",
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):  # until the server listens
            if receiver.run("ss", "-Hltn", "sport = :5201").stdout.strip():
                break
            time.sleep(0.05)
        out = sender.run("iperf3", "-c", receiver.address, "-p", "5201", "-t", str(IPERF_SECONDS),
                         "-P", str(streams), "-J", timeout=IPERF_SECONDS + 30, check=False)
        report = json.loads(out.stdout or "{}")
        if out.returncode != 0 or "error" in report or "sum_received" not in report.get("end", {}):
            raise AssertionError(f"iperf3 failed ({out.returncode}): {report.get('error')} {out.stderr[-300:]}")
        return report["end"]["sum_received"]["bits_per_second"] / 8e9
    finally:
        server.kill()
        server.wait(10)


def _round(c: NetnsCluster, batch: list[tuple], k: int) -> tuple[float, int]:
    """Move the batch once, every request verified; returns (GB/s from the decode ranks' first
    load() to the last completion, bytes moved)."""
    before = sum(s.bytes for s, _ in c.rank_stats(c.decode).values())
    c.clear_decode([b for *_, db, _ in batch for b in db])
    rb = [(f"r{k}-{rid}", *rest) for rid, *rest in batch]
    c.submit_batch(rb, cleared=True)
    res = c.wait([b[0] for b in rb], timeout=240, released=True)
    for rid, r in res.items():
        assert r.ok and set(r.done) == set(range(c.decode.spec.tp_size)), (rid, r.failed, r.done)
    moved = sum(s.bytes for s, _ in c.rank_stats(c.decode).values()) - before
    t0 = min(t for r in res.values() for t in r.loaded_at.values())
    t1 = max(t for r in res.values() for t in r.done_at.values())
    return moved / max(1e-9, t1 - t0) / 1e9, moved


def test_throughput_against_iperf3(hosts, tmp_path):
    if shutil.which("iperf3") is None:
        pytest.skip("iperf3 is not installed (apt-get install -y iperf3)")
    phost, dhost = hosts
    p, d = spec_pair(prefill_tp=2, decode_tp=1, kv_heads=8, head_dim=128, layers=8)  # the demo's pair
    config = EngineConfig(agent=AgentConfig(num_threads=4), handshake_timeout_s=20.0,
                          transfer_timeout_s=120.0)
    rng = random.Random(1)
    p_slots, d_slots = rng.sample(range(REQUESTS), REQUESTS), rng.sample(range(REQUESTS), REQUESTS)
    batch = [(f"req-{i}", 1000 + i, list(range(p_slots[i] * BLOCKS, (p_slots[i] + 1) * BLOCKS)),
              list(range(d_slots[i] * BLOCKS, (d_slots[i] + 1) * BLOCKS)), BLOCKS * p.block_size)
             for i in range(REQUESTS)]
    tcp = {"before": {n: iperf3_gbps(phost, dhost, n) for n in (1, 2)}}
    with NetnsCluster(p, d, prefill_host=phost, decode_host=dhost, env=ucx_env(tmp_path),
                      num_blocks=REQUESTS * BLOCKS, config=config) as c:
        for _, seed, pb, _, ntok in batch:
            c.fill(seed, pb, ntok)
        _, seed, pb, db, ntok = batch[0]
        c.submit("first", seed, pb, db, num_tokens=ntok, fill=False)  # pays the handshake
        assert c.wait(["first"], timeout=120, released=True)["first"].ok
        rounds = [_round(c, batch, k) for k in range(ROUNDS)]
    tcp["after"] = {n: iperf3_gbps(phost, dhost, n) for n in (1, 2)}
    best, moved = max(rounds)
    tcp1 = max(t[1] for t in tcp.values())
    tcp2 = max(t[2] for t in tcp.values())
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"link {phost.name}:{phost.dev} -> {dhost.name}:{dhost.dev}, load average {load}, "
          f"{os.cpu_count()} CPUs")
    print("iperf3 (raw TCP, prefill host -> decode host, {} s): 1 stream {} GB/s, 2 streams {} GB/s".format(
        IPERF_SECONDS, " / ".join(f"{t[1]:.2f}" for t in tcp.values()),
        " / ".join(f"{t[2]:.2f}" for t in tcp.values())) + " (before / after kvbridge)")
    print(f"kvbridge pull TP 2 -> 1, UCX_TLS=tcp: {REQUESTS} requests x {BLOCKS} blocks, "
          f"{moved / 2**20:.1f} MiB per round, every byte verified: "
          + ", ".join(f"{g:.2f}" for g, _ in rounds) + " GB/s")
    print(f"ratio kvbridge (best round {best:.2f} GB/s) / iperf3: {best / tcp1:.2f} of 1 stream "
          f"({tcp1:.2f} GB/s), {best / tcp2:.2f} of 2 streams ({tcp2:.2f} GB/s)")
    assert tcp1 > 0 and tcp2 > 0 and best > 0
    check_transports(tmp_path, dhost)
