"""Issues 13 and 23's targets for bench_vllm.py, checked against one run's figures.

Pure functions over the summaries ``bench_vllm.summarise`` builds (plain dicts), so
they are testable without engines. Each verdict is PASS, FAIL or n/a (a figure is
missing, e.g. the compared connector failed or has no steady rounds).

Targets (kvbridge rows only; "NixlConnector" means each of its variants in the run):
  * load GB/s of the rounds after the first (bytes over the time from the decode load's
    start to the completion the scheduler sees), against memcpy measured in the run
    (issue 23): the median round >= 50 %, the worst round >= 35 %;
  * first-request overhead < 60 ms;
  * a clean run: no failure counter, no ignored notification, no failure log line;
  * steady decode TTFT <= 0.8 x NixlConnector's;
  * first-request overhead <= 0.5 x NixlConnector's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

GBPS_FRACTION = 0.5  # the median round after the first
GBPS_WORST_FRACTION = 0.35  # the worst round after the first
OVERHEAD_MS = 60.0
TTFT_RATIO = 0.8
OVERHEAD_RATIO = 0.5

Verdict = tuple[str, str, str, str, str]  # connector, figure, value, target, PASS/FAIL/n/a


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _check(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def later_gbps(res: dict[str, Any]) -> list[float]:
    """Load GB/s of every round after the first (rounds without a figure left out): the round's
    bytes over its time from the decode load's start to the completion the scheduler sees."""
    return [r["load GB/s"] for r in res.get("rounds", [])[1:] if r.get("load GB/s") is not None]


def _gbps_verdict(name: str, figure: str, value: float | None, rates: Sequence[float], fraction: float,
                  memcpy_gbps: float | None) -> Verdict:
    """GB/s ``value`` (one figure of the later rounds ``rates``) against ``fraction`` of memcpy."""
    pct = 100 * value / memcpy_gbps if value is not None and memcpy_gbps else None
    need = fraction * memcpy_gbps if memcpy_gbps else None
    rounds = ", ".join(f"{r:.2f}" for r in rates) or "none"
    return (name, figure, f"{_fmt(value, '.2f')} ({_fmt(pct, '.0f')} % of memcpy; rounds {rounds})",
            f">= {_fmt(need, '.2f')} ({fraction:.0%} of {_fmt(memcpy_gbps, '.2f')})",
            _check(None if value is None or need is None else value >= need))


def verdicts(results: Sequence[dict[str, Any]], memcpy_gbps: float | None) -> list[Verdict]:
    """One verdict per target for each kvbridge result (labels starting with "kvbridge")."""
    ours = [r for r in results if r["connector"].startswith("kvbridge")]
    theirs = [r for r in results if not r["connector"].startswith("kvbridge")]
    out: list[Verdict] = []
    for res in ours:
        name = res["connector"]
        if res.get("failed"):
            out.append((name, "run", "FAILED", "finishes", "FAIL"))
            continue
        rates = later_gbps(res)
        mid = statistics.median(rates) if rates else None
        out.append(_gbps_verdict(name, "GB/s, median round after the first", mid, rates, GBPS_FRACTION,
                                 memcpy_gbps))
        out.append(_gbps_verdict(name, "GB/s, worst round after the first", min(rates) if rates else None,
                                 rates, GBPS_WORST_FRACTION, memcpy_gbps))
        ovh = res.get("first_request_overhead_ms")
        out.append((name, "first-request overhead", f"{_fmt(ovh, '.1f')} ms", f"< {OVERHEAD_MS:.0f} ms",
                    _check(None if ovh is None else ovh < OVERHEAD_MS)))
        probs = res.get("problems") or []
        out.append((name, "clean run (failures, ignored notifications)",
                    "none" if not probs else "; ".join(probs)[:120], "none", _check(not probs)))
        for other in theirs:
            tag = f"vs {other['connector']}"
            if other.get("failed"):
                why = f"{other['connector']} failed"
                out.append((name, f"steady TTFT {tag}", why, f"<= {TTFT_RATIO}x", "n/a"))
                out.append((name, f"first-request overhead {tag}", why, f"<= {OVERHEAD_RATIO}x", "n/a"))
                continue
            a, b = res.get("steady_ttft_ms"), other.get("steady_ttft_ms")
            ratio = a / b if a is not None and b else None
            out.append((name, f"steady TTFT {tag}", f"{_fmt(a, '.1f')} / {_fmt(b, '.1f')} ms = "
                        + (f"{ratio:.2f}x" if ratio is not None else "no ratio"), f"<= {TTFT_RATIO}x",
                        _check(None if ratio is None else ratio <= TTFT_RATIO)))
            a, b = res.get("first_request_overhead_ms"), other.get("first_request_overhead_ms")
            ratio = a / b if a is not None and b is not None and b > 0 else None
            out.append((name, f"first-request overhead {tag}",
                        f"{_fmt(a, '.1f')} / {_fmt(b, '.1f')} ms = "
                        + (f"{ratio:.2f}x" if ratio is not None else "no ratio (theirs <= 0)"),
                        f"<= {OVERHEAD_RATIO}x", _check(None if ratio is None else ratio <= OVERHEAD_RATIO)))
    return out


def summary_rows(results: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    """(connector, steady TTFT, first-request overhead, queue->scheduled wait of round 0 and
    steady, GB/s per round, handshake) per result."""
    rows = []
    for res in results:
        if res.get("failed"):
            rows.append((res["connector"], "FAILED", "-", "-", "-", res["failed"][:60]))
            continue
        hs = res.get("handshake_s") or {}
        parts = [f"{k.removesuffix('_s')} {statistics.median(v) * 1e3:.1f}" for k, v in hs.items() if v]
        rates = [f"{_fmt(r.get('load GB/s'), '.2f')} ({_fmt(r.get('GB/s'), '.2f')})" for r in res["rounds"]]
        rows.append((res["connector"], f"{_fmt(res.get('steady_ttft_ms'), '.1f')} ms",
                     f"{_fmt(res.get('first_request_overhead_ms'), '.1f')} ms",
                     f"{_fmt(res.get('first_wait_ms'), '.1f')} / {_fmt(res.get('steady_wait_ms'), '.1f')} ms",
                     " / ".join(rates), ", ".join(parts) + (" ms" if parts else "")))
    return rows


def print_tables(results: Sequence[dict[str, Any]], memcpy_gbps: float | None,
                 memcpy_all: Sequence[float] = ()) -> list[Verdict]:
    """Print the side-by-side table and the verdicts; returns the verdicts."""
    print("\n== side by side ==")
    mc = ", ".join(f"{x:.2f}" for x in memcpy_all)
    print(f"memcpy (1 thread, one round's bytes, best of 5, before each connector): "
          f"{mc or '-'} GB/s; median {_fmt(memcpy_gbps, '.2f')}")
    head = ("connector", "steady TTFT", "1st-req overhead", "queue->sched r0 / steady",
            "load GB/s (NIXL-telemetry GB/s) rounds 0..", "handshake")
    rows = [head, *summary_rows(results)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    vs = verdicts(results, memcpy_gbps)
    print("\n== targets (issues 13, 23) ==")
    if not vs:
        print("  (no kvbridge result in this run)")
    widths = [max(len(v[i]) for v in vs) for i in range(5)] if vs else []
    for v in vs:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(v, widths, strict=True)))
    return vs
