"""Every failure policy of the router, against real HTTP upstreams that fail on purpose."""

from __future__ import annotations

import re

import httpx
import pytest
from router_fakes import ServerThread, closed_port, wait_until
from test_router_flow import sse_texts


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("mode", ["error500", "no_params"])
def test_failed_prefill_goes_to_the_other_prefill(make_cluster, mode):
    c = make_cluster(2, 1)
    c.prefill[0].mode = mode
    with c.client() as http:
        texts = [text_of(http.post("/v1/completions", json={"prompt": f"q{i}"})) for i in range(4)]
    assert texts == [f"q{i}|p1" for i in range(4)]
    assert c.error_count("prefill_failed") >= 1
    assert c.error_count("local_prefill") == 0
    wait_until(lambda: c.in_flight() == [0, 0, 0], "in-flight back to zero")


def test_unreachable_prefill_is_skipped_and_taken_out(make_cluster):
    # probes only at start: the request itself must find out that p0 died
    c = make_cluster(2, 1, health_interval_s=3600)
    c.servers[0].stop()  # p0 dies
    dead = c.upstream_urls["p0"]
    with c.client() as http:
        texts = [text_of(http.post("/v1/completions", json={"prompt": f"q{i}"})) for i in range(4)]
    assert texts == [f"q{i}|p1" for i in range(4)]
    assert c.error_count("prefill_unreachable") == 1  # then taken out, not tried again
    assert c.metric("kvbridge_router_instance_healthy", role="prefill", instance=dead) == 0
    h = c.client().get("/health").json()
    assert [p["healthy"] for p in h["prefill"]] == [False, True]


def test_prefill_timeout_goes_to_another_prefill_and_cancels_the_slow_one(make_cluster):
    c = make_cluster(2, 1, prefill_timeout_s=0.5)
    c.prefill[0].mode = "hang"
    c.prefill[1].mode = "hang"
    with c.client() as http:
        # both hang: each is tried once, then the decode instance prefills locally
        r = http.post("/v1/completions", json={"prompt": "slow"}, headers={"X-Request-Id": "t1"})
    assert text_of(r) == "slow|local"
    assert c.error_count("prefill_timeout") == 2
    # the timed-out requests were cancelled upstream (the connection closed)
    wait_until(lambda: c.prefill[0].cancelled == ["t1"] and c.prefill[1].cancelled == ["t1"],
               "hung prefill requests cancelled")
    (dec,) = c.decode[0].generation_requests()
    assert "kv_transfer_params" not in dec.body


def test_no_prefill_left_decode_prefills_locally(make_cluster):
    c = make_cluster(2, 1)
    for p in c.prefill:
        p.mode = "error500"
    with c.client() as http:
        assert text_of(http.post("/v1/completions", json={"prompt": "x"})) == "x|local"
        with http.stream("POST", "/v1/completions", json={"prompt": "y", "stream": True}) as s:
            texts, done = sse_texts(s.read().decode())
    assert "".join(texts) == "y|local" and done
    assert c.error_count("local_prefill") == 2
    assert c.error_count("prefill_failed") == 4


def test_router_without_prefill_instances_decodes_locally(make_cluster):
    c = make_cluster(0, 1)
    with c.client() as http:
        assert text_of(http.post("/v1/completions", json={"prompt": "z"})) == "z|local"
    assert c.error_count("local_prefill") == 0  # not a fallback: no prefill was configured


