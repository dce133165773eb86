"""vLLM 0.33's sleep mode without vLLM: the connector's halves (as in test_worker) drop
their NIXL registrations (``unregister_kv_caches``), refuse transfers while asleep,
and register the same tensors again under a new incarnation (``restore_kv_caches``),
which the scheduler serves anew so that decode engines handshake again. Real NIXL
agents (UCX, host memory), real torch tensors, a real side channel on 127.0.0.1."""

from __future__ import annotations

import pytest
import torch
from halves_wiring import alloc
from test_worker import DECODE, LAYERS, PREFILL, Engine, _run

from kvbridge.handshake import decode_metadata
from kvbridge.vllm import prefill_request_params
from kvbridge.vllm.rank_engines import next_incarnation

pytestmark = pytest.mark.timeout(120)


def _hold(p: Engine, rid: str, blocks: list[int]) -> dict:
    held, params = p.sched.mode.finished(rid, prefill_request_params(), completed=True,
                                         block_ids=(blocks,), num_computed_tokens=16 * len(blocks),
                                         num_prompt_tokens=16 * len(blocks))
    assert held
    return params


def _order_load(d: Engine, rid: str, params: dict, local: list[int]) -> None:
    n = 16 * len(local)
    d.sched.mode.matched_tokens(rid, params, n, 0)
    d.sched.mode.after_alloc(rid, params, n, alloc([local], 0), n)


def _wake(e: Engine) -> None:
    """What vLLM does on wake-up: the workers restore, the engine core collects their
    handshake metadata again and hands it to the scheduler."""
    e.worker.resume()
    hs = e.worker.handshake()
    if hs is not None:
        e.sched.serve({0: (*hs, e.worker.compat_info())})


@pytest.fixture
def pair():
    p, d = Engine("P", PREFILL, seed=1), Engine("D", DECODE, seed=None)
    yield p, d
    d.close()
    p.close()


def test_a_sleeping_prefill_engine_deregisters_and_its_readers_fail_cleanly(pair) -> None:
    p, d = pair
    params = _hold(p, "p-1", [3, 5])
    p.step()  # the hold is placed
    assert p.worker.prefill is not None and p.worker.prefill.held == 1
    agent = p.worker.prefill.agent
    p.worker.suspend()
    p.worker.suspend()  # idempotent
    assert p.worker.asleep and p.worker.prefill is None and p.worker.handshake() is None
    assert agent.closed  # its registrations, connections and transfers are gone with it
    # the held request is vLLM's again: reported sent once
    assert p.step().finished_sending == {"p-1"}
    assert p.step().finished_sending == frozenset()
    # a decode engine reading the old hold: fails (never a hang), its blocks invalid
    _order_load(d, "d-1", params, [2, 9])
    _, recved, failed = _run(p, d, lambda s, r, f: "d-1" in r)
    assert recved == failed == {"d-1"}
    assert d.worker.take_invalid_blocks() == {2, 9}
    assert not any(d.caches[n].any() for n in d.caches)


def test_orders_while_asleep_are_refused_and_reported(pair, caplog) -> None:
    p, d = pair
    d.worker.suspend()
    params = _hold(p, "p-1", [3])
    _order_load(d, "d-1", params, [4])
    with caplog.at_level("WARNING", logger="kvbridge"):
        r = d.step()
    assert r.finished_recving == r.failed_recving == {"d-1"}
    assert d.worker.take_invalid_blocks() == {4}
    assert any("is asleep" in rec.getMessage() for rec in caplog.records)
    p.worker.suspend()
    _hold(p, "p-2", [6])
    assert p.step().finished_sending == {"p-1", "p-2"}  # freed at once, nothing holds them


def test_a_load_in_flight_when_the_decode_engine_sleeps_is_failed(pair) -> None:
    p, d = pair
    params = _hold(p, "p-1", [3, 5])
    p.step()
    _order_load(d, "d-1", params, [2, 9])
    d.worker.start(d.sched.mode.take_orders())  # the load starts (handshake first)
    d.worker.suspend()
    r = d.step()
    assert r.finished_recving == r.failed_recving == {"d-1"}
    assert d.worker.take_invalid_blocks() == {2, 9}


def test_after_waking_the_same_tensors_move_under_a_new_incarnation(pair) -> None:
    p, d = pair
    params = _hold(p, "p-0", [1])  # handshaked before the sleep: the decode side knows "P-1"
    _order_load(d, "d-0", params, [0])
    assert _run(p, d, lambda s, r, f: "d-0" in r)[1:] == ({"d-0"}, set())
    old_port = p.sched.server.port
    for e in (p, d):
        e.worker.suspend()
    # vLLM frees and restores the memory at the same addresses; new contents meanwhile
    for t in p.caches.values():
        t.copy_(torch.rand(t.shape, generator=torch.Generator().manual_seed(7)))
    for e in (p, d):
        _wake(e)
        _wake(e)  # idempotent (a second wake-up with the kv_cache tag)
    new = next_incarnation("P-1")
    assert p.sched.mode.incarnation == new and p.sched.server.incarnation == new
    assert p.sched.server.port == old_port
    assert decode_metadata(p.worker.handshake()[1]).incarnation == new
    params = _hold(p, "p-2", [3, 5, 7])
    assert params["kvbridge_incarnation"] == new
    _order_load(d, "d-2", params, [2, 9, 4])
    sent, recved, failed = _run(p, d, lambda s, r, f: "p-2" in s and "d-2" in r)
    assert "p-2" in sent and sent <= {"p-0", "p-2"} and (recved, failed) == ({"d-2"}, set())
    for name, pc in p.caches.items():
        assert torch.equal(d.caches[name][[2, 9, 4]], pc[[3, 5, 7]])
    stats = d.worker.take_stats()
    # d-0 (before the sleep) and d-2; the new decode engine handshook with the new prefill one
    assert stats["requests_done"] == 2 and len(stats["handshake_duration"]) == 2
    block_bytes = p.caches["model.layers.0.self_attn"][0].numel() * 4
    assert sum(stats["bytes_transferred"]) == (1 + 3) * LAYERS * block_bytes
    # every sleep gives the engine another incarnation
    p.worker.suspend()
    _wake(p)
    assert p.sched.server.incarnation == next_incarnation(new) != new


def test_parameters_issued_before_the_sleep_are_refused_after_it(pair) -> None:
    p, d = pair
    stale = _hold(p, "p-1", [3, 5])
    p.step()
    p.worker.suspend()
    p.step()
    _wake(p)
    _order_load(d, "d-1", stale, [2, 9])
    _, recved, failed = _run(p, d, lambda s, r, f: "d-1" in r)
    assert recved == failed == {"d-1"}
    assert d.worker.take_invalid_blocks() == {2, 9}
    assert not any(d.caches[n].any() for n in d.caches)
