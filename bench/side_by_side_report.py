"""Figures and verdicts of bench_side_by_side.py (pure functions over its round records).

A result is ``{"label", "rounds": [{"ttft_ms", "bytes", "GB/s", "load", "problems"}...],
"failed"?: str, "evidence"?: {...}}`` per connector, A (kvbridge) first; round 0 is the
first request. Targets (issue 23): A's steady decode TTFT <= 0.8x B's; at least 10
steady rounds (after round 0); first-request overhead < 60 ms; KV moved (decode
bytes > 0) in every round; a clean run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

TTFT_RATIO = 0.8
OVERHEAD_MS = 60.0
MIN_STEADY_ROUNDS = 10  # issue 23: at least 10 rounds each, judged on the rounds after the first

Verdict = tuple[str, str, str, str, str]  # connector, figure, value, target, PASS/FAIL/n/a


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """Steady TTFT (median, min, max of rounds >= 1), first TTFT, first-request overhead,
    GB/s median, and the rounds that moved no bytes."""
    rounds = res.get("rounds", [])
    ttfts = [r["ttft_ms"] for r in rounds]
    later = [t for t in ttfts[1:] if t is not None]
    first = ttfts[0] if ttfts else None
    steady = statistics.median(later) if later else None
    rates = [r["GB/s"] for r in rounds[1:] if r.get("GB/s") is not None]
    return {
        "rounds": len(rounds),
        "first_ms": first,
        "steady_ms": steady,
        "steady_rounds": len(later),
        "steady_min_ms": min(later) if later else None,
        "steady_max_ms": max(later) if later else None,
        "overhead_ms": first - steady if first is not None and steady is not None else None,
        "gbps_median": statistics.median(rates) if rates else None,
        "wait_ms": _median([r.get("wait_ms") for r in rounds[1:]]),
        "transfer_ms": _median([r.get("transfer_ms") for r in rounds[1:]]),
        "no_kv_rounds": [i for i, r in enumerate(rounds) if not r.get("bytes")],
        "problems": sorted({p for r in rounds for p in r.get("problems", [])}),
    }


def verdicts(results: Sequence[dict[str, Any]]) -> list[Verdict]:
    """The targets for A (results[0]) against B (results[1]), and the KV checks of both."""
    out: list[Verdict] = []
    sums = [summary(r) for r in results]
    for res, s in zip(results, sums, strict=True):
        name = res["label"]
        if res.get("failed"):
            out.append((name, "run", "FAILED " + res["failed"][:100], "all rounds finish", "FAIL"))
        out.append((name, "KV moved (decode bytes > 0) in every round",
                    "yes" if not s["no_kv_rounds"] and s["rounds"] else
                    f"no bytes in rounds {s['no_kv_rounds']}", "every round",
                    "PASS" if s["rounds"] and not s["no_kv_rounds"] else "FAIL"))
        out.append((name, "steady rounds measured (after round 0)", str(s["steady_rounds"]),
                    f">= {MIN_STEADY_ROUNDS}", "PASS" if s["steady_rounds"] >= MIN_STEADY_ROUNDS else "FAIL"))
        out.append((name, "clean run (failure counters, failure log lines)",
                    "none" if not s["problems"] else "; ".join(s["problems"])[:120], "none",
                    "PASS" if not s["problems"] else "FAIL"))
    a, b = sums[0], sums[1]
    name = results[0]["label"]
    ratio = a["steady_ms"] / b["steady_ms"] if a["steady_ms"] and b["steady_ms"] else None
    out.append((name, f"steady decode TTFT vs {results[1]['label']}",
                f"{_fmt(a['steady_ms'])} / {_fmt(b['steady_ms'])} ms = "
                + (f"{ratio:.2f}x" if ratio is not None else "no ratio"),
                f"<= {TTFT_RATIO}x", "n/a" if ratio is None else ("PASS" if ratio <= TTFT_RATIO else "FAIL")))
    for res, s in zip(results, sums, strict=True):
        ovh = s["overhead_ms"]
        out.append((res["label"], "first-request overhead", f"{_fmt(ovh)} ms", f"< {OVERHEAD_MS:.0f} ms",
                    "n/a" if ovh is None else ("PASS" if ovh < OVERHEAD_MS else "FAIL")))
    return out


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def markdown_rows(meta: dict[str, Any], results: Sequence[dict[str, Any]],
                  vs: Sequence[Verdict]) -> list[str]:
    """One docs/benchmarks.md row per connector."""
    ratio = next((v for v in vs if v[1].startswith("steady decode TTFT")), None)
    rows = []
    for i, res in enumerate(results):
        s = summary(res)
        verdict = f"{ratio[2].split('= ')[-1]}: {ratio[4]}" if ratio and i == 0 else ""
        rows.append(f"| {meta['family']} | {res['label']} | {_fmt(s['steady_ms'])} "
                    f"({_fmt(s['steady_min_ms'])}-{_fmt(s['steady_max_ms'])}) ms | {_fmt(s['first_ms'])} ms | "
                    f"{_fmt(s['overhead_ms'])} ms | {s['rounds']}"
                    + (f" (failed: {res['failed'][:60]})" if res.get("failed") else "")
                    + f" | {'no' if s['no_kv_rounds'] or not s['rounds'] else 'yes'} | {verdict} |")
    return rows


def print_report(meta: dict[str, Any], results: Sequence[dict[str, Any]]) -> list[Verdict]:
    """Per-round table, summary, stall evidence, verdicts and markdown rows; returns verdicts."""
    print(f"\n== rounds (decode TTFT mean over the batch, ms; KV MiB) == load {meta['load_start']} "
          f"-> {meta.get('load_end', '?')}")
    n = max((len(r["rounds"]) for r in results), default=0)
    rows = [["round", *[f"{r['label']} TTFT / MiB" for r in results]]]
    for i in range(n):
        cells = [str(i)]
        for res in results:
            rr = res["rounds"][i] if i < len(res["rounds"]) else None
            cells.append("-" if rr is None else f"{_fmt(rr['ttft_ms'])} / {rr['bytes'] / 2**20:.2f}")
        rows.append(cells)
    _table(rows)
    print("\n== summary ==")
    rows = [["connector", "steady TTFT median (min-max)", "first TTFT", "1st-req overhead",
             "queue->sched median", "transfer ms median", "GB/s median", "rounds"]]
    for res in results:
        s = summary(res)
        rows.append([res["label"], f"{_fmt(s['steady_ms'])} ({_fmt(s['steady_min_ms'])}-"
                     f"{_fmt(s['steady_max_ms'])}) ms", f"{_fmt(s['first_ms'])} ms",
                     f"{_fmt(s['overhead_ms'])} ms", f"{_fmt(s['wait_ms'])} ms", f"{_fmt(s['transfer_ms'])} ms",
                     _fmt(s["gbps_median"], ".2f"), str(s["rounds"])])
    _table(rows)
    for res in results:
        hs = (res["rounds"][0].get("handshake_ms") or {}) if res["rounds"] else {}
        if hs:
            print(f"  {res['label']} first handshake (decode log): "
                  + ", ".join(f"{k.removesuffix('_s')} " + "/".join(f"{x:.1f}" for x in v) + " ms"
                              for k, v in hs.items()))
    for res in results:
        for eng, ev in (res.get("evidence") or {}).items():
            print(f"\n-- {eng} (alive: {ev['alive']}; full log {ev['log']}) notable lines:")
            for ln in ev["notable"]:
                print("   " + ln[:240])
            print("   CPU of the pair (busiest threads): " + " | ".join(ev.get("cpu", [])))
            print("   tail:")
            for ln in ev["tail"]:
                print("   " + ln[:240])
    vs = verdicts(results)
    print("\n== targets (issue 23) ==")
    _table([list(v) for v in vs])
    print("\n== markdown (docs/benchmarks.md) ==")
    print(f"<!-- {meta['started']}, load {meta['load_start']} -> {meta.get('load_end')}, "
          f"{meta['model']}, {meta['prompts']}, {meta['cpus']}, idle pair {meta.get('idle_pair')}, {meta.get('wall_s', 0):.0f} s -->")
    for row in markdown_rows(meta, results, vs):
        print(row)
    return vs
