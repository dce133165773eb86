"""Push mode: one transfer id, the prefill and the decode request sent at once.

The requests' parameters are built here (pure); :meth:`Proxy.run_push
<kvbridge.router.proxy.Proxy.run_push>` sends them.

With kvbridge's ``mode: push`` on the engines, the decode engine allocates the
request's blocks first and offers them to the prefill engine's side channel;
the prefill engine waits for that offer, then writes the KV into them (layer by
layer while it computes the prompt when ``push_layerwise`` is on; nothing here
depends on it). So the router sends both requests together, sharing a transfer
id of its own (see docs/vllm.md, "Push mode")::

    decode:  client body + {"do_remote_prefill": true, "transfer_mode": "push",
                            "kvbridge_transfer_id": ID, "remote_host": P_HOST, "remote_port": P_PORT}
    prefill: one-token body + {"do_remote_decode": true, "transfer_mode": "push",
                               "kvbridge_transfer_id": ID}

``P_HOST:P_PORT`` is the chosen prefill instance's side channel
(:meth:`RouterConfig.side_channel`). The decode answer is streamed to the
client as in pull mode; the prefill answer only feeds metrics and health.

Failure policy (the decode request is already under way when a prefill fails,
so the decode engine decides, never the router):

* a prefill instance that cannot be reached, fails or times out is taken out of
  rotation and counted as in pull mode; the decode engine's offer to it fails
  (at once when nothing listens, after ``handshake_timeout_seconds`` when it does
  not answer), or its writes stop coming (after ``transfer_timeout_seconds``),
  and vLLM's ``kv_load_failure_policy`` applies: ``recompute`` answers from a
  local prefill, ``fail`` ends the request with an error. Nothing waits without
  a bound;
* a prefill answer that says nothing was pushed (its offer never came) is
  counted as ``push_failed``;
* no prefill instance in rotation: the decode instance prefills itself
  (``local_prefill``), as in pull mode;
* decode failures are pull mode's (another decode instance when the first
  cannot be reached, with the same transfer id: the prefill request still
  waits for its offer); when the decode request ends in an error, or is
  answered, the prefill request still running is cancelled (after
  :data:`PREFILL_GRACE_S` for an answered one, whose prefill answer normally
  came first).
"""

from __future__ import annotations

import uuid
from typing import Any

from .requests import ClientRequest, prefill_body

#: the key naming a push transfer on both requests (kvbridge.vllm.params.TRANSFER_ID_KEY)
TRANSFER_ID_KEY = "kvbridge_transfer_id"
#: seconds an answered decode request waits for its prefill answer before cancelling it
PREFILL_GRACE_S = 10.0


def new_transfer_id() -> str:
    """A fresh transfer id (32 hex digits; the engines accept 1..256 characters)."""
    return uuid.uuid4().hex


def push_decode_params(transfer_id: str, host: str, port: int) -> dict[str, Any]:
    """A push-mode decode request's ``kv_transfer_params``: the transfer id and the prefill
    engine's side channel, where the decode engine sends its offer."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
            TRANSFER_ID_KEY: transfer_id, "remote_host": host, "remote_port": port}


def push_prefill_params(transfer_id: str) -> dict[str, Any]:
    """A push-mode prefill request's ``kv_transfer_params``."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_mode": "push",
            TRANSFER_ID_KEY: transfer_id}


def push_prefill_body(req: ClientRequest, transfer_id: str) -> dict[str, Any]:
    """The prefill request: pull mode's one-token body with push parameters."""
    body = prefill_body(req)
    body["kv_transfer_params"] = push_prefill_params(transfer_id)
    return body


def pushed(params: dict[str, Any] | None) -> bool:
    """True when a prefill answer's ``kv_transfer_params`` say its KV was written to decode."""
    return bool(params) and params.get("kvbridge_pushed") is True  # type: ignore[union-attr]
