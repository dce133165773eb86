"""Logic of the benchmarks' reports and verdicts (side by side, serving, push, first request's
phases, native progress), without engines."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = str(Path(__file__).resolve().parents[2] / "bench")


def _bench(name: str) -> ModuleType:
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import importlib

    return importlib.import_module(name)


def _res(label: str, ttfts: list[float], moved: float = 1e6, **extra: object) -> dict:
    return {"label": label, "rounds": [{"ttft_ms": t, "bytes": moved, "GB/s": 1.0, "problems": []}
                                       for t in ttfts], **extra}


def _verdict(vs: list, figure: str, who: str | None = None) -> str:
    return next(v[4] for v in vs if v[1].startswith(figure) and (who is None or v[0] == who))


def test_side_by_side_summary_uses_rounds_after_the_first() -> None:
    rep = _bench("side_by_side_report")
    s = rep.summary(_res("a", [300.0, 10.0, 30.0, 20.0]))
    assert (s["steady_ms"], s["steady_min_ms"], s["steady_max_ms"]) == (20.0, 10.0, 30.0)
    assert s["first_ms"] == 300.0 and s["overhead_ms"] == 280.0


def test_side_by_side_ttft_ratio_passes_at_most_0_8() -> None:
    rep = _bench("side_by_side_report")
    vs = rep.verdicts([_res("kvbridge", [50, 8, 8]), _res("nixl", [50, 10, 10])])
    assert _verdict(vs, "steady decode TTFT") == "PASS"
    vs = rep.verdicts([_res("kvbridge", [50, 9, 9]), _res("nixl", [50, 10, 10])])
    assert _verdict(vs, "steady decode TTFT") == "FAIL"
    assert _verdict(vs, "first-request overhead", "kvbridge") == "PASS"  # 41 ms < 60 ms


def test_side_by_side_round_without_bytes_fails_and_a_failed_pair_is_na() -> None:
    rep = _bench("side_by_side_report")
    a = _res("kvbridge", [50, 8, 8])
    a["rounds"][2]["bytes"] = 0.0
    vs = rep.verdicts([a, _res("nixl", [], failed="round 0: stalled")])
    assert _verdict(vs, "KV moved", "kvbridge") == "FAIL"
    assert _verdict(vs, "run", "nixl") == "FAIL"
    assert _verdict(vs, "steady decode TTFT") == "n/a"


def test_serving_kv_check_needs_bytes_and_no_failures() -> None:
    srv = _bench("bench_serving")
    names = srv.KV_METRICS["pull"]
    ok = srv.kv_check("pull", {names[0]: 10.0}, {names[0]: 5000.0, names[1]: 3.0})
    assert ok["kv"].startswith("PASS") and ok["kv_bytes"] == 4990.0
    assert srv.kv_check("pull", {names[0]: 10.0}, {names[0]: 10.0})["kv"].startswith("FAIL")
    failed = srv.kv_check("nixl", {}, {srv.KV_METRICS["nixl"][0]: 1.0, srv.KV_METRICS["nixl"][2][0]: 1.0})
    assert failed["kv"].startswith("FAIL")
    assert srv.kv_check("single", {}, {})["kv"].startswith("n/a")
    # push: the prefill server's written bytes, the decode server's arrivals and failures
    b, n, (d_failed, p_failed) = srv.KV_METRICS["push"]
    assert b.startswith("prefill:") and p_failed.startswith("prefill:") and not d_failed.startswith("prefill:")
    assert srv.kv_check("push", {}, {b: 4096.0, n: 2.0})["kv"].startswith("PASS (2 transfers")
    assert srv.kv_check("push", {}, {b: 4096.0, n: 2.0, p_failed: 1.0})["kv"].startswith("FAIL")


def test_push_overlap_reads_both_engines_timelines() -> None:
    bp = _bench("bench_push")
    pre = "\n".join([
        "INFO kvbridge-timeline saved r1 t=10.000 layers=0",
        "INFO kvbridge-timeline posted r1 t=10.001 layers=0",
        "INFO kvbridge-timeline written r1 t=10.003 layers=0",
        "INFO kvbridge-timeline saved r1 t=10.010 layers=1",
        "INFO kvbridge-timeline posted r1 t=10.012 layers=1",
        "INFO kvbridge-timeline forward_end r1 t=10.013",
        "INFO kvbridge-timeline written r1 t=10.016 layers=1",
    ])
    dec = "INFO kvbridge-timeline arrived r1 t=10.020 rank=0\nINFO other line"
    o = bp.overlap(pre, dec)
    # measured from the last layer's hand-over (10.010), not the forward's end (10.013)
    assert round(o["left_ms"], 3) == 10.0 and round(o["left_to_last_write_ms"], 3) == 6.0
    assert round(o["forward_tail_ms"], 3) == 3.0
    assert round(o["write_ms"], 3) == 3.0 and o["writes"] == 2
    assert round(o["post_lag_ms"], 3) == 1.5
    assert bp.overlap("no timeline", dec) is None


def test_load_phases_split_each_round_from_the_decode_timeline() -> None:
    lp = _bench("load_phases")
    lines = []
    for r, base in ((0, 100.0), (1, 200.0)):  # two rounds of two requests
        for i, rid in enumerate((f"{2 * r}-x", f"{2 * r + 1}-y")):
            lines += [f"INFO kvbridge-timeline load_ordered {rid} t={base + 0.001 * i:.6f}",
                      f"INFO kvbridge-timeline load_start {rid} t={base + 0.002 + 0.001 * i:.6f}",
                      f"INFO kvbridge-timeline read_posted {rid} t={base + 0.010 + 0.005 * i:.6f} reads=1 "
                      f"prep_ms=0.10 post_ms=2.00 post_cpu_ms=0.50 runnable_ms=1.25",
                      f"INFO kvbridge-timeline read_checked {rid} t={base + 0.011 + 0.005 * i:.6f}",
                      f"INFO kvbridge-timeline load_reported {rid} t={base + 0.020:.6f}",
                      f"INFO kvbridge-timeline load_seen {rid} t={base + 0.023:.6f}"]
    rounds = lp.load_phases("\n".join(lines[::-1]) + "\nINFO other", per_round=2)
    assert len(rounds) == 2
    r = rounds[1]
    assert r["to_worker_ms"] == pytest.approx(2.0, abs=1e-3)
    assert r["posting_ms"] == pytest.approx(13.0, abs=1e-3)  # 200.002 -> 200.015
    assert (r["post_ms"], r["post_cpu_ms"], r["post_runnable_ms"]) == (4.0, 1.0, 2.5)
    assert r["to_report_ms"] == pytest.approx(4.0, abs=1e-3)  # last checked 200.016 -> 200.020
    assert r["to_scheduler_ms"] == pytest.approx(3.0, abs=1e-3)
    assert r["total_ms"] == pytest.approx(23.0, abs=1e-3)
    assert lp.median_phases(rounds)["total_ms"] == pytest.approx(23.0, abs=1e-3)
    # a round whose requests never reported is left out; no timeline, no rounds
    assert len(lp.load_phases("\n".join(x for x in lines if "200." not in x or "load_seen" not in x), 2)) == 1
    assert lp.load_phases("nothing here", 2) == []


def test_side_by_side_needs_ten_steady_rounds() -> None:
    rep = _bench("side_by_side_report")
    vs = rep.verdicts([_res("kvbridge", [50] + [8] * 9), _res("nixl", [50] + [10] * 10)])
    assert _verdict(vs, "steady rounds", "kvbridge") == "FAIL"  # 9 after round 0
    assert _verdict(vs, "steady rounds", "nixl") == "PASS"


def test_serving_push_needs_decode_arrivals_and_every_setup_measured() -> None:
    srv = _bench("bench_serving")
    b, n, _ = srv.KV_METRICS["push"]
    names = srv.KV_METRICS["pull"]
    # the prefill wrote bytes but the decode engine saw no arrival (it recomputed): not moved
    assert srv.kv_check("push", {}, {b: 4096.0})["kv"].startswith("FAIL")
    assert srv.kv_check("push", {}, {b: 4096.0, n: 1.0})["kv"].startswith("PASS")
    # fewer transfers than requests: some were recomputed
    assert srv.kv_check("pull", {}, {names[0]: 4096.0, names[1]: 7.0}, requests=16)["kv"].startswith("FAIL")
    assert srv.kv_check("pull", {}, {names[0]: 4096.0, names[1]: 16.0}, requests=16)["kv"].startswith(
        "PASS (16 transfers for 16 requests")

    def rates(*rs: float) -> list[dict]:
        return [{"rate": r, "kv": "PASS (1 transfers, 1.00 MB)"} for r in rs]

    ok = {"setup": "pull", "rates": rates(1.0, 2.0, 4.0)}
    lines = srv.verdict_lines([ok])
    assert lines[0].startswith("KV moved in every P/D run: PASS") and lines[1].endswith("PASS")
    # a P/D setup that failed, before its first rate or after some, is a run without KV
    for lost in ({"setup": "nixl", "failed": "stalled", "rates": []},
                 {"setup": "nixl", "failed": "stalled", "rates": rates(1.0)}):
        line = srv.verdict_lines([ok, lost])[0]
        assert line.startswith("KV moved in every P/D run: FAIL") and "nixl" in line
    # a single engine has no KV to move; its failure fails the rates check (it measured none)
    single = {"setup": "single", "failed": "x", "rates": []}
    assert srv.verdict_lines([ok, single])[0].startswith("KV moved in every P/D run: PASS")
    assert srv.verdict_lines([ok, single])[1].endswith("FAIL")
    assert srv.verdict_lines([{"setup": "pull", "rates": rates(1.0, 2.0)}])[1].endswith("FAIL")


def _push_row(r: int, ttft: float, left: float | None) -> dict:
    row = {"round": r, "ttft_ms": ttft, "prefill_ttft_ms": 10.0, "prefill_cpu_ms": 5.0, "decode_cpu_ms": 5.0,
           "transfer_ms": 3.0, "transfers": 1, "GB/s": 1.0}
    if left is not None:
        row.update(left_ms=left, left_to_last_write_ms=left, write_ms=2.0, left_to_notified_ms=left,
                   forward_tail_ms=1.0, post_lag_ms=0.1)
    return row


def test_push_report_judges_the_worst_round_and_needs_every_mode(capsys: pytest.CaptureFixture[str]) -> None:
    bp = _bench("bench_push")
    meta = {"model": "m", "num_prompts": 1, "prompt_len": 1, "rounds": 2, "kv_bytes": 2**20, "load_start": 1.0}
    lefts = [9.0, 3.0, 3.0, 5.0]  # round 0 is not judged; median of the rest 3 ms, worst 5 ms
    rows = {"pull": [_push_row(r, 50.0, None) for r in range(4)],
            "push-layerwise": [_push_row(r, 40.0, x) for r, x in enumerate(lefts)]}
    assert bp.report(rows, meta, ["pull round 2: the engine died"], None) == 1
    out = capsys.readouterr().out
    assert "target <= 2 layers' WRITEs = 4.0 ms: PASS" in out
    assert "worst round: 5.0 ms left against the same 4.0 ms: FAIL" in out
    assert "target lower than both: n/a" in out  # push-whole was not run
    assert "indicative only" in out and "the engine died" in out


def test_native_progress_default_is_the_cheapest_delay_within_ten_percent() -> None:
    npb = _bench("bench_native_progress")
    rows = [{"delay": "off", "result": "no completion", "engine_gbps": 9.0},
            {"delay": "0", "result": "ok", "engine_gbps": 8.0, "target_idle_cpu_pct": 100.0,
             "reader_idle_cpu_pct": 100.0},
            {"delay": "100", "result": "ok", "engine_gbps": 7.5, "target_idle_cpu_pct": 2.0,
             "reader_idle_cpu_pct": 2.0},
            {"delay": "1000", "result": "ok", "engine_gbps": 7.3, "target_idle_cpu_pct": 1.0,
             "reader_idle_cpu_pct": 1.0}]
    assert npb.choose_delay(rows) == "1000"
    assert npb.default_verdict(rows, "1000") == "PASS"
    assert npb.default_verdict(rows, "100") == "FAIL"  # 4 % against 2 %: more than 1 point
    rows[2]["target_idle_cpu_pct"] = rows[2]["reader_idle_cpu_pct"] = 1.4  # 2.8 % against 2 %: noise
    assert npb.default_verdict(rows, "100") == "PASS"
    assert npb.default_verdict(rows, "0") == "FAIL"  # spins: 200 % of a core
    assert npb.default_verdict(rows, "5000").startswith("n/a")
    rows[3]["engine_gbps"] = 6.0  # more than 10 % slower than the best: out
    assert npb.choose_delay(rows) == "100"
    assert npb.default_verdict(rows, "1000") == "FAIL"
    assert npb.choose_delay(rows[:1]) is None
