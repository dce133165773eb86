"""Behind vLLM's own router: ``vllm-router`` (the Rust router, P/D mode) in front of vLLM
OpenAI servers running KVBridgeConnector, 2 prefill + 1 decode, one set of servers for
the module.

kvbridge says routers work unchanged; this keeps it true for the router vLLM users
run. ``vllm-router --vllm-pd-disaggregation`` sends each request to a prefill server
with ``kv_transfer_params`` of its own (the decode keys, null-valued), its own
``X-Request-Id`` and body fields, then the prefill answer's parameters, unchanged, to
the decode server. Checked here:

* completions and chat, streamed and not: the text equals the decode server's own
  run of the prompt (no parameters: it computes the prompt itself), and each
  completion moved exactly the prompt's KV (the decode server's metrics, one
  request at a time; equal text alone would not show that KV moved);
* silent recompute is visible: a router that drops ``kv_transfer_params`` (a small
  stripping proxy in front of the decode server) still gets the right text, and the
  decode server's ``vllm:kvbridge_num_requests_without_params_total`` counts every
  such request while no KV moves;
* a prefill server killed mid-run: vllm-router does not retry a request on the
  other prefill server; a request it had sent to the dead one fails cleanly (HTTP
  5xx, never a wrong text). Its health check (every second here) takes the dead
  server out, and every request after that is answered correctly through the
  remaining prefill server, KV moving.
"""

from __future__ import annotations

import http.client
import json
import math
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from e2e_harness import e2e_python, free_port
from served import (
    HOST,
    MODEL_NAME,
    Served,
    engine,
    http_json,
    http_text,
    served_model,
    stop_all,
    text_prompts,
    wait_ready,
)
from test_served_router import (
    BYTES_SUM,
    CHAT,
    FAILURES,
    XFER_COUNT,
    chat,
    completion,
    local_chat,
    local_texts,
    openai_client,
)

LENGTHS = (70, 129, 200)
START_DEADLINE_S = 900
WITHOUT_PARAMS = "vllm:kvbridge_num_requests_without_params_total"
METRICS_WAIT_S = 120  # the decode server's counters follow its engine steps: poll, bounded


def vllm_router_command() -> str:
    """The ``vllm-router`` command of the e2e environment (scripts/setup_e2e_env.sh)."""
    py = e2e_python()
    exe = Path(str(py)).with_name("vllm-router") if py else None
    if exe is None or not exe.exists():
        found = shutil.which("vllm-router")
        if found is None:
            raise RuntimeError("vllm-router is not installed in the e2e environment: rerun "
                               "scripts/setup_e2e_env.sh (it installs vllm-router==0.1.17)")
        return found
    return str(exe)


def vllm_router(prefill: list[str], decode: list[str], workdir: Path, name: str) -> Served:
    """``vllm-router`` in P/D mode, round robin, health checked every second (a dead server
    leaves rotation after one failed probe), metrics on a port of its own."""
    port, prom = free_port(), free_port()
    argv = [vllm_router_command(), "--vllm-pd-disaggregation", "--host", HOST, "--port", str(port),
            "--policy", "round_robin", "--prometheus-host", HOST, "--prometheus-port", str(prom),
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--worker-startup-timeout-secs", "120", "--worker-startup-check-interval", "1",
            "--request-timeout-secs", "300", "--log-level", "info"]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    workdir.mkdir(parents=True, exist_ok=True)
    return Served(name, port, argv, {}, workdir / f"{name}.log", extra={"prom": prom})


def router_prom(r: Served) -> dict[str, float]:
    """vllm-router's Prometheus samples, by full sample name (labels included)."""
    out = {}
    for line in http_text(f"http://{HOST}:{r.extra['prom']}/metrics").splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# --------------------------------------------------------------------------- a stripping router


