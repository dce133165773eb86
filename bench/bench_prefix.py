"""Prefix-aware placement through ``kvbridge router``: decode prefix-cache hits and KV bytes moved.

Real vLLM OpenAI servers (the e2e environment, the tiny Llama of
tests/e2e/served.py): 1 prefill instance (prefix caching off) and 2 decode
instances with prefix caching on, all with KVBridgeConnector. The workload is
``--prefixes`` shared prefixes of ``--prefix-words`` tokens, each followed by
``--per-prefix`` different suffixes, shuffled, sent by ``--concurrency``
clients. It runs twice, through a router with ``--prefix-placement off``
(least loaded) and one with ``--prefix-placement decode``, each arm with
prefixes of its own (so the second arm finds nothing of the first in the
caches). Per arm it reads from the decode servers' /metrics:

* the prefix-cache hit rate: ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``
  (tokens found in the local cache / prompt tokens looked up);
* the KV bytes kvbridge moved (``vllm:kvbridge_bytes_transferred_sum``) and
  the transfers (``vllm:kvbridge_xfer_time_seconds_count``).

Run: ``uv run python bench/bench_prefix.py`` (the engines run in the e2e
environment: build it first with scripts/setup_e2e_env.sh). Prints the
figures and a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

from e2e_harness import missing_env_reason  # noqa: E402
from served import (  # noqa: E402
    Served,
    completion_body,
    engine,
    http_json,
    router,
    served_model,
    stop_all,
    text_prompts,
    wait_ready,
)

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
BYTES = "vllm:kvbridge_bytes_transferred_sum"
XFERS = "vllm:kvbridge_xfer_time_seconds_count"
DONE = "vllm:request_success_total"


def workload(args: argparse.Namespace, seed: int) -> list[str]:
    """``prefixes x per_prefix`` prompts, shuffled: a shared beginning, then words of their own."""
    prefixes = text_prompts([args.prefix_words] * args.prefixes, seed=seed)
    suffixes = text_prompts([args.suffix_words] * (args.prefixes * args.per_prefix), seed=seed + 1)
    prompts = [p + " " + suffixes[i * args.per_prefix + j]
               for i, p in enumerate(prefixes) for j in range(args.per_prefix)]
    random.Random(seed).shuffle(prompts)
    return prompts


def snapshot(decode: list[Served]) -> dict[str, dict[str, float]]:
    return {d.name: d.metrics() for d in decode}


def wait_counted(decode: list[Served], before: dict[str, dict[str, float]], n: int,
                 timeout_s: float = 60) -> dict[str, dict[str, float]]:
    """Metrics once the decode servers have counted ``n`` more finished requests."""
    end = time.monotonic() + timeout_s
    while True:
        now = snapshot(decode)
        done = sum(now[d.name].get(DONE, 0) - before[d.name].get(DONE, 0) for d in decode)
        if done >= n or time.monotonic() > end:
            return now
        time.sleep(0.5)


def run_arm(arm: str, prefill: list[Served], decode: list[Served], workdir: Path,
            args: argparse.Namespace, seed: int) -> dict[str, Any]:
    r = router(prefill, decode, workdir, name=f"router-{arm}",
               extra_args=["--prefix-placement", arm]).start()
    try:
        wait_ready([r], 120)
        prompts = workload(args, seed)
        before = snapshot(decode)
        t0 = time.monotonic()

        def one(p: str) -> int:
            out = http_json(r.url + "/v1/completions", completion_body(p, args.max_tokens), timeout=300)
            return int(out["usage"]["completion_tokens"])

        with ThreadPoolExecutor(args.concurrency) as pool:
            made = list(pool.map(one, prompts))
        wall = time.monotonic() - t0
        after = wait_counted(decode, before, len(prompts))
    finally:
        stop_all([r])
    short = [n for n in made if n != args.max_tokens]
    if short:
        raise RuntimeError(f"{arm}: {len(short)} answers without {args.max_tokens} tokens: {short[:4]}")

    def delta(name: str, d: Served) -> float:
        return after[d.name].get(name, 0) - before[d.name].get(name, 0)

    per = {d.name: {k: delta(m, d) for k, m in (("requests", DONE), ("hits", HITS),
                                                 ("queries", QUERIES), ("bytes", BYTES),
                                                 ("transfers", XFERS))} for d in decode}
    tot = {k: sum(v[k] for v in per.values()) for k in ("requests", "hits", "queries", "bytes",
                                                          "transfers")}
    return {"arm": arm, "requests": len(prompts), "wall_s": wall, "per_decode": per, **tot,
            "hit_rate": tot["hits"] / tot["queries"] if tot["queries"] else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--per-prefix", type=int, default=8)
    ap.add_argument("--prefix-words", type=int, default=160, help="tokens in each shared prefix")
    ap.add_argument("--suffix-words", type=int, default=32, help="tokens after the prefix")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=None, help="keep engine logs here")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = ap.parse_args()
    # a timeout's SIGTERM must still stop the servers (each runs in its own session)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    reason = missing_env_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvb-prefix-"))
    model = served_model()
    p0 = engine("prefill0", model, "prefill", workdir)
    decode = [engine(f"decode{i}", model, "decode", workdir, prefix_caching=True) for i in range(2)]
    servers = [p0, *decode]
    results = []
    try:
        for s in servers:
            s.start()
        wait_ready(servers, 900)
        # warm-up: each decode engine's first P/D request (handshake, first forward) off the books
        warm = router([p0], decode, workdir, name="router-warmup").start()
        try:
            wait_ready([warm], 120)
            for p in text_prompts((40, 41), seed=5):
                http_json(warm.url + "/v1/completions", completion_body(p, 2), timeout=300)
        finally:
            stop_all([warm])
        for seed, arm in ((100, "off"), (200, "decode")):
            res = run_arm(arm, [p0], decode, workdir, args, seed)
            results.append(res)
            print(f"{arm}: {json.dumps(res)}", flush=True)
    finally:
        stop_all(servers)
    load = os.getloadavg()
    print(f"\nworkload: {args.prefixes} prefixes x {args.per_prefix} requests, prefix "
          f"{args.prefix_words} tokens + {args.suffix_words}, {args.max_tokens} output tokens, "
          f"concurrency {args.concurrency}; load average {load[0]:.1f} {load[1]:.1f}\n")
    print("| --prefix-placement | requests per decode | decode prefix-cache hit rate | KV bytes moved "
          "| transfers | wall |")
    print("|---|---|---|---|---|---|")
    for r in results:
        split = " / ".join(f"{int(v['requests'])}" for v in r["per_decode"].values())
        print(f"| `{r['arm']}` | {split} | {100 * r['hit_rate']:.1f} % "
              f"({int(r['hits'])} of {int(r['queries'])} tokens) | {r['bytes'] / 2**20:.2f} MiB "
              f"| {int(r['transfers'])} | {r['wall_s']:.1f} s |")
    off, on = results
    if off["bytes"]:
        print(f"\nwith placement: {on['bytes'] / off['bytes']:.2f}x the KV bytes, hit rate "
              f"{100 * off['hit_rate']:.1f} % -> {100 * on['hit_rate']:.1f} %")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"workdir": str(workdir),
                                                                "json": str(args.json)},
                                         "load": load, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
