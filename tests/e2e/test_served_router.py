"""Served prefill/decode: real vLLM OpenAI servers behind ``kvbridge router``.

Two topologies on this host, each started once per test class:

* 2 prefill (TP 1) + 1 decode (TP 1);
* 1 prefill (TP 2) + 2 decode (TP 1).

Text prompts go through the router with the OpenAI client, streamed and not.
The reference is each decode instance's own local run of the same prompt (sent
straight to it without ``kv_transfer_params``; prefix caching is off, so it
computes the whole prompt itself). Equal text alone would not show that KV
moved (a decode instance that ignored the parameters and prefilled locally
would match too), so the decode instances' Prometheus metrics must show
kvbridge transfers and bytes, no failures, and the router must report no local
fallback. The negative control hands a decode instance the KV of another
prompt of the same length: its output must then differ from the reference,
which proves that decode outputs depend on the transferred KV and that the
comparison can fail.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from served import (
    MODEL_NAME,
    SERVED_CONNECTOR,
    Served,
    completion_body,
    engine,
    http_json,
    http_text,
    parse_metrics,
    router,
    served_model,
    stop_all,
    text_prompts,
    wait_ready,
)

LENGTHS = (70, 96, 129, 200)
MAX_TOKENS = 24
CHAT = [[{"role": "user", "content": p}] for p in text_prompts((40, 110), seed=7)]
START_DEADLINE_S = 900
BYTES_SUM = "vllm:kvbridge_bytes_transferred_sum"
XFER_COUNT = "vllm:kvbridge_xfer_time_seconds_count"
FAILURES = ("vllm:kvbridge_num_failed_transfers_total", "vllm:kvbridge_num_expired_leases_total")

FIGURES: dict[str, dict[str, float]] = {}


def openai_client(url: str) -> Any:
    import httpx
    import openai

    # idle connections expire after 1 s, well before a vLLM server (5 s) closes them: a
    # request written into a connection the server is closing fails with a ReadError
    limits = httpx.Limits(keepalive_expiry=1.0)
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300,
                         http_client=httpx.Client(trust_env=False, timeout=300, limits=limits))


def completion(client: Any, prompt: str, *, stream: bool) -> tuple[str, float, float]:
    """(text, seconds to first text, seconds in all) of one greedy completion."""
    t0 = time.monotonic()
    if not stream:
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0.0, extra_body={"ignore_eos": True})
        dt = time.monotonic() - t0
        return r.choices[0].text, dt, dt
    ttft = None
    parts = []
    for ev in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0.0, stream=True, extra_body={"ignore_eos": True}):
        if ev.choices and ev.choices[0].text:
            ttft = ttft if ttft is not None else time.monotonic() - t0
            parts.append(ev.choices[0].text)
    return "".join(parts), ttft or 0.0, time.monotonic() - t0


def chat(client: Any, messages: list[dict[str, str]], *, stream: bool) -> str:
    if not stream:
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0.0, extra_body={"ignore_eos": True})
        return r.choices[0].message.content
    parts = []
    for ev in client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True,
                                             max_tokens=MAX_TOKENS, temperature=0.0,
                                             extra_body={"ignore_eos": True}):
        if ev.choices and ev.choices[0].delta.content:
            parts.append(ev.choices[0].delta.content)
    return "".join(parts)


def local_texts(decode: Served, prompts: list[str]) -> list[str]:
    """The decode instance's own runs: no kv_transfer_params, so it prefills itself."""
    out = [http_json(decode.url + "/v1/completions", completion_body(p, MAX_TOKENS))["choices"][0]["text"]
           for p in prompts]
    assert all(len(t.split()) == MAX_TOKENS for t in out), out  # one word per token
    assert len(set(out)) == len(out), out  # different prompts, different continuations
    return out


def local_chat(decode: Served) -> list[str]:
    body = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return [http_json(decode.url + "/v1/chat/completions", dict(body, messages=m))["choices"][0]
            ["message"]["content"] for m in CHAT]


