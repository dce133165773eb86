#!/usr/bin/env python3
"""Pull vs push vs layer-by-layer push through real vLLM engines (KVBridgeConnector).

    .e2e/venv/bin/python bench/bench_push.py [--rounds 4] [--layers 16] [--json out.json]

Same model, same prompts, same run, three ways of moving the prompt's KV:

  * pull: the decode engine READs the prefill engine's blocks after prefill finished;
  * push whole-request: both engines get the request at once, decode allocates and
    offers its blocks, prefill writes the whole request after its forward pass;
  * push layer-by-layer: as above, each layer written as soon as vLLM computed it.

Per mode it prints the decode TTFT (vLLM's first_token_latency of the decode
request; in push mode the decode request arrives together with the prefill one, so
its TTFT includes the prefill computation, in pull mode it does not: the pull
column adds the prefill engine's own latency to compare like with like), the
first-request overhead (round 0 minus the median of later rounds) and the transfer
time and GB/s. Then how much of the transfer the layer-by-layer overlap hides. The
TTFTs themselves carry the prefill computation's run-to-run spread (hundreds of ms
on two busy cores), so the overlap is measured on the *exposed gap*: how long after
the prefill engine's last first token of a round the decode engine's last first
token comes (the transfer left after the forward pass, the notification, and the
decode engine's own step, the same in both modes). Hidden share = (gap whole -
gap layer-by-layer) / the whole-request push's transfer time per round, with the
target (>= 80 % when the prefill computation takes longer than the transfer).

Needs the e2e environment (scripts/setup_e2e_env.sh). Prints figures only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

from e2e_harness import (  # noqa: E402
    KVBRIDGE_CONNECTOR,
    DisaggRun,
    EngineConfig,
    EngineFailed,
    cpu_binding,
    kvbridge_push,
    make_prompts,
    missing_env_reason,
    run_disaggregated,
    tiny_llama,
    transfer_figures,
    transfer_problems,
)

TARGET_HIDDEN = 0.80


def _ttfts(outputs: list[dict[str, Any]]) -> list[float]:
    return [o["metrics"]["first_token_latency"] for o in outputs if o.get("metrics")]


def _mean_ms(xs: list[float]) -> float | None:
    return statistics.fmean(xs) * 1e3 if xs else None


def summarise(run: DisaggRun, mode: str) -> dict[str, Any]:
    """Per round: decode TTFT (and, for pull, the prefill request's own latency, which a
    pulled request waits for before it reaches the decode engine)."""
    rounds = []
    for r, rec in enumerate(run.decode["rounds"]):
        ttft = _mean_ms(_ttfts(rec["outputs"]))
        pre = _mean_ms(_ttfts(run.prefill["rounds"][r]["outputs"])) if mode == "pull" else 0.0
        rounds.append({"round": r, "decode_ttft_ms": ttft, "prefill_ms": pre,
                       "end_to_end_ms": None if ttft is None or pre is None else ttft + pre})
    gaps = []
    for r in range(1, len(run.decode["rounds"])):
        ends = [[o["metrics"]["arrival_time"] + o["metrics"]["first_token_latency"]
                 for o in res["rounds"][r]["outputs"] if o.get("metrics")]
                for res in (run.prefill, run.decode)]
        if all(ends):
            gaps.append((max(ends[1]) - max(ends[0])) * 1e3)
    side = "decode" if mode == "pull" else "prefill"
    figs = transfer_figures(run, side=side)
    later = [x["end_to_end_ms"] for x in rounds[1:] if x["end_to_end_ms"] is not None]
    steady = statistics.median(later) if later else None
    first = rounds[0]["end_to_end_ms"]
    n = max(len(rounds), 1)
    return {
        "mode": mode, "rounds": rounds, "steady_ms": steady,
        "first_request_overhead_ms": None if steady is None or first is None else first - steady,
        "transfers": figs.get("transfers"), "transfer_ms_per_round": (figs.get("transfer_s") or 0) * 1e3 / n,
        "GB/s": figs.get("GB/s"), "bytes_per_round": (figs.get("bytes") or 0) / n,
        "gap_ms": statistics.median(gaps) if gaps else None,
        "problems": transfer_problems(run),
    }


def report(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    print(f"\nmodel: {meta['model']}; {meta['num_prompts']} prompts x {meta['prompt_len']} tokens; "
          f"KV per round {meta['kv_bytes'] / 2**20:.1f} MiB; {meta['rounds']} rounds; {meta['cpus']}")
    print("mode                 steady TTFT  first-req overhead  xfers  xfer ms/round   GB/s"
          "  exposed gap")
    for mode, res in results.items():
        if res.get("failed"):
            print(f"{mode:20s} FAILED: {res['failed']}")
            continue
        print(f"{mode:20s} {_f(res['steady_ms'], '9.1f')} ms  {_f(res['first_request_overhead_ms'], '12.1f')} ms"
              f"  {_f(res['transfers'], '5.0f')}  {_f(res['transfer_ms_per_round'], '12.1f')}  {_f(res['GB/s'], '6.2f')}"
              f"  {_f(res.get('gap_ms'), '8.1f')} ms")
        if res["problems"]:
            print("   PROBLEMS: " + "; ".join(res["problems"]))
    out: dict[str, Any] = {}
    whole, layer, pull = (results.get(k, {}) for k in ("push-whole", "push-layerwise", "pull"))
    if all(r and not r.get("failed") and r.get("gap_ms") is not None for r in (whole, layer)):
        xfer = whole["transfer_ms_per_round"]
        compute = pull.get("rounds", [{}])[-1].get("prefill_ms") if pull and not pull.get("failed") else None
        hidden = None if not xfer else max(0.0, min(1.0, (whole["gap_ms"] - layer["gap_ms"]) / xfer))
        out = {"hidden": hidden, "transfer_ms": xfer, "prefill_compute_ms": compute}
        applies = compute is None or compute > xfer
        verdict = ("n/a (prefill computation shorter than the transfer)" if not applies else
                   "PASS" if hidden is not None and hidden >= TARGET_HIDDEN else "FAIL")
        print(f"\noverlap: layer-by-layer push hides {_f(None if hidden is None else hidden * 100, '.0f')} % "
              f"of the whole-request transfer ({xfer:.1f} ms per round; prefill computation "
              f"{_f(compute, '.1f')} ms); target >= {TARGET_HIDDEN:.0%}: {verdict}")
        out["verdict"] = verdict
    return out


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--modes", default="pull,push-whole,push-layerwise")
    ap.add_argument("--deadline-s", type=float, default=900)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    reason = missing_env_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvb-push-bench-"))
    model = tiny_llama(args.kv_heads, layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                       intermediate=2 * args.heads * args.head_dim)
    prompts = make_prompts([args.prompt_len] * args.num_prompts, seed=11)
    engine_kw = {"kv_cache_memory_bytes": args.kv_cache_mib * 2**20,
                 "max_model_len": max(1024, args.prompt_len + args.max_tokens + 32)}
    p_cpus, d_cpus = cpu_binding(1, 1)
    meta = {"model": f"{args.layers} layers, {args.kv_heads} KV heads x {args.head_dim}, fp32",
            "num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "rounds": args.rounds,
            "kv_bytes": 2 * args.layers * args.kv_heads * args.head_dim * 4 * args.prompt_len * args.num_prompts,
            "cpus": f"prefill cpus {p_cpus}, decode cpus {d_cpus}"}
    connectors = {"pull": (KVBRIDGE_CONNECTOR, False), "push-whole": (kvbridge_push(False), True),
                  "push-layerwise": (kvbridge_push(True), True)}
    results: dict[str, dict[str, Any]] = {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in connectors:
            ap.error(f"unknown mode {mode!r}; choose from {sorted(connectors)}")
        conn, push = connectors[mode]
        try:
            run = run_disaggregated(conn, model, prompts, args.max_tokens, workdir / mode,
                                    prefill=EngineConfig(cpus=p_cpus, engine=engine_kw),
                                    decode=EngineConfig(cpus=d_cpus, engine=engine_kw),
                                    rounds=args.rounds, deadline_s=args.deadline_s, push=push)
        except EngineFailed as exc:
            results[mode] = {"failed": (str(exc).splitlines() or ["?"])[0]}
            continue
        results[mode] = summarise(run, "pull" if not push else mode)
    overlap = report(results, meta)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results, "overlap": overlap}, indent=1))
    return 1 if any(r.get("failed") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
