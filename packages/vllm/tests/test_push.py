"""Push mode through the connector's halves without vLLM: the decode scheduler offers its
blocks to the prefill engine's side channel, the prefill workers write them layer by layer
(or whole) over real NIXL agents, from real torch tensors in vLLM 0.32's cache layout."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from halves_wiring import alloc
from test_worker import CFG
from test_worker import Engine as WorkerEngine

from kvbridge.tools.ports import free_port
from kvbridge.vllm import EngineRoles, PushOrders
from kvbridge.vllm.params import TRANSFER_ID_KEY

pytestmark = pytest.mark.timeout(120)

PUSH = replace(CFG, mode="push")
PREFILL, DECODE = EngineRoles(producer=True, consumer=False), EngineRoles(producer=False, consumer=True)


class Engine(WorkerEngine):
    """test_worker's engine pair half in push mode, stepping in vLLM 0.32's call order."""

    def __init__(self, engine_id: str, roles: EngineRoles, seed: int | None, cfg=PUSH) -> None:
        super().__init__(engine_id, roles, seed, cfg)
        self.saved: list[str] = []
        self.progress: list = []

    def step(self, forward: bool = False):
        """One engine step in vLLM 0.32's order: the metadata is bound, the forward pass
        saves each layer, then start_load_kv, wait_for_save and the results."""
        orders = self.sched.mode.take_orders(self.progress)
        self.progress = []
        if forward:
            for name in self.layers:
                self.saved.append(name)
                self.worker.save_layer(name, orders)
        self.worker.start(orders)
        self.worker.finish_saves(orders)
        return orders, self.worker.results()



@pytest.fixture
def engines():
    p, d = Engine("P", PREFILL, seed=3), Engine("D", DECODE, seed=None)
    yield p, d
    d.close()
    p.close()


def _decode_params(p: Engine, tid: str) -> dict:
    return {"do_remote_prefill": True, "transfer_mode": "push", TRANSFER_ID_KEY: tid,
            "remote_host": "127.0.0.1", "remote_port": p.port}


def _prefill_params(tid: str) -> dict:
    return {"do_remote_decode": True, "transfer_mode": "push", TRANSFER_ID_KEY: tid}


def _finished(e: Engine, rid: str) -> bool:
    """vLLM's request_finished for a push prefill request: keep its blocks?"""
    keep, _ = e.sched.mode.finished(rid, _prefill_params("any"), completed=True, block_ids=(),
                                    num_computed_tokens=0, num_prompt_tokens=0)
    return keep


def _wait(cond, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.005)
    raise TimeoutError


@pytest.mark.parametrize("layerwise", [True, False], ids=["layer-by-layer", "whole-request"])
def test_decode_allocates_first_and_prefill_writes_into_its_blocks(layerwise) -> None:
    p = Engine("P", PREFILL, seed=3, cfg=replace(PUSH, push_layerwise=layerwise))
    d = Engine("D", DECODE, seed=None)
    try:
        dparams, pparams = _decode_params(p, "t-1"), _prefill_params("t-1")
        # decode: the prompt is an asynchronous load of every token
        assert d.sched.mode.matched_tokens("d-1", dparams, 40, 0) == (40, True)
        # prefill: vLLM asks until the offer arrived
        assert p.sched.mode.matched_tokens("p-1", pparams, 40, 0) == (None, False)
        d.sched.mode.after_alloc("d-1", dparams, 40, alloc([[2, 9, 4]], 0), 40)
        # one transfer per request: vLLM may allocate twice, one offer goes out (and the
        # request's parameters are left as they are)
        d.sched.mode.after_alloc("d-1", dparams, 40, alloc([[2, 9, 4]], 0), 40)
        assert dparams["do_remote_prefill"] is True
        _wait(lambda: p.sched.mode.matched_tokens("p-1", pparams, 40, 0) == (0, False))
        p.sched.mode.after_alloc("p-1", pparams, 0, alloc([[3, 5, 7, 11]]), 0)
        # decode's next step expects the request (the accept named the prefill facts)
        _wait(lambda: d.sched.mode._expects)
        orders, _ = d.step()
        (exp,) = orders.expects
        assert (exp.prefill_engine_id, exp.prefill_tp, exp.local_block_ids) == ("P", 1, ((2, 9, 4),))
        # prefill computes the whole prompt in one step: its workers push during the forward pass
        p.progress = [("p-1", 0, 40, None)]
        orders, res = p.step(forward=True)
        (push,) = orders.pushes
        assert push.block_ids == ((3, 5, 7),) and push.target.block_ids == ((2, 9, 4),)
        assert push.layerwise is layerwise
        assert _finished(p, "p-1") is True  # blocks stay until released
        sent, recved, failed = set(res.finished_sending), set(), set()
        end = time.monotonic() + 15
        while not ("p-1" in sent and "d-1" in recved) and time.monotonic() < end:
            dres = d.step()[1]
            recved |= dres.finished_recving
            failed |= dres.failed_recving
            sent |= p.step()[1].finished_sending
            time.sleep(0.005)
        assert sent == {"p-1"} and recved == {"d-1"} and failed == set()
        assert d.worker.decode.stats.requests_done == 1
        for name, pc in p.caches.items():
            dc = d.caches[name]
            for pb, db in ((3, 2), (5, 9), (7, 4)):
                assert torch.equal(dc[db], pc[pb]), (name, pb, db)
            assert not dc[1].any()  # nothing else written
        transfers = p.worker.prefill.stats.transfers
        assert transfers == (len(p.layers) if layerwise else 1)
        assert d.worker.decode.stats.notifications_unknown == 0
        assert not p.sched.mode.pending and not d.sched.mode.pending
    finally:
        d.close()
        p.close()


