"""The connector's two halves without vLLM: a prefill and a decode engine, each a
scheduler and worker halves, move one request over real NIXL agents (UCX, host
memory) and a real side channel on 127.0.0.1, from real torch tensors in vLLM
0.32's cache layout. vLLM's configuration objects are stand-ins with the
attributes registration reads."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from halves_wiring import SchedulerHalves, alloc

from kvbridge.tools.ports import free_port
from kvbridge.vllm import (
    ConnectorConfig,
    EngineRoles,
    HoldOrder,
    LoadOrder,
    PullOrders,
    RemotePrefill,
    encode_remote_prefill,
    prefill_request_params,
    register_caches,
    worker_half,
)
from kvbridge.vllm.modes import TransferResults

pytestmark = pytest.mark.timeout(120)

LAYERS, NB, HEADS, BLOCK, HEAD = 2, 16, 2, 16, 16
CFG = ConnectorConfig(ucx_threads=0, huge_pages=False, lease_seconds=30,
                      handshake_timeout_seconds=2, transfer_timeout_seconds=10)
PREFILL, DECODE = EngineRoles(producer=True, consumer=False), EngineRoles(producer=False, consumer=True)


def _vllm_config(cache_dtype: str = "auto") -> SimpleNamespace:
    mc = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: HEADS,
                         get_head_size=lambda: HEAD, get_vocab_size=lambda: 1024,
                         hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"],
                                                   hidden_size=64, num_attention_heads=4))
    return SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype=cache_dtype))


def _caches(seed: int | None, fp8: bool = False) -> dict[str, torch.Tensor]:
    """vLLM 0.32's per-layer cache: [blocks, heads, tokens, 2 * head] (K and V packed);
    FP8 caches (any ``kv_cache_dtype=fp8*``) are uint8 tensors of that shape."""
    g = torch.Generator().manual_seed(seed or 0)
    shape = (NB, HEADS, BLOCK, 2 * HEAD)
    if fp8:
        return {f"model.layers.{i}.self_attn": (
            torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) if seed is not None
            else torch.zeros(shape, dtype=torch.uint8)) for i in range(LAYERS)}
    return {f"model.layers.{i}.self_attn": (torch.rand(shape, generator=g) if seed is not None
                                            else torch.zeros(shape)) for i in range(LAYERS)}



class Engine:
    """One engine's two connector halves, wired as KVBridgeConnector wires them."""

    def __init__(self, engine_id: str, roles: EngineRoles, seed: int | None,
                 cfg: ConnectorConfig = CFG, cache_dtype: str = "auto") -> None:
        self.caches = _caches(seed, fp8=cache_dtype.startswith("fp8"))
        self.port = port = free_port()
        self.sched = SchedulerHalves(engine_id=engine_id, block_size=BLOCK, tp_size=1, config=cfg,
                                   port=port, roles=roles)
        self.worker = worker_half(0, roles, cfg)
        reg = register_caches(_vllm_config(cache_dtype), SimpleNamespace(num_blocks=NB), self.caches, cfg,
                              engine_id=engine_id, attention_backend="test")
        self.layers = reg.layer_names
        self.worker.register(reg.spec, reg.regions, reg.engine_config, incarnation=f"{engine_id}-1",
                             address=(cfg.side_channel_host, port), layer_names=reg.layer_names)
        hs = self.worker.handshake()
        if hs is not None:
            self.sched.serve({0: (*hs, self.worker.compat_info())})

    def step(self) -> TransferResults:
        self.worker.start(self.sched.mode.take_orders())
        return self.worker.results()

    def close(self) -> None:
        self.worker.close()
        self.sched.close()


@pytest.fixture
def pair():
    p, d = Engine("P", PREFILL, seed=1), Engine("D", DECODE, seed=None)
    yield p, d
    d.close()
    p.close()


def _run(p: Engine, d: Engine, until, timeout: float = 20.0) -> tuple[set, set, set]:
    sent, recved, failed = set(), set(), set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until(sent, recved, failed):
        r = d.step()
        recved |= r.finished_recving
        failed |= r.failed_recving
        sent |= p.step().finished_sending
        time.sleep(0.005)
    return sent, recved, failed


def test_a_request_moves_from_the_prefill_worker_to_the_decode_worker(pair) -> None:
    p, d = pair
    held, params = p.sched.mode.finished("p-1", prefill_request_params(), completed=True,
                                          block_ids=([3, 5, 7, 11],), num_computed_tokens=40,
                                          num_prompt_tokens=40)
    assert held and params["remote_port"] == p.sched.port
    assert d.sched.mode.matched_tokens("d-1", params, 40, 0) == (39, True)
    d.sched.mode.after_alloc("d-1", params, 40, alloc([[2, 9, 4]], 0), 40)
    sent, recved, failed = _run(p, d, lambda s, r, f: "p-1" in s and "d-1" in r)
    assert (sent, recved, failed) == ({"p-1"}, {"d-1"}, set())
    for name, pc in p.caches.items():
        torch.testing.assert_close(d.caches[name][[2, 9, 4]], pc[[3, 5, 7]], rtol=0, atol=0)
        assert not d.caches[name][[0, 1, 3, 5]].any()  # nothing else was written
    assert d.worker.take_invalid_blocks() == set()
    stats = d.worker.take_stats()
    assert stats is not None and stats["requests_done"] == 1 and len(stats["transfer_duration"]) >= 1
    assert sum(stats["bytes_transferred"]) == 3 * LAYERS * HEADS * BLOCK * 2 * HEAD * 4