def kv_moved(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """(transfers, bytes) a decode instance pulled between two metric snapshots."""
    return (after.get(XFER_COUNT, 0) - before.get(XFER_COUNT, 0),
            after.get(BYTES_SUM, 0) - before.get(BYTES_SUM, 0))


def assert_no_new_failures(before: dict[str, dict[str, float]], *instances: Served) -> None:
    """No transfer failed and no lease expired on ``instances`` since ``before``.

    Counters are cumulative and decode0 lives through both topologies: the kill
    test of the first one may fail a READ in flight on it (allowed there), so
    each round compares with its own snapshot."""
    for s in instances:
        m = s.metrics()
        for name in FAILURES:
            new = m.get(name, 0) - before[s.name].get(name, 0)
            assert new == 0, f"{s.name}: {name} rose by {new} in this round (now {m.get(name)})"


def router_metrics(r: Served) -> dict[str, str]:
    return {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1]
            for line in http_text(r.url + "/metrics").splitlines() if line and not line.startswith("#")}


def router_errors(r: Served, kind: str) -> float:
    return float(router_metrics(r).get(f'kvbridge_router_errors_total{{kind="{kind}"}}', 0))


class Topology:
    def __init__(self, prefill: list[Served], decode: list[Served], workdir: Path) -> None:
        self.prefill, self.decode, self.workdir = prefill, decode, workdir
        self.router: Served | None = None
        self.prompts = text_prompts(LENGTHS, seed=1234)
        # same length as prompts[1], other words: the negative control's donor
        self.donor = text_prompts((LENGTHS[1],), seed=99)[0]
        self.local: dict[str, list[str]] = {}
        self.local_chat: dict[str, list[str]] = {}
        self.start_s = 0.0


@pytest.fixture(scope="session")
def served_tiny() -> Path:
    return served_model(kv_heads=2)


@pytest.fixture(scope="module")
def decode0(e2e_workdir: Path, served_tiny: Path) -> Iterator[Served]:
    """One decode instance both topologies use (started with the first, never killed)."""
    d = engine("decode0", served_tiny, "decode", e2e_workdir / "served")
    try:
        yield d.start()
    finally:
        stop_all([d])


def _topology(workdir: Path, model: Path, prefill_tp: int, n_prefill: int, shared: Served,
              n_new_decode: int) -> Iterator[Topology]:
    t0 = time.monotonic()
    # 3 or 4 workers on two cores: none pinned, one OpenMP thread each (see EngineConfig.cpus)
    prefill = [engine(f"prefill{i}-tp{prefill_tp}", model, "prefill", workdir, tp=prefill_tp)
               for i in range(n_prefill)]
    new = [engine(f"decode{i + 1}", model, "decode", workdir) for i in range(n_new_decode)]
    topo = Topology(prefill, [shared, *new], workdir)
    try:
        for s in prefill + new:
            s.start()
        wait_ready(prefill + topo.decode, START_DEADLINE_S)
        topo.router = router(prefill, topo.decode, workdir, name=f"router-tp{prefill_tp}").start()
        wait_ready([topo.router], 120)
        topo.start_s = time.monotonic() - t0
        for d in topo.decode:  # each decode instance's own run, once per instance
            if "local" not in d.extra:
                d.extra["local"] = local_texts(d, topo.prompts + [topo.donor])
                d.extra["local_chat"] = local_chat(d)
            topo.local[d.name] = d.extra["local"]
            topo.local_chat[d.name] = d.extra["local_chat"]
        yield topo
    finally:
        stop_all(prefill + new + ([topo.router] if topo.router else []))


@pytest.fixture(scope="class")
def two_prefill_one_decode(e2e_workdir: Path, served_tiny: Path, decode0: Served) -> Iterator[Topology]:
    yield from _topology(e2e_workdir / "served", served_tiny, 1, 2, decode0, 0)


@pytest.fixture(scope="class")
def tp2_prefill_two_decode(e2e_workdir: Path, served_tiny: Path, decode0: Served) -> Iterator[Topology]:
    yield from _topology(e2e_workdir / "served", served_tiny, 2, 1, decode0, 1)


def _write_figures(workdir: Path) -> None:
    (workdir / "served_figures.json").write_text(json.dumps(FIGURES, indent=1))
    print("\nserved figures:", json.dumps(FIGURES, indent=1))


