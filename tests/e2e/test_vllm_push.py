"""Push mode through real vLLM engines: the decode engine allocates first, the prefill engine
writes each layer as vLLM computes it (TP 1 -> 1, and the negative control) or the whole
request after the forward pass (TP 2 -> 1); outputs must equal the non-disaggregated run,
token for token. (Each mode with each TP pair would double the suite's engine starts;
bench/bench_push.py runs both modes on the same prompts.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_harness import (
    DEFAULT_MAX_TOKENS as MAX_TOKENS,
)
from e2e_harness import (
    DisaggRun,
    EngineConfig,
    cpu_binding,
    kvbridge_push,
    run_disaggregated,
    transfer_figures,
    transfer_problems,
)

pytestmark = pytest.mark.timeout(1800)

BLOCK = 32
BYTES_PER_TOKEN_PER_HEAD = 2 * 2 * 32 * 4  # 2 layers, K and V, head dim 32, float32


def _check_clean_push(run: DisaggRun, prompts: list[list[int]], kv_heads: int) -> None:
    # the prefill engine kept each request's blocks until its push was released
    for p in run.transfer_params():
        assert p == {"transfer_mode": "push", "kvbridge_pushed": True}, p
    assert transfer_problems(run) == []
    # bytes arrived by WRITE: the decode engine counts no READ, the prefill engine
    # counts the pushes (every layer of every prompt block, all ranks together)
    figs = transfer_figures(run)
    min_bytes = sum((len(p) - 1) // BLOCK * BLOCK for p in prompts) * BYTES_PER_TOKEN_PER_HEAD * kv_heads
    pf = run.prefill_figures()
    assert pf.get("transfers", 0) > 0 and pf.get("bytes", 0) >= min_bytes, (pf, min_bytes, figs)
    assert all(r == "length" for r in run.decode_finish_reasons()), run.decode_finish_reasons()


LAYERS = 2  # of the tiny model


def test_push_layer_by_layer_matches_baseline(model_kv2: Path, prompts: list[list[int]],
                                              baseline_kv2: list[list[int]], e2e_workdir: Path) -> None:
    run = run_disaggregated(kvbridge_push(), model_kv2, prompts, MAX_TOKENS,
                            e2e_workdir / "push-tp1-tp1-layerwise", push=True)
    assert run.decode_tokens() == baseline_kv2
    _check_clean_push(run, prompts, kv_heads=2)
    # one WRITE per layer and request: the layers went out one by one
    assert run.prefill_figures()["transfers"] == LAYERS * len(prompts)


def test_push_negative_control_dummy_prefill_weights_mismatch(
        model_kv2: Path, prompts: list[list[int]], baseline_kv2: list[list[int]],
        e2e_workdir: Path) -> None:
    run = run_disaggregated(kvbridge_push(), model_kv2, prompts, MAX_TOKENS,
                            e2e_workdir / "push-dummy", push=True,
                            prefill=EngineConfig(cpus="0", engine={"load_format": "dummy"}))
    decode = run.decode_tokens()
    assert all(len(t) == MAX_TOKENS for t in decode), decode
    _check_clean_push(run, prompts, kv_heads=2)
    mismatched = [i for i, (d, b) in enumerate(zip(decode, baseline_kv2, strict=True)) if d != b]
    assert mismatched == list(range(len(prompts))), (decode, baseline_kv2)


def test_push_whole_request_prefill_tp2_into_decode_tp1(
        model_kv4: Path, prompts: list[list[int]], baseline_kv4: list[list[int]],
        e2e_workdir: Path) -> None:
    p_cpus, d_cpus = cpu_binding(2, 1)
    run = run_disaggregated(kvbridge_push(layerwise=False), model_kv4, prompts, MAX_TOKENS,
                            e2e_workdir / "push-tp2-tp1-kv4-whole", push=True,
                            prefill=EngineConfig(tp=2, cpus=p_cpus), decode=EngineConfig(tp=1, cpus=d_cpus))
    assert run.decode_tokens() == baseline_kv4
    _check_clean_push(run, prompts, kv_heads=4)
    # one WRITE per request from each of the two prefill ranks
    assert run.prefill_figures()["transfers"] == 2 * len(prompts)
