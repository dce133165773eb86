"""Hundreds of concurrent requests through one router: none lost, counts back to zero."""

from __future__ import annotations

import asyncio
import collections

import httpx
from router_fakes import wait_until

from kvbridge.router.app import NODELAY

N = 200


async def _fire(url: str, n: int) -> list[tuple[int, str, str, str]]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=NODELAY)
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False,
                                 transport=transport) as http:

        async def one(i: int) -> tuple[int, str, str, str]:
            rid = f"r{i}"
            if i % 3 == 0:  # a third streamed
                async with http.stream("POST", "/v1/completions", headers={"X-Request-Id": rid},
                                       json={"prompt": f"p{i}", "stream": True}) as r:
                    raw = (await r.aread()).decode()
                    from test_router_flow import sse_texts

                    texts, done = sse_texts(raw)
                    assert done
                    return r.status_code, "".join(texts), r.headers["x-request-id"], rid
            r = await http.post("/v1/completions", json={"prompt": f"p{i}"},
                                headers={"X-Request-Id": rid})
            assert r.status_code == 200, r.text
            return r.status_code, r.json()["choices"][0]["text"], r.headers["x-request-id"], rid

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_hundreds_of_concurrent_requests(make_cluster):
    # generous bounds: the fakes, the router and the client share one process and two cores
    c = make_cluster(2, 2, connect_timeout_s=120, health_timeout_s=120, health_interval_s=1)
    results = asyncio.run(_fire(c.url, N))
    assert len(results) == N
    for i, (status, text, rid_back, rid) in enumerate(results):
        assert status == 200
        prompt, source = text.split("|")
        assert prompt == f"p{i}" and source in ("p0", "p1")
        assert rid_back == rid
    # every request reached exactly one decode instance, with its own id
    ids = [s.request_id for d in c.decode for s in d.generation_requests()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(N))
    per_decode = [len(d.generation_requests()) for d in c.decode]
    per_prefill = collections.Counter(r[1].split("|")[1] for r in results)
    assert min(per_decode) > 0 and len(per_prefill) == 2  # load went to every instance
    wait_until(lambda: c.in_flight() == [0, 0, 0, 0], "in-flight back to zero")
    assert c.metric("kvbridge_router_requests_total", endpoint="/v1/completions") == N
    for kind in ("prefill_failed", "prefill_unreachable", "decode_failed", "local_prefill"):
        assert c.error_count(kind) == 0, kind
    text = c.client().get("/metrics").text
    assert 'kvbridge_router_in_flight{instance="' in text
