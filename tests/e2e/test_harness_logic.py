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


# --------------------------------------------------------------------------- bench targets


def _targets():
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[2] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import vllm_targets

    return vllm_targets


def _res(label: str, gbps: list[float], steady: float, overhead: float, problems=()) -> dict:
    return {"connector": label, "rounds": [{"load GB/s": g} for g in gbps], "steady_ttft_ms": steady,
            "first_request_overhead_ms": overhead, "problems": list(problems), "handshake_s": {}}


def test_targets_pass_and_fail_per_figure():
    t = _targets()
    ours = _res("kvbridge", [0.1, 6.0, 5.5, 7.0], steady=30.0, overhead=40.0)
    nixl = _res("vllm-NixlConnector", [1.0, 2.0, 2.0, 2.0], steady=40.0, overhead=100.0)
    got = {v[1]: v[4] for v in t.verdicts([ours, nixl], memcpy_gbps=10.0)}
    # later rounds (round 0 is not counted): median 6.0 >= 5.0, worst 5.5 >= 3.5; 40 < 60 ms;
    # 30/40 = 0.75 <= 0.8; 40/100 = 0.4 <= 0.5
    assert got == {"GB/s, median round after the first": "PASS", "GB/s, worst round after the first": "PASS",
                   "first-request overhead": "PASS",
                   "clean run (failures, ignored notifications)": "PASS",
                   "steady TTFT vs vllm-NixlConnector": "PASS",
                   "first-request overhead vs vllm-NixlConnector": "PASS"}
    # median 3.7 < 5.0, worst 3.4 < 3.5
    slow = _res("kvbridge", [9.0, 3.4, 4.0], steady=33.0, overhead=61.0,
                problems=["decode: vllm:kvbridge_num_ignored_notifications = 2"])
    got = {v[1]: v[4] for v in t.verdicts([slow, nixl], memcpy_gbps=10.0)}
    assert set(got.values()) == {"FAIL"}
    # a good median does not hide one slow round, nor a tolerable worst round a slow median
    spiky = _res("kvbridge", [1.0, 9.0, 3.0, 9.0], steady=30.0, overhead=40.0)
    got = {v[1]: v[4] for v in t.verdicts([spiky], memcpy_gbps=10.0)}
    assert (got["GB/s, median round after the first"], got["GB/s, worst round after the first"]) == ("PASS", "FAIL")
    flat = _res("kvbridge", [1.0, 4.0, 4.5, 4.0], steady=30.0, overhead=40.0)
    got = {v[1]: v[4] for v in t.verdicts([flat], memcpy_gbps=10.0)}
    assert (got["GB/s, median round after the first"], got["GB/s, worst round after the first"]) == ("FAIL", "PASS")


def test_targets_na_when_nixl_failed_or_figures_missing():
    t = _targets()
    ours = _res("kvbridge", [1.0], steady=30.0, overhead=40.0)  # no round after the first
    failed = {"connector": "vllm-NixlConnector", "failed": "deadline of 300 s passed"}
    vs = t.verdicts([ours, failed], memcpy_gbps=None)
    got = {v[1]: v[4] for v in vs}
    assert got["GB/s, worst round after the first"] == "n/a"
    assert got["GB/s, median round after the first"] == "n/a"
    assert got["steady TTFT vs vllm-NixlConnector"] == "n/a"
    assert got["first-request overhead vs vllm-NixlConnector"] == "n/a"
    # a failed kvbridge run is one FAIL, not a crash
    assert t.verdicts([{"connector": "kvbridge", "failed": "x"}], 10.0) == [
        ("kvbridge", "run", "FAILED", "finishes", "FAIL")]


def test_targets_no_overhead_ratio_against_a_non_positive_overhead():
    t = _targets()
    ours = _res("kvbridge", [1.0, 9.0], steady=30.0, overhead=40.0)
    nixl = _res("vllm-NixlConnector", [1.0, 2.0], steady=40.0, overhead=-17.0)  # noise: r0 < steady
    got = {v[1]: v for v in t.verdicts([ours, nixl], memcpy_gbps=10.0)}
    row = got["first-request overhead vs vllm-NixlConnector"]
    assert row[4] == "n/a" and "no ratio" in row[2]
    assert got["steady TTFT vs vllm-NixlConnector"][4] == "PASS"


def test_transfer_problems_count_only_what_moved_during_the_run() -> None:
    """Long-lived engines keep their counters across scenarios: a failure of an earlier
    scenario (in metrics_start) is not this run's, a new one is."""
    name = "vllm:nixl_num_failed_transfers"
    earlier = _run([[]], start=[_counter(name, 4)], end=[_counter(name, 4)])
    assert transfer_problems(earlier) == []
    more = _run([[]], start=[_counter(name, 4)], end=[_counter(name, 5)])
    assert transfer_problems(more) == [f"decode: {name} = 1"]


def test_engine_defs_need_a_connector_exactly_for_prefill_and_decode() -> None:
    from pathlib import Path

    import pytest
    from e2e_harness import EngineConfig
    from engine_pool import EngineDef

    m = Path("/models/tiny")
    EngineDef("d", m, "decode", NIXL_CONNECTOR)
    EngineDef("l", m, "local")
    with pytest.raises(ValueError, match="needs a connector"):
        EngineDef("p", m, "prefill")
    with pytest.raises(ValueError, match="role must be"):
        EngineDef("x", m, "baseline", NIXL_CONNECTOR)
    # the pool reuses an engine only for an equal definition
    assert EngineDef("d", m, "decode", NIXL_CONNECTOR) == EngineDef("d", m, "decode", NIXL_CONNECTOR)
    assert (EngineDef("d", m, "decode", NIXL_CONNECTOR, EngineConfig(tp=2))
            != EngineDef("d", m, "decode", NIXL_CONNECTOR))
    env = EngineConfig(cpus="nobind", in_process=True).env()
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "1"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in EngineConfig().env()


def test_load_span_runs_from_first_queued_to_last_scheduled() -> None:
    """bench_vllm's round load time (issue 23): first request queued at decode -> last scheduled;
    requests without both timestamps are left out, and none at all gives no figure."""
    _targets()  # puts bench/ on sys.path
    from bench_vllm import load_span_s

    outs = [{"metrics": {"queued_ts": 10.0, "scheduled_ts": 10.5}},
            {"metrics": {"queued_ts": 10.2, "scheduled_ts": 11.25}},
            {"metrics": {"queued_ts": 9.0}}, {}]
    assert load_span_s(outs) == 1.25
    assert load_span_s([{}, {"metrics": {"queued_ts": 1.0}}]) is None
