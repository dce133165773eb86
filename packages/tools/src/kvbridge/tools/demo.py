"""``kvbridge demo`` (an entry point of the ``kvbridge.commands`` group): a prefill engine and a decode
engine in real processes move a batch of requests, and every byte is verified."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

from kvbridge.nixl import EngineConfig, Stats
from kvbridge.topology import (
    TopologyError,
    add_shape_arguments,
    engines_from_args,
    mamba_state_bytes,
    plan_to_text,
    plan_transfer,
)

from .agentargs import add_agent_arguments, agent_config
from .harness import Cluster, HarnessError
from .hybrid_cache import with_hybrid_groups
from .memcpy import device_copy_gbps, memcpy_gbps
from .progress_bars import progress, ticker


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("pull", "push"), default="pull",
                   help="pull: decode READs (default); push: prefill WRITEs")
    add_agent_arguments(p)
    p.add_argument("--backends", default="UCX", help="comma-separated NIXL backends (default UCX)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the caches live: host memory (default; NIXL DRAM) or GPU memory "
                        "(VRAM; rank r on cuda:r %% GPUs); the baseline is then a GPU copy")
    p.add_argument("--ranks-per-process", type=int, default=1, metavar="N",
                   help="TP ranks per engine process (default 1: one process per rank)")
    p.add_argument("--staging-mib", type=int, default=EngineConfig.staging_mib, metavar="MIB",
                   help="pull, host memory: each decode rank's staging buffer for READs whose pieces "
                        f"are scattered locally (0: read every piece into place; default "
                        f"{EngineConfig.staging_mib})")


def _config(args: argparse.Namespace) -> EngineConfig:
    # hybrid (--mamba) requests name the null block 0 in their Mamba group's list, as vLLM does
    return EngineConfig(agent=agent_config(args, tuple(b.strip() for b in args.backends.split(",") if b.strip())),
                        mode=args.mode, handshake_timeout_s=20.0, transfer_timeout_s=120.0,
                        mem_type="VRAM" if args.device == "cuda" else "DRAM",
                        staging_mib=args.staging_mib,
                        null_block_id=NULL if getattr(args, "mamba", False) else None)


def _demo_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbridge demo",
        description="Move the KV blocks of a batch of requests from a prefill engine to a decode engine "
        "(real processes, NIXL over UCX in host memory, ZMQ handshakes on 127.0.0.1) and verify "
        "every byte.",
    )
    add_shape_arguments(p, defaults={"prefill_tp": 2, "decode_tp": 1, "kv_heads": 8, "head_dim": 128,
                                     "layers": 8, "ssm_heads": 16, "ssm_head_dim": 32, "ssm_state": 16,
                                     "ssm_groups": 4, "conv_width": 4}, mamba=True)
    p.add_argument("--blocks", type=int, default=32, metavar="N", help="prefill blocks per request (default 32)")
    p.add_argument("--requests", type=int, default=8, metavar="R", help="requests in the batch (default 8)")
    p.add_argument("--rounds", type=int, default=3, metavar="N",
                   help="times the batch is moved, each verified; the best round is compared with "
                        "memcpy's best of 5 (default 3)")
    _engine_args(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log engine events")
    return p


NULL = 0  # the block hybrid requests name where they hold no block (never allocated)


def _d_blocks_for(n_p: int, p_bs: int, d_bs: int) -> int:
    return -(-(n_p * p_bs) // d_bs)


TARGET_SHARE = 0.5  # aggregate throughput of the batch, as a share of this machine's memcpy


def demo_command(argv: list[str]) -> int:
    args = _demo_parser().parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.blocks <= 0 or args.requests <= 0 or args.rounds <= 0:
        print("kvbridge demo: error: --blocks, --requests and --rounds must be positive", file=sys.stderr)
        return 2
    try:
        prefill, decode = engines_from_args(args)
        if args.mamba:  # one FULL attention group and one MAMBA group sharing every region
            prefill, decode = with_hybrid_groups(prefill), with_hybrid_groups(decode)
        plan = plan_transfer(prefill, decode)
    except TopologyError as exc:
        print(f"kvbridge demo: error: {exc}", file=sys.stderr)
        return 2
    print(plan_to_text(plan).rstrip())
    n_p = args.blocks
    n_d = _d_blocks_for(n_p, prefill.block_size, decode.block_size)
    ntok = n_p * prefill.block_size
    # hybrids: block 0 is the null block, and every request has one Mamba state page more
    num_blocks = (max(n_p, n_d) + 1) * args.requests + 1 if args.mamba else max(n_p, n_d) * args.requests
    per_rank_mib = max(n_p * prefill.region_block_bytes * plan.prefill_layout.regions,
                       n_d * decode.region_block_bytes * plan.decode_layout.regions) * args.requests / 2**20
    state = ""
    if args.mamba:
        state = (f" + one Mamba state page per request ({mamba_state_bytes(prefill)} / "
                 f"{mamba_state_bytes(decode)} bytes of state per layer and prefill / decode rank, "
                 f"pages of {prefill.region_block_bytes} / {decode.region_block_bytes} bytes)")
    print(f"\ndemo: {args.requests} requests x {ntok} tokens ({n_p} prefill blocks, {n_d} decode blocks"
          f"{state}), mode {args.mode}, cache per rank {per_rank_mib:.1f} MiB", flush=True)
    try:
        run = _run(args, prefill, decode, n_p, n_d, ntok, num_blocks)
    except HarnessError as exc:
        print(f"kvbridge demo: FAILED: {exc}", file=sys.stderr)
        return 1
    return _report(args, run, prefill, decode)


def _run(args, prefill, decode, n_p: int, n_d: int, ntok: int, num_blocks: int) -> dict:
    """Start both engines, move one request alone (it pays the handshake), then the whole batch
    at once; returns what :func:`_report` prints."""
    rng = np.random.default_rng(1)
    out: dict = {}
    t_start = time.monotonic()
    c = Cluster(prefill, decode, num_blocks=num_blocks, config=_config(args),
                ranks_per_process=args.ranks_per_process)
    nproc = len(_groups(prefill, args)) + len(_groups(decode, args))
    try:
        with ticker(f"starting {nproc} engine processes"):
            c.start()
        _run_batch(args, c, rng, out, n_p, n_d, ntok, t_start)
    finally:
        c.close()
    out["memcpy"] = memcpy_gbps() if args.device == "cpu" else device_copy_gbps()
    return out


def _run_batch(args, c: Cluster, rng, out: dict, n_p: int, n_d: int, ntok: int, t_start: float) -> None:
    out["start_s"] = time.monotonic() - t_start
    # each request gets a run of consecutive blocks (as allocators mostly hand out), the
    # runs placed differently on the two sides; NIXL merges each run into few descriptors
    p_slots, d_slots = rng.permutation(args.requests), rng.permutation(args.requests)
    batch = []
    t = time.monotonic()
    with progress("filling prefill caches", args.requests, unit="request") as bar:
        for i in range(args.requests):
            pb = list(range(int(p_slots[i]) * n_p, int(p_slots[i]) * n_p + n_p))
            db = list(range(int(d_slots[i]) * n_d, int(d_slots[i]) * n_d + n_d))
            if args.mamba:  # [attention ids, Mamba ids]: the state page last, null blocks before
                pb, db = _hybrid_ids(pb, i, n_p, args.requests), _hybrid_ids(db, i, n_d, args.requests)
            c.fill(1000 + i, pb, ntok)
            batch.append((f"req-{i}", 1000 + i, pb, db, ntok))
            bar.update()
    out["fill_s"] = time.monotonic() - t
    # the first request (the batch's first one again, alone) pays the handshake
    _, seed, pb, db, _ = batch[0]
    c.submit("first", seed, pb, db, num_tokens=ntok, fill=False)
    first = c.wait(["first"], timeout=120, released=args.mode == "pull")["first"]
    out["first_ms"] = (max(first.done_at.values(), default=0) - min(first.loaded_at.values(), default=0)) * 1e3
    mover = c.decode if args.mode == "pull" else c.prefill  # the ranks that post the transfers
    out["results"], out["rounds"] = {"first": first}, []
    for k in range(args.rounds):
        rb = [(f"r{k}-{rid}", *rest) for rid, *rest in batch]
        out["rounds"].append(_round(args, c, mover, rb, out["results"], f"round {k + 1}/{args.rounds}"))
    out["dstats"] = c.rank_stats(c.decode)
    out["pstats"] = c.rank_stats(c.prefill)
    out["peaks"] = c.peaks(mover)


def _round(args, c: Cluster, mover, batch: list[tuple], results: dict, label: str) -> dict:
    """Move the batch once, every request handed over together; returns its timings."""
    before = {r: s.bytes for r, (s, _) in c.rank_stats(mover).items()}
    # zero the batch's decode blocks now (so that bytes a transfer fails to write show):
    # verification work of the harness, kept out of the batch's time
    c.clear_decode([b for *_, db, _ in batch for b in db])
    with progress(f"transferring, {label}", len(batch), unit="request") as bar:
        t0 = time.monotonic()
        c.submit_batch(batch, cleared=True)
        res = c.wait([b[0] for b in batch], timeout=300, released=args.mode == "pull", on_progress=bar.update)
    results.update(res)
    after = c.rank_stats(mover)
    tp = range(c.decode.spec.tp_size)
    return {
        "t0": t0,
        "t_end": max((t for r in res.values() for t in r.done_at.values()), default=t0),
        "moved": {r: s.bytes - before.get(r, 0) for r, (s, _) in after.items()},
        # the decode ranks' first load() (pull) or expect() (push): where the engines' part starts
        "t_load": min((t for r in res.values() for t in r.loaded_at.values()), default=t0),
        "loaded_at": {r: min((x.loaded_at.get(r, t0) for x in res.values()), default=t0) for r in tp},
        "done_at": {r: max((x.done_at.get(r, t0) for x in res.values()), default=t0) for r in tp},
    }


def _hybrid_ids(attn: list[int], i: int, n: int, requests: int) -> list[list[int]]:
    """Request ``i``'s block ids per group: attention blocks after the null block 0, and its
    Mamba state page after every request's attention blocks."""
    page = 1 + n * requests + i
    return [[b + 1 for b in attn], [NULL] * (len(attn) - 1) + [page]]


