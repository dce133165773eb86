"""The connector's transfer statistics as plain data (kvbridge.vllm.stats)."""

from __future__ import annotations

import pytest

from kvbridge.nixl import Stats
from kvbridge.vllm.stats import empty_stats, is_empty, merge_stats, reduce_stats, stats_delta


def test_merge_stats_rules() -> None:
    assert merge_stats(None, None) is None
    a = {"l": [1]}
    out = merge_stats(a, {"l": (2,), "n": 1.5})
    assert out == {"l": [1, 2], "n": 1.5}
    assert a == {"l": [1]}  # inputs untouched
    with pytest.raises(TypeError, match="'l'"):
        merge_stats({"l": [1]}, {"l": 3})


def test_counter_deltas_between_engine_snapshots() -> None:
    before, now = Stats(), Stats()
    now.requests_done, now.leases_expired, now.notifications_bad_token = 5, 1, 2
    now.late_transfers, now.late_errors = 4, 6
    now.failures = {"handshake": 1, "timeout": 3}
    d = stats_delta(now, before)
    assert d["requests_done"] == 5 and d["expired_leases"] == 1
    assert d["late_transfers"] == 4 and d["late_errors"] == 6
    assert d["failed_handshakes"] == 1 and d["failed_timeouts"] == 3
    assert d["ignored_notifications"] == 2 and d["failed_transfers"] == 0


def test_two_workers_merge_and_reduce() -> None:
    a, b = empty_stats(), empty_stats()
    assert is_empty(a)
    a["transfer_duration"] += [0.01, 0.03]
    a["bytes_transferred"] += [10_000_000, 30_000_000]
    b["transfer_duration"] += [0.02]
    b["bytes_transferred"] += [20_000_000]
    b["failed_handshakes"] = 2
    merged = merge_stats(a, b)
    assert merged is not None and not is_empty(merged)
    red = reduce_stats(merged)
    assert red["Transfers"] == 3 and red["Throughput (GB/s)"] == pytest.approx(1.0)
    assert red["Failed handshakes"] == 2 and red["Handshakes"] == 0


def test_requests_without_params_are_counted_on_consumers_only(caplog) -> None:
    import logging

    from kvbridge.vllm.stats import WithoutParams

    d = WithoutParams(consumer=True)
    with caplog.at_level(logging.DEBUG, logger="kvbridge.vllm"):
        assert d.arrived("a", None) and d.arrived("b", {}) and d.arrived("c", {"x": 1})
        assert d.arrived("n", {"do_remote_prefill": None})  # null is absent
    assert not d.arrived("d", {"do_remote_prefill": True, "remote_host": "h"})
    assert not d.arrived("p", {"do_remote_decode": True})  # a kv_both engine's prefill request
    assert d.total == 4 and d.take() == {"requests_without_params": 4} and d.take() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "without kv_transfer_params" in warnings[0].getMessage()
    merged = merge_stats(empty_stats(), {"requests_without_params": 4})
    assert not is_empty(merged) and reduce_stats(merged)["Requests without params"] == 4
    p = WithoutParams(consumer=False)
    assert not p.arrived("a", None) and p.take() is None
