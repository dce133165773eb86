#!/usr/bin/env python3
"""KVBridgeConnector and vLLM's NixlConnector side by side, rounds interleaved (issue 23, item 6).

    .e2e/venv/bin/python bench/bench_side_by_side.py [--model-family llama|gemma3|granite|qwen3next]
                                                     [--rounds 11] [--json out.json]

Both engine pairs (prefill + decode per connector, four long-lived in-process vLLM
engines, ``engine_runner.py --serve``) stay up for the whole run, under the same CPU
pinning (every prefill engine on core 0, every decode engine on core 1 by default).
Rounds alternate A, B, A, B, ...: round r of each connector runs the same prompts
(new prompts every round, so no cache can help), one connector right after the other.

Per round it records the decode engine's time to first token (vLLM's
first_token_latency: arrival at decode -> first token, which includes the handshake
in round 0, the pull and the last prompt token's forward pass), averaged over the
batch, and the bytes the decode engine's connector metrics say it pulled: a round
that moved no bytes is a silent recompute and fails the run. Steady TTFT is the
median (with min and max) of rounds >= 1; first-request overhead is round 0 minus
that median. Before round 0 every engine runs one local request (no connector
involved), so that round 0 holds the connector's first-request costs (handshake, first
transfer) and not the engine's first forward pass. Each engine's CPU use while idle (seconds of CPU per second of wall
time, from /proc, before the first round) is printed too: a NIXL progress thread
that spins shows there, and it takes a core away from whatever shares it.

Target (issue 23): kvbridge's steady decode TTFT at most 0.8x NixlConnector's;
printed with PASS/FAIL, next to the first-request overheads (target < 60 ms) and a
"KV moved in every round" check. When one connector's pair fails or stalls past
``--round-deadline-s``, its engine log tails and matching lines are printed and
saved, and the other connector's rounds go on.

Needs the e2e environment (scripts/setup_e2e_env.sh). Prints each figure of issue 23 with its target and PASS/FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

from e2e_harness import (  # noqa: E402
    BENCH_CONNECTORS,
    EngineConfig,
    EngineFailed,
    handshake_timings,
    make_prompts,
    missing_env_reason,
    tiny_llama,
    transfer_figures,
    transfer_problems,
)
from engine_pool import Engine, EngineDef, EnginePool, pd_round  # noqa: E402
from families import FAMILIES, tiny_family_model  # noqa: E402
from proc_cpu import describe  # noqa: E402
from side_by_side_report import print_report  # noqa: E402

#: log lines worth showing when a pair stalls or fails
STALL_PATTERNS = re.compile(r"(?i)error|timed? ?out|expired|fail|stall|handshake|Traceback|abort")


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its threads (children excluded)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(engines: list[Engine], window_s: float) -> dict[str, float]:
    """Each engine's CPU seconds per wall second over ``window_s`` while nobody asks it anything."""
    before = {e.name: cpu_seconds(e.proc.pid) for e in engines}
    t0 = time.monotonic()
    time.sleep(window_s)
    dt = time.monotonic() - t0
    return {e.name: (cpu_seconds(e.proc.pid) - before[e.name]) / dt for e in engines}


def freeze(engines: list[Engine], stop: bool) -> None:
    """SIGSTOP (or SIGCONT) each engine's process group: a paused pair uses no CPU."""
    for e in engines:
        if e.alive():
            try:
                os.killpg(e.proc.pid, signal.SIGSTOP if stop else signal.SIGCONT)
            except ProcessLookupError:
                pass


def stall_evidence(engines: list[Engine], out_dir: Path) -> dict[str, Any]:
    """Log tails and notable lines of a pair that failed, copied next to the report."""
    ev: dict[str, Any] = {}
    cpu = describe({e.name: e.proc.pid for e in engines if e.alive()}, 2.0, 4)
    for e in engines:
        text = e.log_since(0)
        (out_dir / f"{e.name}.log").write_text(text)
        lines = [ln for ln in text.splitlines() if STALL_PATTERNS.search(ln)]
        ev[e.name] = {"alive": e.alive(), "notable": lines[-15:], "cpu": cpu,
                      "tail": text.splitlines()[-15:], "log": str(out_dir / f"{e.name}.log")}
    return ev


