"""The request path: prefill on one instance, decode on another, answer the client.

Pull mode here; push mode (both requests at once) in :mod:`.push`. Failure policy
of pull mode:

* a prefill instance that fails (5xx, unreachable, an answer without
  ``kv_transfer_params``) or times out: the request goes to the next prefill
  instance; when none is left, to a decode instance without transfer
  parameters, which then prefills itself (slower, never lost);
* a decode instance that cannot be reached: the next decode instance (the
  request never reached the first one, so the prefilled blocks are still
  unread); a decode instance that fails or times out once it has the request:
  an OpenAI-style error to the client (a 502/504, or an ``error`` event when
  the stream has started);
* a 4xx from an instance: the client's request is at fault, passed through;
* the client going away: the upstream request in progress is cancelled
  (its connection is closed, which makes vLLM abort the request).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio
import httpx

from .config import RouterConfig
from .metrics import RouterMetrics
from .pool import Instance, Pool
from .push import PREFILL_GRACE_S, new_transfer_id, push_decode_params, push_prefill_body, pushed
from .requests import ClientRequest, decode_body, error_body, prefill_body

log = logging.getLogger("kvbridge.router")

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class RouterError(Exception):
    """An error answer for the client (OpenAI style)."""

    def __init__(self, status: int, message: str, type_: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_

    def body(self) -> bytes:
        return json.dumps(error_body(self.message, status=self.status, type_=self.type)).encode()


class UpstreamReply(Exception):
    """An instance's own 4xx answer, passed to the client unchanged."""

    def __init__(self, status: int, content: bytes, content_type: str) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.content = content
        self.content_type = content_type


def describe(e: BaseException) -> str:
    """``Type: message`` of an exception and of the root cause it wraps (httpx hides errno)."""
    text = f"{type(e).__name__}: {e}".rstrip(": ")
    root = e
    while root.__cause__ is not None or (root.__context__ is not None and not root.__suppress_context__):
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
    root_text = f"{type(root).__name__}: {root}".rstrip(": ")
    if root is not e and root_text != text:
        text += f" ({root_text})"
    return text


def _client_error(status: int) -> bool:
    return 400 <= status < 500 and status not in (408, 429)


def _short(content: bytes, limit: int = 300) -> str:
    text = content.decode("utf-8", "replace").strip().replace("\n", " ")
    return text[:limit] + ("..." if len(text) > limit else "")


def _headers(request_id: str, auth: str | None) -> dict[str, str]:
    h = {"X-Request-Id": request_id}
    if auth:
        h["Authorization"] = auth
    return h


async def send_bytes(send: Send, status: int, content: bytes, content_type: str,
                     request_id: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(content)).encode()),
                            (b"x-request-id", request_id.encode())]})
    await send({"type": "http.response.body", "body": content, "more_body": False})


