#!/usr/bin/env python3
"""What the router adds: latency per request and throughput, against upstreams that answer at once.

    uv run python bench/bench_router.py [--requests 300] [--concurrency 32] [--throughput-requests 2000]

Three processes on this host: fake OpenAI instances (one prefill, one decode,
answering at once; packages/router/tests/router_fakes.py), ``python -m
kvbridge.router`` in front of them, and this client. Figures, all measured in
this run on the same upstreams:

* ``decode only``: the request straight to the decode instance (one hop);
* ``client P then D``: the client itself does the prefill call, then the decode
  call with the returned ``kv_transfer_params`` (the two hops a router makes,
  without the router): the baseline for the router's added latency;
* ``router``: the request through the router.

The added latency is ``router - client P then D`` (p50 and p99 of sequential
requests); throughput is requests per second with ``--concurrency`` requests in
flight. Loops are bounded in count and in time (``--max-seconds`` per phase).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "packages" / "router" / "tests"
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 16}

SERVE_FAKES = """
import sys, time
sys.path.insert(0, sys.argv[1])
from router_fakes import FakeInstance, ServerThread
p, d = FakeInstance("p0"), FakeInstance("d0")
sp, sd = ServerThread(p.app).start(), ServerThread(d.app).start()
print(sp.port, sd.port, flush=True)
while True:
    time.sleep(3600)
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, proc: subprocess.Popen, deadline_s: float = 60) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", trust_env=False, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy within {deadline_s} s")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


# ------------------------------------------------------------------ the three ways


def prefill_then_decode_sync(http: httpx.Client, p_url: str, d_url: str) -> str:
    pre = http.post(p_url + "/v1/completions", json=dict(
        BODY, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True}))
    params = pre.json()["kv_transfer_params"]
    r = http.post(d_url + "/v1/completions", json=dict(BODY, kv_transfer_params=params))
    return r.json()["choices"][0]["text"]


async def prefill_then_decode_async(http: httpx.AsyncClient, p_url: str, d_url: str) -> str:
    pre = await http.post(p_url + "/v1/completions", json=dict(
        BODY, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True}))
    params = pre.json()["kv_transfer_params"]
    r = await http.post(d_url + "/v1/completions", json=dict(BODY, kv_transfer_params=params))
    return r.json()["choices"][0]["text"]


def latency(n: int, max_s: float, call) -> list[float]:
    for _ in range(min(20, n)):  # warm connections and code paths
        call()
    out: list[float] = []
    end = time.monotonic() + max_s
    while len(out) < n and time.monotonic() < end:
        t0 = time.perf_counter()
        text = call()
        out.append(time.perf_counter() - t0)
        if not text.endswith("|p0"):
            raise RuntimeError(f"unexpected answer {text!r}: the KV did not come from the prefill")
    return out


async def throughput(n: int, conc: int, max_s: float, make_call) -> tuple[int, float]:
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(trust_env=False, timeout=60, limits=limits,
                                 transport=httpx.AsyncHTTPTransport(limits=limits,
                                                                    socket_options=NODELAY)) as http:
        call = make_call(http)
        await asyncio.gather(*(call() for _ in range(conc)))  # warm-up
        todo = n
        end = time.monotonic() + max_s

        async def worker() -> int:
            nonlocal todo
            done = 0
            while todo > 0 and time.monotonic() < end:
                todo -= 1
                text = await call()
                if not text.endswith("|p0"):
                    raise RuntimeError(f"unexpected answer {text!r}")
                done += 1
            return done

        t0 = time.perf_counter()
        done = sum(await asyncio.gather(*(worker() for _ in range(conc))))
        return done, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="sequential requests per way (latency)")
    ap.add_argument("--throughput-requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-seconds", type=float, default=60, help="time bound of each phase")
    args = ap.parse_args(argv)

    procs: list[subprocess.Popen] = []
    try:
        fakes = subprocess.Popen([sys.executable, "-c", SERVE_FAKES, str(FAKES)],
                                 stdout=subprocess.PIPE, text=True)
        procs.append(fakes)
        line = fakes.stdout.readline() if fakes.stdout else ""
        p_port, d_port = (int(x) for x in line.split())
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        r_port = free_port()
        router = subprocess.Popen([sys.executable, "-m", "kvbridge.router", "--prefill", p_url,
                                   "--decode", d_url, "--port", str(r_port), "--log-level", "warning"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs.append(router)
        r_url = f"http://127.0.0.1:{r_port}"
        wait_health(r_url, router)

        with httpx.Client(trust_env=False, timeout=60,
                          transport=httpx.HTTPTransport(socket_options=NODELAY)) as http:
            def decode_only() -> str:
                # the decode instance answers "<prompt>|local" without parameters; count it as p0
                r = http.post(d_url + "/v1/completions", json=BODY)
                return r.json()["choices"][0]["text"].replace("|local", "|p0")

            def routed() -> str:
                return http.post(r_url + "/v1/completions", json=BODY).json()["choices"][0]["text"]

            lat = {
                "decode only": latency(args.requests, args.max_seconds, decode_only),
                "client P then D": latency(args.requests, args.max_seconds,
                                           lambda: prefill_then_decode_sync(http, p_url, d_url)),
                "router": latency(args.requests, args.max_seconds, routed),
            }

        def direct_call(h: httpx.AsyncClient):
            return lambda: prefill_then_decode_async(h, p_url, d_url)

        def routed_call(h: httpx.AsyncClient):
            async def call() -> str:
                r = await h.post(r_url + "/v1/completions", json=BODY)
                return r.json()["choices"][0]["text"]
            return call

        tput = {
            "client P then D": asyncio.run(throughput(args.throughput_requests, args.concurrency,
                                                      args.max_seconds, direct_call)),
            "router": asyncio.run(throughput(args.throughput_requests, args.concurrency,
                                             args.max_seconds, routed_call)),
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    print(f"kvbridge router overhead, upstreams answering at once ({os.cpu_count()} CPUs, "
          f"client, router and upstreams on this host)")
    print(f"{'sequential requests':<22}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for k, v in lat.items():
        print(f"{k:<22}{len(v):>6}{pct(v, .5) * 1e3:>10.2f}{pct(v, .99) * 1e3:>10.2f}"
              f"{statistics.mean(v) * 1e3:>10.2f}")
    base, rt = lat["client P then D"], lat["router"]
    print(f"router added latency: p50 {(pct(rt, .5) - pct(base, .5)) * 1e3:+.2f} ms, "
          f"p99 {(pct(rt, .99) - pct(base, .99)) * 1e3:+.2f} ms (router - client P then D)")
    print(f"{'throughput':<22}{'n':>6}{'req/s':>10}   (concurrency {args.concurrency})")
    for k, (n, secs) in tput.items():
        print(f"{k:<22}{n:>6}{n / secs:>10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
