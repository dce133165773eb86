"""Client request checks and the bodies sent to prefill and decode instances (pure).

The router changes as little as it can: the prefill request is the client's
body with ``kv_transfer_params = {"do_remote_decode": true}``, one output token
and no streaming; the decode request is the client's body with the
``kv_transfer_params`` the prefill instance returned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)

#: What a prefill request carries (vLLM's convention, understood by kvbridge's connector
#: and by vLLM's NixlConnector).
PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}


class BadRequest(ValueError):
    """The client's request is invalid; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class ClientRequest:
    """A checked client request."""

    endpoint: str
    body: dict[str, Any]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty; send at least one character or token", param="prompt")
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise BadRequest("the router takes one prompt per request; send a list of several "
                                 "prompts as separate requests", param="prompt")
            return
        if all(_is_int(t) for t in prompt):
            return
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            if len(prompt) != 1:
                raise BadRequest("the router takes one prompt per request; send a list of several "
                                 "prompts as separate requests", param="prompt")
            return
    raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids",
                     param="prompt")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects",
                         param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", param="messages")


def parse_request(endpoint: str, raw: bytes) -> ClientRequest:
    """Check a client's body for ``endpoint``; raises :class:`BadRequest` saying what to fix."""
    if endpoint not in ENDPOINTS:
        raise BadRequest(f"unknown endpoint {endpoint}; use {' or '.join(ENDPOINTS)}", status=404)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if "model" in body and not isinstance(body["model"], str):
        raise BadRequest("'model' must be a string", param="model")
    if endpoint == COMPLETIONS:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required for /v1/completions", param="prompt")
        _check_prompt(body["prompt"])
    else:
        if "messages" not in body:
            raise BadRequest("'messages' is required for /v1/chat/completions", param="messages")
        _check_messages(body["messages"])
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise BadRequest("'stream' must be true or false", param="stream")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not _is_int(v) or v < 1):
            raise BadRequest(f"'{key}' must be a positive integer, got {v!r}", param=key)
    for key in ("n", "best_of"):
        v = body.get(key)
        if v is not None and v != 1:
            raise BadRequest(f"'{key}' = {v!r} is not supported through the prefill/decode router; "
                             "send separate requests (or leave it at 1)", param=key)
    if body.get("kv_transfer_params") is not None:
        raise BadRequest("'kv_transfer_params' is set by the router; remove it, or send the request "
                         "straight to an instance to manage transfers yourself",
                         param="kv_transfer_params")
    return ClientRequest(endpoint, body)


def prefill_body(req: ClientRequest) -> dict[str, Any]:
    """The body for a prefill instance: compute the KV, make one token, keep the blocks."""
    body = dict(req.body)
    body["kv_transfer_params"] = dict(PREFILL_PARAMS)
    body["stream"] = False
    body.pop("stream_options", None)
    body.pop("min_tokens", None)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return body


def decode_body(req: ClientRequest, kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The body for a decode instance; without parameters it prefills locally."""
    body = dict(req.body)
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def error_body(message: str, *, status: int, type_: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}
