"""The router as an ASGI application (Starlette), its health checks, and serving it.

Library use::

    from kvbridge.router import RouterConfig, Router
    router = Router(RouterConfig(prefill=("http://p0:8100",), decode=("http://d0:8200",)))
    app = router.app          # any ASGI server; or: serve(config)

Everything the router knows lives in one :class:`Router` object (no module or
process state besides it), so several routers can run side by side, in one
process or on several hosts, in front of the same instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import uvicorn
from anyio import create_task_group
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .config import RouterConfig
from .metrics import RouterMetrics
from .pool import Instance, Pool
from .proxy import Proxy, describe, send_bytes
from .requests import CHAT, COMPLETIONS, BadRequest, error_body, parse_request

log = logging.getLogger("kvbridge.router")

Scope = MutableMapping[str, Any]

#: Socket options for upstream connections (see Router._lifespan).
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
#: seconds the router keeps a client's idle connection open (uvicorn's default is 5 s, which
#: equals the idle expiry of common HTTP client pools, httpx's and so the OpenAI SDK's among
#: them: a client's request could go out on a connection the router is closing and fail)
CLIENT_KEEPALIVE_S = 75


def _request_id(scope: Scope) -> str:
    for k, v in scope.get("headers", ()):
        if k == b"x-request-id":
            rid = v.decode("latin-1").strip()
            if rid and len(rid) <= 200 and rid.isprintable():
                return rid
    return uuid.uuid4().hex


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


class _Endpoint:
    """A raw ASGI endpoint for one proxied path (it watches for client disconnects)."""

    def __init__(self, router: Router, path: str) -> None:
        self.router = router
        self.path = path

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        r = self.router
        rid = _request_id(scope)
        r.metrics.requests.labels(endpoint=self.path).inc()
        try:
            raw = await _read_body(receive, r.config.max_body_bytes)
            req = parse_request(self.path, raw)
        except BadRequest as e:
            r.metrics.error("bad_request")
            body = json.dumps(error_body(str(e), status=e.status, type_="invalid_request_error",
                                         param=e.param)).encode()
            await send_bytes(send, e.status, body, "application/json", rid)
            return
        except _Disconnected:
            r.metrics.error("client_disconnect")
            return
        disconnected = False
        answered = False  # the last body message went out

        async def tracked_send(msg: MutableMapping[str, Any]) -> None:
            nonlocal answered
            await send(msg)
            if msg["type"] == "http.response.body" and (
                    not msg.get("more_body", False)
                    # a client may hang up right after the SSE terminator: it has everything
                    or msg.get("body", b"").rstrip().endswith(b"data: [DONE]")):
                answered = True

        async with create_task_group() as tg:

            async def watch() -> None:
                nonlocal disconnected
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        # once the answer is out, uvicorn reports a disconnect too: not a cancel
                        if not answered:
                            disconnected = True
                            tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            try:
                await r.proxy.handle(req, rid, _header(scope, b"authorization"), tracked_send)
            finally:
                tg.cancel_scope.cancel()
        if disconnected:
            r.metrics.error("client_disconnect")
            log.info("request %s: client disconnected; upstream request cancelled", rid)


class _Disconnected(Exception):
    pass


async def _read_body(receive: Any, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _Disconnected()
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body larger than {limit} bytes (max_body_bytes)", status=413)
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


class Router:
    """One router: pools, metrics, the upstream HTTP client, health checks, the ASGI app."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.prefill = Pool.of("prefill", config.prefill, self.metrics.instance_changed,
                               unhealthy_after=config.unhealthy_after,
                               placement=config.placement("prefill"))
        self.decode = Pool.of("decode", config.decode, self.metrics.instance_changed,
                              unhealthy_after=config.unhealthy_after,
                              placement=config.placement("decode"))
        self._client: httpx.AsyncClient | None = None
        self._proxy: Proxy | None = None
        self.app = Starlette(
            routes=[
                Route(COMPLETIONS, _Endpoint(self, COMPLETIONS), methods=["POST"]),
                Route(CHAT, _Endpoint(self, CHAT), methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ],
            lifespan=self._lifespan,
        )

    @property
    def proxy(self) -> Proxy:
        if self._proxy is None:
            raise RuntimeError("the router is not started: serve Router.app with an ASGI server "
                               "that runs its lifespan (uvicorn does)")
        return self._proxy

    def instances(self) -> list[Instance]:
        return self.prefill.instances + self.decode.instances

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        c = self.config
        # idle connections expire before the instances close them (see upstream_keepalive_s):
        # httpx's default (5 s) equals uvicorn's, and a request sent on a connection that the
        # instance closes at that moment fails with a ReadError
        limits = httpx.Limits(max_connections=c.max_connections,
                              max_keepalive_connections=c.max_connections,
                              keepalive_expiry=c.upstream_keepalive_s)
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=c.connect_timeout_s),
            # TCP_NODELAY: httpx writes headers and body separately; with Nagle's algorithm
            # and delayed ACKs every POST would wait ~40 ms for nothing
            transport=httpx.AsyncHTTPTransport(limits=limits, socket_options=NODELAY),
            trust_env=False,  # never send instance traffic through an environment proxy
        )
        self._proxy = Proxy(c, self.prefill, self.decode, self.metrics, self._client)
        task = asyncio.create_task(self._health_loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self._client.aclose()
            self._proxy = None

    # ------------------------------------------------------------------ health

    async def _probe(self, pool: Pool, inst: Instance) -> None:
        client = self._client
        if client is None:
            return
        try:
            resp = await asyncio.wait_for(client.get(inst.url + "/health"),
                                          self.config.health_timeout_s)
            ok, why = resp.status_code == 200, f"/health answered {resp.status_code}"
        except asyncio.TimeoutError:
            ok, why = False, f"/health gave no answer within {self.config.health_timeout_s} s"
        except httpx.HTTPError as e:
            ok, why = False, f"/health failed: {describe(e)}"
        if pool.mark_probe(inst, ok, why):
            if ok:
                log.info("%s instance %s is back in rotation", pool.role, inst.url)
            else:
                log.warning("%s instance %s taken out of rotation: %s", pool.role, inst.url, why)

    async def check_health(self) -> None:
        """Probe every instance once (concurrently)."""
        await asyncio.gather(*(self._probe(pool, i) for pool in (self.prefill, self.decode)
                               for i in pool.instances))

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # a probe bug must not stop the checks for good
                log.exception("health check round failed")
            await asyncio.sleep(self.config.health_interval_s)

    # ------------------------------------------------------------------ small endpoints

    async def _health(self, _request: Request) -> Response:
        ok = bool(self.decode.healthy())
        return JSONResponse(
            {"status": "ok" if ok else "no healthy decode instance",
             "prefill": [i.snapshot() for i in self.prefill.instances],
             "decode": [i.snapshot() for i in self.decode.instances]},
            status_code=200 if ok else 503)

    async def _metrics(self, _request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def _models(self, request: Request) -> Response:
        for inst in self.decode.healthy():
            try:
                resp = await asyncio.wait_for(self.proxy.client.get(inst.url + "/v1/models"),
                                              self.config.health_timeout_s)
            except (asyncio.TimeoutError, httpx.HTTPError):
                continue
            if resp.status_code == 200:
                return Response(resp.content, media_type="application/json")
        return JSONResponse(error_body("no decode instance answered /v1/models; retry later",
                                       status=503, type_="service_unavailable"), status_code=503)


def serve(config: RouterConfig, *, log_level: str = "info") -> None:
    """Run a router with uvicorn on ``config.host:config.port`` until interrupted."""
    router = Router(config)
    uvicorn.run(router.app, host=config.host, port=config.port, log_level=log_level,
                access_log=False, timeout_keep_alive=CLIENT_KEEPALIVE_S)
