"""Push mode through real vLLM engines: the decode engine allocates first, the prefill engine
writes each layer as vLLM computes it (TP 1 -> 1, and the negative control) or the whole
request after the forward pass (TP 2 -> 1); outputs must equal the non-disaggregated run
(each decode engine's own local run of the prompts), token for token. (Each mode with each
TP pair would double the suite's engine starts; bench/bench_push.py runs both modes on the
same prompts.) Engines live for the module (engine_pool.EnginePool); the negative control
swaps only the prefill engine."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from e2e_harness import (
    DEFAULT_MAX_TOKENS as MAX_TOKENS,
)
from e2e_harness import (
    DisaggRun,
    EngineConfig,
    kvbridge_push,
    transfer_figures,
    transfer_problems,
)
from engine_pool import EngineDef, EnginePool, baseline, running_pool

pytestmark = pytest.mark.timeout(1800)

BLOCK = 32
BYTES_PER_TOKEN_PER_HEAD = 2 * 2 * 32 * 4  # 2 layers, K and V, head dim 32, float32
TP1 = EngineConfig(cpus="nobind", in_process=True)
LAYERWISE = kvbridge_push()
WHOLE = kvbridge_push(layerwise=False)


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


@pytest.fixture(scope="module")
def pool(e2e_workdir: Path, forker: Any) -> Iterator[EnginePool]:
    with running_pool(e2e_workdir / "push", "push", forker) as p:
        yield p


@pytest.fixture(scope="module")
def decode_kv2(model_kv2: Path) -> EngineDef:
    return EngineDef("decode-kv2-push", model_kv2, "decode", LAYERWISE, TP1)


@pytest.fixture(scope="module")
def prefill_kv2(model_kv2: Path) -> EngineDef:
    return EngineDef("prefill-kv2-push", model_kv2, "prefill", LAYERWISE, TP1)


@pytest.fixture(scope="module")
def push_baseline_kv2(pool: EnginePool, prefill_kv2: EngineDef, decode_kv2: EngineDef,
                      prompts: list[list[int]]) -> list[list[int]]:
    # the first test's pair starts together (two engines, two cores)
    _, d = pool.use(prefill_kv2, decode_kv2, keep=pool.engines)
    return baseline(d, prompts, MAX_TOKENS)


def test_push_layer_by_layer_matches_baseline(pool: EnginePool, prefill_kv2: EngineDef,
                                              decode_kv2: EngineDef, prompts: list[list[int]],
                                              push_baseline_kv2: list[list[int]]) -> None:
    p, d = pool.use(prefill_kv2, decode_kv2)
    run = pool.round(p, d, prompts, MAX_TOKENS, push=True)
    assert run.decode_tokens() == push_baseline_kv2
    _check_clean_push(run, prompts, kv_heads=2)
    # one WRITE per layer and request: the layers went out one by one
    assert run.prefill_figures()["transfers"] == LAYERS * len(prompts)


def test_push_negative_control_dummy_prefill_weights_mismatch(
        pool: EnginePool, model_kv2: Path, prompts: list[list[int]],
        push_baseline_kv2: list[list[int]]) -> None:
    # A fresh decode engine (its baseline is that of the same model and settings: local runs
    # are identical). Seen 2026-11-26 before pd_round kept the prefill engine stepping in push
    # mode: decode waited 120 s for this push and failed every request, although the prefill
    # engine wrote every layer without error.
    p, d = pool.use(EngineDef("prefill-kv2-push-dummy", model_kv2, "prefill", LAYERWISE,
                              replace(TP1, engine={"load_format": "dummy"})),
                    EngineDef("decode-kv2-push-2", model_kv2, "decode", LAYERWISE, TP1))
    assert baseline(d, prompts, MAX_TOKENS) == push_baseline_kv2
    run = pool.round(p, d, prompts, MAX_TOKENS, push=True)
    decode = run.decode_tokens()
    assert all(len(t) == MAX_TOKENS for t in decode), decode
    _check_clean_push(run, prompts, kv_heads=2)
    mismatched = [i for i, (d, b) in enumerate(zip(decode, push_baseline_kv2, strict=True)) if d != b]
    assert mismatched == list(range(len(prompts))), (decode, push_baseline_kv2)


def test_push_whole_request_prefill_tp2_into_decode_tp1(
        pool: EnginePool, model_kv4: Path, prompts: list[list[int]]) -> None:
    d_def = EngineDef("decode-kv4-push", model_kv4, "decode", WHOLE, TP1)
    (d,) = pool.use(d_def)
    base = baseline(d, prompts, MAX_TOKENS)
    p, d = pool.use(EngineDef("prefill-kv4-tp2-push", model_kv4, "prefill", WHOLE, replace(TP1, tp=2)),
                    d_def)
    run = pool.round(p, d, prompts, MAX_TOKENS, push=True)
    assert run.decode_tokens() == base
    _check_clean_push(run, prompts, kv_heads=4)
    # one WRITE per request from each of the two prefill ranks
    assert run.prefill_figures()["transfers"] == 2 * len(prompts)