def _routed_round(topo: Topology, label: str) -> None:
    """Every prompt through the router, non-streamed then streamed; chat both ways; figures."""
    assert topo.router is not None
    ref = topo.local[topo.decode[0].name]
    for d in topo.decode[1:]:  # same model, same TP: every decode instance's local run agrees
        assert topo.local[d.name] == ref
        assert topo.local_chat[d.name] == topo.local_chat[topo.decode[0].name]
    before = {s.name: s.metrics() for s in (*topo.prefill, *topo.decode)}
    client = openai_client(topo.router.url)
    direct = openai_client(topo.decode[0].url)
    rows: dict[str, list[float]] = {"routed_ttft_s": [], "routed_total_s": [],
                                    "local_ttft_s": [], "local_total_s": []}
    n_routed = 0
    for i, prompt in enumerate(topo.prompts):
        text, _, total = completion(client, prompt, stream=False)
        assert text == ref[i], f"prompt {i} (non-streamed) differs from the decode instance's own run"
        text, ttft, total = completion(client, prompt, stream=True)
        assert text == ref[i], f"prompt {i} (streamed) differs from the decode instance's own run"
        rows["routed_ttft_s"].append(ttft)
        rows["routed_total_s"].append(total)
        # the same prompt on the decode instance alone (local prefill), same client, same shape
        text, ttft, total = completion(direct, prompt, stream=True)
        assert text == ref[i]
        rows["local_ttft_s"].append(ttft)
        rows["local_total_s"].append(total)
        n_routed += 2
    for j, msgs in enumerate(CHAT):
        for stream in (False, True):
            assert chat(client, msgs, stream=stream) == topo.local_chat[topo.decode[0].name][j]
            n_routed += 1
    transfers = bytes_ = 0.0
    for d in topo.decode:
        t, b = kv_moved(before[d.name], d.metrics())
        if len(topo.decode) > 1:
            assert t > 0 and b > 0, f"{d.name} pulled no KV through kvbridge"
        transfers += t
        bytes_ += b
    # one pull per routed request (per decode worker; TP 1 here)
    assert transfers >= n_routed and bytes_ > 0, (transfers, bytes_)
    assert router_errors(topo.router, "local_prefill") == 0
    assert router_errors(topo.router, "prefill_failed") == 0
    assert_no_new_failures(before, *topo.prefill, *topo.decode)
    rm = parse_metrics(http_text(topo.router.url + "/metrics"))
    dm = [d.metrics() for d in topo.decode]
    xfer_s = sum(m.get("vllm:kvbridge_xfer_time_seconds_sum", 0) for m in dm)
    xfer_n = sum(m.get(XFER_COUNT, 0) for m in dm)
    FIGURES[label] = {
        "engines_ready_s": round(topo.start_s, 1), "requests": n_routed,
        "kv_transfers": transfers, "kv_bytes": bytes_,
        **{k: round(statistics.median(v), 4) for k, v in rows.items()},
        # where a routed request's time goes, as the router and the decode engine see it
        "router_prefill_mean_s": round(rm["kvbridge_router_prefill_seconds_sum"]
                                       / rm["kvbridge_router_prefill_seconds_count"], 4),
        "router_decode_first_byte_mean_s": round(
            rm["kvbridge_router_decode_first_byte_seconds_sum"]
            / rm["kvbridge_router_decode_first_byte_seconds_count"], 4),
        "kv_transfer_mean_s": round(xfer_s / xfer_n, 4) if xfer_n else 0.0,
    }
    _write_figures(topo.workdir.parent)


