"""Pull mode's scheduler half (kvbridge.vllm.pull.scheduler), without vLLM."""

from __future__ import annotations

import pytest

from kvbridge.vllm.modes import Allocated
from kvbridge.vllm.params import (
    PARAMS_VERSION,
    decode_remote_prefill,
    is_remote_prefill,
    prefill_request_params,
)
from kvbridge.vllm.pull.scheduler import PullScheduler


def _alloc(new_block_ids: list, hits: int = 0) -> Allocated:
    return Allocated(new_block_ids=tuple(tuple(g) for g in new_block_ids), prefix_hits=hits)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def prefill(clock: Clock | None = None, **kw) -> PullScheduler:
    base = dict(engine_id="P", block_size=16, tp_size=2, address=("10.0.0.1", 5601),
                producer=True, consumer=False, heartbeat_s=5.0, clock=clock or Clock())
    base.update(kw)
    s = PullScheduler(**base)
    s.set_served("inc-1", {})
    return s


def decode(clock: Clock | None = None, **kw) -> PullScheduler:
    base = dict(engine_id="D", block_size=16, tp_size=1, address=("10.0.0.2", 5602),
                producer=False, consumer=True, heartbeat_s=5.0, clock=clock or Clock())
    base.update(kw)
    return PullScheduler(**base)


def finish_prefill(p: PullScheduler, rid: str = "p-1", prompt: int = 40,
                   blocks=(7, 3, 9, 12)) -> dict:
    params = prefill_request_params()
    held, out = p.finished(rid, params, completed=True, block_ids=(list(blocks),),
                           num_computed_tokens=prompt, num_prompt_tokens=prompt)
    assert held is True and out is not None
    return out


def test_prefill_holds_the_computed_blocks_and_returns_vllm_style_params() -> None:
    p = prefill()
    out = finish_prefill(p, prompt=40, blocks=(7, 3, 9, 12))  # 40 tokens: 3 blocks of 16
    orders = p.take_orders()
    assert [(h.request_id, h.block_ids) for h in orders.holds] == [("p-1", ((7, 3, 9),))]
    token = orders.holds[0].token
    assert len(token) == 32 and out["kvbridge_token"] == token
    assert is_remote_prefill(out) and out["do_remote_decode"] is False
    assert out["remote_block_ids"] == [[7, 3, 9]] and out["remote_request_id"] == "p-1"
    assert (out["remote_host"], out["remote_port"]) == ("10.0.0.1", 5601)
    assert out["tp_size"] == 2 and out["remote_num_tokens"] == 40 and out["remote_block_size"] == 16
    assert out["kvbridge_incarnation"] == "inc-1" and out["kvbridge_version"] == PARAMS_VERSION
    rp = decode_remote_prefill(out)
    assert rp.token == token and rp.incarnation == "inc-1"
    assert p.take_orders().empty  # orders go out once
    # a second request gets its own token
    finish_prefill(p, "p-2")
    assert p.take_orders().holds[0].token != token


@pytest.mark.parametrize("why", ["aborted", "no-remote-decode", "not-producer", "no-metadata",
                                 "no-blocks"])
def test_prefill_does_not_hold_what_it_cannot_serve(why: str) -> None:
    p = prefill(producer=why != "not-producer")
    if why == "no-metadata":
        p.set_served("", {})
    params = {} if why == "no-remote-decode" else prefill_request_params()
    blocks = [] if why == "no-blocks" else [1, 2]
    held, out = p.finished("r", params, completed=why != "aborted", block_ids=(blocks,),
                           num_computed_tokens=20, num_prompt_tokens=20)
    assert (held, out) == (False, None)
    assert p.take_orders().holds == ()


def test_decode_matches_the_prompt_but_its_last_token_and_orders_one_load() -> None:
    p, d = prefill(), decode()
    params = finish_prefill(p, prompt=40)
    assert d.matched_tokens("d-1", params, 40, 0) == (39, True)  # decode computes token 40
    assert d.matched_tokens("d-1", params, 40, 16) == (23, True)  # a 16-token local prefix hit
    assert d.matched_tokens("d-1", params, 40, 40) == (0, False)
    d.after_alloc("d-1", params, 40, _alloc([[5, 6]], 1), 23)
    # the request's parameters are never changed: the scheduler remembers the order itself
    assert params == finish_prefill(prefill(), prompt=40) | {k: params[k] for k in (
        "kvbridge_token", "remote_request_id")} and params["do_remote_prefill"] is True
    (ld,) = d.take_orders().loads
    assert ld.request_id == "d-1" and ld.local_block_ids == ((5, 6),) and ld.computed_tokens == 16
    assert ld.source.request_id == "p-1" and ld.source.block_ids == ((7, 3, 9),)
    # vLLM may call after_alloc again after the load: nothing new is ordered
    d.after_alloc("d-1", params, 40, _alloc([[8]], 0), 0)
    assert d.take_orders().empty
    assert d.matched_tokens("d-1", params, 40, 0) == (0, False)