class Proxy:
    """Runs requests through the prefill and decode pools with one shared HTTP client."""

    def __init__(self, config: RouterConfig, prefill: Pool, decode: Pool, metrics: RouterMetrics,
                 client: httpx.AsyncClient) -> None:
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.client = client

    async def handle(self, req: ClientRequest, request_id: str, auth: str | None, send: Send) -> None:
        """Answer one checked request on ``send`` (errors included)."""
        try:
            if self.config.mode == "push":
                await self.run_push(req, request_id, auth, send)
                return
            params = await self.run_prefill(req, request_id, auth)
            await self.run_decode(req, params, request_id, auth, send)
        except UpstreamReply as r:
            self.metrics.error("upstream_4xx")
            await send_bytes(send, r.status, r.content, r.content_type, request_id)
        except RouterError as e:
            await send_bytes(send, e.status, e.body(), "application/json", request_id)

    # ------------------------------------------------------------------ prefill

    async def run_prefill(self, req: ClientRequest, request_id: str,
                          auth: str | None) -> dict[str, Any] | None:
        """``kv_transfer_params`` from the first prefill instance that delivers them;
        None when no prefill instance is left (the decode instance prefills itself)."""
        body = prefill_body(req)
        key = self.prefill.prefix_key(req.body)
        tried: list[Instance] = []
        while True:
            inst = self.prefill.choose(exclude=tried, key=key)
            if inst is None:
                if len(self.prefill):
                    self.metrics.error("local_prefill")
                self.metrics.recompute.decode_without(request_id, len(tried))
                return None
            tried.append(inst)
            params = await self._prefill_once(inst, req.endpoint, body, request_id, auth)
            if params is not None:
                return params

    async def _prefill_once(self, inst: Instance, endpoint: str, body: dict[str, Any],
                            request_id: str, auth: str | None, *,
                            push: bool = False) -> dict[str, Any] | None:
        """The answer's ``kv_transfer_params``; None when ``inst`` failed (counted, logged).
        ``push``: an answer without parameters is no failure (its push did not happen:
        :mod:`.push` judges it) and gives ``{}``."""
        t0 = time.monotonic()
        with self.prefill.using(inst):
            try:
                with anyio.fail_after(self.config.prefill_timeout_s):
                    resp = await self.client.post(inst.url + endpoint, json=body,
                                                  headers=_headers(request_id, auth))
            except TimeoutError:
                self.metrics.error("prefill_timeout")
                self.prefill.mark_failed(inst, f"no answer within {self.config.prefill_timeout_s} s")
                log.warning("request %s: prefill on %s timed out after %.1f s; trying another",
                            request_id, inst.url, self.config.prefill_timeout_s)
                return None
            except httpx.HTTPError as e:
                self.metrics.error("prefill_unreachable")
                self.prefill.mark_failed(inst, describe(e))
                log.warning("request %s: prefill on %s failed (%s); trying another",
                            request_id, inst.url, describe(e))
                return None
        if _client_error(resp.status_code):
            raise UpstreamReply(resp.status_code, resp.content,
                                resp.headers.get("content-type", "application/json"))
        why = ""
        params = None
        if resp.status_code >= 300:
            why = f"HTTP {resp.status_code}: {_short(resp.content)}"
        else:
            try:
                params = resp.json().get("kv_transfer_params")
            except (ValueError, AttributeError):
                why = f"answer is not a JSON object: {_short(resp.content)}"
            else:
                if push:  # push answers carry no pull keys; the decode engine got the KV
                    if not isinstance(params, dict):
                        params = {}
                else:  # counted there (silent recompute, made loud), logged below
                    why = self.metrics.recompute.prefill_answer(inst.url, params) or ""
                    if why:
                        params = None
        if params is None:
            inst.last_error = why
            self.metrics.error("prefill_failed")
            log.warning("request %s: prefill on %s failed (%s); trying another", request_id,
                        inst.url, why)
            return None
        took = time.monotonic() - t0
        self.metrics.prefill_seconds.labels(instance=inst.url).observe(took)
        log.debug("request %s: prefill on %s answered in %.1f ms", request_id, inst.url, took * 1e3)
        if self.prefill.mark_ok(inst):
            log.info("prefill instance %s answered a request: back in rotation", inst.url)
        return params

    # ------------------------------------------------------------------ push

    async def run_push(self, req: ClientRequest, request_id: str, auth: str | None,
                       send: Send) -> None:
        """Push mode: the prefill and the decode request at once (failure policy in
        :mod:`.push`)."""
        inst = self.prefill.choose(key=self.prefill.prefix_key(req.body))
        if inst is None:
            if len(self.prefill):
                self.metrics.error("local_prefill")
            self.metrics.recompute.decode_without(request_id, 0)
            await self.run_decode(req, None, request_id, auth, send)
            return
        tid = new_transfer_id()
        host, port = self.config.side_channel(inst.url)
        prefill_done = anyio.Event()

        async def prefill() -> None:
            try:
                await self._push_prefill(inst, req, tid, request_id, auth)
            finally:
                prefill_done.set()

        failure: Exception | None = None  # the decode's error answer, raised once prefill stopped
        async with anyio.create_task_group() as tg:
            tg.start_soon(prefill)
            try:
                await self.run_decode(req, push_decode_params(tid, host, port), request_id, auth,
                                      send)
            except (UpstreamReply, RouterError) as e:
                failure = e
            else:
                with anyio.move_on_after(PREFILL_GRACE_S):
                    await prefill_done.wait()
                if not prefill_done.is_set():
                    log.warning("request %s: decode answered but prefill on %s did not within "
                                "%.0f s of it; cancelling the prefill request", request_id,
                                inst.url, PREFILL_GRACE_S)
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _push_prefill(self, inst: Instance, req: ClientRequest, tid: str, request_id: str,
                            auth: str | None) -> None:
        """The prefill half of a push; failures are counted and logged, never raised (the
        decode engine's kv_load_failure_policy covers the request)."""
        try:
            params = await self._prefill_once(inst, req.endpoint, push_prefill_body(req, tid),
                                              request_id, auth, push=True)
        except UpstreamReply as r:  # the decode instance refuses the same request
            self.metrics.error("upstream_4xx")
            log.warning("request %s: prefill on %s refused it (HTTP %d)", request_id, inst.url,
                        r.status)
            return
        if params is not None and not pushed(params):
            self.metrics.error("push_failed")
            log.warning("request %s: prefill on %s computed the prompt without pushing it "
                        "(kv_transfer_params %s): the decode engine's offer never came, so it "
                        "recomputes or fails per its kv_load_failure_policy", request_id,
                        inst.url, params)

    # ------------------------------------------------------------------ decode

    async def run_decode(self, req: ClientRequest, params: dict[str, Any] | None, request_id: str,
                         auth: str | None, send: Send) -> None:
        body = decode_body(req, params)
        key = self.decode.prefix_key(req.body)
        tried: list[Instance] = []
        while True:
            # out-of-rotation instances last: a probe may have missed a busy but live engine
            inst = (self.decode.choose(exclude=tried, key=key)
                    or self.decode.choose(exclude=tried, any_health=True, key=key))
            if inst is None:
                self.metrics.error("no_decode")
                down = self.decode.describe_down()
                raise RouterError(503, f"no decode instance is available (tried {len(tried)} of "
                                  f"{len(self.decode)}{': ' + down if down else ''}); retry later",
                                  "service_unavailable")
            tried.append(inst)
            if await self._decode_once(inst, req, body, request_id, auth, send):
                return

    async def _decode_once(self, inst: Instance, req: ClientRequest, body: dict[str, Any],
                           request_id: str, auth: str | None, send: Send) -> bool:
        """False when ``inst`` could not be reached (try another); True once answered."""
        t0 = time.monotonic()
        started = False  # response headers sent to the client
        got: int | None = None  # bytes of the instance's response body so far (None: no headers)
        metrics = self.metrics
        with self.decode.using(inst):
            try:
                with anyio.fail_after(self.config.decode_timeout_s):
                    request = self.client.build_request("POST", inst.url + req.endpoint, json=body,
                                                        headers=_headers(request_id, auth))
                    log.debug("request %s: decode sent to %s", request_id, inst.url)
                    try:
                        resp = await self.client.send(request, stream=True)
                    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                        metrics.error("decode_unreachable")
                        self.decode.mark_failed(inst, describe(e))
                        log.warning("request %s: decode instance %s unreachable (%s); trying another",
                                    request_id, inst.url, describe(e))
                        return False
                    got = 0  # the headers came
                    try:
                        if resp.status_code >= 300:
                            content = await resp.aread()
                            if _client_error(resp.status_code):
                                raise UpstreamReply(resp.status_code, content,
                                                    resp.headers.get("content-type", "application/json"))
                            metrics.error("decode_failed")
                            inst.last_error = f"HTTP {resp.status_code}"
                            raise RouterError(502, f"decode instance {inst.url} failed with HTTP "
                                              f"{resp.status_code}: {_short(content)}", "upstream_error")
                        ctype = resp.headers.get("content-type", "application/json")
                        first = True
                        whole: list[bytes] = []
                        async for chunk in resp.aiter_bytes():
                            got += len(chunk)
                            if first:
                                metrics.decode_first_byte_seconds.labels(instance=inst.url).observe(
                                    time.monotonic() - t0)
                                first = False
                            if not req.stream:
                                whole.append(chunk)
                                continue
                            if not started:
                                await self._start_stream(send, ctype, request_id)
                                started = True
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        if req.stream:
                            if not started:
                                await self._start_stream(send, ctype, request_id)
                                started = True
                            await send({"type": "http.response.body", "body": b"", "more_body": False})
                        else:
                            await send_bytes(send, resp.status_code, b"".join(whole), ctype,
                                             request_id)
                    finally:
                        await resp.aclose()
            except TimeoutError:
                metrics.error("decode_timeout")
                await self._fail(send, started, request_id, RouterError(
                    504, f"decode instance {inst.url} did not finish within "
                    f"{self.config.decode_timeout_s} s (decode_timeout_s)", "timeout"))
                return True
            except httpx.HTTPError as e:
                metrics.error("decode_failed")
                inst.last_error = describe(e)
                where = "before its response headers" if got is None else f"after {got} bytes"
                await self._fail(send, started, request_id, RouterError(
                    502, f"decode instance {inst.url} failed mid-request, {where}, "
                    f"{time.monotonic() - t0:.1f} s after it was sent ({describe(e)})",
                    "upstream_error"))
                return True
        took = time.monotonic() - t0
        metrics.decode_seconds.labels(instance=inst.url).observe(took)
        log.debug("request %s: decode on %s answered in %.1f ms", request_id, inst.url, took * 1e3)
        if self.decode.mark_ok(inst):
            log.info("decode instance %s answered a request: back in rotation", inst.url)
        return True

    @staticmethod
    async def _start_stream(send: Send, content_type: str, request_id: str) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type.encode()),
                                (b"cache-control", b"no-cache"),
                                (b"x-request-id", request_id.encode())]})

    @staticmethod
    async def _fail(send: Send, started: bool, request_id: str, err: RouterError) -> None:
        log.error("request %s: %s", request_id, err.message)
        if not started:
            await send_bytes(send, err.status, err.body(), "application/json", request_id)
            return
        event = b"data: " + err.body() + b"\n\n"
        await send({"type": "http.response.body", "body": event, "more_body": False})
