"""Disaggregated prefill/decode with real vLLM engines, per connector.

Every test runs for each selected connector (``KVB_E2E_CONNECTORS``, see
``_selected``): kvbridge's ``KVBridgeConnector`` by default, vLLM's own
NixlConnector (the reference) on request.

The engines live for the whole module (engine_pool.EnginePool), one prefill/decode
pair at work at a time; the tests run in file order and each names the engines it
needs, so consecutive tests share them:

    prefill-kv2 + decode-kv2              P/D equals decode-kv2's own local run
    prefill-kv2-dummy + decode-kv2        negative control (only prefill swapped)
    prefill-kv2 + decode-kv2-tp2          TP 1 -> 2
    prefill-kv2-dummy (killed) + decode-kv2-tp2
                                          dead prefill, never reached by decode
    prefill-kv2 (killed) + decode-kv2-tp2 dead prefill after a handshake
    prefill-kv4-tp2 + decode-kv4          TP 2 -> 1
    prefill-kv2-frozen + decode-kv2-impatient
                                          loads time out during the first handshake

The baseline is each decode engine's own run of the prompts without
kv_transfer_params (same process, same weights); the TP 2 decode engine is held
to the TP 1 baseline, as before.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from e2e_harness import CONNECTORS as ALL_CONNECTORS
from e2e_harness import (
    DEFAULT_MAX_TOKENS as MAX_TOKENS,
)
from e2e_harness import (
    ConnectorUnderTest,
    DisaggRun,
    EngineConfig,
    metric_total,
    transfer_figures,
    transfer_problems,
)
from engine_pool import EngineDef, EnginePool, baseline, running_pool


def _selected() -> list:
    """Connectors to test: $KVB_E2E_CONNECTORS (comma list of names in e2e_harness.CONNECTORS,
    or "all"); kvbridge's alone by default, vLLM's NixlConnector on request (it doubles the
    suite's time and is the reference, not the product)."""
    want = os.environ.get("KVB_E2E_CONNECTORS", "kvbridge").strip()
    names = sorted(ALL_CONNECTORS) if want == "all" else [n.strip() for n in want.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_CONNECTORS]
    if unknown:
        raise ValueError(f"KVB_E2E_CONNECTORS names unknown connectors {unknown}; "
                         f"known: {sorted(ALL_CONNECTORS)} or 'all'")
    return [pytest.param(ALL_CONNECTORS[n], id=ALL_CONNECTORS[n].label) for n in names]


BLOCK = 32
# Tiny model: 2 layers, head dim 32, float32 -> K and V bytes per token per KV head.
BYTES_PER_TOKEN_PER_HEAD = 2 * 2 * 32 * 4

pytestmark = pytest.mark.timeout(1800)

# One OpenMP thread per worker, placed by the OS: engines are reused across pairs (the
# TP 1 prefill serves a TP 2 decode later), so no engine may pin a core another needs.
TP1 = EngineConfig(cpus="nobind", in_process=True)
TP2 = replace(TP1, tp=2)


@pytest.fixture(scope="module", params=_selected())
def connector(request: pytest.FixtureRequest) -> ConnectorUnderTest:
    return request.param


class Engines:
    def __init__(self, c: ConnectorUnderTest, kv2: Path, kv4: Path) -> None:
        self.p = EngineDef("prefill-kv2", kv2, "prefill", c, TP1)
        self.d = EngineDef("decode-kv2", kv2, "decode", c, TP1)
        self.p_dummy = EngineDef("prefill-kv2-dummy", kv2, "prefill", c,
                                 replace(TP1, engine={"load_format": "dummy"}))
        self.d_tp2 = EngineDef("decode-kv2-tp2", kv2, "decode", c, TP2)
        # kvbridge: the decode engine gets a staging buffer (kvbridge.nixl.staging), which the
        # TP 2 prefill engine's heads split calls on (a pair shares one connector setting)
        staged = (replace(c, extra_config={**c.extra_config, "staging_mib": 128})
                  if c.kv_connector == "KVBridgeConnector" else c)
        self.p4_tp2 = EngineDef("prefill-kv4-tp2", kv4, "prefill", staged, TP2)
        self.d4 = EngineDef("decode-kv4", kv4, "decode", staged, TP1)
        # loads time out after 2 s, handshakes may take a minute; failed loads recompute
        impatient = replace(c, kv_load_failure_policy="recompute", extra_config={
            **c.extra_config, "transfer_timeout_seconds": 2.0, "handshake_timeout_seconds": 60})
        self.p_frozen = EngineDef("prefill-kv2-frozen", kv2, "prefill", impatient, TP1)
        self.d_impatient = EngineDef("decode-kv2-impatient", kv2, "decode", impatient, TP1)


@pytest.fixture(scope="module")
def engines(connector: ConnectorUnderTest, model_kv2: Path, model_kv4: Path) -> Engines:
    return Engines(connector, model_kv2, model_kv4)


@pytest.fixture(scope="module")
def pool(connector: ConnectorUnderTest, e2e_workdir: Path, forker: Any) -> Iterator[EnginePool]:
    with running_pool(e2e_workdir / f"pull-{connector.label}", connector.label, forker) as p:
        yield p


@pytest.fixture(scope="module")
def baseline_kv2(pool: EnginePool, engines: Engines, prompts: list[list[int]]) -> list[list[int]]:
    # the first test's pair starts together (two engines, two cores)
    _, d = pool.use(engines.p, engines.d, keep=pool.engines)
    return baseline(d, prompts, MAX_TOKENS)


def _check_clean_transfer(run: DisaggRun, prompts: list[list[int]], kv_heads: int) -> None:
    # Prefill answered every request with transfer parameters in vLLM's convention.
    params = run.transfer_params()
    assert len(params) == len(prompts)
    for p in params:
        assert isinstance(p, dict) and p, params
        assert p.get("do_remote_prefill") is True, p
    # No failure or expiry counter moved, no failure line in either log.
    assert transfer_problems(run) == []
    # The decode engine really pulled: transfers happened and moved at least the
    # prompt's full blocks (whole KV of the model, every rank together).
    figs = transfer_figures(run)
    assert figs.get("transfers", 0) > 0, figs
    min_bytes = sum((len(p) - 1) // BLOCK * BLOCK for p in prompts) * BYTES_PER_TOKEN_PER_HEAD * kv_heads
    assert figs.get("bytes", 0) >= min_bytes, (figs, min_bytes)
    # Decode did not recompute the prompt: vLLM counts only the locally computed tail.
    assert all(r == "length" for r in run.decode_finish_reasons()), run.decode_finish_reasons()


def test_prefill_decode_matches_baseline(pool: EnginePool, engines: Engines, prompts: list[list[int]],
                                         baseline_kv2: list[list[int]]) -> None:
    p, d = pool.use(engines.p, engines.d)
    run = pool.round(p, d, prompts, MAX_TOKENS)
    decode = run.decode_tokens()
    assert all(len(t) == MAX_TOKENS for t in decode), decode
    assert decode == baseline_kv2
    # The prefill engine's single token is the baseline's first token.
    assert [t[:1] for t in run.prefill_tokens()] == [t[:1] for t in baseline_kv2]
    _check_clean_transfer(run, prompts, kv_heads=2)


def test_negative_control_dummy_prefill_weights_mismatch(
    pool: EnginePool, engines: Engines, prompts: list[list[int]], baseline_kv2: list[list[int]],
) -> None:
    """Prefill with random weights: decode must use that (wrong) KV and diverge."""
    p, d = pool.use(engines.p_dummy, engines.d, keep=[engines.p.name])
    run = pool.round(p, d, prompts, MAX_TOKENS)
    decode = run.decode_tokens()
    assert all(len(t) == MAX_TOKENS for t in decode), decode
    # The transfer itself was clean, so the mismatch comes from the pulled KV.
    _check_clean_transfer(run, prompts, kv_heads=2)
    mismatched = [i for i, (d, b) in enumerate(zip(decode, baseline_kv2, strict=True)) if d != b]
    assert mismatched == list(range(len(prompts))), (decode, baseline_kv2)


def test_heterogeneous_tp_prefill_tp1_decode_tp2_matches_baseline(
    pool: EnginePool, engines: Engines, prompts: list[list[int]], baseline_kv2: list[list[int]],
) -> None:
    p, d = pool.use(engines.p, engines.d_tp2, keep=[engines.p_dummy.name])
    run = pool.round(p, d, prompts, MAX_TOKENS)
    assert run.decode_tokens() == baseline_kv2
    for params in run.transfer_params():
        assert params.get("tp_size", 1) == 1, params
    _check_clean_transfer(run, prompts, kv_heads=2)


def _check_dead_prefill(run: DisaggRun, connector: ConnectorUnderTest, base: list[list[int]]) -> None:
    assert run.prefill_exit is not None and run.prefill_exit != 0
    reasons = run.decode_finish_reasons()
    tokens = run.decode_tokens()
    assert len(tokens) == len(base)
    for i, (r, t) in enumerate(zip(reasons, tokens, strict=True)):
        # Either failed per vLLM's "fail" policy, or recomputed locally (then exact).
        assert r == "error" or t == base[i], (i, r, t)
    # The failure is visible: a failure counter or a failure log line (this round's).
    metrics = run.decode.get("metrics_end", [])
    start = run.decode.get("metrics_start", [])
    counted = sum(metric_total(metrics, n) - metric_total(start, n) for n in connector.failure_counters)
    assert counted > 0 or transfer_problems(run), run.decode_log[-3000:]


def test_prefill_dies_before_pull(pool: EnginePool, engines: Engines, connector: ConnectorUnderTest,
                                  prompts: list[list[int]], baseline_kv2: list[list[int]]) -> None:
    """Decode must neither hang nor invent tokens when the prefill engine is gone (this
    decode engine never reached it: the handshake fails)."""
    p, d = pool.use(engines.p_dummy, engines.d_tp2, keep=[engines.p.name])
    run = pool.round(p, d, prompts, MAX_TOKENS, kill_prefill_before_pull=True, deadline_s=600)
    _check_dead_prefill(run, connector, baseline_kv2)


def test_prefill_dies_after_handshake_before_pull(
    pool: EnginePool, engines: Engines, connector: ConnectorUnderTest, prompts: list[list[int]],
    baseline_kv2: list[list[int]],
) -> None:
    """As above, but decode already shook hands with that prefill engine (earlier test):
    the READs themselves fail."""
    p, d = pool.use(engines.p, engines.d_tp2)
    run = pool.round(p, d, prompts, MAX_TOKENS, kill_prefill_before_pull=True, deadline_s=600)
    _check_dead_prefill(run, connector, baseline_kv2)


def test_heterogeneous_tp_prefill_tp2_decode_tp1_matches_baseline(
    pool: EnginePool, engines: Engines, prompts: list[list[int]],
) -> None:
    (d,) = pool.use(engines.d4)
    baseline_kv4 = baseline(d, prompts, MAX_TOKENS)
    p, d = pool.use(engines.p4_tp2, engines.d4)
    run = pool.round(p, d, prompts, MAX_TOKENS)
    assert run.decode_tokens() == baseline_kv4
    for params in run.transfer_params():
        assert params.get("tp_size", 2) == 2, params
    _check_clean_transfer(run, prompts, kv_heads=4)
    # each prefill rank holds half of a decode block's heads: READs went through the staging
    # buffer (kvbridge.nixl.staging) and the tokens above prove the copy into place
    if run.connector.kv_connector == "KVBridgeConnector":
        name = "vllm:kvbridge_num_staged_reads"
        end = run.decode.get("metrics_end") or run.decode["rounds"][-1]["metrics"]
        assert metric_total(end, name) - metric_total(run.decode.get("metrics_start", []), name) > 0


def test_load_given_up_during_its_handshake_is_recomputed_and_never_read_into(
    pool: EnginePool, engines: Engines, connector: ConnectorUnderTest, prompts: list[list[int]],
    baseline_kv2: list[list[int]],
) -> None:
    """The prefill engine is frozen (SIGSTOP) for 8 s right after it prefilled, so the decode
    engine's first handshake with it outlasts the decode's 2 s transfer timeout: every load
    is given up and vLLM recomputes the prompts. When the prefill engine runs again the
    handshake completes; the decode engine must then not read into the blocks vLLM took
    back (it once did, and the text changed). The decode log says so for each request."""
    if connector.kv_connector != "KVBridgeConnector":
        pytest.skip("kvbridge's transfer and handshake timeouts; NixlConnector has its own")
    p, d = pool.use(engines.p_frozen, engines.d_impatient)
    off = d.log_offset()
    run = pool.round(p, d, prompts, MAX_TOKENS, freeze_prefill_s=8.0, deadline_s=600)
    assert run.decode_tokens() == baseline_kv2
    assert all(r == "length" for r in run.decode_finish_reasons()), run.decode_finish_reasons()
    start, end = run.decode.get("metrics_start", []), run.decode["metrics_end"]
    timed_out = sum(metric_total(end, n) - metric_total(start, n) for n in connector.failure_counters)
    assert timed_out >= 1, run.decode_log[-3000:]
    d.call("flush", 300, prompt=prompts[0][:8], delay_s=2.0)  # steps after the handshake ended
    log = d.log_since(off)
    assert re.search(r"handshake with engine \S+ \(TP 1\) took", log), log[-3000:]
    given_up = re.findall(r"request \S+ was given up before its READs were posted; nothing was read", log)
    assert len(given_up) == len(prompts), log[-3000:]