def test_prefill_blocks_are_freed_only_after_the_scheduler_said_finished(engines) -> None:
    p, d = engines
    dparams, pparams = _decode_params(p, "t-2"), _prefill_params("t-2")
    d.sched.mode.after_alloc("d-2", dparams, 16, alloc([[1]], 0), 16)
    _wait(lambda: p.sched.mode.matched_tokens("p-2", pparams, 16, 0) == (0, False))
    p.sched.mode.after_alloc("p-2", pparams, 0, alloc([[6]]), 0)
    _wait(lambda: d.sched.mode._expects)
    d.step()
    p.progress = [("p-2", 0, 16, None)]
    p.step(forward=True)
    # the push is released on the prefill worker before vLLM finished the request
    _wait(lambda: (d.step(), p.step()) and "p-2" in p.worker._push_released)
    assert _finished(p, "p-2")
    _, res = p.step()
    assert res.finished_sending == {"p-2"}


def test_a_chunked_prompt_is_pushed_with_its_last_chunk(engines) -> None:
    p, d = engines
    dparams, pparams = _decode_params(p, "t-3"), _prefill_params("t-3")
    d.sched.mode.after_alloc("d-3", dparams, 40, alloc([[1, 2, 3]], 0), 40)
    _wait(lambda: p.sched.mode.matched_tokens("p-3", pparams, 40, 0) == (0, False))
    p.sched.mode.after_alloc("p-3", pparams, 0, alloc([[4]]), 0)
    p.progress = [("p-3", 0, 16, None)]
    assert p.step()[0].pushes == ()
    p.progress = [("p-3", 16, 24, ((8, 9),))]
    (push,) = p.step()[0].pushes
    assert push.block_ids == ((4, 8, 9),)


def test_an_offer_to_a_dead_prefill_fails_the_load_with_its_blocks(engines) -> None:
    _, d = engines
    dparams = _decode_params(SimpleNamespace(port=free_port()), "t-4")
    d.sched.mode.after_alloc("d-4", dparams, 30, alloc([[5, 6]], 0), 30)
    _wait(lambda: d.sched.mode._failed, timeout=30)
    orders, res = d.step()
    assert orders.failed == (("d-4", ((5, 6),)),)
    assert res.failed_recving == {"d-4"} and res.finished_recving == {"d-4"}
    assert d.worker.take_invalid_blocks() == {5, 6}
    # counted as a failed handshake, as pull mode counts one with a dead prefill engine
    stats = d.worker.take_stats()
    assert stats["failed_handshakes"] == 1 and stats["requests_failed"] == 1


def test_a_prefill_request_without_an_offer_is_computed_after_the_wait(engines) -> None:
    p, _ = engines
    p.sched.mode.wait_s = 0.05
    assert p.sched.mode.matched_tokens("p-5", _prefill_params("nobody"), 8, 0) == (None, False)
    time.sleep(0.1)
    assert p.sched.mode.matched_tokens("p-5", _prefill_params("nobody"), 8, 0) == (0, False)
    assert _finished(p, "p-5") is False


def test_bad_push_params_are_computed_locally(engines) -> None:
    p, d = engines
    assert d.sched.mode.matched_tokens("x", {"transfer_mode": "push", "do_remote_prefill": True}, 8, 0) == (0, False)
    assert p.sched.mode.matched_tokens("y", {"transfer_mode": "push", "do_remote_decode": True}, 8,
                                       0) == (0, False)
    assert PushOrders().empty


