"""Push mode (``--mode push``): the request bodies, the configuration, and the flow through
real HTTP servers whose fakes meet like push-mode engines.

The fakes rendezvous on the transfer id as kvbridge's engines do: the decode fake
"offers" its blocks to the prefill fake named by ``remote_host:remote_port`` and waits
for the write; the prefill fake waits for that offer before it answers. A router
that sent the two requests one after the other would therefore see every push
fail; an offer to a side channel where no prefill fake lives fails at once and the
decode fake "recomputes" (``kv_load_failure_policy: recompute``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import client
from router_fakes import ServerThread, prompt_text, wait_until
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from test_router_flow import sse_texts

from kvbridge.router import Router, RouterConfig
from kvbridge.router.cli import build_parser, config_from_args
from kvbridge.router.config import ConfigError
from kvbridge.router.push import (
    TRANSFER_ID_KEY,
    push_decode_params,
    push_prefill_body,
    push_prefill_params,
)
from kvbridge.router.requests import parse_request

WAIT_S = 5.0  # how long a fake waits for its peer (a bound: the flow never needs it)


@dataclass
class World:
    """Side channels of live prefill fakes ("host:port" -> fake) and the offers made."""

    channels: dict[str, PushPrefill] = field(default_factory=dict)
    offers: dict[str, asyncio.Event] = field(default_factory=dict)
    written: dict[str, asyncio.Event] = field(default_factory=dict)

    def event(self, table: dict[str, asyncio.Event], tid: str) -> asyncio.Event:
        return table.setdefault(tid, asyncio.Event())


def _app(handler: Any) -> Starlette:
    async def health(_r: Request) -> Response:
        return Response(status_code=200)

    return Starlette(routes=[Route("/v1/completions", handler, methods=["POST"]),
                             Route("/v1/chat/completions", handler, methods=["POST"]),
                             Route("/health", health, methods=["GET"])])


@dataclass(eq=False)
class PushPrefill:
    """A push-mode prefill engine: answers once the decode fake's offer came and it wrote."""

    name: str
    world: World
    side_channel: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0

    def __post_init__(self) -> None:
        self.app = _app(self.generate)
        self.world.channels[self.side_channel] = self

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        tid = body["kv_transfer_params"][TRANSFER_ID_KEY]
        offer = self.world.event(self.world.offers, tid)
        end = asyncio.get_running_loop().time() + WAIT_S
        while not offer.is_set():
            if await request.is_disconnected():  # the router cancelled the request
                self.cancelled += 1
                return Response(status_code=499)
            if asyncio.get_running_loop().time() > end:  # no offer: computed without transfer
                return JSONResponse({"choices": [{"index": 0, "text": "x"}]})
            await asyncio.sleep(0.01)
        self.world.event(self.world.written, tid).set()
        return JSONResponse({"choices": [{"index": 0, "text": "x"}],
                             "kv_transfer_params": {"transfer_mode": "push", "kvbridge_pushed": True}})


@dataclass(eq=False)
class PushDecode:
    """A push-mode decode engine with ``kv_load_failure_policy: recompute``; its text says
    where the KV came from (``<prompt>|pushed by <prefill>``, ``|recomputed``, ``|local``)."""

    name: str
    world: World
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.app = _app(self.generate)

    async def source(self, params: dict[str, Any] | None) -> str:
        if not params:
            return "local"
        tid = params[TRANSFER_ID_KEY]
        prefill = self.world.channels.get(f"{params['remote_host']}:{params['remote_port']}")
        if prefill is None:  # the offer cannot be delivered: the load fails at once
            return "recomputed"
        self.world.event(self.world.offers, tid).set()
        try:
            await asyncio.wait_for(self.world.event(self.world.written, tid).wait(), WAIT_S)
        except asyncio.TimeoutError:
            return "recomputed"
        return f"pushed by {prefill.name}"

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        text = f"{prompt_text(body)}|{await self.source(body.get('kv_transfer_params'))}"
        if not body.get("stream"):
            return JSONResponse({"choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

        async def events():
            for piece in (text[:3], text[3:]):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': piece}]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@dataclass
class PushCluster:
    world: World
    prefill: list[PushPrefill]
    decode: PushDecode
    router: Router
    servers: dict[str, ServerThread]

    def post(self, prompt: str, **extra: Any) -> Any:
        with client(self.servers["router"].url) as http:
            return http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, **extra})

    def errors(self, kind: str) -> float:
        v = self.router.metrics.registry.get_sample_value("kvbridge_router_errors_total",
                                                          {"kind": kind})
        return v or 0.0

    def kill(self, i: int) -> None:
        """Stop prefill fake ``i`` like a dead engine: its HTTP port and side channel go."""
        self.servers[self.prefill[i].name].stop()
        del self.world.channels[self.prefill[i].side_channel]


