"""``kvbridge demo`` (an entry point of the ``kvbridge.commands`` group): a prefill engine and a decode
engine in real processes move a batch of requests, and every byte is verified."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

from kvbridge.topology import (
    TopologyError,
    add_shape_arguments,
    engines_from_args,
    plan_to_text,
    plan_transfer,
)

from ..agent import AgentConfig
from ..config import EngineConfig
from ..stats import Stats
from .harness import Cluster, HarnessError
from .memcpy import memcpy_gbps


class _Progress:
    """A one-line progress bar on stderr, shown only when the run takes a while."""

    def __init__(self, total: int, label: str, after_s: float = 1.5):
        self.total, self.label, self.after = total, label, after_s
        self.start = time.monotonic()
        self.count = 0
        self.shown = False

    def __call__(self, n: int = 1) -> None:
        self.count += n
        if not sys.stderr.isatty() and self.total < 64:
            return
        if time.monotonic() - self.start < self.after and self.count < self.total:
            return
        width = 30
        filled = int(width * self.count / max(1, self.total))
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.count}/{self.total}")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("pull", "push"), default="pull",
                   help="pull: decode READs (default); push: prefill WRITEs")
    p.add_argument("--ucx-threads", type=int, default=4, metavar="N",
                   help="UCX worker threads per agent (default 4)")
    p.add_argument("--backends", default="UCX", help="comma-separated NIXL backends (default UCX)")
    p.add_argument("--ranks-per-process", type=int, default=1, metavar="N",
                   help="TP ranks per engine process (default 1: one process per rank)")


def _config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(agent=AgentConfig(backends=tuple(b.strip() for b in args.backends.split(",") if b.strip()),
                                          num_threads=args.ucx_threads),
                        mode=args.mode, handshake_timeout_s=20.0, transfer_timeout_s=120.0)


def _demo_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbridge demo",
        description="Move the KV blocks of a batch of requests from a prefill engine to a decode engine "
        "(real processes, NIXL over UCX in host memory, ZMQ handshakes on 127.0.0.1) and verify "
        "every byte.",
    )
    add_shape_arguments(p, defaults={"prefill_tp": 2, "decode_tp": 1, "kv_heads": 8, "head_dim": 128,
                                     "layers": 8})
    p.add_argument("--blocks", type=int, default=32, metavar="N", help="prefill blocks per request (default 32)")
    p.add_argument("--requests", type=int, default=8, metavar="R", help="requests in the batch (default 8)")
    _engine_args(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log engine events")
    return p


def _d_blocks_for(n_p: int, p_bs: int, d_bs: int) -> int:
    return -(-(n_p * p_bs) // d_bs)


def demo_command(argv: list[str]) -> int:
    args = _demo_parser().parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.blocks <= 0 or args.requests <= 0:
        print("kvbridge demo: error: --blocks and --requests must be positive", file=sys.stderr)
        return 2
    try:
        prefill, decode = engines_from_args(args)
        plan = plan_transfer(prefill, decode)
    except TopologyError as exc:
        print(f"kvbridge demo: error: {exc}", file=sys.stderr)
        return 2
    print(plan_to_text(plan).rstrip())
    n_p = args.blocks
    n_d = _d_blocks_for(n_p, prefill.block_size, decode.block_size)
    ntok = n_p * prefill.block_size
    num_blocks = max(n_p, n_d) * args.requests
    per_rank_mib = max(n_p * prefill.region_block_bytes * plan.prefill_layout.regions,
                       n_d * decode.region_block_bytes * plan.decode_layout.regions) * args.requests / 2**20
    print(f"\ndemo: {args.requests} requests x {ntok} tokens ({n_p} prefill blocks, {n_d} decode blocks), "
          f"mode {args.mode}, cache per rank {per_rank_mib:.1f} MiB")
    rng = np.random.default_rng(1)
    t_start = time.monotonic()
    try:
        with Cluster(prefill, decode, num_blocks=num_blocks, config=_config(args),
                     ranks_per_process=args.ranks_per_process) as c:
            t_ready = time.monotonic()
            # each request gets a run of consecutive blocks (as allocators mostly hand out), the
            # runs placed differently on the two sides; NIXL merges each run into few descriptors
            p_slots = rng.permutation(args.requests)
            d_slots = rng.permutation(args.requests)
            rids = [f"req-{i}" for i in range(args.requests)]
            jobs = []
            for i, rid in enumerate(rids):
                pb = list(range(int(p_slots[i]) * n_p, int(p_slots[i]) * n_p + n_p))
                db = list(range(int(d_slots[i]) * n_d, int(d_slots[i]) * n_d + n_d))
                c.fill(1000 + i, pb, ntok)
                jobs.append((rid, pb, db))
            t_filled = time.monotonic()
            # the first request pays the handshake; the rest of the batch is timed without it
            first_rid, pb, db = jobs[0]
            c.submit(first_rid, 1000, pb, db, num_tokens=ntok, fill=False)
            first = c.wait([first_rid], timeout=120)[first_rid]
            first_ms = (max(first.done_at.values(), default=0) - min(first.loaded_at.values(), default=0)) * 1e3
            bar = _Progress(len(rids), "transferring")
            bar(1)
            t0 = time.monotonic()
            for i, (rid, pb, db) in enumerate(jobs[1:], start=1):
                c.submit(rid, 1000 + i, pb, db, num_tokens=ntok, fill=False)
            res = c.wait(rids, timeout=300, released=args.mode == "pull", on_progress=bar)
            bar.close()
            rest = [res[r] for r in rids[1:]]
            t_end = max((t for r in rest for t in r.done_at.values()), default=t0)
            dstats = c.rank_stats(c.decode)
            pstats = c.rank_stats(c.prefill)
    except HarnessError as exc:
        print(f"kvbridge demo: FAILED: {exc}", file=sys.stderr)
        return 1
    ds = Stats.merge([s for s, _ in dstats.values()])
    ps = Stats.merge([s for s, _ in pstats.values()])
    moved = ds.bytes if args.mode == "pull" else ps.bytes
    moved_rest = moved * (len(rids) - 1) / len(rids)
    hs_stats = dstats if args.mode == "pull" else pstats
    hs_ms = max((s.handshake_ms / max(1, s.handshakes) for s, _ in hs_stats.values()), default=0.0)
    failed = {rid: r.failed for rid, r in res.items() if r.failed}
    mismatched = {rid: r.mismatches for rid, r in res.items() if r.mismatches}
    wall = max(1e-9, t_end - t0)
    mc = memcpy_gbps()
    xs = ds if args.mode == "pull" else ps
    ranks = decode.tp_size if args.mode == "pull" else prefill.tp_size
    print(f"processes started in {t_ready - t_start:.1f} s; caches filled in {t_filled - t_ready:.1f} s")
    print(f"handshake (slowest rank): {hs_ms:.1f} ms")
    # NIXL telemetry counts the descriptors left after merging adjacent ones (0: telemetry off)
    merged = f"; NIXL merged them into {xs.descriptors}" if xs.descriptors else ""
    print(f"moved {moved / 2**20:.1f} MiB in {xs.transfers} NIXL transfers "
          f"({xs.descriptors_posted} descriptors posted{merged})")
    print(f"first request (handshake + lists + transfer): {first_ms:.1f} ms")
    if len(rids) > 1:
        print(f"other {len(rids) - 1} requests: {wall * 1e3:.1f} ms, {moved_rest / wall / 1e9:.2f} GB/s "
              f"aggregate over {ranks} rank(s) (submitted one at a time through the harness)")
    if xs.xfer_us:
        print(f"NIXL telemetry: {xs.gbps:.2f} GB/s per transfer on average (transfers overlap)")
    print(f"memcpy on this machine (one thread): {mc:.2f} GB/s")
    print(f"prefill released {ps.requests_released} request copies "
          f"({ps.leases_expired} by lease expiry); decode verified {sum(len(r.done) for r in res.values())} "
          f"rank shards")
    if failed or mismatched or ps.leases_expired:
        for rid, f in failed.items():
            print(f"FAILED {rid}: {f}", file=sys.stderr)
        for rid, n in mismatched.items():
            print(f"MISMATCH {rid}: {n} bytes differ from the expected shards", file=sys.stderr)
        if ps.leases_expired:
            print(f"{ps.leases_expired} leases expired", file=sys.stderr)
        print("demo: FAILED", file=sys.stderr)
        return 1
    print("demo: OK, every byte verified")
    return 0