def round_record(run: Any, wall_s: float, load: str) -> dict[str, Any]:
    outs = run.decode["rounds"][0]["outputs"]
    ttfts = [o["metrics"]["first_token_latency"] for o in outs if o.get("metrics")]
    figs = transfer_figures(run, 0)
    # queued -> scheduled in the decode scheduler: the load's wait (handshake, READs, the
    # completion reaching the scheduler), without the front end and the forward pass
    waits = [(o["metrics"]["scheduled_ts"] - o["metrics"]["queued_ts"]) for o in outs
             if (o.get("metrics") or {}).get("scheduled_ts") and o["metrics"].get("queued_ts")]
    return {"ttft_ms": statistics.fmean(ttfts) * 1e3 if ttfts else None,
            "wait_ms": statistics.fmean(waits) * 1e3 if waits else None,
            "transfer_ms": figs.get("transfer_s", 0.0) * 1e3,
            "ttft_max_ms": max(ttfts) * 1e3 if ttfts else None,
            "bytes": figs.get("bytes", 0.0), "transfers": figs.get("transfers", 0),
            "GB/s": figs.get("GB/s"), "wall_s": wall_s, "load": load,
            "problems": transfer_problems(run),
            "handshake_ms": {k: [x * 1e3 for x in v]
                             for k, v in handshake_timings(run.decode_log, run.connector).items() if v},
            "tokens": [len(o["token_ids"]) for o in outs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-family", choices=("llama", *FAMILIES), default="llama")
    ap.add_argument("--connector", action="append", choices=sorted(BENCH_CONNECTORS),
                    help="the two connectors, in the order their rounds run (default: kvbridge, nixl-host); "
                         "the verdicts judge kvbridge against the other")
    ap.add_argument("--rounds", type=int, default=11,
                    help="rounds per connector, round 0 (the first request) included (>= 2; the default "
                         "gives the 10 steady rounds issue 23 asks for)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 4 (3 for a family)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 512 (150 for a family)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4, help="llama only")
    ap.add_argument("--kv-heads", type=int, default=8, help="llama only")
    ap.add_argument("--head-dim", type=int, default=64, help="llama only")
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--cpus", choices=("pinned", "nobind"), default="pinned",
                    help="pinned: prefill engines on core 0, decode engines on core 1; "
                         "nobind: no pinning, one OpenMP thread each")
    ap.add_argument("--run-idle-pair", action="store_true",
                    help="leave the pair whose turn it is not running (default: SIGSTOP it for the "
                         "other pair's round, so that its idle CPU use, e.g. a spinning NIXL "
                         "progress thread, cannot slow the other connector)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the one local request per engine before round 0 (then the first-"
                         "request overhead also holds each engine's first forward pass)")
    ap.add_argument("--round-deadline-s", type=float, default=180)
    ap.add_argument("--idle-window-s", type=float, default=3.0)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    # a timeout's SIGTERM must still stop the servers (each runs in its own session)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (round 0 is the first request)")
    names = args.connector or ["kvbridge", "nixl-host"]
    if len(names) != 2:
        ap.error("give exactly two --connector (A and B), or none")
    family = args.model_family != "llama"
    n = args.num_prompts or (3 if family else 4)
    length = args.prompt_len or (150 if family else 512)
    reason = missing_env_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvb-sbs-"))
    if family:
        fam = FAMILIES[args.model_family]
        model = tiny_family_model(args.model_family)
        engine_kw, env, desc = dict(fam.engine), dict(fam.env), fam.description
    else:
        model = tiny_llama(args.kv_heads, layers=args.layers, heads=8, head_dim=args.head_dim,
                           intermediate=2 * 8 * args.head_dim)
        engine_kw, env = {}, {}
        desc = f"Llama {args.layers} layers, {args.kv_heads} KV heads x {args.head_dim}, fp32"
    engine_kw.update(kv_cache_memory_bytes=args.kv_cache_mib * 2**20,
                     max_model_len=max(1024, length + args.max_tokens + 32))
    p_cpus, d_cpus = ("0", "1") if args.cpus == "pinned" else ("nobind", "nobind")
    base = EngineConfig(in_process=True, engine=engine_kw, extra_env=env)
    pairs: dict[str, tuple[EngineDef, EngineDef]] = {}
    for tag in names:
        c = BENCH_CONNECTORS[tag]
        pairs[tag] = (EngineDef(f"{tag}-prefill", model, "prefill", c, replace(base, cpus=p_cpus)),
                      EngineDef(f"{tag}-decode", model, "decode", c, replace(base, cpus=d_cpus)))
    meta: dict[str, Any] = {
        "model": desc, "family": args.model_family, "prompts": f"{n} x {length} tokens",
        "max_tokens": args.max_tokens, "rounds": args.rounds,
        "warmup": not args.no_warmup,
        "idle_pair": "running" if args.run_idle_pair else "paused (SIGSTOP) during the other's round",
        "cpus": f"prefill {p_cpus}, decode {d_cpus}",
        "load_start": load_average(), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workdir": str(workdir), "command": " ".join(sys.argv)}
    print(f"side by side: {desc}; {meta['prompts']}; {args.rounds} rounds each, interleaved "
          f"{names[0]}, {names[1]}, ...; {meta['cpus']}; idle pair {meta['idle_pair']}; "
          f"load {meta['load_start']}", flush=True)
    pool = EnginePool(workdir)
    results: dict[str, dict[str, Any]] = {t: {"label": BENCH_CONNECTORS[t].label, "rounds": []} for t in names}
    t_start = time.monotonic()
    try:
        engines: dict[str, tuple[Engine, Engine]] = {}
        all_defs = [d for t in names for d in pairs[t]]
        running = pool.use(*all_defs)
        for t in names:
            engines[t] = (running[all_defs.index(pairs[t][0])], running[all_defs.index(pairs[t][1])])
        meta["engine_start_s"] = pool.report()
        if not args.no_warmup:  # each engine's first forward pass, outside round 0
            warm = make_prompts([min(length, 64)], seed=999)
            for e in running:
                e.call("generate", args.round_deadline_s, prompts=warm, max_tokens=2, params=None)
        meta["idle_cpu"] = idle_cpu(running, args.idle_window_s)
        print(f"engines up ({meta['engine_start_s']}); idle CPU per engine: "
              + ", ".join(f"{k} {v:.2f}" for k, v in meta["idle_cpu"].items()), flush=True)
        for r in range(args.rounds):
            prompts = make_prompts([length] * n, seed=1000 + r)
            for t in names:
                res = results[t]
                if res.get("failed"):
                    continue
                p, d = engines[t]
                if not args.run_idle_pair:
                    for other in names:
                        freeze(list(engines[other]), stop=other != t)
                t0 = time.monotonic()
                try:
                    run = pd_round(p, d, prompts, args.max_tokens, deadline_s=args.round_deadline_s,
                                   flush=False)
                except EngineFailed as exc:
                    res["failed"] = f"round {r}: " + (str(exc).splitlines() or ["?"])[0]
                    res["evidence"] = stall_evidence([p, d], workdir)
                    print(f"  {t} round {r} FAILED after {time.monotonic() - t0:.0f} s: {res['failed']}",
                          flush=True)
                    pool.discard(p, d)
                    continue
                rec = round_record(run, time.monotonic() - t0, load_average())
                res["rounds"].append(rec)
                print(f"  {t:10s} round {r:2d}: TTFT {rec['ttft_ms']:8.1f} ms, {rec['transfers']:.0f} "
                      f"transfers, {rec['bytes'] / 2**20:.2f} MiB, load {rec['load']}", flush=True)
    finally:
        for e in pool.engines.values():
            freeze([e], stop=False)
        pool.close()
    meta["load_end"] = load_average()
    meta["wall_s"] = time.monotonic() - t_start
    # the TTFT target is kvbridge's against NixlConnector's: judge with kvbridge as A, whatever
    # order the rounds ran in
    judged = sorted(names, key=lambda t: not t.startswith("kvbridge"))
    verdicts = print_report(meta, [results[t] for t in judged])
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results, "verdicts": verdicts},
                                        indent=1, default=str))
        print(f"figures written to {args.json}")
    return 1 if any(v[-1] == "FAIL" for v in verdicts) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as exc:  # model build failed
        print(exc, file=sys.stderr)
        sys.exit(2)
