"""Real HTTP servers for the router's tests: fake OpenAI instances served by uvicorn.

:class:`FakeInstance` is a small Starlette app that behaves like a vLLM OpenAI
server started with a KV connector, as far as the router can see: a prefill
request (``kv_transfer_params.do_remote_decode``) returns ``kv_transfer_params``
naming the instance; a decode request answers with a text that says where its
KV came from (``"<prompt>|<prefill instance>"`` or ``"<prompt>|local"``).
Its ``mode`` selects a failure. :class:`ServerThread` serves any ASGI app on
127.0.0.1 in a thread (used for the fakes and for the router itself).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODES = ("ok", "error500", "hang", "no_params", "bad_request", "die_mid_stream", "unhealthy",
         "gated_stream")


def wait_until(pred: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``pred`` until it holds; fail the test when it never does (a bound, not a timing)."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"never happened within {timeout_s} s: {what}")
        time.sleep(0.02)


def prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return " ".join(str(m.get("content", "")) for m in body["messages"])
    p = body.get("prompt")
    if isinstance(p, list):
        p = p[0] if p and isinstance(p[0], (str, list)) else p
    return p if isinstance(p, str) else json.dumps(p)


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    request_id: str | None
    client_port: int | None = None  # the router's end of the connection


@dataclass
class FakeInstance:
    """A fake OpenAI server; ``mode`` may be changed while it runs."""

    name: str
    mode: str = "ok"
    chunks: int = 4
    seen: list[Seen] = field(default_factory=list)
    cancelled: list[str | None] = field(default_factory=list)  # request ids whose client left
    completed: list[str | None] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} not in {MODES}")
        self.app = Starlette(routes=[
            Route("/v1/completions", self._generate, methods=["POST"]),
            Route("/v1/chat/completions", self._generate, methods=["POST"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
        ])

    def generation_requests(self) -> list[Seen]:
        return [s for s in self.seen if s.path.startswith("/v1/")]

    async def _health(self, _r: Request) -> Response:
        return Response(status_code=503 if self.mode == "unhealthy" else 200)

    async def _models(self, _r: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model",
                                                          "owned_by": self.name}]})

    async def _wait_for_disconnect(self, request: Request, rid: str | None, limit_s: float = 60) -> None:
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            if await request.is_disconnected():
                self.cancelled.append(rid)
                return
            await asyncio.sleep(0.02)

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        rid = request.headers.get("x-request-id")
        self.seen.append(Seen(request.url.path, body, rid, request.client.port if request.client else None))
        params = body.get("kv_transfer_params") or {}
        is_prefill = bool(params.get("do_remote_decode"))
        mode = self.mode
        if mode == "hang":
            await self._wait_for_disconnect(request, rid)
            return JSONResponse({"error": "hung"}, status_code=500)
        if mode == "error500":
            return JSONResponse({"error": {"message": f"{self.name} broke"}}, status_code=500)
        if mode == "bad_request":
            return JSONResponse({"error": {"message": "prompt is too long", "code": 400}},
                                status_code=400)
        if is_prefill:
            out: dict[str, Any] = {"id": f"cmpl-{rid}", "object": "text_completion",
                                   "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
            if mode != "no_params":
                out["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                             "remote_engine_id": self.name, "request_id": rid}
            self.completed.append(rid)
            return JSONResponse(out)
        source = params.get("remote_engine_id", "local")
        text = f"{prompt_text(body)}|{source}"
        chat = request.url.path.endswith("/chat/completions")
        if not body.get("stream"):
            self.completed.append(rid)
            choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                       "finish_reason": "length"} if chat else
                                      {"index": 0, "text": text, "finish_reason": "length"})
            return JSONResponse({"id": f"cmpl-{rid}", "object": "chat.completion" if chat else
                                 "text_completion", "model": "tiny", "created": 0,
                                 "choices": [choice],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                           "total_tokens": 2}})
        return StreamingResponse(self._stream(text, rid, chat, mode), media_type="text/event-stream")

    async def _stream(self, text: str, rid: str | None, chat: bool, mode: str):
        n = max(1, self.chunks)
        size = -(-len(text) // n)
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        done = False
        try:
            for i, piece in enumerate(pieces):
                if chat:
                    chunk = {"id": f"c-{rid}", "object": "chat.completion.chunk", "model": "tiny",
                             "created": 0, "choices": [{"index": 0, "delta": {"content": piece},
                                                        "finish_reason": None}]}
                else:
                    chunk = {"id": f"c-{rid}", "object": "text_completion", "model": "tiny",
                             "created": 0, "choices": [{"index": 0, "text": piece,
                                                        "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                if i == 0 and mode == "gated_stream":
                    end = time.monotonic() + 60
                    while not self.gate.is_set() and time.monotonic() < end:
                        await asyncio.sleep(0.02)
                if i == 1 and mode == "die_mid_stream":
                    raise RuntimeError(f"{self.name} died mid-stream (test)")
                await asyncio.sleep(0)
            yield b"data: [DONE]\n\n"
            done = True
            self.completed.append(rid)
        finally:
            if not done and mode != "die_mid_stream":
                self.cancelled.append(rid)


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def server_loop() -> asyncio.AbstractEventLoop:
    """One event loop in a daemon thread that serves every test server of this process.

    One loop, not one thread per server: event loops in several threads take turns on
    the GIL, which made 200 concurrent requests ten times slower.
    """
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="test-servers").start()
            _LOOP = loop
        return _LOOP


class ServerThread:
    """Serve an ASGI app with uvicorn on 127.0.0.1 (on the shared :func:`server_loop`)."""

    def __init__(self, app: Any, port: int = 0) -> None:
        self.app = app
        # proto IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
        # sockets whose proto says TCP, and with Nagle on, every keep-alive response that
        # uvicorn writes in two pieces waits ~40 ms for a delayed ACK
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(
            app, log_level="error", access_log=False, lifespan="on", timeout_graceful_shutdown=1,
            backlog=2048, timeout_keep_alive=30))
        self.future: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.future = asyncio.run_coroutine_threadsafe(self.server.serve(sockets=[self.sock]),
                                                       server_loop())
        wait_until(lambda: self.server.started or self.future.done(), "uvicorn start")
        if not self.server.started:
            raise RuntimeError(f"uvicorn did not start: {self.future.exception()}")
        return self

    def stop(self) -> None:
        """Stop like a dead process: no listener and no open connection left.

        uvicorn's shutdown leaves connections that did not close within its grace
        period open; on the shared loop they would go on answering, so close them.
        """
        self.server.should_exit = True
        if self.future is not None:
            self.future.result(30)
            self.future = None

            async def close_connections() -> None:
                for conn in list(self.server.server_state.connections):
                    transport = getattr(conn, "transport", None)
                    if transport is not None:
                        transport.abort()

            asyncio.run_coroutine_threadsafe(close_connections(), server_loop()).result(10)
        self.sock.close()

    @staticmethod
    def stop_all(servers: list[ServerThread]) -> None:
        """Stop several servers at once (each takes a few polls of uvicorn's main loop)."""
        for s in servers:
            s.server.should_exit = True
        for s in servers:
            s.stop()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (connection refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
