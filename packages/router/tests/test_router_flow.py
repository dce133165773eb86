"""The request path through real HTTP servers: prefill → decode, streaming, request ids."""

from __future__ import annotations

import json
import logging
import time

import pytest
from router_fakes import wait_until

from kvbridge.router import ConfigError, RouterConfig


def sse_texts(raw: str) -> tuple[list[str], bool]:
    """(text pieces, saw [DONE]) of an SSE body."""
    texts, done = [], False
    for line in raw.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        obj = json.loads(data)
        ch = obj["choices"][0]
        texts.append(ch.get("text") if "text" in ch else ch["delta"].get("content", ""))
    return texts, done


def test_completion_goes_prefill_then_decode_with_the_params(make_cluster):
    c = make_cluster(2, 1)
    with c.client() as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 7,
                                               "stream_options": {"include_usage": True}},
                      headers={"X-Request-Id": "req-42"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "req-42"
    text = r.json()["choices"][0]["text"]
    prompt, source = text.split("|")
    assert prompt == "hello" and source in ("p0", "p1")
    p = next(f for f in c.prefill if f.name == source)
    (pre,) = p.generation_requests()
    assert pre.body["kv_transfer_params"]["do_remote_decode"] is True
    assert pre.body["max_tokens"] == 1 and pre.body["stream"] is False
    assert "stream_options" not in pre.body
    assert pre.request_id == "req-42"
    (dec,) = c.decode[0].generation_requests()
    # decode gets the client's body plus exactly what the prefill instance returned
    assert dec.body["max_tokens"] == 7
    assert dec.body["kv_transfer_params"] == {"do_remote_prefill": True, "do_remote_decode": False,
                                              "remote_engine_id": source, "request_id": "req-42"}
    assert dec.request_id == "req-42"
    assert c.metric("kvbridge_router_requests_total", endpoint="/v1/completions") == 1
    assert c.metric("kvbridge_router_prefill_seconds_count", instance=c.upstream_urls[source]) == 1
    wait_until(lambda: c.metric("kvbridge_router_decode_seconds_count",
                                instance=c.upstream_urls["d0"]) == 1, "decode latency observed")
    wait_until(lambda: c.in_flight() == [0, 0, 0], "in-flight back to zero")


def test_request_id_is_made_when_missing_and_differs_per_request(make_cluster):
    c = make_cluster(1, 1)
    with c.client() as http:
        ids = [http.post("/v1/completions", json={"prompt": "a"}).headers["x-request-id"]
               for _ in range(3)]
    assert len(set(ids)) == 3 and all(ids)
    assert [s.request_id for s in c.decode[0].generation_requests()] == ids


def test_prefill_choice_spreads_over_instances(make_cluster):
    c = make_cluster(2, 1)
    with c.client() as http:
        for i in range(6):
            assert http.post("/v1/completions", json={"prompt": f"q{i}"}).status_code == 200
    # sequential requests leave every count at zero: ties go round-robin
    assert [len(p.generation_requests()) for p in c.prefill] == [3, 3]


def test_chat_non_streaming_and_streaming(make_cluster):
    c = make_cluster(1, 1)
    msgs = [{"role": "user", "content": "hi there"}]
    with c.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 5})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "hi there|p0"
        (pre,) = c.prefill[0].generation_requests()
        assert pre.path == "/v1/chat/completions"
        assert pre.body["max_completion_tokens"] == 1 and pre.body["max_tokens"] == 1
        with http.stream("POST", "/v1/chat/completions", json={"messages": msgs, "stream": True}) as s:
            assert s.status_code == 200
            assert s.headers["content-type"].startswith("text/event-stream")
            raw = s.read().decode()
    texts, done = sse_texts(raw)
    assert "".join(texts) == "hi there|p0" and done
    assert len(texts) == 4  # the decode instance's chunks, not merged into one
    # streams read to the end are neither disconnects nor cut short
    wait_until(lambda: c.metric("kvbridge_router_decode_seconds_count",
                                instance=c.upstream_urls["d0"]) == 2, "both decodes observed")
    assert c.error_count("client_disconnect") == 0