class TestTwoPrefillOneDecode:
    def test_routed_outputs_equal_the_decode_instances_own_run(self, two_prefill_one_decode):
        topo = two_prefill_one_decode
        _routed_round(topo, "2 prefill (TP 1) + 1 decode (TP 1)")
        served = parse_metrics(http_text(topo.router.url + "/metrics"))
        assert served.get("kvbridge_router_prefill_seconds_count", 0) >= 2 * len(topo.prompts)
        per_prefill = [v for k, v in router_metrics(topo.router).items()
                       if k.startswith("kvbridge_router_prefill_seconds_count")]
        assert len(per_prefill) == 2 and all(float(v) > 0 for v in per_prefill), per_prefill

    def test_negative_control_other_prompts_kv_changes_the_output(self, two_prefill_one_decode):
        topo = two_prefill_one_decode
        p, d = topo.prefill[0], topo.decode[0]
        target = topo.prompts[1]
        ref = topo.local[d.name][1]
        # prefill the donor (same length, other words); decode the target with the donor's KV
        pre = http_json(p.url + "/v1/completions", completion_body(
            topo.donor, 1, kv_transfer_params={"do_remote_decode": True}))
        params = pre["kv_transfer_params"]
        before = d.metrics()
        out = http_json(d.url + "/v1/completions", completion_body(
            target, MAX_TOKENS, kv_transfer_params=params))["choices"][0]["text"]
        transfers, moved = kv_moved(before, d.metrics())
        assert transfers >= 1 and moved > 0  # the KV did move
        assert len(out.split()) == MAX_TOKENS
        assert out != ref, "decode output ignores the transferred KV: the comparison cannot fail"
        # and the same hand-over with the target's own KV gives the reference again
        pre = http_json(p.url + "/v1/completions", completion_body(
            target, 1, kv_transfer_params={"do_remote_decode": True}))
        out = http_json(d.url + "/v1/completions", completion_body(
            target, MAX_TOKENS, kv_transfer_params=pre["kv_transfer_params"]))["choices"][0]["text"]
        assert out == ref

    def test_killing_a_prefill_instance_mid_run_loses_no_request(self, two_prefill_one_decode):
        topo = two_prefill_one_decode
        assert topo.router is not None
        client = openai_client(topo.router.url)
        ref = topo.local[topo.decode[0].name]
        jobs = [(i % len(topo.prompts), i % 2 == 1) for i in range(12)]
        done = threading.Semaphore(0)
        victim = topo.prefill[0]

        def run(job: tuple[int, bool]) -> tuple[int, str]:
            k, stream = job
            try:
                return k, completion(client, topo.prompts[k], stream=stream)[0]
            finally:
                done.release()

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(run, j) for j in jobs]
            for _ in range(2):  # mid-run: two answered, the rest in flight or queued
                assert done.acquire(timeout=600)
            victim.kill(sig=9)
            t_kill = time.monotonic()
            results = [f.result(timeout=900) for f in futures]
        for k, text in results:
            assert text == ref[k], f"prompt {k} after the kill differs from the local run"
        health = json.loads(http_text(topo.router.url + "/health"))
        # the router took the dead instance out (a probe or a request found it)
        deadline = time.monotonic() + 60
        while health["prefill"][0]["healthy"] and time.monotonic() < deadline:
            time.sleep(1)
            health = json.loads(http_text(topo.router.url + "/health"))
        assert not health["prefill"][0]["healthy"] and health["prefill"][1]["healthy"]
        # and later requests go to the surviving prefill instance, KV still moving
        before = topo.decode[0].metrics()
        assert completion(client, topo.prompts[0], stream=False)[0] == ref[0]
        assert kv_moved(before, topo.decode[0].metrics())[0] >= 1
        # what the kill cost (retries and local prefills are allowed: nothing was lost)
        FIGURES["kill prefill0 mid-run"] = {
            "requests_completed": len(results), "seconds": round(time.monotonic() - t_kill, 1),
            **{k: router_errors(topo.router, k) for k in (
                "prefill_unreachable", "prefill_failed", "prefill_timeout", "local_prefill")}}
        _write_figures(topo.workdir.parent)


class TestTP2PrefillTwoDecode:
    def test_routed_outputs_equal_each_decode_instances_own_run(self, tp2_prefill_two_decode):
        _routed_round(tp2_prefill_two_decode, "1 prefill (TP 2) + 2 decode (TP 1)")


def test_served_connector_recomputes_on_load_failure():
    """The served tests rely on decode instances recomputing when a pull fails."""
    cfg = SERVED_CONNECTOR.kv_transfer_config("decode", "127.0.0.1", 1)
    assert cfg["kv_load_failure_policy"] == "recompute"
    assert cfg["kv_connector"] == "KVBridgeConnector" and cfg["kv_connector_module_path"] == "kvbridge.vllm"
