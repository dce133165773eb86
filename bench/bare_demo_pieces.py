#!/usr/bin/env python3
"""Bare NIXL on the default demo's pieces: what NIXL and UCX reach here without kvbridge.

    uv run python bench/bare_demo_pieces.py [--threads 2] [--per-transfer 512] [--repeats 12]

Two source processes (the demo's two prefill ranks) each own 64 MiB; this
process READs 4,096 pieces of 16 KiB from each, contiguous on the source and
every other 16 KiB here (a decode block's first half from one source, its
second half from the other), so NIXL can merge nothing: 8,192 descriptors per
round, 128 MiB, as in one round of ``kvbridge demo``. Every READ of a round is
posted at once from one thread, which then checks them in a busy loop; no
engine, worker thread, notification or verification. Prints the best and
median round against single-thread memcpy measured in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np
import torch

from kvbridge.memory import advise_huge_pages
from kvbridge.nixl import AgentConfig, NixlAgent
from kvbridge.tools.memcpy import memcpy_gbps

PIECE = 16 << 10
PIECES = 4096
SOURCE_BYTES = PIECE * PIECES


def _source(conn, config: AgentConfig) -> None:
    buf = torch.ones(SOURCE_BYTES, dtype=torch.uint8)
    addr = buf.data_ptr()
    advise_huge_pages([(addr, SOURCE_BYTES)])
    agent = NixlAgent(f"bare-demo-source-{os.getpid()}", config)
    agent.register([(addr, SOURCE_BYTES, 0)])
    conn.send((agent.metadata(), addr))
    conn.recv()  # until told to stop
    agent.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="UCX threads (num_threads), as the demo's 2")
    ap.add_argument("--per-transfer", type=int, default=512, help="descriptors per READ (the demo's 512)")
    ap.add_argument("--repeats", type=int, default=12, help="rounds")
    args = ap.parse_args()
    if PIECES % args.per_transfer:
        ap.error(f"--per-transfer must divide {PIECES}")
    config = AgentConfig(num_threads=args.threads, telemetry=False)
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for _ in range(2):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=_source, args=(theirs, config), daemon=True)
        p.start()
        conns.append(ours)
        procs.append(p)
    dst = torch.zeros(2 * SOURCE_BYTES, dtype=torch.uint8)
    base = dst.data_ptr()
    advise_huge_pages([(base, 2 * SOURCE_BYTES)])
    agent = NixlAgent("bare-demo-reader", config)
    agent.register([(base, 2 * SOURCE_BYTES, 0)])
    lists = []
    for r, conn in enumerate(conns):
        meta, src = conn.recv()
        peer = agent.add_remote(meta)
        i = np.arange(PIECES, dtype=np.uint64)
        size, dev = np.full(PIECES, PIECE, np.uint64), np.zeros(PIECES, np.uint64)
        remote = agent.prepare(peer, np.stack([src + i * PIECE, size, dev], axis=1))
        local = agent.prepare(None, np.stack([base + i * 2 * PIECE + r * PIECE, size, dev], axis=1))
        lists.append((local, remote))
    rates = []
    for _ in range(args.repeats):
        t0, posted = time.perf_counter(), []
        for local, remote in lists:
            for start in range(0, PIECES, args.per_transfer):
                idx = np.arange(start, start + args.per_transfer, dtype=np.int64)
                x = agent.make_transfer("READ", local, idx, remote, idx)
                agent.post(x)
                posted.append(x)
        while any(agent.state(x) == "PROC" for x in posted):
            pass
        rates.append(2 * SOURCE_BYTES / (time.perf_counter() - t0) / 1e9)
        states = {agent.state(x) for x in posted}
        for x in posted:
            agent.release_transfer(x)
        if states != {"DONE"}:
            raise SystemExit(f"a READ ended in {states - {'DONE'}}")
    if not torch.equal(dst, torch.ones_like(dst)):
        raise SystemExit("the READs did not deliver every byte")
    m = memcpy_gbps()
    print(f"bare NIXL, {args.threads} UCX thread(s), {args.per_transfer} descriptors per READ: "
          f"best {max(rates):.2f} GB/s ({100 * max(rates) / m:.0f} % of memcpy), median "
          f"{statistics.median(rates):.2f} GB/s; memcpy {m:.2f} GB/s (one thread, best of 5); "
          f"every byte checked")
    for conn in conns:
        conn.send("stop")
    for p in procs:
        p.join(10)
    agent.close()


if __name__ == "__main__":
    main()