class Stripper:
    """A router that drops ``kv_transfer_params``: an HTTP proxy in front of one server that
    forwards every request with the parameters removed from JSON bodies (what users meet
    when a router or gateway loses them). Serves on 127.0.0.1 in threads of this process."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.stripped = 0
        stripper = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the answer's end is the connection's close

            def log_message(self, *args: Any) -> None:
                return

            def _forward(self, body: bytes | None) -> None:
                if body:
                    doc = json.loads(body)
                    if isinstance(doc, dict) and doc.pop("kv_transfer_params", None) is not None:
                        stripper.stripped += 1
                    body = json.dumps(doc).encode()
                conn = http.client.HTTPConnection(stripper.upstream.hostname,
                                                  stripper.upstream.port, timeout=300)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in ("content-length", "host", "connection")}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(k, v)
                    self.end_headers()
                    while chunk := resp.read1(65536):
                        self.wfile.write(chunk)
                        self.wfile.flush()
                finally:
                    conn.close()

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._forward(None)

            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("content-length") or 0)
                self._forward(self.rfile.read(n))

        self.server = ThreadingHTTPServer((HOST, free_port()), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server.server_address[1]}"

    def __enter__(self) -> Stripper:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=30)


# --------------------------------------------------------------------------- the servers


@dataclass
class Setup:
    prefill: list[Served]
    decode: Served
    router: Served
    workdir: Path
    bytes_per_token: int
    block_size: int = 32
    prompts: list[str] = field(default_factory=list)
    local: list[str] = field(default_factory=list)
    local_chat: list[str] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    start_s: float = 0.0


def kv_bytes_per_token(model: Path) -> int:
    """K and V of every layer for one token, float32 (as the servers run)."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module")
def setup(e2e_workdir: Path) -> Iterator[Setup]:
    model = served_model(kv_heads=2)
    workdir = e2e_workdir / "vllm-router"
    t0 = time.monotonic()
    prefill = [engine(f"vr-prefill{i}", model, "prefill", workdir) for i in range(2)]
    decode = engine("vr-decode0", model, "decode", workdir)
    servers = [*prefill, decode]
    router: Served | None = None
    try:
        for s in servers:
            s.start()
        wait_ready(servers, START_DEADLINE_S)
        router = vllm_router([p.url for p in prefill], [decode.url], workdir, "vllm-router").start()
        wait_ready([router], 180)
        s = Setup(prefill, decode, router, workdir, kv_bytes_per_token(model))
        s.start_s = time.monotonic() - t0
        s.prompts = text_prompts(LENGTHS, seed=4321)
        s.local = local_texts(decode, s.prompts)
        s.prompt_tokens = [http_json(decode.url + "/tokenize", {"model": MODEL_NAME, "prompt": p})
                           ["count"] for p in s.prompts]
        s.local_chat = local_chat(decode)
        yield s
    finally:
        stop_all(servers + ([router] if router else []))


def wait_metric(server: Served, name: str, at_least: float) -> dict[str, float]:
    """The server's metrics once ``name`` reached ``at_least`` (fails after METRICS_WAIT_S)."""
    end = time.monotonic() + METRICS_WAIT_S
    while True:
        m = server.metrics()
        if m.get(name, 0) >= at_least:
            return m
        if time.monotonic() > end:
            raise AssertionError(f"{server.name}: {name} = {m.get(name, 0)}, expected >= {at_least} "
                                 f"within {METRICS_WAIT_S} s")
        time.sleep(0.5)


