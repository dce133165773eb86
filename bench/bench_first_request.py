#!/usr/bin/env python3
"""First-request overhead of a prefill/decode pair in real vLLM (issue 23, item 3).

    flock /tmp/kvb-heavy.lock .e2e/venv/bin/python bench/bench_first_request.py \\
        [--pairs 4] [--restarts 4] [--connector kvbridge|nixl] [--json out.json]

A *first handshake* is the first request between a decode engine and a prefill
engine it has never talked to. This bench makes ``--pairs`` fresh engine pairs
and, for each, ``--restarts`` prefill restarts (a new prefill engine, same
decode engine): ``pairs * (1 + restarts)`` first handshakes. Before a first
request, every new engine serves one local request, so that its own first
forward pass (which is not the connector's doing) is paid before the clock runs.
Then one pull round (the first request: handshake, READs) and ``--steady``
more rounds with other prompts of the same lengths.

First-request overhead = decode TTFT of the first round minus the median of
the steady rounds (vLLM's ``first_token_latency``, mean over the prompts).
Prints p50 and p100 with the targets (p50 < 60 ms, p100 < 150 ms) and
PASS/FAIL, and, for kvbridge, each first request's steps from the decode
engine's log (ms after the request named the prefill engine: handshake start
and end, first READ posted, first completion seen; and the handshake's
phases: metadata, agents, lists).

Engines are in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), forked from a
server that imported vLLM once, one OpenMP thread each, unpinned, as in the
e2e suite. Needs the e2e environment (scripts/setup_e2e_env.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

from e2e_harness import (  # noqa: E402
    CONNECTORS,
    EngineConfig,
    make_prompts,
    missing_env_reason,
    tiny_llama,
    transfer_problems,
)

TARGET_P50_MS = 60.0
TARGET_P100_MS = 150.0
MIN_HANDSHAKES = 20  # issue 23: over at least 20 first handshakes

_HS = re.compile(r"handshake with engine \S+ \(TP \d+\) took ([0-9.]+) ms: metadata ([0-9.]+) ms, "
                 r"agents ([0-9.]+) ms, lists ([0-9.]+) ms; queued ([0-9.]+) ms")
_FIRST = re.compile(r"first transfer with engine \S+: handshake began at ([0-9.na]+) ms, ended at "
                    r"([0-9.na]+) ms, first post at ([0-9.na]+) ms, first completion seen at ([0-9.na]+) ms")
STEPS = ("handshake_ms", "metadata_ms", "agents_ms", "lists_ms", "queued_ms",
         "hs_begin_at", "hs_end_at", "post_at", "done_at")


def ttft_ms(rec: dict[str, Any]) -> float:
    t = [o["metrics"]["first_token_latency"] for o in rec["outputs"]
         if o.get("metrics") and o["metrics"].get("first_token_latency") is not None]
    return statistics.fmean(t) * 1e3 if t else float("nan")


def steps_from_log(log: str) -> dict[str, float]:
    out: dict[str, float] = {}
    m = _HS.search(log)
    if m:
        out.update(zip(STEPS[:5], map(float, m.groups()), strict=True))
    m = _FIRST.search(log)
    if m:
        out.update(zip(STEPS[5:], map(float, m.groups()), strict=True))
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--restarts", type=int, default=4, help="prefill restarts per pair")
    ap.add_argument("--steady", type=int, default=3, help="rounds after the first, for the steady TTFT")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--connector", default="kvbridge", choices=sorted(CONNECTORS))
    ap.add_argument("--baseline-pairs", type=int, default=0,
                    help="kvbridge: this many more pairs (with --restarts each) with warm_up off, "
                         "interleaved with the others, as the same run's baseline")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    reason = missing_env_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    from engine_pool import EngineDef, running_pool
    from forkserver import ForkServer

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvb-first-request-"))
    model = tiny_llama(2, layers=args.layers)
    base = CONNECTORS[args.connector]
    variants = {"": base}
    if args.baseline_pairs and args.connector == "kvbridge":
        variants["no-warm-up"] = replace(base, label="kvbridge (warm_up off)",
                                         extra_config={**base.extra_config, "warm_up": False})
    plan = [""] * args.pairs
    for k in range(min(args.baseline_pairs, args.pairs) if len(variants) > 1 else 0):
        plan.insert(2 * k + 1, "no-warm-up")
    cfg = EngineConfig(cpus="nobind", in_process=True)
    server = ForkServer(workdir / "forkserver", os.environ)
    try:
        server.wait_ready()
    except RuntimeError as exc:
        print(f"fork server off ({exc}); engines start as processes of their own")
        server.close()
        server = None
    seed = [100]

    def prompts() -> list[list[int]]:
        seed[0] += 1
        return make_prompts([args.prompt_len] * args.num_prompts, seed=seed[0])

    firsts: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        with running_pool(workdir, "first-request", server) as pool:
            for i, variant in enumerate(plan):
                conn = variants[variant]
                d_def = EngineDef(f"d{i}", model, "decode", conn, cfg)
                for j in range(args.restarts + 1):
                    p_def = EngineDef(f"p{i}-{j}", model, "prefill", conn, cfg)
                    p, d = pool.use(p_def, d_def)
                    for e in (p, d) if j == 0 else (p,):
                        e.call("generate", prompts=prompts(), max_tokens=1, params=None)
                    off = d.log_offset()
                    first = pool.round(p, d, prompts(), args.max_tokens)
                    log = d.log_since(off)
                    steady = [ttft_ms(pool.round(p, d, prompts(), args.max_tokens).decode["rounds"][0])
                              for _ in range(args.steady)]
                    f_ms = ttft_ms(first.decode["rounds"][0])
                    rec = {"variant": variant or args.connector, "pair": i, "restart": j, "first_ms": f_ms, "steady_ms": statistics.median(steady),
                           "overhead_ms": f_ms - statistics.median(steady), **steps_from_log(log)}
                    problems += [f"pair {i} restart {j}: {x}" for x in transfer_problems(first)]
                    firsts.append(rec)
                    print(f"{variant or args.connector:10s} pair {i} {'fresh  ' if j == 0 else f'restart {j}'}: first {f_ms:7.1f} ms, steady "
                          f"{rec['steady_ms']:6.1f} ms, overhead {rec['overhead_ms']:7.1f} ms  " +
                          " ".join(f"{k}={rec[k]:.1f}" for k in STEPS if k in rec), flush=True)
    finally:
        if server is not None:
            server.close()
    summary = {}
    for variant in variants:
        name = variant or args.connector
        mine = [r for r in firsts if r["variant"] == name]
        ov = [r["overhead_ms"] for r in mine]
        if not ov:
            continue
        p50, p100 = statistics.median(ov), max(ov)
        summary[name] = {"n": len(ov), "p50_ms": p50, "p100_ms": p100}
        fresh = sum(1 for r in mine if r["restart"] == 0)
        print(f"\n{name}: {len(ov)} first handshakes ({fresh} fresh pairs, {len(ov) - fresh} prefill "
              f"restarts); load {os.getloadavg()[0]:.1f}")
        print(f"first-request overhead p50 {p50:.1f} ms (target < {TARGET_P50_MS:.0f}): "
              f"{'PASS' if p50 < TARGET_P50_MS else 'FAIL'}; p100 {p100:.1f} ms (target < "
              f"{TARGET_P100_MS:.0f}): {'PASS' if p100 < TARGET_P100_MS else 'FAIL'}" +
              ("" if variant else  # the baseline variant runs fewer pairs by design
               f"; first handshakes {len(ov)} (target >= {MIN_HANDSHAKES}, fresh pairs and restarts both): "
               f"{'PASS' if len(ov) >= MIN_HANDSHAKES and 0 < fresh < len(ov) else 'FAIL'}"))
        for kind, sel in (("fresh pairs", 0), ("restarts", 1)):
            xs = [r["overhead_ms"] for r in mine if (r["restart"] > 0) == bool(sel)]
            if xs:
                print(f"  {kind:11s}: overhead p50 {statistics.median(xs):7.1f}  max {max(xs):7.1f} ms")
        for k in STEPS:
            xs = [r[k] for r in mine if k in r and r[k] == r[k]]
            if xs:
                print(f"  {k:13s} p50 {statistics.median(xs):7.1f}  max {max(xs):7.1f} ms")
    if problems:
        print("PROBLEMS:\n  " + "\n  ".join(problems[:10]))
    if args.json:
        args.json.write_text(json.dumps({"connector": args.connector, "firsts": firsts,
                                         "summary": summary, "problems": problems}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
