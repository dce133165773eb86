"""Silent recompute, made loud: prefill answers without usable ``kv_transfer_params`` and
decode requests sent without them, counted and logged.

A decode instance given no transfer parameters computes the whole prompt itself: the
answer is right, only slower, and nobody notices. What the router sees of that:

* a prefill answer (2xx) whose ``kv_transfer_params`` are missing, not an object,
  lack ``do_remote_prefill: true``, or hold null for a key a pull needs
  (``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``,
  ``remote_request_id``; other connectors' keys are left to them): counted per instance in
  ``kvbridge_router_prefill_without_params_total``; the router then tries another
  prefill instance (see :mod:`kvbridge.router.proxy`);
* a decode request the router sends without parameters (no prefill instance left):
  ``kvbridge_router_decode_without_params_total``. That decode computes its prompt.

What the router cannot see: a decode instance that got usable parameters and still
loaded nothing (its pull failed and it recomputed, or it ignored the parameters).
vLLM's answer does not say: its ``usage.prompt_tokens_details.cached_tokens`` reports
the prefill side's cache hits for a remote prefill. The decode instance's own metrics
do (``vllm:kvbridge_num_failed_transfers_total``,
``vllm:kvbridge_num_requests_without_params_total``); docs/serving.md shows the alerts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("kvbridge.router")

#: keys a decode instance needs to pull a prompt (vLLM's NixlConnector and kvbridge): null is unusable
PULL_KEYS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
             "remote_request_id")


def unusable(params: Any) -> str | None:
    """Why a prefill answer's ``kv_transfer_params`` cannot make its decode pull the prompt,
    or None when they can."""
    if params is None:
        return "the answer carries no kv_transfer_params"
    if not isinstance(params, Mapping) or not params:
        return f"kv_transfer_params is {type(params).__name__} {params!r:.80}, not parameters"
    if not params.get("do_remote_prefill"):
        return "kv_transfer_params lack do_remote_prefill=true"
    null = [k for k in PULL_KEYS if k in params and params[k] is None]
    if null:
        return f"kv_transfer_params hold null for {', '.join(null)}"
    return None


class RecomputeMetrics:
    """The two counters, in the router's registry, and their log lines."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.prefill_without_params = Counter(
            "kvbridge_router_prefill_without_params",
            "Prefill answers (2xx) without usable kv_transfer_params, per prefill instance "
            "(retried on another instance).", ["instance"], registry=registry)
        self.decode_without_params = Counter(
            "kvbridge_router_decode_without_params",
            "Decode requests sent without kv_transfer_params (no prefill instance left): "
            "the decode instance computed the prompt itself.", registry=registry)

    def prefill_answer(self, instance: str, params: Any) -> str | None:
        """Check one prefill answer's parameters: count an unusable one and return why (the
        caller logs it with what it does next); None when they are usable."""
        why = unusable(params)
        if why is None:
            return None
        self.prefill_without_params.labels(instance=instance).inc()
        return (f"{why}: is the instance started with --kv-transfer-config and a producer "
                "role, and does every proxy between it and the router keep the field?")

    def decode_without(self, request_id: str, tried: int) -> None:
        """A decode request goes out without parameters: count and log (warning)."""
        self.decode_without_params.inc()
        log.warning("request %s: no prefill instance delivered kv_transfer_params (tried %d); "
                    "the decode instance computes the prompt itself", request_id, tried)
