"""The soak's per-lane report: what each lane counted, and the table it prints."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import faults as F  # tests/soak/faults.py
from probes import Series  # tests/soak/probes.py


@dataclass
class LaneReport:
    lane: str
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    released: Counter = field(default_factory=Counter)
    bytes_verified: int = 0
    max_end_s: float = 0.0
    series: dict[int, Series] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    survivors: list[str] = field(default_factory=list)
    checkpoint: int = 0
    wall_s: float = 0.0
    restarted_checked: int = 0
    kept_waits: int = 0  # probes that waited for a given-up transfer to end


def _mib(kib: int) -> str:
    return f"{kib / 1024:.1f}"


def print_table(reports: list[LaneReport], wall_s: float, lanes: dict[str, dict[str, int]],
                bound_s: float) -> None:
    """Each lane's outcomes, faults, releases and its surviving processes' counts (markdown)."""
    out = []
    for rep in reports:
        out.append(f"### lane {rep.lane}: {lanes[rep.lane]['prefill_tp']} prefill ranks -> "
                   f"{lanes[rep.lane]['decode_tp']} decode ranks, {rep.lane} mode, {rep.wall_s:.0f} s")
        out.append("")
        out.append("| | |")
        out.append("|---|---|")
        out.append(f"| requests | {rep.requests} |")
        for k, v in sorted(rep.outcomes.items()):
            out.append(f"| ended {k} | {v} |")
        for k in F.KINDS:
            out.append(f"| fault {k} | {rep.faults.get(k, 0)} |")
        for k, v in sorted(rep.released.items()):
            out.append(f"| prefill releases: {k} | {v} |")
        out.append(f"| bytes verified | {rep.bytes_verified} ({rep.bytes_verified / 2**20:.1f} MiB) |")
        out.append(f"| probes that waited for a given-up transfer to end | {rep.kept_waits} |")
        out.append(f"| slowest end (s, bound {bound_s:.0f}) "
                   f"| {rep.max_end_s:.2f} |")
        out.append("")
        out.append(f"Surviving processes, from the first probe at or after request {rep.checkpoint} "
                   "(the checkpoint) to the end:")
        out.append("")
        out.append("| process | requests | RSS MiB | threads | fds | sockets | NIXL lists | "
                   "remote agents | transfers | peers |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for s in rep.series.values():
            if s.label not in rep.survivors:
                continue
            (n0, a), (n1, b) = s.window(rep.checkpoint)[0], s.points[-1]
            cells = " | ".join(f"{a[k]} -> {b[k]}" for k in ("threads", "fds", "sockets", "lists",
                                                           "remote_agents", "transfers", "peers"))
            out.append(f"| {s.label} | {n0} -> {n1} | {_mib(a['rss_kib'])} -> {_mib(b['rss_kib'])} | "
                       f"{cells} |")
        restarted = [s for s in rep.series.values() if s.label not in rep.survivors]
        out.append(f"\n{len(restarted)} restarted processes, {rep.restarted_checked} with windows of "
                   "2 probes or more, which were checked.\n")
    out.append(f"total wall time {wall_s:.0f} s")
    print("\n".join(out), flush=True)
