"""The harness's own logic (no vLLM needed): placeholders, metrics, log checks."""

from __future__ import annotations

from e2e_harness import (
    NIXL_CONNECTOR,
    DisaggRun,
    failure_lines,
    handshake_timings,
    histogram,
    make_prompts,
    metric_total,
    transfer_figures,
    transfer_problems,
)


def _hist(name: str, count: int, total: float) -> dict:
    return {"name": name, "type": "Histogram", "labels": {}, "count": count, "sum": total}


def _counter(name: str, v: float, engine: str = "0") -> dict:
    return {"name": name, "type": "Counter", "labels": {"engine": engine}, "value": v}


def _run(decode_rounds: list[list[dict]], *, start: list[dict] | None = None,
         end: list[dict] | None = None, prefill_end: list[dict] | None = None,
         plog: str = "", dlog: str = "") -> DisaggRun:
    decode = {"metrics_start": start or [],
              "rounds": [{"metrics": m, "outputs": []} for m in decode_rounds]}
    if end is not None:
        decode["metrics_end"] = end
    prefill = {"rounds": [{"metrics": [], "outputs": []}], "metrics_end": prefill_end or []}
    return DisaggRun(NIXL_CONNECTOR, prefill, decode, plog, dlog)


def test_connector_config_fills_host_and_port() -> None:
    cfg = NIXL_CONNECTOR.kv_transfer_config("prefill", "127.0.0.1", 7001)
    assert cfg["kv_connector"] == "NixlConnector" and cfg["kv_role"] == "kv_producer"
    assert NIXL_CONNECTOR.kv_transfer_config("decode", "h", 1)["kv_role"] == "kv_consumer"
    env = NIXL_CONNECTOR.engine_env("127.0.0.1", 7001)
    assert env == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "7001"}
    assert "VLLM_LOGGING_LEVEL" in NIXL_CONNECTOR.engine_env("h", 1, timings=True)


def test_metric_helpers_sum_over_labels() -> None:
    ms = [_counter("c", 1, "0"), _counter("c", 2, "1"), _hist("h", 3, 0.5), _hist("h", 1, 0.25)]
    assert metric_total(ms, "c") == 3 and metric_total(ms, "absent") == 0
    assert histogram(ms, "h") == (4, 0.75)


def test_transfer_figures_per_round_are_differences() -> None:
    t, b = NIXL_CONNECTOR.transfer_time_metric, NIXL_CONNECTOR.transfer_bytes_metric
    r0 = [_hist(t, 4, 0.004), _hist(b, 4, 4e6)]
    r1 = [_hist(t, 6, 0.006), _hist(b, 6, 8e6)]
    run = _run([r0, r1], start=[_hist(t, 0, 0.0), _hist(b, 0, 0.0)], end=r1)
    assert transfer_figures(run, 1) == {"transfers": 2, "transfer_s": 0.002, "bytes": 4e6,
                                        "GB/s": 4e6 / 0.002 / 1e9}
    whole = transfer_figures(run)
    assert whole["transfers"] == 6 and whole["bytes"] == 8e6


def test_transfer_problems_see_counters_and_log_lines() -> None:
    clean = _run([[]], end=[_counter("vllm:nixl_num_failed_transfers", 0)])
    assert transfer_problems(clean) == []
    bad = _run([[]], end=[_counter("vllm:nixl_num_failed_transfers", 2)],
               prefill_end=[_counter("vllm:nixl_num_kv_expired_reqs", 1)],
               dlog="x\nERROR NIXL transfer failure: handshake_failed | ...\n")
    problems = transfer_problems(bad)
    assert any("decode: vllm:nixl_num_failed_transfers = 2" in p for p in problems)
    assert any("prefill: vllm:nixl_num_kv_expired_reqs = 1" in p for p in problems)
    assert any("decode log" in p for p in problems)
    assert failure_lines("a\nReleasing expired KV blocks for request x\n", ["expired"])
    # The periodic stats line names the expiry counter; it is not a failure.
    stats_line = ("INFO [metrics.py:103] KV Transfer metrics: Num successful transfers=12, "
                  "Num failed transfers=0, Num KV expired reqs=0, Num notifs after expiry=0")
    assert transfer_problems(_run([[]], end=[], dlog=stats_line)) == []


def test_handshake_timings_parse_debug_lines() -> None:
    log = ("NIXL handshake: get metadata took: 0.0045\n"
           "NIXL handshake: add agent took: 0.046 (notif_agents_only=False)\n")
    assert handshake_timings(log, NIXL_CONNECTOR) == {"get_metadata_s": [0.0045],
                                                      "add_agent_s": [0.046]}


def test_prompts_are_deterministic_and_avoid_special_ids() -> None:
    a, b = make_prompts([70, 5], seed=3), make_prompts([70, 5], seed=3)
    assert a == b and [len(p) for p in a] == [70, 5]
    assert min(min(p) for p in a) >= 3 and max(max(p) for p in a) < 1024
    assert make_prompts([70], seed=4) != make_prompts([70], seed=3)


def test_cpu_binding_pins_disjoint_cores_or_none() -> None:
    from e2e_harness import cpu_binding

    assert cpu_binding(1, 1, cpus=2) == ("0", "1")
    assert cpu_binding(2, 2, cpus=4) == ("0|1", "2|3")
    # three workers on two cores: never pin two engines to one core
    assert cpu_binding(2, 1, cpus=2) == ("nobind", "nobind")
    assert cpu_binding(1, 2, cpus=2) == ("nobind", "nobind")