def test_offers_of_one_batch_are_scheduled_together() -> None:
    """A burst of offers (a decode engine allocating a batch) releases its requests together,
    not one per step as each offer lands."""
    from kvbridge.handshake import PushOffer
    from kvbridge.vllm.push.scheduler import BATCH_CAP_S, BATCH_WINDOW_S, PushScheduler

    now = [100.0]
    st = PushScheduler(engine_id="P", block_size=16, tp_size=1, address=("127.0.0.1", 1), layerwise=True,
                   wait_s=30, send_offer=None, clock=lambda: now[0])
    st.set_served("", dict(block_size=16, kernel_blocks_per_block=1, head_order="HND"))

    def offer(tid):
        return PushOffer(protocol_version=1, transfer_id=tid, engine_id="D", host="h", port=1,
                         tp_size=1, block_size=16, block_ids=[[1]], token="t")

    for rid in ("a", "b", "c"):
        assert st.matched_tokens(rid, _prefill_params(rid), 16, 0) == (None, False)
    st.on_offer(offer("a"))
    assert st.matched_tokens("a", _prefill_params("a"), 16, 0) == (None, False)  # b, c still coming
    now[0] += BATCH_WINDOW_S / 2
    st.on_offer(offer("b"))
    assert st.matched_tokens("a", _prefill_params("a"), 16, 0) == (None, False)
    now[0] += BATCH_WINDOW_S * 1.5  # the burst is over: c is not part of it
    assert st.matched_tokens("a", _prefill_params("a"), 16, 0) == (0, False)
    assert st.matched_tokens("b", _prefill_params("b"), 16, 0) == (0, False)
    assert st.matched_tokens("c", _prefill_params("c"), 16, 0) == (None, False)
    # a steady trickle of offers never holds a request back longer than the cap
    st.on_offer(offer("c"))
    for rid in ("d", "e"):
        st.matched_tokens(rid, _prefill_params(rid), 16, 0)
    t0 = now[0]
    while st.matched_tokens("c", _prefill_params("c"), 16, 0) != (0, False):
        now[0] += BATCH_WINDOW_S / 2
        st.on_offer(offer(f"x{now[0]:f}"))
    assert now[0] - t0 <= BATCH_CAP_S + BATCH_WINDOW_S


def test_requests_that_arrived_together_wait_for_each_others_offers() -> None:
    """A request the scheduler has not considered yet still counts as part of the batch: the
    first request's offer does not release it alone while the second's is still coming
    (else the engine computes them in two forward passes)."""
    from kvbridge.handshake import PushOffer
    from kvbridge.vllm.push.scheduler import BATCH_WINDOW_S, PushScheduler

    now = [100.0]
    st = PushScheduler(engine_id="P", block_size=16, tp_size=1, address=("127.0.0.1", 1), layerwise=True,
                       wait_s=30, send_offer=None, clock=lambda: now[0])
    st.set_served("", dict(block_size=16, kernel_blocks_per_block=1, head_order="HND"))
    for rid in ("a", "b"):
        assert st.on_new_request(rid, _prefill_params(rid), 16) is False
    assert st.pending
    st.on_offer(PushOffer(protocol_version=1, transfer_id="a", engine_id="D", host="h", port=1,
                          tp_size=1, block_size=16, block_ids=[[1]], token="t"))
    assert st.matched_tokens("a", _prefill_params("a"), 16, 0) == (None, False)  # b's is coming
    now[0] += BATCH_WINDOW_S / 2
    st.on_offer(PushOffer(protocol_version=1, transfer_id="b", engine_id="D", host="h", port=1,
                          tp_size=1, block_size=16, block_ids=[[2]], token="t"))
    assert st.matched_tokens("a", _prefill_params("a"), 16, 0) == (0, False)
    assert st.matched_tokens("b", _prefill_params("b"), 16, 0) == (0, False)