def test_decode_loads_no_more_than_prefill_computed() -> None:
    p, d = prefill(), decode()
    params = finish_prefill(p, prompt=40)
    params["remote_num_tokens"] = 39  # vLLM < 0.32 prefill engines leave the last token out
    assert d.matched_tokens("d", params, 40, 0) == (39, True)


def test_full_local_hit_and_abort_before_allocation_release_the_prefill_blocks() -> None:
    p, d = prefill(), decode()
    hit = finish_prefill(p, "p-1")
    # 33 tokens, blocks of 16: a local prefix of 2 blocks covers all but the last token,
    # which decode computes itself, so nothing is read (vLLM then allocates with 0 external
    # tokens and after_alloc releases the prefill blocks)
    short = finish_prefill(p, "p-0", prompt=33, blocks=(7, 3, 9))
    assert d.matched_tokens("d-0", short, 33, 32) == (0, False)
    assert d.matched_tokens("d-0", short, 33, 16) == (16, True)
    d.after_alloc("d-1", hit, 40, _alloc([], 3), 0)
    aborted = finish_prefill(p, "p-2")
    assert d.finished("d-2", aborted, completed=False, block_ids=([],), num_computed_tokens=0,
                      num_prompt_tokens=40) == (False, None)
    orders = d.take_orders()
    assert orders.loads == () and [r.request_id for r in orders.releases] == ["p-1", "p-2"]
    # a request that was loaded is not released again when it finishes
    loaded = finish_prefill(p, "p-3")
    d.after_alloc("d-3", loaded, 40, _alloc([[1, 2, 3]], 0), 40)
    d.take_orders()
    assert d.finished("d-3", loaded, completed=True, block_ids=([1, 2, 3],), num_computed_tokens=41,
                      num_prompt_tokens=40) == (False, None)
    assert d.take_orders().empty


def test_queued_requests_handshake_at_once_and_renew_every_heartbeat() -> None:
    clock = Clock()
    p, d = prefill(), decode(clock)
    params = finish_prefill(p, "p-1")
    d.on_new_request("d-1", params, 40)
    assert [r.request_id for r in d.take_orders().renewals] == ["p-1"]  # handshake now
    clock.t += 4.9
    assert d.take_orders().empty
    clock.t += 0.2
    assert [r.request_id for r in d.take_orders().renewals] == ["p-1"]
    assert d.queued == 1
    d.after_alloc("d-1", params, 40, _alloc([[4, 5, 6]], 0), 40)
    clock.t += 10
    orders = d.take_orders()
    assert orders.renewals == () and len(orders.loads) == 1 and d.queued == 0


@pytest.mark.parametrize("bad", [
    {"do_remote_prefill": True},  # fields missing
    "foreign",  # made by another connector: no kvbridge token
    "short",  # block lists cannot hold the prompt
    "push",  # the other side runs another mode
    "pp",  # the prefill engine ran pipeline parallel
    "dcp",  # ... or decode context parallel
])
def test_unusable_params_mean_local_compute_with_one_warning(bad, caplog) -> None:
    p, d = prefill(), decode()
    params = finish_prefill(p, prompt=40)
    if bad == "foreign":
        params.pop("kvbridge_token")
    elif bad == "short":
        params["remote_block_ids"] = [[7]]
    elif bad == "push":
        params["transfer_mode"] = "push"
    elif bad in ("pp", "dcp"):
        params[f"{bad}_size"] = 2
    else:
        params = bad
    with caplog.at_level("WARNING", logger="kvbridge.vllm"):
        for _ in range(3):
            assert d.matched_tokens("d-1", params, 40, 0) == (0, False)
    assert len([r for r in caplog.records if "d-1" in r.getMessage()]) == 1
    d.on_new_request("d-1", params, 40)
    d.after_alloc("d-1", params, 40, _alloc([[1]], 0), 0)
    assert d.take_orders().empty


