"""Resource probes of harness processes (Linux ``/proc``) and the soak's flatness rule.

A probe reads what the kernel knows of a process: resident memory, threads,
open file descriptors and, among them, sockets. The engine's own handles
(NIXL transfers, prepared lists, remote agents, known peers) come from
:meth:`~kvbridge.nixl.rank.RankEngine.resource_counts` through the harness.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

#: counts that must stay within a fixed bound from the checkpoint on
EXACT = ("threads", "fds", "sockets", "transfers", "lists", "remote_agents", "peers")
#: counts allowed ``AgentConfig.num_threads`` more per peer agent whose process died (killed or
#: closed): each of the UCX backend's dedicated worker threads keeps its TCP socket to such an
#: agent open (CLOSE-WAIT) after the agent is removed, since nothing progresses that worker's
#: endpoint again (upstream ai-dynamo/nixl#2025; none with ``num_threads=0``)
PER_DEPARTED_PEER = ("fds", "sockets")


@dataclass(frozen=True)
class ProcSample:
    """What ``/proc`` says about one process at one moment."""

    rss_kib: int
    threads: int
    fds: int
    sockets: int


def probe(pid: int) -> ProcSample:
    """Read ``/proc/<pid>``; raises OSError when the process is gone."""
    rss = threads = 0
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    fds = sockets = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                sockets += 1
        except OSError:  # closed meanwhile
            fds -= 1
    return ProcSample(rss, threads, fds, sockets)


@dataclass
class Series:
    """The quiescent samples of one process: (requests finished so far, counts)."""

    label: str
    pid: int
    points: list[tuple[int, dict[str, int]]] = field(default_factory=list)

    def add(self, requests: int, sample: ProcSample, handles: dict[str, int], departed: int = 0) -> None:
        """``departed``: peer agents that were connected to this process and died, so far."""
        counts = {"rss_kib": sample.rss_kib, "threads": sample.threads, "fds": sample.fds,
                  "sockets": sample.sockets, "departed": departed}
        counts.update({k: v for k, v in handles.items() if k in EXACT})
        self.points.append((requests, counts))

    def window(self, start: int) -> list[tuple[int, dict[str, int]]]:
        return [p for p in self.points if p[0] >= start]


def flatness_problems(series: Series, start: int, rss_tol_kib: int,
                      per_departed_peer: int = 1) -> list[str]:
    """Why ``series`` is not flat from request ``start`` on (empty: it is).

    Flat: every exact count (:data:`EXACT`) at every sample from the first one at
    or after ``start`` on is at most the highest value it had up to that first
    sample (the steady state the process reached: a peer known, its lists
    prepared). :data:`PER_DEPARTED_PEER` counts are compared less
    ``per_departed_peer`` per peer that had departed by each sample (the sockets
    such a peer leaves behind, see above): a peer that died before ``start`` and
    whose replacement connected after it costs nothing more. Resident memory at the last sample
    is at most ``rss_tol_kib`` above the first, and its least-squares trend over
    the window, extrapolated over the window, is below the same tolerance
    (noise up and down passes, a steady climb does not).
    """
    pts = series.window(start)
    if len(pts) < 2:
        return [f"{series.label}: fewer than 2 samples from request {start} on"]
    out = []
    n0, base = pts[0]
    before = [c for n, c in series.points if n <= n0]
    for key in EXACT:
        if key not in base:
            continue
        left = per_departed_peer if key in PER_DEPARTED_PEER else 0

        def own(c: dict[str, int], key: str = key, left: int = left) -> int:
            return c[key] - left * c["departed"]

        bound = max(own(c) for c in before)
        over = [(n, c[key], c["departed"]) for n, c in pts if own(c) > bound]
        if over:
            out.append(f"{series.label}: {key} at most {bound} up to request {n0} (less "
                       f"{left} per departed peer), then {over[:4]} (request, value, departed)")
    rss = [(n, c["rss_kib"]) for n, c in pts]
    growth = rss[-1][1] - rss[0][1]
    if growth > rss_tol_kib:
        out.append(f"{series.label}: RSS grew {growth} KiB (> {rss_tol_kib} KiB) from request "
                   f"{rss[0][0]} to {rss[-1][0]}")
    if len(rss) >= 3:
        xs = [float(n) for n, _ in rss]
        ys = [float(v) for _, v in rss]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
        trend = slope * (xs[-1] - xs[0])
        if trend > rss_tol_kib:
            out.append(f"{series.label}: RSS trend +{trend:.0f} KiB over the window (> {rss_tol_kib} KiB)")
    return out
