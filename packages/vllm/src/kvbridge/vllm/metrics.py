"""The connector's metrics in vLLM's classes: :class:`KVBridgeStats` (the stats one
interval's workers report, merged by vLLM and logged as ``KV Transfer metrics``)
and :class:`KVBridgePromMetrics` (Prometheus ``vllm:kvbridge_*``).

The data inside is plain (:mod:`kvbridge.vllm.stats`). This module imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbridge.vllm.stats import empty_stats, is_empty, merge_stats, reduce_stats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVBridgePromMetrics", "KVBridgeStats"]


@dataclass
class KVBridgeStats(KVConnectorStats):
    """Transfer statistics of one interval, mergeable across workers (vLLM aggregates them).

    ``data`` is a :func:`kvbridge.vllm.stats.empty_stats` mapping.
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = empty_stats()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is not None and other.data:
            self.data = merge_stats(self.data, other.data) or {}
        return self

    def is_empty(self) -> bool:
        return is_empty(self.data)

    def reduce(self) -> dict[str, int | float]:
        return reduce_stats(self.data)


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """Prometheus metrics ``vllm:kvbridge_*`` (per engine)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def hist(name: str, doc: str, buckets: list[float]) -> dict:
            return create_metric_per_engine(
                self._histogram_cls(name=name, documentation=doc, buckets=buckets,
                                    labelnames=labelnames), per_engine_labelvalues)

        def counter(name: str, doc: str) -> dict:
            return create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)

        secs = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
        self._hist = {
            "transfer_duration": hist("vllm:kvbridge_xfer_time_seconds",
                                      "Duration of kvbridge KV transfers (NIXL telemetry).", secs),
            "post_duration": hist("vllm:kvbridge_post_time_seconds",
                                  "Time NIXL spent posting kvbridge KV transfers.", secs),
            "bytes_transferred": hist("vllm:kvbridge_bytes_transferred",
                                      "Bytes per kvbridge KV transfer.",
                                      [float(2 ** (10 + i)) for i in range(1, 25, 2)]),
            "num_descriptors": hist("vllm:kvbridge_num_descriptors",
                                    "NIXL descriptors per kvbridge KV transfer (after merging).",
                                    [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536]),
            "handshake_duration": hist("vllm:kvbridge_handshake_seconds",
                                       "Side-channel handshake + agent load + list preparation.",
                                       secs),
        }
        self._counters = {
            "failed": counter("vllm:kvbridge_num_failed_transfers",
                              "Requests whose KV transfer failed (handshake, transfer error, "
                              "post exception or timeout)."),
            "failed_handshakes": counter("vllm:kvbridge_num_failed_handshakes",
                                         "Requests failed because the handshake failed."),
            "expired_leases": counter("vllm:kvbridge_num_expired_leases",
                                      "Prefill requests whose blocks were freed at lease expiry."),
            "ignored_notifications": counter("vllm:kvbridge_num_ignored_notifications",
                                             "Notifications ignored: unknown request, wrong "
                                             "token, malformed or without a valid proof."),
            "requests_done": counter("vllm:kvbridge_num_requests_done",
                                     "Decode-side requests whose KV arrived (per worker)."),
            "staged_reads": counter("vllm:kvbridge_num_staged_reads",
                                    "READs landed in the decode worker's staging buffer and "
                                    "copied into place (pieces scattered locally)."),
            "late_transfers": counter("vllm:kvbridge_num_late_transfers",
                                      "Transfers that completed after their request was given "
                                      "up (timed out): their bytes moved after the blocks were "
                                      "handed back. Should stay 0; see the kvbridge docs."),
            "late_errors": counter("vllm:kvbridge_num_late_errors",
                                   "Transfers that ended in error after their request was given "
                                   "up (timed out): part of their bytes may have moved after the "
                                   "blocks were handed back. Should stay 0."),
            "requests_without_params": counter(
                "vllm:kvbridge_num_requests_without_params",
                "Requests a decode (kv_consumer or kv_both) engine got without "
                "kv_transfer_params: computed locally, nothing loaded (a router that drops "
                "the parameters shows here)."),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for key, metric in self._hist.items():
            for v in d.get(key, ()):
                metric[engine_idx].observe(v)
        failed = sum(int(d.get(k, 0)) for k in ("failed_handshakes", "failed_transfers",
                                                 "failed_posts", "failed_timeouts"))
        if failed:
            self._counters["failed"][engine_idx].inc(failed)
        for key in ("failed_handshakes", "expired_leases", "ignored_notifications", "requests_done",
                    "requests_without_params", "staged_reads", "late_transfers", "late_errors"):
            if d.get(key):
                self._counters[key][engine_idx].inc(int(d[key]))