def test_offers_older_than_the_transfer_timeout_are_never_written_into() -> None:
    """The decode engine gives up on an offer after its transfer timeout and may reuse the
    blocks: the prefill engine must then neither keep nor push into that offer."""
    from kvbridge.handshake import PushOffer
    from kvbridge.vllm.push.scheduler import PushScheduler

    now = [100.0]
    st = PushScheduler(engine_id="P", block_size=16, tp_size=1, address=("127.0.0.1", 1), layerwise=False,
                       wait_s=30, send_offer=None, clock=lambda: now[0])
    st.set_served("", dict(block_size=16, kernel_blocks_per_block=1, head_order="HND"))

    def offer(tid):
        return PushOffer(protocol_version=1, transfer_id=tid, engine_id="D", host="h", port=1,
                         tp_size=1, block_size=16, block_ids=[[7]], token="t")

    # an offer whose request comes too late is not taken: computed without a transfer
    st.on_offer(offer("late"))
    now[0] += 31
    assert st.matched_tokens("late", _prefill_params("late"), 16, 0) == (0, False)
    # unclaimed offers are forgotten once stale (the next offer sweeps them)
    st.on_offer(offer("never"))
    now[0] += 31
    st.on_offer(offer("fresh"))
    now[0] += 1  # past the batch window (the waiting "never" request would hold "fresh" back)
    assert st.matched_tokens("never", _prefill_params("never"), 16, 0) == (None, False)
    # an offer taken in time, but whose prompt completes after the timeout, is not pushed
    assert st.matched_tokens("fresh", _prefill_params("fresh"), 16, 0) == (0, False)
    st.after_alloc("fresh", _prefill_params("fresh"), 16, alloc([[3]]), 0)
    now[0] += 31
    assert st.take_orders([("fresh", 0, 16, None)]).pushes == ()
    assert st.finished("fresh", _prefill_params("fresh"), completed=True, block_ids=((3,),),
                       num_computed_tokens=16, num_prompt_tokens=16) == (False, None)
    # control: the same sequence within the offer's lifetime (27 s of the 30) pushes
    assert st.offer_lifetime_s == pytest.approx(27)
    st.on_offer(offer("ok"))
    now[0] += 1
    assert st.matched_tokens("ok", _prefill_params("ok"), 16, 0) == (0, False)
    st.after_alloc("ok", _prefill_params("ok"), 16, alloc([[4]]), 0)
    now[0] += 25
    (push,) = st.take_orders([("ok", 0, 16, None)]).pushes
    assert push.block_ids == ((4,),) and push.target.block_ids == ((7,),)


# ----- idle steps: a push decode rank waits for the prefill engine's writes ------------
def _expected(p: Engine, d: Engine, tid: str, d_blocks, p_blocks, tokens: int = 40) -> None:
    """Decode offers ``d_blocks`` for request d-<tid>, prefill accepts with ``p_blocks``,
    and decode's step expects the request."""
    dparams, pparams = _decode_params(p, tid), _prefill_params(tid)
    d.sched.mode.matched_tokens(f"d-{tid}", dparams, tokens, 0)
    d.sched.mode.after_alloc(f"d-{tid}", dparams, tokens, alloc([d_blocks], 0), tokens)
    _wait(lambda: p.sched.mode.matched_tokens(f"p-{tid}", pparams, tokens, 0) == (0, False))
    p.sched.mode.after_alloc(f"p-{tid}", pparams, 0, alloc([p_blocks]), 0)
    _wait(lambda: d.sched.mode._expects)
    (exp,) = d.step()[0].expects
    assert exp.local_block_ids == (tuple(d_blocks),)


def test_an_idle_decode_step_waits_for_the_writes_and_returns_when_they_land(engines) -> None:
    """One results() call with a wait returns the request as soon as the prefill engine's
    WRITEs landed (found from the WRITTEN notifications it checks while waiting); without
    the wait it returns before the prefill engine even computed."""
    import threading

    p, d = engines
    _expected(p, d, "w1", [2, 9, 4], [3, 5, 7, 11])
    out: list = []

    def idle_step() -> None:
        t0 = time.monotonic()
        out.append((d.worker.results(wait_s=8.0), time.monotonic() - t0))

    waiter = threading.Thread(target=idle_step)
    waiter.start()
    time.sleep(0.2)  # the decode rank waits meanwhile; then the prefill engine computes
    p.progress = [("p-w1", 0, 40, None)]
    p.step(forward=True)
    end = time.monotonic() + 10
    while waiter.is_alive() and time.monotonic() < end:  # the prefill engine keeps stepping
        p.step()
        time.sleep(0.005)
    waiter.join(1)
    assert out, "the idle step never returned"
    res, took = out[0]
    assert res.finished_recving == {"d-w1"} and not res.failed_recving
    assert 0.2 <= took < 5.0
    for name, pc in p.caches.items():
        for pb, db in ((3, 2), (5, 9), (7, 4)):
            assert torch.equal(d.caches[name][db], pc[pb]), (name, pb, db)


def test_an_idle_decode_wait_ends_at_its_limit(engines) -> None:
    """Nothing is written: the wait returns empty at its limit, the request still awaited."""
    p, d = engines
    _expected(p, d, "w2", [6, 8], [1, 2])
    t0 = time.monotonic()
    assert d.worker.results(wait_s=0.3).empty
    assert 0.25 <= time.monotonic() - t0 < 1.5
    assert d.worker.decode.pending == 1


def test_an_idle_decode_rank_with_nothing_awaited_returns_at_once(engines) -> None:
    _, d = engines
    t0 = time.monotonic()
    assert d.worker.results(wait_s=5.0).empty
    assert time.monotonic() - t0 < 0.5

