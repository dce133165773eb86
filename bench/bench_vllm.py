#!/usr/bin/env python3
"""Disaggregated prefill/decode benchmark with real vLLM engines, per KV connector.

    .e2e/venv/bin/python bench/bench_vllm.py [--connector nixl ...] [--rounds 4] [--json out.json]

For each connector (same model, same prompts, same run) it starts a prefill and a
decode engine (separate processes, one CPU core each by default) and runs
``--rounds`` batches of prompts through them. Per round it reports, from the
decode engine:

  * time to first token with transfer (vLLM's per-request first_token_latency:
    arrival at decode -> first token, which includes handshake, pull and the
    last prompt token's forward pass), mean and max over the batch;
  * mean queued -> scheduled time in the decode scheduler (the load's wait,
    without the front end and the forward pass, which CPU contention inflates);
  * transfer count, seconds, bytes and GB/s (the connector's own metrics);
  * load GB/s: the round's bytes over its load time as issue 23 defines it, from the
    first request queued in the decode scheduler (its load starts) to the last one
    scheduled (its completion seen by the scheduler), which the GB/s targets use;
and once per run the handshake phases parsed from the decode log, engine start
times, and the first-request overhead = round-0 TTFT minus the median TTFT of
the later rounds. ``--local-baseline`` adds a non-disaggregated engine's TTFT on
the same prompts (prefill computed locally) as a reference.

Before each connector it measures single-thread memcpy of one round's bytes. At
the end it prints every connector side by side (steady TTFT, first-request
overhead, GB/s per round, handshake) and issues 13 and 23's targets for each kvbridge
variant with PASS/FAIL (bench/vllm_targets.py): load GB/s of the rounds after the
first against memcpy (median >= 50 %, worst >= 35 %), overhead,
a clean run, and TTFT / overhead ratios against each NixlConnector variant.
Connectors by default: kvbridge, kvbridge-step-poll (READs checked by the step
poll only, the behaviour before ``complete_in_background``), nixl (vLLM's
NixlConnector, defaults) and nixl-host (its documented host-buffer settings).

Transfer GB/s is bytes over the sum of per-transfer durations from NIXL
telemetry (post -> completion first seen by a state check), vLLM's convention.
A transfer's duration therefore includes the time until its owner next checked
it: kvbridge checks a READ from its posting thread until it completes
(``complete_in_background``), so there it is the copy; transfers that overlap
count their common time twice (kvbridge posts a round's READs one request
after another, so they rarely overlap).

``--model-family granite|qwen3next|gemma3`` runs a tiny random checkpoint of that
family instead of the Llama (scripts/make_tiny_hybrids.py; Mamba2 hybrid, gated
delta-net hybrid, sliding window + full attention), by default kvbridge and nixl only
with a short run (3 prompts of 150 tokens, 3 rounds); it prints the same decode TTFT
and first-request overhead for both connectors. Its KV per round is the attention
layers' share estimated as for the Llama (Mamba state comes on top).

Needs the e2e environment (scripts/setup_e2e_env.sh). Prints each figure of issue 23
with its target and PASS/FAIL; its exit status reflects failed runs, not missed targets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

from e2e_harness import (  # noqa: E402
    BENCH_CONNECTORS,
    DisaggRun,
    EngineConfig,
    EngineFailed,
    cpu_binding,
    handshake_timings,
    make_prompts,
    missing_env_reason,
    run_baseline,
    run_disaggregated,
    tiny_llama,
    transfer_figures,
    transfer_problems,
)
from families import FAMILIES, tiny_family_model  # noqa: E402
from load_phases import PHASES, load_phases, median_phases  # noqa: E402
from vllm_targets import print_tables  # noqa: E402

DEFAULT_ORDER = ("kvbridge", "kvbridge-step-poll", "nixl", "nixl-host")
#: the default connectors and run length for --model-family other than llama
FAMILY_ORDER = ("kvbridge", "nixl")
FAMILY_DEFAULTS = {"rounds": 3, "num_prompts": 3, "prompt_len": 150}
LLAMA_DEFAULTS = {"rounds": 4, "num_prompts": 4, "prompt_len": 512}


def host_memcpy_gbps(nbytes: int) -> float:
    """Single-thread memcpy of ``nbytes`` on this machine now (the baseline of every GB/s)."""
    from kvbridge.tools.memcpy import memcpy_gbps

    return memcpy_gbps(nbytes)


def _ttfts(outputs: list[dict[str, Any]]) -> list[float]:
    return [o["metrics"]["first_token_latency"] for o in outputs if o.get("metrics")]


def _waits(outputs: list[dict[str, Any]]) -> list[float]:
    """Per request: queued in the decode scheduler -> scheduled (for a remote prefill, the
    load's wait: handshake, READs, completion seen), without front-end and forward time."""
    out = []
    for o in outputs:
        m = o.get("metrics") or {}
        if m.get("scheduled_ts") and m.get("queued_ts"):
            out.append(m["scheduled_ts"] - m["queued_ts"])
    return out


def load_span_s(outputs: list[dict[str, Any]]) -> float | None:
    """A round's load time as issue 23 defines it: from the first request's arrival in the
    decode scheduler (its load starts) to the last one scheduled (its completion seen)."""
    ms = [o.get("metrics") or {} for o in outputs]
    q = [m["queued_ts"] for m in ms if m.get("queued_ts") and m.get("scheduled_ts")]
    s = [m["scheduled_ts"] for m in ms if m.get("queued_ts") and m.get("scheduled_ts")]
    return (max(s) - min(q)) if q and max(s) > min(q) else None


def summarise(run: DisaggRun, label: str, per_round: int) -> dict[str, Any]:
    rounds = []
    for r, rec in enumerate(run.decode["rounds"]):
        t = _ttfts(rec["outputs"])
        w = _waits(rec["outputs"])
        figs = transfer_figures(run, r)
        span = load_span_s(rec["outputs"])
        if span and figs.get("bytes"):
            figs["load_s"] = span
            figs["load GB/s"] = figs["bytes"] / span / 1e9
        rounds.append({
            "round": r,
            "ttft_mean_ms": statistics.fmean(t) * 1e3 if t else None,
            "ttft_max_ms": max(t) * 1e3 if t else None,
            "queued_to_scheduled_ms": statistics.fmean(w) * 1e3 if w else None,
            "decode_generate_ms": rec["generate_s"] * 1e3,
            **figs,
        })
    later = [x["ttft_mean_ms"] for x in rounds[1:] if x["ttft_mean_ms"] is not None]
    first = rounds[0]["ttft_mean_ms"]
    waits = [x["queued_to_scheduled_ms"] for x in rounds[1:] if x["queued_to_scheduled_ms"] is not None]
    hs = handshake_timings(run.decode_log, run.connector)
    return {
        "connector": label,
        "prefill_engine_start_s": run.prefill["engine_start_s"],
        "decode_engine_start_s": run.decode["engine_start_s"],
        "handshake_s": {k: v for k, v in hs.items()},
        "rounds": rounds,
        "steady_ttft_ms": statistics.median(later) if later else None,
        "first_request_overhead_ms": (first - statistics.median(later)) if later and first else None,
        "steady_wait_ms": statistics.median(waits) if waits else None,
        "first_wait_ms": rounds[0]["queued_to_scheduled_ms"],
        "problems": transfer_problems(run),
        # kvbridge pull: where the load time went, from the decode engine's timeline
        "load_phases": median_phases(load_phases(run.decode_log, per_round)[1:]),
    }


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_report(results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    print(f"\nmodel: {meta['model_desc']}; {meta['num_prompts']} prompts x {meta['prompt_len']} "
          f"tokens; KV per round {meta['kv_bytes_per_round'] / 2**20:.1f} MiB; cores: {meta['cpus']}")
    if meta.get("local_ttft_ms") is not None:
        print(f"local (no disaggregation) TTFT mean: {meta['local_ttft_ms']:.1f} ms")
    for res in results:
        if res.get("failed"):
            print(f"\n== {res['connector']} ==  FAILED after {res['wall_s']:.0f} s: {res['failed']}")
            continue
        print(f"\n== {res['connector']} ==  engine start P {res['prefill_engine_start_s']:.1f} s, "
              f"D {res['decode_engine_start_s']:.1f} s")
        for k, v in res["handshake_s"].items():
            print(f"  handshake {k}: " + ", ".join(f"{x * 1e3:.1f} ms" for x in v))
        print("  round  TTFT mean  TTFT max  queue->sched  xfers  xfer ms   MiB      GB/s  load ms  load GB/s")
        for r in res["rounds"]:
            print(f"  {r['round']:5d}  {_fmt(r['ttft_mean_ms'], '8.1f')}  {_fmt(r['ttft_max_ms'], '8.1f')}"
                  f"  {_fmt(r.get('queued_to_scheduled_ms'), '11.1f')}"
                  f"  {_fmt(r.get('transfers'), '6.0f')}  {_fmt((r.get('transfer_s') or 0) * 1e3, '7.2f')}"
                  f"  {_fmt((r.get('bytes') or 0) / 2**20, '7.2f')}  {_fmt(r.get('GB/s'), '7.2f')}"
                  f"  {_fmt((r.get('load_s') or 0) * 1e3, '7.2f')}  {_fmt(r.get('load GB/s'), '9.2f')}")
        print(f"  steady TTFT (median of rounds >= 1): {_fmt(res['steady_ttft_ms'], '.1f')} ms; "
              f"first-request overhead: {_fmt(res['first_request_overhead_ms'], '.1f')} ms")
        if res["problems"]:
            print("  PROBLEMS: " + "; ".join(res["problems"]))
        ph = res.get("load_phases") or {}
        if ph.get("total_ms") is not None:
            print("  where the load time went (decode timeline, median of rounds >= 1):")
            for key, what in PHASES:
                print(f"    {ph[key]:7.2f} ms  {what}")
            if ph["post_cpu_ms"] > 0:
                print(f"    copy rate while the posting thread ran: "
                      f"{meta['kv_bytes_per_round'] / (ph['post_cpu_ms'] / 1e3) / 1e9:.2f} GB/s")


def rescan(path: Path, names: list[str]) -> int:
    """The report of an earlier run, summarised again from what it left in its workdir."""
    old = json.loads(path.read_text())
    meta, workdir = old["meta"], Path(old["meta"]["workdir"])
    by_label = {r["connector"]: r for r in old["results"]}
    results = []
    for name in names:
        c = BENCH_CONNECTORS[name]
        d = workdir / name
        if (d / "decode.json").exists() and (d / "prefill.json").exists():
            run = DisaggRun(c, json.loads((d / "prefill.json").read_text()),
                            json.loads((d / "decode.json").read_text()),
                            (d / "prefill.log").read_text(errors="replace"),
                            (d / "decode.log").read_text(errors="replace"))
            results.append(summarise(run, c.label, meta["num_prompts"]))
        elif c.label in by_label:
            results.append(by_label[c.label])
    mc = meta.get("memcpy_gbps") or []
    print_report(results, meta)
    print_tables(results, statistics.median(mc) if mc else None, mc)
    return 1 if any(r.get("failed") for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", action="append", choices=sorted(BENCH_CONNECTORS),
                    help="connector(s) to measure, in order (default: kvbridge, "
                         "kvbridge-step-poll, nixl, nixl-host)")
    ap.add_argument("--model-family", choices=("llama", *FAMILIES), default="llama",
                    help="llama: the tiny Llama of --layers/--kv-heads/...; otherwise that "
                         "family's tiny checkpoint (shape flags ignored)")
    ap.add_argument("--rounds", type=int, default=None, help="default 4 (3 for a family)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 4 (3 for a family)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 512 (150 for a family)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv-cache-mib", type=int, default=256,
                    help="KV cache per engine (must hold one round)")
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--cpus", choices=("auto", "nobind"), default="auto",
                    help="auto: each worker pinned to its own core when the engines fit; "
                         "nobind: no pinning (NIXL progress threads may use any core)")
    ap.add_argument("--local-baseline", action="store_true",
                    help="also measure a non-disaggregated engine's TTFT")
    ap.add_argument("--deadline-s", type=float, default=900,
                    help="bound on one connector's whole run; a connector that passes it is "
                         "reported as failed and the others are still measured")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write all figures here")
    ap.add_argument("--rescan", type=Path, default=None, metavar="JSON",
                    help="run no engine: rebuild the report from the --json of an earlier run "
                         "(its memcpy figures, and the logs and results left in its workdir)")
    args = ap.parse_args(argv)
    family = args.model_family != "llama"
    for k, v in (FAMILY_DEFAULTS if family else LLAMA_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.rescan:
        return rescan(args.rescan, args.connector or list(DEFAULT_ORDER))

    reason = missing_env_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    names = args.connector or list(FAMILY_ORDER if family else DEFAULT_ORDER)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvb-bench-"))
    if family:
        # the tiny family checkpoints: 4 layers, 2 KV heads of 32 (attention layers only move KV)
        model = tiny_family_model(args.model_family)
        args.layers, args.kv_heads, args.head_dim = 4, 2, 32
    else:
        model = tiny_llama(args.kv_heads, layers=args.layers, heads=args.heads,
                           head_dim=args.head_dim, intermediate=2 * args.heads * args.head_dim)
    prompts = make_prompts([args.prompt_len] * args.num_prompts, seed=7)
    elem = 2 if family and FAMILIES[args.model_family].engine.get("dtype") == "bfloat16" else 4
    kv_bytes = 2 * args.layers * args.kv_heads * args.head_dim * elem * args.prompt_len * args.num_prompts
    family_env = dict(FAMILIES[args.model_family].env) if family else {}
    engine_kw = {**(FAMILIES[args.model_family].engine if family else {}),
                 "kv_cache_memory_bytes": args.kv_cache_mib * 2**20,
                 "max_model_len": max(1024, args.prompt_len + args.max_tokens + 32)}
    p_cpus, d_cpus = (cpu_binding(args.prefill_tp, args.decode_tp) if args.cpus == "auto"
                      else ("nobind", "nobind"))
    meta: dict[str, Any] = {
        "model_desc": (f"{FAMILIES[args.model_family].description}, "
                       f"{FAMILIES[args.model_family].engine.get('dtype', 'float32')}" if family else
                       f"{args.layers} layers, {args.kv_heads} KV heads x {args.head_dim}, fp32"),
        "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
        "kv_bytes_per_round": kv_bytes, "rounds": args.rounds, "workdir": str(workdir), "cpus": f"prefill {p_cpus}, decode {d_cpus}",
    }
    if args.local_baseline:
        base = run_baseline(model, prompts, args.max_tokens, workdir / "local",
                            engine=EngineConfig(cpus="0", engine=engine_kw))
        t = _ttfts(base.result["rounds"][0]["outputs"])
        meta["local_ttft_ms"] = statistics.fmean(t) * 1e3
        meta["local_engine_start_s"] = base.result["engine_start_s"]
    results = []
    memcpy: list[float] = []
    for name in names:
        memcpy.append(host_memcpy_gbps(kv_bytes))  # between engine pairs: nothing else of ours runs
        t0 = time.perf_counter()
        try:
            run = run_disaggregated(
                BENCH_CONNECTORS[name], model, prompts, args.max_tokens, workdir / name,
                prefill=EngineConfig(tp=args.prefill_tp, cpus=p_cpus,
                                     engine=engine_kw, extra_env=family_env),
                decode=EngineConfig(tp=args.decode_tp, cpus=d_cpus, engine=engine_kw,
                                    extra_env={**family_env, "KVBRIDGE_TIMELINE": "1"}),
                rounds=args.rounds, timings=True, deadline_s=args.deadline_s,
            )
        except EngineFailed as exc:  # keep the other connectors' figures
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            results.append({"connector": BENCH_CONNECTORS[name].label, "failed": first,
                            "wall_s": time.perf_counter() - t0,
                            "logs": str(workdir / name)})
            continue
        res = summarise(run, BENCH_CONNECTORS[name].label, args.num_prompts)
        res["wall_s"] = time.perf_counter() - t0
        results.append(res)
    meta["memcpy_gbps"] = memcpy
    print_report(results, meta)
    verdicts = print_tables(results, statistics.median(memcpy) if memcpy else None, memcpy)
    meta["verdicts"] = verdicts
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"\nfigures written to {args.json}")
    return 1 if any(r.get("failed") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