def moved(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    return after.get(XFER_COUNT, 0) - before.get(XFER_COUNT, 0), after.get(BYTES_SUM, 0) - before.get(BYTES_SUM, 0)


# --------------------------------------------------------------------------- tests


def test_completions_and_chat_equal_the_decode_servers_own_run_and_move_the_prompts_kv(setup):
    s = setup
    client = openai_client(s.router.url)
    d = s.decode
    first = {p.name: p.metrics() for p in s.prefill}
    first_d = d.metrics()
    t0 = time.monotonic()
    n = 0
    for i, prompt in enumerate(s.prompts):
        n_tokens = s.prompt_tokens[i]
        for stream in (False, True):
            before = wait_metric(d, XFER_COUNT, first_d.get(XFER_COUNT, 0) + n)
            text = completion(client, prompt, stream=stream)[0]
            assert text == s.local[i], f"prompt {i} (stream={stream}) differs from the decode run"
            n += 1
            after = wait_metric(d, XFER_COUNT, before.get(XFER_COUNT, 0) + 1)
            transfers, nbytes = moved(before, after)
            # the decode server computes the last prompt token itself; the blocks holding
            # the others are read whole
            blocks = math.ceil((n_tokens - 1) / s.block_size)
            assert (transfers, nbytes) == (1, blocks * s.block_size * s.bytes_per_token), (
                f"prompt {i} ({n_tokens} tokens, stream={stream}): {transfers} transfers, "
                f"{nbytes} bytes")
    for j, msgs in enumerate(CHAT):
        for stream in (False, True):
            before = d.metrics()
            assert chat(client, msgs, stream=stream) == s.local_chat[j]
            n += 1
            after = wait_metric(d, XFER_COUNT, before.get(XFER_COUNT, 0) + 1)
            assert moved(before, after)[1] > 0
    routed_s = time.monotonic() - t0
    after_d = d.metrics()
    assert after_d.get(WITHOUT_PARAMS, 0) == first_d.get(WITHOUT_PARAMS, 0), \
        "a routed request reached the decode server without kv_transfer_params"
    for name in FAILURES:
        assert after_d.get(name, 0) == first_d.get(name, 0), f"decode: {name} rose"
    # round robin: both prefill servers prefilled (their own metrics count the prompts)
    for p in s.prefill:
        m = p.metrics()
        assert m["vllm:prompt_tokens_total"] > first[p.name]["vllm:prompt_tokens_total"], p.name
    rp = router_prom(s.router)
    print(f"\nvllm-router: servers ready in {s.start_s:.0f} s; {n} routed requests in "
          f"{routed_s:.1f} s; router counters: "
          f"{ {k: v for k, v in rp.items() if k.startswith('vllm_router_pd_prefill')} }")


def test_a_router_that_drops_the_parameters_is_counted_by_the_decode_server(setup):
    """Silent recompute made visible: the text is still right (the decode server
    computes the prompt), no KV moves, and the decode metric counts every request."""
    s = setup
    d = s.decode
    with Stripper(d.url) as strip:
        r = vllm_router([s.prefill[1].url], [strip.url], s.workdir, "vllm-router-stripping").start()
        try:
            wait_ready([r], 180)
            client = openai_client(r.url)
            before = d.metrics()
            for i, prompt in enumerate(s.prompts[:2]):
                assert completion(client, prompt, stream=False)[0] == s.local[i]
            assert chat(client, CHAT[0], stream=True) == s.local_chat[0]
            after = wait_metric(d, WITHOUT_PARAMS, before.get(WITHOUT_PARAMS, 0) + 3)
            assert strip.stripped == 3  # every decode request lost its parameters
            assert after[WITHOUT_PARAMS] - before.get(WITHOUT_PARAMS, 0) == 3
            assert moved(before, after) == (0, 0)
        finally:
            stop_all([r])


def test_a_prefill_server_killed_mid_run(setup):
    """vllm-router does not retry elsewhere: a request sent to the dead prefill server fails
    with a 5xx, never with a wrong text; once its health check took the server out, every
    request goes through the other one and is answered correctly, KV moving."""
    import openai

    s = setup
    client = openai_client(s.router.url)
    victim, survivor = s.prefill
    jobs = [(i % len(s.prompts), i % 2 == 1) for i in range(8)]
    done = threading.Semaphore(0)

    def run(job: tuple[int, bool]) -> tuple[int, str | None, int | None]:
        k, stream = job
        try:
            return k, completion(client, s.prompts[k], stream=stream)[0], None
        except openai.APIStatusError as e:
            return k, None, e.status_code
        finally:
            done.release()

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(run, j) for j in jobs]
        for _ in range(2):  # mid-run: two answered, the rest in flight or queued
            assert done.acquire(timeout=600)
        victim.kill(sig=9)
        results = [f.result(timeout=900) for f in futures]
    failed = [status for _, text, status in results if text is None]
    for k, text, status in results:
        assert text is None or text == s.local[k], f"prompt {k}: a wrong text after the kill"
        assert text is not None or (status is not None and status >= 500), status
    # the health check takes the dead server out (one failed probe, every second)
    key = f'vllm_router_worker_health{{worker="{victim.url}"}}'
    end = time.monotonic() + 60
    while router_prom(s.router).get(key) != 0 and time.monotonic() < end:
        time.sleep(0.5)
    assert router_prom(s.router).get(key) == 0, "vllm-router kept the dead prefill server"
    assert router_prom(s.router).get(f'vllm_router_worker_health{{worker="{survivor.url}"}}') == 1
    before = s.decode.metrics()
    for i, stream in ((0, False), (1, True), (2, False), (0, True)):
        assert completion(client, s.prompts[i], stream=stream)[0] == s.local[i]
    wait_metric(s.decode, XFER_COUNT, before.get(XFER_COUNT, 0) + 4)
    print(f"\nprefill killed mid-run: {len(results) - len(failed)} of {len(results)} requests "
          f"answered, {len(failed)} failed with {sorted(set(failed))}; 4 later requests answered "
          "through the surviving prefill server")