@pytest.mark.parametrize("decode_key, moves", [("0123456789abcdef-same", True),
                                               ("fedcba9876543210-other", False), (None, False)])
def test_auth_key_from_the_connector_config_guards_the_side_channel(decode_key, moves) -> None:
    """Prefill keyed: a decode engine with the same key loads; another key or none fails the
    load with its blocks invalid (never a hang)."""
    p = Engine("P", PREFILL, seed=1, cfg=replace(CFG, auth_key="0123456789abcdef-same"))
    d = Engine("D", DECODE, seed=None, cfg=replace(CFG, auth_key=decode_key))
    try:
        assert p.sched.server is not None and p.sched.server.authenticated
        _, params = p.sched.mode.finished("p-1", prefill_request_params(), completed=True,
                                           block_ids=([3, 5],), num_computed_tokens=20,
                                           num_prompt_tokens=20)
        d.sched.mode.matched_tokens("d-1", params, 20, 0)
        d.sched.mode.after_alloc("d-1", params, 20, alloc([[2, 9]], 0), 20)
        sent, recved, failed = _run(p, d, lambda s, r, f: "d-1" in r)
        assert recved == {"d-1"} and failed == (set() if moves else {"d-1"})
        if moves:
            for name, pc in p.caches.items():
                torch.testing.assert_close(d.caches[name][[2, 9]], pc[[3, 5]], rtol=0, atol=0)
        else:
            assert d.worker.take_invalid_blocks() == {2, 9}
            assert d.worker.take_stats()["failed_handshakes"] == 1
    finally:
        d.close()
        p.close()


def test_a_load_from_a_dead_prefill_engine_fails_with_its_blocks_invalid(pair) -> None:
    _, d = pair
    dead = RemotePrefill.of(engine_id="gone", host="127.0.0.1", port=free_port(),
                            request_id="p-9", block_ids=((1, 2, 3),), token="t" * 32,
                            incarnation="x", num_tokens=40, block_size=BLOCK)
    params = encode_remote_prefill(dead)
    assert d.sched.mode.matched_tokens("d-9", params, 40, 0) == (39, True)
    d.sched.mode.after_alloc("d-9", params, 40, alloc([[6, 8, 10]], 0), 40)
    failed: set[str] = set()
    deadline = time.monotonic() + 20
    while "d-9" not in failed and time.monotonic() < deadline:
        r = d.step()
        failed |= r.failed_recving
        assert r.failed_recving <= r.finished_recving
        time.sleep(0.01)
    assert failed == {"d-9"}
    assert d.worker.take_invalid_blocks() == {6, 8, 10}
    assert d.worker.take_invalid_blocks() == set()  # reported once
    assert d.worker.take_stats()["failed_handshakes"] == 1


def test_a_load_the_engine_refuses_is_reported_failed_at_once(pair) -> None:
    p, d = pair
    _, params = p.sched.mode.finished("p-2", prefill_request_params(), completed=True,
                                       block_ids=([1, 2],), num_computed_tokens=20,
                                       num_prompt_tokens=20)
    p.step()
    d.sched.mode.after_alloc("d-2", params, 20, alloc([[NB + 3, 1]], 0), 20)  # outside the cache
    r = d.step()
    assert r.finished_recving == r.failed_recving == {"d-2"}
    assert d.worker.take_invalid_blocks() == {NB + 3, 1}


def test_orders_for_a_half_this_rank_does_not_run_are_answered_not_dropped() -> None:
    w = worker_half(0, DECODE, CFG)  # no engines registered: neither holds nor loads can run
    src = RemotePrefill.of(engine_id="P", host="h", port=1, request_id="p", block_ids=((1,),),
                           token="t")
    w.start(PullOrders(loads=(LoadOrder("d", src, ((4,),), 0),), holds=(HoldOrder("h", ((1,),), "t"),)))
    assert w.results() == TransferResults(frozenset({"h"}), frozenset({"d"}), frozenset({"d"}))
    assert w.take_invalid_blocks() == {4} and w.take_stats() is None
    assert w.handshake() is None
    multi = worker_half(0, DECODE, CFG, single_group=False)
    multi.start(PullOrders(loads=(LoadOrder("d", src, ((4,),), 0),)))
    assert multi.results().failed_recving == {"d"} and multi.take_invalid_blocks() == set()