def test_stream_is_passed_through_as_it_arrives(make_cluster):
    """The first event reaches the client while the decode instance still holds the rest."""
    c = make_cluster(1, 1)
    d = c.decode[0]
    d.mode = "gated_stream"
    with c.client() as http, http.stream("POST", "/v1/completions",
                                         json={"prompt": "abcdefgh", "stream": True}) as s:
        lines = s.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        # the upstream is still waiting on its gate: nothing after chunk 0 was produced yet
        assert not d.gate.is_set() and d.completed == []
        d.gate.set()
        rest = "\n".join(lines)
    texts, done = sse_texts(first + "\n" + rest)
    assert "".join(texts) == "abcdefgh|p0" and done


def test_models_health_and_metrics_endpoints(make_cluster):
    c = make_cluster(1, 2)
    with c.client() as http:
        m = http.get("/v1/models")
        assert m.status_code == 200 and m.json()["data"][0]["id"] == "tiny"
        h = http.get("/health")
        assert h.status_code == 200
        assert h.json()["status"] == "ok" and len(h.json()["decode"]) == 2
        http.post("/v1/completions", json={"prompt": "m"})
        text = http.get("/metrics").text
    for name in ("kvbridge_router_requests_total", "kvbridge_router_errors_total",
                 "kvbridge_router_prefill_seconds_bucket", "kvbridge_router_decode_seconds_bucket",
                 "kvbridge_router_in_flight", "kvbridge_router_instance_healthy"):
        assert name in text, name


def test_two_routers_side_by_side_share_instances(make_cluster):
    from router_fakes import ServerThread

    from kvbridge.router import Router

    c = make_cluster(1, 1)
    second = Router(c.router.config)
    with ServerThread(second.app) as s2, c.client() as a:
        import httpx

        with httpx.Client(base_url=s2.url, trust_env=False, timeout=60) as b:
            ra = a.post("/v1/completions", json={"prompt": "one"})
            rb = b.post("/v1/completions", json={"prompt": "two"})
    assert ra.json()["choices"][0]["text"] == "one|p0"
    assert rb.json()["choices"][0]["text"] == "two|p0"
    wait_until(lambda: second.decode.instances[0].in_flight == 0, "second router idle")


def test_idle_upstream_connections_expire_before_the_instance_closes_them(make_cluster):
    """An instance closes a connection idle for its keep-alive (vLLM: 5 s); a request the router
    writes into it at that moment fails. The router drops idle connections after
    ``upstream_keepalive_s`` instead: a request after a longer pause opens a new connection,
    one sooner reuses the open one."""
    # no health probes in between: they would keep the connections busy
    c = make_cluster(1, 1, upstream_keepalive_s=0.5, health_interval_s=60.0)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    with c.client() as http:
        for pause_s in (0.0, 0.0, 1.5):
            time.sleep(pause_s)
            assert http.post("/v1/completions", json=body).status_code == 200
    for inst in (c.prefill[0], c.decode[0]):
        ports = [s.client_port for s in inst.generation_requests()]
        assert len(ports) == 3 and None not in ports
        assert ports[1] == ports[0], f"{inst.name}: the router did not reuse an open connection"
        assert ports[2] != ports[1], f"{inst.name}: the router reused a connection idle past its expiry"


def test_default_upstream_keepalive_is_below_vllms():
    assert RouterConfig(prefill=(), decode=("http://127.0.0.1:1",)).upstream_keepalive_s < 5.0
    with pytest.raises(ConfigError, match="upstream_keepalive_s"):
        RouterConfig(prefill=(), decode=("http://127.0.0.1:1",), upstream_keepalive_s=0)


def test_debug_log_follows_each_request_through_both_instances(make_cluster, caplog):
    """At debug level the router logs, per request id, when the prefill answered and when the
    decode was sent and answered: what an operator needs to find where a request waits."""
    caplog.set_level(logging.DEBUG, logger="kvbridge.router")
    c = make_cluster(1, 1)
    with c.client() as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                      headers={"X-Request-Id": "req-dbg"})
    assert r.status_code == 200
    wait_until(lambda: any("decode on" in m.getMessage() for m in caplog.records), "decode answered")
    lines = [m.getMessage() for m in caplog.records if "req-dbg" in m.getMessage()]
    assert [ln.split(": ", 1)[1].split(" ")[:2] for ln in lines] == [
        ["prefill", "on"], ["decode", "sent"], ["decode", "on"]], lines
    assert c.upstream_urls["p0"] in lines[0] and c.upstream_urls["d0"] in lines[2]
