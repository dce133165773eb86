"""Disaggregated prefill/decode with real vLLM engines, per connector.

Every test runs for each selected connector (``KVB_E2E_CONNECTORS``, see
``_selected``): kvbridge's ``KVBridgeConnector`` by default, vLLM's own
NixlConnector (the reference) on request.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from e2e_harness import CONNECTORS as ALL_CONNECTORS
from e2e_harness import (
    DEFAULT_MAX_TOKENS as MAX_TOKENS,
)
from e2e_harness import (
    ConnectorUnderTest,
    DisaggRun,
    EngineConfig,
    cpu_binding,
    metric_total,
    run_disaggregated,
    transfer_figures,
    transfer_problems,
)


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


CONNECTORS = _selected()

BLOCK = 32
# Tiny model: 2 layers, head dim 32, float32 -> K and V bytes per token per KV head.
BYTES_PER_TOKEN_PER_HEAD = 2 * 2 * 32 * 4

pytestmark = pytest.mark.timeout(1800)


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


@pytest.mark.parametrize("connector", CONNECTORS)
def test_prefill_decode_matches_baseline(
    connector: ConnectorUnderTest, model_kv2: Path, prompts: list[list[int]],
    baseline_kv2: list[list[int]], e2e_workdir: Path,
) -> None:
    run = run_disaggregated(connector, model_kv2, prompts, MAX_TOKENS,
                            e2e_workdir / f"pd-tp1-tp1-{connector.label}")
    decode = run.decode_tokens()
    assert all(len(t) == MAX_TOKENS for t in decode), decode
    assert decode == baseline_kv2
    # The prefill engine's single token is the baseline's first token.
    assert [t[:1] for t in run.prefill_tokens()] == [t[:1] for t in baseline_kv2]
    _check_clean_transfer(run, prompts, kv_heads=2)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_negative_control_dummy_prefill_weights_mismatch(
    connector: ConnectorUnderTest, model_kv2: Path, prompts: list[list[int]],
    baseline_kv2: list[list[int]], e2e_workdir: Path,
) -> None:
    """Prefill with random weights: decode must use that (wrong) KV and diverge."""
    run = run_disaggregated(
        connector, model_kv2, prompts, MAX_TOKENS, e2e_workdir / f"pd-dummy-{connector.label}",
        prefill=EngineConfig(cpus="0", engine={"load_format": "dummy"}),
    )
    decode = run.decode_tokens()
    assert all(len(t) == MAX_TOKENS for t in decode), decode
    # The transfer itself was clean, so the mismatch comes from the pulled KV.
    _check_clean_transfer(run, prompts, kv_heads=2)
    mismatched = [i for i, (d, b) in enumerate(zip(decode, baseline_kv2, strict=True)) if d != b]
    assert mismatched == list(range(len(prompts))), (decode, baseline_kv2)


HETERO = [
    pytest.param(2, 1, 4, id="P-tp2-D-tp1-kv4"),
    pytest.param(1, 2, 2, id="P-tp1-D-tp2-kv2"),
]


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize(("p_tp", "d_tp", "kv_heads"), HETERO)
def test_heterogeneous_tp_matches_baseline(
    connector: ConnectorUnderTest, p_tp: int, d_tp: int, kv_heads: int,
    request: pytest.FixtureRequest, prompts: list[list[int]], e2e_workdir: Path,
) -> None:
    model = request.getfixturevalue(f"model_kv{kv_heads}")
    baseline = request.getfixturevalue(f"baseline_kv{kv_heads}")
    # Three workers on two cores: no pinning (a shared pinned core stalls transfers).
    p_cpus, d_cpus = cpu_binding(p_tp, d_tp)
    run = run_disaggregated(
        connector, model, prompts, MAX_TOKENS,
        e2e_workdir / f"pd-tp{p_tp}-tp{d_tp}-kv{kv_heads}-{connector.label}",
        prefill=EngineConfig(tp=p_tp, cpus=p_cpus),
        decode=EngineConfig(tp=d_tp, cpus=d_cpus),
    )
    assert run.decode_tokens() == baseline
    for p in run.transfer_params():
        assert p.get("tp_size", p_tp) == p_tp, p
    _check_clean_transfer(run, prompts, kv_heads=kv_heads)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_prefill_dies_before_pull(
    connector: ConnectorUnderTest, model_kv2: Path, prompts: list[list[int]],
    baseline_kv2: list[list[int]], e2e_workdir: Path,
) -> None:
    """Decode must neither hang nor invent tokens when the prefill engine is gone."""
    run = run_disaggregated(
        connector, model_kv2, prompts, MAX_TOKENS, e2e_workdir / f"pd-dead-{connector.label}",
        kill_prefill_before_pull=True, deadline_s=600,
    )
    assert run.prefill_exit is not None and run.prefill_exit != 0
    reasons = run.decode_finish_reasons()
    tokens = run.decode_tokens()
    for i, (r, t) in enumerate(zip(reasons, tokens, strict=True)):
        # Either failed per vLLM's "fail" policy, or recomputed locally (then exact).
        assert r == "error" or t == baseline_kv2[i], (i, r, t)
    # The failure is visible: a failure counter or a failure log line.
    metrics = run.decode.get("metrics_end", [])
    counted = sum(metric_total(metrics, n) for n in connector.failure_counters)
    assert counted > 0 or transfer_problems(run), run.decode_log[-3000:]