def test_the_scheduler_serves_ranks_that_agree_and_refuses_others(pair) -> None:
    from msgspec.structs import replace

    from kvbridge.handshake import decode_metadata, encode_metadata

    p, _ = pair
    assert p.sched.mode.incarnation == "P-1" and p.sched.server is not None
    compat, md = p.worker.handshake()
    other = encode_metadata(replace(decode_metadata(md), rank=1, incarnation="P-2"))
    with pytest.raises(ValueError, match="rank 1"):  # the server checks every rank it is handed
        p.sched.serve({0: (compat, md), 1: (compat, other)})
    # nothing was lost: the engine is still served as it was
    assert p.sched.server.ranks == [0] and p.sched.server.incarnation == "P-1"
    assert p.sched.mode.incarnation == "P-1"
    with pytest.raises(ValueError, match="disagree on the compatibility hash"):
        p.sched.serve({0: (compat, md), 1: ("another-model", md)})


def _load_one(p: Engine, d: Engine) -> tuple[set, set, set]:
    _, params = p.sched.mode.finished("p-1", prefill_request_params(), completed=True,
                                       block_ids=([3, 5, 7],), num_computed_tokens=40,
                                       num_prompt_tokens=40)
    d.sched.mode.matched_tokens("d-1", params, 40, 0)
    d.sched.mode.after_alloc("d-1", params, 40, alloc([[2, 9, 4]], 0), 39)
    return _run(p, d, lambda s, r, f: "d-1" in r)


@pytest.mark.parametrize("p_dtype, d_dtype", [("fp8", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")])
def test_fp8_caches_move_byte_for_byte(p_dtype: str, d_dtype: str) -> None:
    """kv_cache_dtype=fp8*: vLLM hands over uint8 tensors; the bytes move as they are ("fp8"
    is vLLM's name for fp8_e4m3, so the two spellings pair)."""
    p = Engine("P", PREFILL, seed=1, cache_dtype=p_dtype)
    d = Engine("D", DECODE, seed=None, cache_dtype=d_dtype)
    try:
        assert p.worker.prefill.spec.dtype == "uint8"
        assert p.worker.compat_info()["cache_dtype"] == ("fp8_e4m3" if p_dtype == "fp8" else p_dtype)
        sent, recved, failed = _load_one(p, d)
        assert (recved, failed) == ({"d-1"}, set())
        for name, pc in p.caches.items():
            assert torch.equal(d.caches[name][[2, 9, 4]], pc[[3, 5, 7]])
        assert sum(d.worker.take_stats()["bytes_transferred"]) == 3 * LAYERS * HEADS * BLOCK * 2 * HEAD
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("p_dtype, d_dtype", [("fp8_e4m3", "fp8_e5m2"), ("fp8", "auto")])
def test_a_kv_cache_dtype_mismatch_is_refused_naming_both(p_dtype: str, d_dtype: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Two FP8 formats (stored alike as uint8) or FP8 against the model dtype: the handshake
    refuses, the load fails with its blocks invalid, and the message names both dtypes."""
    p = Engine("P", PREFILL, seed=1, cache_dtype=p_dtype)
    d = Engine("D", DECODE, seed=None, cache_dtype=d_dtype)
    try:
        with caplog.at_level("WARNING", logger="kvbridge"):
            _, recved, failed = _load_one(p, d)
        assert recved == failed == {"d-1"}
        assert d.worker.take_invalid_blocks() == {2, 9, 4}
        assert not any(d.caches[n].any() for n in d.caches)
        want = "fp8_e4m3" if p_dtype == "fp8" else p_dtype
        other = "fp32" if d_dtype == "auto" else d_dtype
        msg = next(r.getMessage() for r in caplog.records if "d-1" in r.getMessage())
        assert f"KV-cache dtype differs: peer '{want}', this side '{other}'" in msg, msg
    finally:
        d.close()
        p.close()


def test_a_kv_cache_dtype_kvbridge_does_not_know_is_refused_at_registration() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'nvfp4' is not supported"):
        Engine("P", PREFILL, seed=1, cache_dtype="nvfp4")
    with pytest.raises(ValueError, match="1-byte elements but the cache tensors hold fp32"):
        register_caches(_vllm_config("fp8"), SimpleNamespace(num_blocks=NB), _caches(1), CFG,
                        engine_id="P", attention_backend="test")


# ----- idle steps: only push-mode decode ranks wait (test_push.py); pull ranks never do -----
def test_pull_ranks_never_wait_in_an_idle_step(pair) -> None:
    """Pull mode: neither a decode rank with a load in flight nor a prefill rank holding
    blocks waits (RankEngines.idle_waits); both return at once."""
    p, d = pair
    held, params = p.sched.mode.finished("p-1", prefill_request_params(), completed=True,
                                          block_ids=([3, 5],), num_computed_tokens=20,
                                          num_prompt_tokens=20)
    assert held
    p.step()
    d.sched.mode.matched_tokens("d-1", params, 20, 0)
    d.sched.mode.after_alloc("d-1", params, 20, alloc([[2, 9]], 0), 20)
    d.worker.start(d.sched.mode.take_orders())
    assert p.worker.prefill is not None and p.worker.prefill.held == 1
    for w in (d.worker, p.worker):
        t0 = time.monotonic()
        assert w.results(wait_s=5.0).empty  # a wait would have returned the load done
        assert time.monotonic() - t0 < 0.5
    _, recved, failed = _run(p, d, lambda s, r, f: "d-1" in r)  # and the load still completes
    assert recved == {"d-1"} and failed == set()
