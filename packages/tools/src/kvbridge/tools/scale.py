"""``kvbridge bench --scale``: what requests cost as the work grows, and whether anything leaks.

One prefill and one decode engine in two processes (TP 1 -> 1, pull, NIXL over
UCX in host memory), over a small geometry so that 10k blocks fit in a
modest cache: 2 layers x (K, V) x 1 KV head of 64 x bf16, 16-token blocks,
so 4 regions of 2 KiB per block (8 KiB), every block a descriptor of its own
(block ids drawn at random on both sides, so NIXL cannot merge them). Bytes
are not verified here (the demo and the tests do that).

* **blocks per request** (1, 10, 100, 1k, 10k; one request at a time, median of
  ``reps``): the transfer time (decode ``load()`` to completion) and the
  descriptor preparation (the decode engine's ``Stats.prep_us`` per posted
  request: block ids to index arrays to NIXL transfer handles, ready to post);
* **requests in flight** (1 to 64, 128 blocks each, handed over together as
  :meth:`~.harness.Cluster.submit_batch` does): time from submission to the
  batch's last completion, the median request's own time, aggregate GB/s;
* **flatness**: 10k requests of 4 blocks, in batches of 50; at each checkpoint
  (nothing in flight) both engines' live NIXL resources (registrations,
  prepared lists, transfer handles, remote agents, known peers) and every
  engine process's RSS. FLAT when the resource counts are identical at every
  checkpoint and no process's RSS grew by more than ``RSS_SLACK_MIB`` from the
  first checkpoint to the last; GROWING otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvbridge.nixl import AgentConfig, EngineConfig
from kvbridge.topology import EngineSpec

from .chart import FORMATS, Panel, save
from .harness import Cluster, HarnessError
from .memcpy import memcpy_gbps
from .progress_bars import progress, ticker

RSS_SLACK_MIB = 4.0  # allowed RSS growth per process from the first checkpoint to the last
INFLIGHT_BLOCKS = 128  # blocks per request in the requests-in-flight sweep
FLAT_BLOCKS, FLAT_BATCH = 4, 50  # blocks per request and requests per batch in the flatness run


def scale_spec(engine_id: str) -> EngineSpec:
    """The geometry of every scale run: 8 KiB per 16-token block in 4 regions of 2 KiB."""
    return EngineSpec(engine_id, 1, 1, 64, 2, 16, "bf16")


BLOCK_BYTES = scale_spec("x").region_block_bytes * 4


@dataclass(frozen=True)
class Point:
    """One measured point: ``x`` blocks per request, or requests in flight."""

    x: int
    descriptors: int  # per request, handed to NIXL
    transfer_ms: float  # blocks sweep: one request's time; in-flight sweep: the whole batch's
    request_ms: float  # the median request's own time (load to completion)
    prep_us: float  # descriptor preparation per request
    gbps: float  # bytes moved / transfer_ms


@dataclass(frozen=True)
class Checkpoint:
    """After ``requests`` requests of the flatness run, nothing in flight."""

    requests: int
    resources: dict[str, int]  # summed over both engines' ranks
    rss_mib: dict[str, float]  # engine process ("prefill 0", "decode 0") -> RSS


@dataclass(frozen=True)
class ScaleResult:
    memcpy_gbps: float
    blocks: list[Point]
    inflight: list[Point]
    checkpoints: list[Checkpoint]
    flat: bool
    verdict: str  # why FLAT or GROWING


def rss_mib(pid: int) -> float:
    """Resident set size of a process (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def flatness_verdict(checkpoints: list[Checkpoint], slack_mib: float = RSS_SLACK_MIB) -> tuple[bool, str]:
    """FLAT when every checkpoint's resource counts equal the first one's and no process's RSS
    grew by more than ``slack_mib`` from the first checkpoint to the last."""
    if len(checkpoints) < 2:
        raise ValueError("flatness needs at least two checkpoints")
    first, last = checkpoints[0], checkpoints[-1]
    changed = [c for c in checkpoints[1:] if c.resources != first.resources]
    growth = {p: last.rss_mib[p] - first.rss_mib[p] for p in first.rss_mib}
    worst = max(growth, key=lambda p: growth[p])
    rule = (f"rule: NIXL resources identical at every checkpoint, RSS growth <= {slack_mib:g} MiB per "
            f"process from {first.requests} to {last.requests} requests")
    if changed:
        c = changed[0]
        return False, f"GROWING: resources {first.resources} -> {c.resources} at {c.requests} requests ({rule})"
    if growth[worst] > slack_mib:
        return False, f"GROWING: {worst} RSS +{growth[worst]:.1f} MiB ({rule})"
    return True, f"FLAT: largest RSS change {worst} {growth[worst]:+.1f} MiB ({rule})"


_ROLES = {"p": "prefill", "d": "decode"}


class _Run:
    """The sweeps, over one started :class:`Cluster`."""

    def __init__(self, cluster: Cluster, seed: int = 0) -> None:
        self.c, self.rng, self.n = cluster, np.random.default_rng(seed), 0

    def _blocks(self, count: int) -> list[int]:
        return [int(x) for x in self.rng.choice(self.c.num_blocks, count, replace=False)]

    def _batch(self, requests: int, blocks: int) -> list[tuple]:
        out = []
        for _ in range(requests):
            self.n += 1
            out.append((f"s{self.n}", self.n, self._blocks(blocks), self._blocks(blocks), blocks * 16))
        return out

    def _prep(self) -> tuple[int, int]:
        (st, _), = self.c.rank_stats(self.c.decode).values()
        return st.prep_us, st.posts

    def move(self, requests: int, blocks: int) -> tuple[float, list[float], float]:
        """One batch: (ms to its last completion, each request's ms, prep us per request)."""
        batch = self._batch(requests, blocks)
        prep0, posts0 = self._prep()
        t0 = time.monotonic()
        self.c.submit_batch(batch, verify=False)
        res = self.c.wait([b[0] for b in batch], timeout=600, released=True)
        bad = {rid: r.failed for rid, r in res.items() if r.failed}
        if bad:
            raise HarnessError(f"scale requests failed: {bad}")
        end = max(t for r in res.values() for t in r.done_at.values())
        each = [(max(r.done_at.values()) - min(r.loaded_at.values())) * 1e3 for r in res.values()]
        prep1, posts1 = self._prep()
        return (end - t0) * 1e3, each, (prep1 - prep0) / max(1, posts1 - posts0)

    def blocks_sweep(self, counts: list[int], reps: int, bar) -> list[Point]:
        out = []
        for n in counts:
            times, preps = [], []
            for _ in range(reps):
                _, each, prep = self.move(1, n)
                times.append(each[0])
                preps.append(prep)
                bar()
            ms = statistics.median(times)
            out.append(Point(n, n * 4, ms, ms, statistics.median(preps), n * BLOCK_BYTES / ms / 1e6))
        return out

    def inflight_sweep(self, counts: list[int], reps: int, bar) -> list[Point]:
        out = []
        for r in counts:
            walls, each, preps = [], [], []
            for _ in range(reps):
                wall, e, prep = self.move(r, INFLIGHT_BLOCKS)
                walls.append(wall)
                each.extend(e)
                preps.append(prep)
                bar()
            ms = statistics.median(walls)
            out.append(Point(r, INFLIGHT_BLOCKS * 4, ms, statistics.median(each), statistics.median(preps),
                             r * INFLIGHT_BLOCKS * BLOCK_BYTES / ms / 1e6))
        return out

    def checkpoint(self, done: int) -> Checkpoint:
        res: dict[str, int] = {}
        for group in (self.c.prefill, self.c.decode):
            for _, counts in self.c.rank_stats(group).values():
                for k, v in counts.items():
                    res[k] = res.get(k, 0) + v
        rss = {f"{_ROLES[g.role]} {i}": rss_mib(pid)
               for g in (self.c.prefill, self.c.decode) for i, pid in enumerate(g.pids)}
        return Checkpoint(done, res, rss)

    def flatness(self, total: int, at: list[int], bar) -> list[Checkpoint]:
        done, out = 0, []
        marks = sorted(set(at) | {total})
        while done < total:
            step = min(FLAT_BATCH, total - done, min(m for m in marks if m > done) - done)
            self.move(step, FLAT_BLOCKS)
            done += step
            bar(step)
            if done in marks:
                out.append(self.checkpoint(done))
        return out


def run_scale(block_counts: list[int], inflight_counts: list[int], total_requests: int,
              checkpoints: list[int], reps: int = 3) -> ScaleResult:
    """Start the two engines, run the three sweeps, stop them; prints progress on stderr."""
    num_blocks = max(max(block_counts), max(inflight_counts) * INFLIGHT_BLOCKS, FLAT_BLOCKS * FLAT_BATCH) + 64
    cfg = EngineConfig(agent=AgentConfig(num_threads=1), transfer_timeout_s=300)
    c = Cluster(scale_spec("scale-prefill"), scale_spec("scale-decode"), num_blocks=num_blocks, config=cfg)
    try:
        with ticker("scale: starting 2 engine processes"):
            c.start()
        run = _Run(c)
        run.move(1, 1)  # the handshake, outside every figure
        with progress("scale: blocks per request", len(block_counts) * reps, unit="rep") as bar:
            blocks = run.blocks_sweep(block_counts, reps, bar.update)
        with progress("scale: requests in flight", len(inflight_counts) * reps, unit="rep") as bar:
            inflight = run.inflight_sweep(inflight_counts, reps, bar.update)
        with progress("scale: flatness", total_requests, unit="request") as bar:
            cps = run.flatness(total_requests, checkpoints, bar.update)
    finally:
        c.close()
    flat, why = flatness_verdict(cps)
    return ScaleResult(memcpy_gbps(), blocks, inflight, cps, flat, why)


def print_report(r: ScaleResult) -> None:
    kib = BLOCK_BYTES // 1024
    print(f"geometry: {kib} KiB per block in 4 descriptors of {kib // 4} KiB (random block ids, "
          f"TP 1 -> 1, pull); memcpy {r.memcpy_gbps:.2f} GB/s (one thread, same run)")
    print("\nblocks per request (one request at a time, median):")
    print(f"{'blocks':>8} {'descriptors':>12} {'transfer ms':>12} {'GB/s':>7} {'prep us':>9} {'prep us/block':>14}")
    for p in r.blocks:
        print(f"{p.x:>8} {p.descriptors:>12} {p.transfer_ms:>12.2f} {p.gbps:>7.2f} {p.prep_us:>9.0f} "
              f"{p.prep_us / p.x:>14.2f}")
    print(f"\nrequests in flight ({INFLIGHT_BLOCKS} blocks each, submitted together, median):")
    print(f"{'requests':>8} {'batch ms':>10} {'request ms':>11} {'GB/s':>7} {'prep us/request':>16}")
    for p in r.inflight:
        print(f"{p.x:>8} {p.transfer_ms:>10.2f} {p.request_ms:>11.2f} {p.gbps:>7.2f} {p.prep_us:>16.0f}")
    print(f"\nflatness ({FLAT_BLOCKS} blocks per request, batches of {FLAT_BATCH}):")
    for cp in r.checkpoints:
        res = ", ".join(f"{k} {v}" for k, v in cp.resources.items())
        rss = ", ".join(f"{k} {v:.1f}" for k, v in cp.rss_mib.items())
        print(f"  after {cp.requests:>6} requests: {res}; RSS MiB: {rss}")
    print(r.verdict)


def write_plot(r: ScaleResult, path: str) -> None:
    """The curves of ``r`` as a chart: SVG, PNG or PDF by the extension of ``path``."""
    panels = [
        Panel("Cost per request vs blocks per request", "blocks per request", "ms (log)", {
            "transfer (load to completion)": [(p.x, p.transfer_ms) for p in r.blocks],
            "descriptor preparation": [(p.x, max(p.prep_us, 1.0) / 1e3) for p in r.blocks]}),
        Panel(f"Requests in flight ({INFLIGHT_BLOCKS} blocks each)", "requests in flight", "ms (log)", {
            "batch (submission to last completion)": [(p.x, p.transfer_ms) for p in r.inflight],
            "median request (load to completion)": [(p.x, p.request_ms) for p in r.inflight]}),
    ]
    note = (f"kvbridge bench --scale: {BLOCK_BYTES // 1024} KiB blocks in 4 descriptors, TP 1 -> 1 pull over "
            f"NIXL/UCX in host memory; memcpy {r.memcpy_gbps:.1f} GB/s in the same run. {r.verdict.split(' (')[0]}")
    save(panels, path, note=note)


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def scale_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvbridge bench --scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=_ints, default=[1, 10, 100, 1000, 10000], metavar="N,N,...",
                   help="blocks per request (default 1,10,100,1000,10000)")
    p.add_argument("--inflight", type=_ints, default=[1, 2, 4, 8, 16, 32, 64], metavar="R,R,...",
                   help="requests in flight (default 1,2,4,8,16,32,64)")
    p.add_argument("--total", type=int, default=10000, metavar="N", help="requests of the flatness run")
    p.add_argument("--checkpoints", type=_ints, default=[1000, 5000, 10000], metavar="N,N,...",
                   help="where the flatness run reports resources and RSS (default 1000,5000,10000)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per point (median; default 3)")
    p.add_argument("--plot", metavar="FILE.svg",
                   help="write the curves as a chart (matplotlib): .svg, .png or .pdf")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = p.parse_args(argv)
    if args.plot and os.path.splitext(args.plot)[1].lstrip(".").lower() not in FORMATS:
        print(f"kvbridge bench --scale: error: --plot {args.plot}: name the chart .svg, .png or "
              ".pdf", file=sys.stderr)
        return 2
    cps = [x for x in args.checkpoints if x <= args.total]
    if args.total < 2 or len(set(cps) | {args.total}) < 2 or args.reps < 1:
        print("kvbridge bench --scale: error: --total needs at least two checkpoints at or below it "
              "and --reps must be positive", file=sys.stderr)
        return 2
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    r = run_scale(args.blocks, args.inflight, args.total, cps, args.reps)
    if args.json:
        print(json.dumps(asdict(r)))
    else:
        print_report(r)
    if args.plot:
        write_plot(r, args.plot)
    return 0 if r.flat else 1