def _groups(spec, args) -> list:
    per = args.ranks_per_process or spec.tp_size
    return list(range(0, spec.tp_size, per))


def _report(args, run: dict, prefill, decode) -> int:
    res = run["results"]
    ds = Stats.merge([s for s, _ in run["dstats"].values()])
    ps = Stats.merge([s for s, _ in run["pstats"].values()])
    xs = ds if args.mode == "pull" else ps
    hs_stats = run["dstats"] if args.mode == "pull" else run["pstats"]
    hs_ms = max((s.handshake_ms / max(1, s.handshakes) for s, _ in hs_stats.values()), default=0.0)
    mc = run["memcpy"]
    base = "memcpy" if args.device == "cpu" else "GPU copy"
    rounds = run["rounds"]
    aggs = [sum(x["moved"].values()) / max(1e-9, x["t_end"] - x["t_load"]) / 1e9 for x in rounds]
    best = max(range(len(rounds)), key=lambda i: aggs[i])
    rd, agg = rounds[best], aggs[best]
    t0, wall, moved = rd["t_load"], max(1e-9, rd["t_end"] - rd["t_load"]), sum(rd["moved"].values())
    print(f"processes started in {run['start_s']:.1f} s; caches filled in {run['fill_s']:.1f} s")
    print(f"handshake (slowest rank): {hs_ms:.1f} ms")
    print(f"first request, alone (handshake + lists + transfer): {run['first_ms']:.1f} ms")
    # NIXL telemetry counts the descriptors left after merging adjacent ones (0: telemetry off)
    merged = f"; NIXL merged them into {xs.descriptors}" if xs.descriptors else ""
    staged = (f", {xs.staged_reads} of them staged (copied into place in "
              f"{xs.staged_copy_us / 1e3:.1f} ms)" if xs.staged_reads else "")
    print(f"in all: {xs.transfers} NIXL transfers{staged} ({xs.descriptors_posted} descriptors "
          f"posted{merged})")
    role = "decode" if args.mode == "pull" else "prefill"
    start = "load()" if args.mode == "pull" else "expect()"
    print(f"batch: {args.requests} requests submitted together to every rank, {moved / 2**20:.1f} MiB, "
          f"moved {len(rounds)} time(s): " + ", ".join(f"{a:.2f}" for a in aggs) + " GB/s aggregate")
    print(f"best round ({best + 1}): {(rd['t_end'] - rd['t0']) * 1e3:.1f} ms from the harness's submission, "
          f"{wall * 1e3:.1f} ms from the decode ranks' first {start} to the last completion (the figures below)")
    for r in sorted(rd["moved"]):
        # pull: each decode rank's own first load() and last completion; push: the batch's (the
        # prefill's WRITEs are not timed one by one)
        s0, s1 = ((rd["loaded_at"].get(r, t0), rd["done_at"].get(r, rd["t_end"]))
                  if args.mode == "pull" else (t0, rd["t_end"]))
        rate = rd["moved"][r] / max(1e-9, s1 - s0) / 1e9
        peak_req, peak_x = run["peaks"][r]
        print(f"  {role} rank {r}: {rd['moved'][r] / 2**20:.1f} MiB, {rate:.2f} GB/s "
              f"({100 * rate / mc:.0f} % of {base}); at most {peak_req} requests outstanding, "
              f"{peak_x} NIXL transfers live at once")
    verdict = "PASS" if agg >= TARGET_SHARE * mc else "FAIL"
    how = "one thread" if args.device == "cpu" else "cuda:0 to cuda:0"
    print(f"aggregate (best round): {agg:.2f} GB/s = {100 * agg / mc:.0f} % of {base} ({mc:.2f} GB/s, "
          f"{how}, best of 5, same run); target >= {100 * TARGET_SHARE:.0f} %: {verdict}")
    print(f"prefill released {ps.requests_released} request copies "
          f"({ps.leases_expired} by lease expiry); decode verified "
          f"{sum(len(r.done) for r in res.values())} rank shards")
    failed = {rid: r.failed for rid, r in res.items() if r.failed}
    mismatched = {rid: r.mismatches for rid, r in res.items() if r.mismatches}
    unverified = [rid for rid, r in res.items() if any(v < 0 for v in r.done.values())]
    if failed or mismatched or unverified or ps.leases_expired:
        for rid, f in failed.items():
            print(f"FAILED {rid}: {f}", file=sys.stderr)
        for rid, n in mismatched.items():
            print(f"MISMATCH {rid}: {n} bytes differ from the expected shards", file=sys.stderr)
        for rid in unverified:
            print(f"UNVERIFIED {rid}: a rank did not check its bytes", file=sys.stderr)
        if ps.leases_expired:
            print(f"{ps.leases_expired} leases expired", file=sys.stderr)
        print("demo: FAILED", file=sys.stderr)
        return 1
    print("demo: OK, every byte verified (the exit status reflects correctness, not the target)")
    return 0
