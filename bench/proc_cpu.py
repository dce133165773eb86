"""CPU use of engine processes and their threads, from /proc (for stall evidence in benchmarks).

A vLLM engine with NixlConnector keeps NIXL's progress thread spinning; on two cores a
spinning thread beside an engine's worker is what starves it. These helpers say which
processes and threads used how much CPU over a short window, and on which cores each
process may run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _ticks(stat: Path) -> int:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used so far."""
    return _ticks(Path(f"/proc/{pid}/stat")) / _TICK


def group_pids(pgid: int) -> list[int]:
    """Every process of process group ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def thread_cpu(pids: list[int], window_s: float = 2.0) -> list[tuple[int, int, str, str, float]]:
    """(pid, tid, process name, allowed cores, cores used) per thread over ``window_s``,
    busiest first; threads that used nothing are left out."""
    def sample() -> dict[tuple[int, int], int]:
        out = {}
        for pid in pids:
            for t in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    out[(pid, int(t.name))] = _ticks(t / "stat")
                except (OSError, ValueError):
                    continue
        return out

    a = sample()
    t0 = time.monotonic()
    time.sleep(window_s)
    b = sample()
    dt = time.monotonic() - t0
    rows = []
    for key, v in b.items():
        used = (v - a.get(key, v)) / _TICK / dt
        if used <= 0:
            continue
        pid, tid = key
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            allowed = next(ln.split(":", 1)[1].strip() for ln in Path(f"/proc/{pid}/status").read_text()
                           .splitlines() if ln.startswith("Cpus_allowed_list"))
        except (OSError, StopIteration):
            name, allowed = "?", "?"
        rows.append((pid, tid, name, allowed, used))
    return sorted(rows, key=lambda r: -r[4])


def describe(groups: dict[str, int], window_s: float = 2.0, top: int = 8) -> list[str]:
    """Lines naming the busiest threads of each named process group."""
    lines = []
    for name, pgid in groups.items():
        rows = thread_cpu(group_pids(pgid), window_s)
        total = sum(r[4] for r in rows)
        lines.append(f"{name}: {total:.2f} cores over {window_s:.0f} s")
        for pid, tid, comm, allowed, used in rows[:top]:
            kind = "main thread" if pid == tid else "thread"
            lines.append(f"  pid {pid} {comm} ({kind} {tid}, cores {allowed}): {used:.2f}")
    return lines
