"""Prometheus metrics of one router (its own registry: no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .pool import Instance
from .recompute import RecomputeMetrics

#: Error kinds counted in ``kvbridge_router_errors_total{kind=...}``.
ERROR_KINDS = (
    "bad_request",        # the client's request was invalid (4xx from the router)
    "upstream_4xx",       # an instance rejected the request as invalid (passed to the client)
    "prefill_failed",     # a prefill instance failed (5xx, unusable answer); retried elsewhere
    "prefill_timeout",    # a prefill instance did not answer in time; retried elsewhere
    "prefill_unreachable",  # connection to a prefill instance failed; retried elsewhere
    "local_prefill",      # no prefill instance left: the decode instance prefilled itself
    "push_failed",        # push mode: a prefill answered without pushing (no offer came)
    "decode_failed",      # the decode instance failed (error to the client)
    "decode_timeout",     # the decode instance did not finish in time (error to the client)
    "decode_unreachable",  # connection to a decode instance failed; another one was tried
    "no_decode",          # no healthy decode instance (503 to the client)
    "client_disconnect",  # the client went away; upstream requests were cancelled
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    """Counters, histograms and gauges; ``render()`` gives the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvbridge_router_requests", "Client requests by endpoint.",
                                ["endpoint"], registry=r)
        self.errors = Counter("kvbridge_router_errors", "Errors and fallbacks by kind.",
                              ["kind"], registry=r)
        self.prefill_seconds = Histogram(
            "kvbridge_router_prefill_seconds", "Prefill request latency (successful prefills).",
            ["instance"], buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_first_byte_seconds = Histogram(
            "kvbridge_router_decode_first_byte_seconds",
            "Time from sending a decode request to its first response bytes.",
            ["instance"], buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_seconds = Histogram(
            "kvbridge_router_decode_seconds", "Decode request latency, to the last byte.",
            ["instance"], buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("kvbridge_router_in_flight", "Requests in flight per instance.",
                               ["role", "instance"], registry=r)
        self.healthy = Gauge("kvbridge_router_instance_healthy",
                             "1 while the instance is in rotation, 0 while taken out.",
                             ["role", "instance"], registry=r)
        for kind in ERROR_KINDS:
            self.errors.labels(kind=kind)
        #: prefill answers without usable parameters, decode requests sent without them
        self.recompute = RecomputeMetrics(r)

    def instance_changed(self, inst: Instance) -> None:
        self.in_flight.labels(role=inst.role, instance=inst.url).set(inst.in_flight)
        self.healthy.labels(role=inst.role, instance=inst.url).set(1 if inst.healthy else 0)

    def error(self, kind: str) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown error kind {kind!r}; known: {', '.join(ERROR_KINDS)}")
        self.errors.labels(kind=kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
