"""KVBridgeConnector pieces that need vLLM importable but no engine: stats, metrics, layout."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("vllm")

from kvbridge.vllm import (  # noqa: E402
    HoldOrder,
    KVBridgeConnector,
    KVBridgeConnectorMetadata,
    KVBridgeHandshake,
    KVBridgePromMetrics,
    KVBridgeStats,
    PullOrders,
)


def test_stats_merge_across_workers_and_reduce() -> None:
    a, b = KVBridgeStats(), KVBridgeStats()
    assert a.is_empty()
    a.data["transfer_duration"] += [0.01, 0.03]
    a.data["bytes_transferred"] += [10_000_000, 30_000_000]
    a.data["expired_leases"] = 1
    b.data["transfer_duration"] += [0.02]
    b.data["bytes_transferred"] += [20_000_000]
    b.data["failed_handshakes"] = 2
    merged = a.aggregate(b)
    assert not merged.is_empty()
    assert merged.data["bytes_transferred"] == [10_000_000, 30_000_000, 20_000_000]
    assert merged.data["expired_leases"] == 1 and merged.data["failed_handshakes"] == 2
    red = merged.reduce()
    assert red["Transfers"] == 3 and red["Throughput (GB/s)"] == pytest.approx(1.0)
    assert red["Failed handshakes"] == 2
    # vLLM ships stats as their data dict and rebuilds them with the class method
    rebuilt = KVBridgeConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(merged.data)))
    assert isinstance(rebuilt, KVBridgeStats) and rebuilt.data == merged.data


class _Metric:
    def __init__(self, name: str, **_: object) -> None:
        self.name, self.observed, self.total = name, [], 0

    def labels(self, *args: object, **kw: object) -> _Metric:
        return self

    def observe(self, v: float) -> None:
        self.observed.append(v)

    def inc(self, v: float = 1) -> None:
        self.total += v


def test_prometheus_metrics_observe_per_transfer_and_count_failures() -> None:
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.config import VllmConfig

    types = {Gauge: _Metric, Counter: _Metric, Histogram: _Metric}
    prom = KVBridgePromMetrics(VllmConfig(), types, ["engine"], {0: ["0"]})
    data = KVBridgeStats().data
    data["transfer_duration"] += [0.5, 0.25]
    data["failed_transfers"], data["failed_timeouts"], data["expired_leases"] = 1, 2, 4
    data["requests_without_params"], data["late_transfers"], data["late_errors"] = 5, 6, 7
    prom.observe(data, 0)
    assert prom._counters["requests_without_params"][0].total == 5
    assert prom._counters["late_transfers"][0].total == 6
    assert prom._counters["late_errors"][0].total == 7
    assert prom._hist["transfer_duration"][0].observed == [0.5, 0.25]
    assert prom._counters["failed"][0].total == 3
    assert prom._counters["expired_leases"][0].total == 4


def test_wire_values_pickle() -> None:
    meta = KVBridgeConnectorMetadata(PullOrders(holds=(HoldOrder("r", ((1, 2),), "t" * 32),)))
    assert pickle.loads(pickle.dumps(meta)).orders == meta.orders
    hs = KVBridgeHandshake(0, "abc", b"\x81\x00")
    assert pickle.loads(pickle.dumps(hs)) == hs


def test_required_layout_is_hnd_unless_mla() -> None:
    class MC:
        use_mla = False

    class VC:
        model_config = MC()

    assert KVBridgeConnector.get_required_kvcache_layout(VC()) == "LBHNC"
    MC.use_mla = True
    assert KVBridgeConnector.get_required_kvcache_layout(VC()) is None


def test_sleep_mode_is_supported_in_pull_mode_only() -> None:
    """vLLM >= 0.33 asks before enabling sleep mode (0.32 never asks): push mode lets prefill
    engines write into the decode cache, whose registration they would keep."""
    from vllm.config import KVTransferConfig

    def ask(extra: dict) -> bool:
        return KVBridgeConnector.supports_sleep_mode(KVTransferConfig(
            kv_connector="KVBridgeConnector", kv_role="kv_both", kv_connector_extra_config=extra))

    assert ask({}) is True and ask({"mode": "pull"}) is True
    assert ask({"mode": "push"}) is False


@pytest.mark.parametrize("setting", ["pipeline_parallel_size", "decode_context_parallel_size",
                                     "prefill_context_parallel_size"])
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_pipeline_and_context_parallel_engines_are_refused_at_start(setting: str, role: str) -> None:
    """vLLM's own configuration objects with PP, DCP or PCP 2: the connector refuses to
    start, naming the setting, before touching anything else."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig, ParallelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbridge.vllm import ConfigError

    ktc = KVTransferConfig(kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.vllm",
                           kv_role="kv_consumer")
    pc = ParallelConfig(tensor_parallel_size=2, **{setting: 2})
    with pytest.raises(ConfigError, match=f"{setting}=2.*{setting}=1"):
        KVBridgeConnector(SimpleNamespace(kv_transfer_config=ktc, parallel_config=pc),
                          KVConnectorRole[role], None)
