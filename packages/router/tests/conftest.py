"""Fixtures: fake OpenAI instances and a router, all real uvicorn servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from router_fakes import FakeInstance, ServerThread

from kvbridge.router import Router, RouterConfig
from kvbridge.router.app import NODELAY


@dataclass
class Cluster:
    prefill: list[FakeInstance]
    decode: list[FakeInstance]
    router: Router
    servers: list[ServerThread] = field(default_factory=list)
    router_server: ServerThread | None = None
    upstream_urls: dict[str, str] = field(default_factory=dict)  # fake name -> url

    @property
    def url(self) -> str:
        assert self.router_server is not None
        return self.router_server.url

    def client(self, **kw: Any) -> httpx.Client:
        return client(self.url, **kw)

    def in_flight(self) -> list[int]:
        return [i.in_flight for i in self.router.instances()]

    def metric(self, name: str, **labels: str) -> float:
        v = self.router.metrics.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    def error_count(self, kind: str) -> float:
        return self.metric("kvbridge_router_errors_total", kind=kind)


def client(url: str, **kw: Any) -> httpx.Client:
    """A sync client without Nagle delays (see kvbridge.router.app.NODELAY)."""
    transport = httpx.HTTPTransport(socket_options=NODELAY)
    return httpx.Client(base_url=url, timeout=60, trust_env=False, transport=transport, **kw)


@pytest.fixture
def make_cluster() -> Iterator[Any]:
    made: list[Cluster] = []

    def make(n_prefill: int = 2, n_decode: int = 1, *, extra_prefill_urls: tuple[str, ...] = (),
             extra_decode_urls: tuple[str, ...] = (), **config: Any) -> Cluster:
        prefill = [FakeInstance(f"p{i}") for i in range(n_prefill)]
        decode = [FakeInstance(f"d{i}") for i in range(n_decode)]
        servers = [ServerThread(f.app).start() for f in prefill + decode]
        urls = {f.name: s.url for f, s in zip(prefill + decode, servers, strict=True)}
        config.setdefault("health_interval_s", 0.1)
        # generous bounds: on two busy cores a live fake may answer a probe slowly, and a
        # live instance taken out would send requests elsewhere (dead ones refuse at once)
        config.setdefault("health_timeout_s", 30.0)
        config.setdefault("connect_timeout_s", 30.0)
        cfg = RouterConfig(
            prefill=tuple(urls[f.name] for f in prefill) + extra_prefill_urls,
            decode=tuple(extra_decode_urls) + tuple(urls[f.name] for f in decode), **config)
        router = Router(cfg)
        c = Cluster(prefill, decode, router, servers, upstream_urls=urls)
        made.append(c)
        c.router_server = ServerThread(router.app).start()
        return c

    yield make
    ServerThread.stop_all([s for c in made for s in ([c.router_server] if c.router_server else [])
                           + c.servers])