def test_prefill_client_error_is_passed_to_the_client(make_cluster):
    c = make_cluster(2, 1)
    for p in c.prefill:
        p.mode = "bad_request"
    with c.client() as http:
        r = http.post("/v1/completions", json={"prompt": "way too long"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt is too long"
    assert sum(len(p.generation_requests()) for p in c.prefill) == 1  # not retried elsewhere
    assert c.decode[0].generation_requests() == []


def test_decode_failure_is_a_clear_openai_error(make_cluster):
    c = make_cluster(1, 1)
    c.decode[0].mode = "error500"
    with c.client() as http:
        r = http.post("/v1/completions", json={"prompt": "q"})
    assert r.status_code == 502
    err = r.json()["error"]
    assert "decode instance" in err["message"] and "500" in err["message"]
    assert err["type"] == "upstream_error" and err["code"] == 502
    assert c.error_count("decode_failed") == 1
    wait_until(lambda: c.in_flight() == [0, 0], "in-flight back to zero")


def test_decode_timeout_is_a_504(make_cluster):
    c = make_cluster(1, 1, decode_timeout_s=0.5)
    c.decode[0].mode = "hang"
    with c.client() as http:
        r = http.post("/v1/completions", json={"prompt": "q"}, headers={"X-Request-Id": "dt"})
    assert r.status_code == 504 and "decode_timeout_s" in r.json()["error"]["message"]
    wait_until(lambda: c.decode[0].cancelled == ["dt"], "timed-out decode cancelled upstream")


def test_unreachable_decode_tries_the_next_decode(make_cluster):
    c = make_cluster(1, 2, health_interval_s=3600)
    c.servers[1].stop()  # d0 dies; only the requests can tell
    with c.client() as http:
        texts = [text_of(http.post("/v1/completions", json={"prompt": f"q{i}"})) for i in range(3)]
    assert texts == [f"q{i}|p0" for i in range(3)]
    assert c.error_count("decode_unreachable") == 1
    assert len(c.decode[1].generation_requests()) == 3


def test_no_decode_instance_is_a_503(make_cluster):
    dead = f"http://127.0.0.1:{closed_port()}"
    c = make_cluster(1, 0, extra_decode_urls=(dead,))
    with c.client() as http:
        r = http.post("/v1/completions", json={"prompt": "q"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert "tried 1 of 1" in r.json()["error"]["message"]  # tried, though out of rotation
        wait_until(lambda: http.get("/health").status_code == 503, "router reports no decode")
        assert http.get("/v1/models").status_code == 503


def test_decode_out_of_rotation_is_still_tried_when_no_other_is_left(make_cluster):
    """A busy engine may miss its probes: with every decode instance out of rotation the
    router still tries them before refusing, and an answer puts the instance back."""
    c = make_cluster(1, 2)
    c.decode[0].mode = c.decode[1].mode = "unhealthy"  # /health says 503, requests work
    gauge = lambda i: c.metric("kvbridge_router_instance_healthy", role="decode",
                               instance=c.upstream_urls[f"d{i}"])
    wait_until(lambda: gauge(0) == 0 and gauge(1) == 0, "both decode instances taken out")
    with c.client() as http:
        assert http.get("/health").status_code == 503
        assert text_of(http.post("/v1/completions", json={"prompt": "q"})).startswith("q|p0")
    assert c.error_count("no_decode") == 0
    assert sum(len(d.generation_requests()) for d in c.decode) == 1


def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event(make_cluster):
    c = make_cluster(1, 1)
    c.decode[0].mode = "die_mid_stream"
    with c.client() as http, http.stream("POST", "/v1/completions",
                                         json={"prompt": "abcdefgh", "stream": True}) as s:
        assert s.status_code == 200
        raw = s.read().decode()
    events = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
    assert "[DONE]" not in events
    assert "decode instance" in events[-1] and '"error"' in events[-1]
    # where it broke: after the bytes the client got before the error event, not before headers
    got = re.search(r"failed mid-request, after (\d+) bytes, [0-9.]+ s after it was sent", events[-1])
    assert got and int(got[1]) == len(raw) - len(f"data: {events[-1]}\n\n") > 0, events[-1]
    assert c.error_count("decode_failed") == 1
    wait_until(lambda: c.in_flight() == [0, 0], "in-flight back to zero")


def test_client_disconnect_mid_stream_cancels_the_decode_request(make_cluster):
    c = make_cluster(1, 1)
    d = c.decode[0]
    d.mode = "gated_stream"
    with c.client() as http, http.stream("POST", "/v1/completions", json={"prompt": "abcdefgh",
                                         "stream": True}, headers={"X-Request-Id": "gone"}) as s:
        next(ln for ln in s.iter_lines() if ln.startswith("data: "))
    # the client closed its connection while the decode instance still streams
    wait_until(lambda: d.cancelled == ["gone"], "decode stream cancelled upstream")
    wait_until(lambda: c.in_flight() == [0, 0], "in-flight back to zero")
    wait_until(lambda: c.error_count("client_disconnect") == 1, "disconnect counted")
    assert d.completed == []


def test_client_disconnect_during_prefill_cancels_it_and_skips_decode(make_cluster):
    c = make_cluster(1, 1)
    c.prefill[0].mode = "hang"
    with c.client() as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"prompt": "q"}, headers={"X-Request-Id": "bye"},
                      timeout=httpx.Timeout(60, read=0.5))
    wait_until(lambda: c.prefill[0].cancelled == ["bye"], "prefill cancelled upstream")
    wait_until(lambda: c.in_flight() == [0, 0], "in-flight back to zero")
    assert c.decode[0].generation_requests() == []


def test_dead_instance_comes_back_into_rotation(make_cluster):
    from router_fakes import FakeInstance

    port = closed_port()
    url = f"http://127.0.0.1:{port}"
    c = make_cluster(1, 1, extra_prefill_urls=(url,))
    gauge = lambda: c.metric("kvbridge_router_instance_healthy", role="prefill", instance=url)
    wait_until(lambda: gauge() == 0, "down instance taken out")
    revived = FakeInstance("p-revived")
    with ServerThread(revived.app, port=port):
        wait_until(lambda: gauge() == 1, "revived instance back in rotation")
        with c.client() as http:
            texts = [text_of(http.post("/v1/completions", json={"prompt": f"q{i}"}))
                     for i in range(4)]
        assert {t.split("|")[1] for t in texts} == {"p0", "p-revived"}
        revived.mode = "unhealthy"  # answers, but /health says no: out again
        wait_until(lambda: gauge() == 0, "unhealthy instance taken out")