@pytest.fixture
def push_cluster():
    made: list[ServerThread] = []

    def make(n_prefill: int = 1, **config: Any) -> PushCluster:
        world = World()
        prefill = [PushPrefill(f"p{i}", world, f"10.0.0.{i + 1}:{5600 + i}") for i in range(n_prefill)]
        decode = PushDecode("d0", world)
        servers = {f.name: ServerThread(f.app).start() for f in [*prefill, decode]}
        made.extend(servers.values())
        channels = {servers[p.name].url: p.side_channel for p in prefill}
        config.setdefault("health_interval_s", 3600)  # only requests change health here
        router = Router(RouterConfig(prefill=tuple(servers[p.name].url for p in prefill),
                                     decode=(servers["d0"].url,), mode="push",
                                     prefill_side_channels=channels, **config))
        servers["router"] = ServerThread(router.app).start()
        made.append(servers["router"])
        return PushCluster(world, prefill, decode, router, servers)

    yield make
    ServerThread.stop_all([s for s in made if s.future is not None])


# ------------------------------------------------------------------ request building


def test_push_bodies_are_what_kvbridges_connector_parses():
    req = parse_request("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "hi", "max_tokens": 9, "stream": True,
         "stream_options": {"include_usage": True}}).encode())
    pre = push_prefill_body(req, "t-1")
    assert pre["kv_transfer_params"] == push_prefill_params("t-1")
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    dec = push_decode_params("t-1", "10.0.0.5", 5601)
    params = pytest.importorskip("kvbridge.vllm.params")  # the connector's own parser
    assert params.route(pre["kv_transfer_params"]).prefill
    assert params.route(pre["kv_transfer_params"]).push
    assert params.decode_push_prefill(pre["kv_transfer_params"]).transfer_id == "t-1"
    assert params.route(dec).decode and params.route(dec).push
    parsed = params.decode_push_decode(dec)
    assert (parsed.transfer_id, parsed.host, parsed.port) == ("t-1", "10.0.0.5", 5601)
    assert params.TRANSFER_ID_KEY == TRANSFER_ID_KEY


def test_side_channels_from_configuration_or_the_url_host():
    cfg = RouterConfig(prefill=("http://p0:8100", "http://[::1]:8101"), decode=("http://d:8200",),
                       mode="push", prefill_side_channels={"p0:8100/": "10.1.1.1:5700"})
    assert cfg.side_channel("http://p0:8100") == ("10.1.1.1", 5700)
    assert cfg.side_channel("http://[::1]:8101") == ("::1", 5600)  # kvbridge's default port
    with pytest.raises(ConfigError, match="not a prefill instance"):
        RouterConfig(prefill=("http://p0:8100",), decode=("http://d:8200",),
                     prefill_side_channels={"http://p1:8100": "p1:5600"})
    for bad in ("p0", "p0:0", "p0:x", ":5600"):
        with pytest.raises(ConfigError, match="host:port"):
            RouterConfig(prefill=("http://p0:8100",), decode=("http://d:8200",),
                         prefill_side_channels={"http://p0:8100": bad})
    with pytest.raises(ConfigError, match="mode must be one of pull, push"):
        RouterConfig(prefill=(), decode=("http://d:8200",), mode="pushy")


def test_cli_mode_and_side_channel_flags():
    args = build_parser().parse_args(["--mode", "push", "--prefill", "http://p0:8100",
                                      "--decode", "http://d:8200", "--prefill-side-channel",
                                      "http://p0:8100=10.0.0.5:5601"])
    cfg = config_from_args(args)
    assert cfg.mode == "push" and cfg.side_channel("http://p0:8100") == ("10.0.0.5", 5601)
    args = build_parser().parse_args(["--decode", "http://d:8200", "--prefill", "http://p0:8100",
                                      "--prefill-side-channel", "10.0.0.5:5601"])
    with pytest.raises(ConfigError, match="URL=HOST:PORT"):
        config_from_args(args)
    assert config_from_args(build_parser().parse_args(["--decode", "http://d:8200"])).mode == "pull"