def test_plain_requests_are_left_alone() -> None:
    d = decode()
    assert d.matched_tokens("x", None, 10, 0) == (0, False)
    assert d.matched_tokens("x", {}, 10, 0) == (0, False)
    d.after_alloc("x", None, 10, _alloc([[1]], 0), 0)
    assert d.finished("x", None, completed=True, block_ids=([1],), num_computed_tokens=10,
                      num_prompt_tokens=10) == (False, None)
    assert d.take_orders().empty


def test_producer_only_engine_ignores_decode_params() -> None:
    p = prefill()
    params = finish_prefill(prefill(engine_id="P2"), prompt=40)
    assert p.matched_tokens("x", params, 40, 0) == (0, False)


def test_bad_construction_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PullScheduler(engine_id="x", block_size=0, tp_size=1, address=("h", 1), producer=True,
                       consumer=False, heartbeat_s=1)


@pytest.mark.parametrize(("key", "setting"), [("pp_size", "pipeline_parallel_size=1"),
                                              ("dcp_size", "decode_context_parallel_size=1")])
def test_params_of_a_pipeline_or_context_parallel_prefill_are_refused_by_name(
        key: str, setting: str, caplog) -> None:
    params = dict(finish_prefill(prefill(), prompt=40), **{key: 4})
    d = decode()
    with caplog.at_level("WARNING", logger="kvbridge.vllm"):
        assert d.matched_tokens("d-1", params, 40, 0) == (0, False)
    (msg,) = [r.getMessage() for r in caplog.records if "d-1" in r.getMessage()]
    assert f"{key}=4" in msg and setting in msg and "computed locally" in msg


def test_params_are_parsed_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.vllm.pull import scheduler as steps

    calls = []
    real = steps.decode_remote_prefill
    monkeypatch.setattr(steps, "decode_remote_prefill", lambda p: calls.append(p) or real(p))
    p, d = prefill(), decode()
    params = finish_prefill(p, prompt=40)
    d.on_new_request("d-1", params, 40)
    for _ in range(3):
        assert d.matched_tokens("d-1", params, 40, 0) == (39, True)
    d.after_alloc("d-1", params, 40, _alloc([[1, 2, 3]], 0), 40)
    (ld,) = d.take_orders().loads
    assert len(calls) == 1 and ld.source == decode_remote_prefill(params | {"do_remote_prefill": True})
    # a finished request's parse is forgotten: the same id with new params is parsed again
    d.finished("d-1", params, completed=True, block_ids=([1, 2, 3],), num_computed_tokens=41,
               num_prompt_tokens=40)
    assert d.matched_tokens("d-1", finish_prefill(p, "p-2"), 40, 0) == (39, True)
    assert len(calls) == 2


# What vllm-router 0.1.17 (vLLM's Rust router, --vllm-pd-disaggregation) sends with a
# prefill request, captured here: the keys of the decode parameters, null-valued.
VLLM_ROUTER_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False,
                       "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                       "remote_port": None}


def test_vllm_router_prefill_params_with_null_keys_hold_and_answer_as_usual() -> None:
    """Null keys count as absent: the request is a prefill for a remote decode, its blocks
    are held and its output carries usable decode parameters; a decode engine given them
    (with the router's unknown keys beside) loads."""
    p = prefill()
    assert p.on_new_request("p-9", VLLM_ROUTER_PREFILL, 40) is False
    assert p.matched_tokens("p-9", VLLM_ROUTER_PREFILL, 40, 0) == (0, False)
    held, out = p.finished("p-9", VLLM_ROUTER_PREFILL, completed=True, block_ids=([7, 3, 9],),
                           num_computed_tokens=40, num_prompt_tokens=40)
    assert held is True and out is not None
    assert [h.request_id for h in p.take_orders().holds] == ["p-9"]
    assert out["remote_block_ids"] == [[7, 3, 9]] and out["remote_engine_id"] == "P"
    d = decode()
    forwarded = dict(out, router_hint=None)  # a router's own key, null
    d.on_new_request("d-9", forwarded, 40)
    assert d.matched_tokens("d-9", forwarded, 40, 0) == (39, True)  # all but the last