# ------------------------------------------------------------------ flow


def test_push_sends_both_requests_at_once_with_one_transfer_id(push_cluster):
    c = push_cluster(2)
    for i in range(4):
        r = c.post(f"hello {i}", max_tokens=5)
        assert r.status_code == 200, r.text
        prompt, source = r.json()["choices"][0]["text"].split("|")
        # the prefill fake answers only after the decode fake's offer: sent together
        assert prompt == f"hello {i}" and source.startswith("pushed by p")
    assert sorted(len(p.bodies) for p in c.prefill) == [2, 2]  # least loaded, round robin
    for p in c.prefill:
        for pre in p.bodies:
            tid = pre["kv_transfer_params"][TRANSFER_ID_KEY]
            (dec,) = [d for d in c.decode.bodies if d["kv_transfer_params"][TRANSFER_ID_KEY] == tid]
            host, port = p.side_channel.split(":")
            assert dec["kv_transfer_params"] == push_decode_params(tid, host, int(port))
            assert dec["max_tokens"] == 5 and pre["max_tokens"] == 1
    assert len({d["kv_transfer_params"][TRANSFER_ID_KEY] for d in c.decode.bodies}) == 4
    reg = c.router.metrics.registry
    assert sum(reg.get_sample_value("kvbridge_router_prefill_seconds_count",
                                    {"instance": c.servers[p.name].url}) for p in c.prefill) == 4
    assert c.errors("push_failed") == c.errors("prefill_failed") == 0
    wait_until(lambda: [i.in_flight for i in c.router.instances()] == [0, 0, 0], "in-flight zero")


def test_push_streams_the_decode_answer(push_cluster):
    c = push_cluster(1)
    r = c.post("streamed words", stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    texts, done = sse_texts(r.text)
    assert "".join(texts) == "streamed words|pushed by p0" and done


def test_killed_prefill_decode_recomputes_and_later_requests_prefill_locally(push_cluster):
    c = push_cluster(1)
    c.kill(0)
    # the router still counts p0 in rotation: both requests go out, the prefill one finds
    # nobody, the decode engine's offer fails at once and it recomputes (its policy)
    r = c.post("after the kill")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "after the kill|recomputed"
    assert c.errors("prefill_unreachable") == 1
    assert not c.router.prefill.instances[0].healthy
    # p0 is out of rotation now: the decode instance prefills without push parameters
    r = c.post("later")
    assert r.json()["choices"][0]["text"] == "later|local"
    assert "kv_transfer_params" not in c.decode.bodies[-1]
    assert c.errors("local_prefill") == 1
    # the recompute is loud: counted as a decode request sent without parameters
    assert c.router.metrics.registry.get_sample_value(
        "kvbridge_router_decode_without_params_total", {}) == 1


def test_a_prefill_that_answers_without_pushing_is_counted(push_cluster):
    c = push_cluster(1)
    # a decode side channel that never offers: the decode fake cannot reach the prefill
    # fake's side channel (another address configured on the decode request)
    c.world.channels["elsewhere:1"] = c.world.channels.pop(c.prefill[0].side_channel)
    r = c.post("no offer")
    assert r.json()["choices"][0]["text"] == "no offer|recomputed"
    wait_until(lambda: c.errors("push_failed") == 1, "push_failed counted")
    assert c.errors("prefill_failed") == 0 and c.router.prefill.instances[0].healthy


def test_no_decode_instance_cancels_the_waiting_prefill(push_cluster):
    c = push_cluster(1)
    c.servers["d0"].stop()
    r = c.post("nobody decodes")
    assert r.status_code == 503 and "no decode instance" in r.json()["error"]["message"]
    # the prefill request waiting for an offer was cancelled, not left to its timeout
    wait_until(lambda: c.prefill[0].cancelled == 1, "prefill request cancelled", timeout_s=WAIT_S - 1)
    wait_until(lambda: [i.in_flight for i in c.router.instances()] == [0, 0], "in-flight zero")

