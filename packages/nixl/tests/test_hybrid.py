"""Hybrid attention + Mamba-2 caches and sliding-window groups through the engine, with real
NIXL agents (UCX, host memory) and real ZMQ, in one process: every byte is checked against
the expected shard, and bytes that must not move are checked untouched."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvbridge.nixl import AgentConfig, EngineConfig, TransferParams
from kvbridge.tools.hybrid_cache import HybridCache, logical_content, with_hybrid_groups
from kvbridge.tools.local_ranks import LocalRanks
from kvbridge.topology import EngineSpec, MambaSpec

pytestmark = pytest.mark.timeout(120)

NB = 12
NULL = 0
CFG = EngineConfig(agent=AgentConfig(num_threads=0), lease_s=30, handshake_timeout_s=3,
                   transfer_timeout_s=15, null_block_id=NULL)
MAMBA = MambaSpec(ssm_heads=4, ssm_head_dim=8, state_size=8, n_groups=2, conv_width=4)


def hybrid(engine_id: str, tp: int, kv_heads: int = 2) -> EngineSpec:
    return with_hybrid_groups(EngineSpec(engine_id, tp, kv_heads, 16, 2, 16, "bf16",
                                         layout="blocks-first", mamba=MAMBA))


class Engines:
    """A prefill and a decode engine (every rank) in this process."""

    def __init__(self, p_spec, d_spec, cfg=CFG):
        self.cfg = cfg
        self.p = LocalRanks.start("p", p_spec, range(p_spec.tp_size), NB, cfg)
        self.d = LocalRanks.start("d", d_spec, range(d_spec.tp_size), NB, cfg,
                                  serve=cfg.mode == "push")

    def move(self, rid, p_ids, d_ids, content, *, computed_tokens=0, fill=True):
        """Fill the prefill caches, move the request (pull or push); returns decode done ids."""
        pre, dec = list(self.p.engines.values()), list(self.d.engines.values())
        if fill:
            for c in self.p.caches.values():
                c.fill(content, p_ids)
        if self.cfg.mode == "pull":
            params = pre[0].hold(rid, p_ids)
            for e in pre[1:]:
                e.hold(rid, p_ids, params.token)
            for e in dec:
                e.load(rid, params, d_ids, computed_tokens)
        else:
            token = "tok-" + rid
            host, port = dec[0].address
            dspec = dec[0].spec
            target = TransferParams("decode", host, port, dspec.tp_size,
                                    tuple(tuple(g) for g in d_ids), token,
                                    computed_tokens=computed_tokens)
            for e in dec:
                e.expect(rid, "prefill", pre[0].spec.tp_size, token, d_ids)
            for e in pre:
                e.push(rid, p_ids, target)
        return self.run(rid)

    def run(self, rid, timeout=20.0):
        pre, dec = list(self.p.engines.values()), list(self.d.engines.values())
        done, released = {}, {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for r, e in enumerate(dec):
                ev = e.poll()
                assert not ev.failed, ev.failed
                if rid in ev.done:
                    done[r] = True
            for q, e in enumerate(pre):
                for rel in e.poll():
                    released[q] = rel.reason
            if len(done) == len(dec) and len(released) == len(pre):
                return released
            time.sleep(0.001)
        raise TimeoutError(f"done {done}, released {released}")

    def close(self):
        self.d.close()
        self.p.close()


TP_PAIRS = [(2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("p_tp,d_tp", TP_PAIRS, ids=[f"P{p}-D{d}" for p, d in TP_PAIRS])
def test_hybrid_request_moves_attention_and_mamba_state(p_tp, d_tp, mode):
    eng = Engines(hybrid("prefill", p_tp), hybrid("decode", d_tp), replace(CFG, mode=mode))
    try:
        content = logical_content(eng.p.spec, 5, 3 * 16)
        p_ids = [[4, 2, 7], [NULL, NULL, 9]]  # attention blocks; the state in the last Mamba block
        d_ids = [[3, 8, 5], [NULL, NULL, 11]]
        for c in eng.d.caches.values():  # a sentinel in the decode null block and unused pages
            for t in c.regions:
                t[NULL] = 0xA5
                t[10] = 0x5A
        released = eng.move("a", p_ids, d_ids, content)
        assert set(released.values()) == {"notified" if mode == "pull" else "written"}
        for c in eng.d.caches.values():
            assert c.verify(content, d_ids, 0, 48) == 0
            # the state shard really arrived (not zeros): content is random
            assert c.regions[1][11, :16].any()
            for t in c.regions:
                assert bool((t[NULL] == 0xA5).all()) and bool((t[10] == 0x5A).all())
        # a wrong state page on one prefill rank shows as a mismatch (the check can fail)
        first = next(iter(eng.d.caches.values()))
        first.regions[0][11, 3] ^= 0xFF
        assert first.verify(content, d_ids, 0, 48) == 1
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_rank_holding_only_duplicate_heads_gives_mamba_state_only(mode):
    """One KV head, prefill TP 2: both prefill ranks hold the head, the decode rank reads it
    from rank 0 alone and reads the Mamba state from both. Rank 1's attention blocks are
    scrambled after the fill: any attention byte taken from it would show."""
    eng = Engines(hybrid("prefill", 2, kv_heads=1), hybrid("decode", 1, kv_heads=1),
                  replace(CFG, mode=mode))
    try:
        plan = eng.d.engines[0].plan_for(eng.p.spec).decode_ranks[0]
        assert plan.mamba.fa_source_ranks == (0,) and plan.mamba.fa_emptied_ranks == (1,)
        content = logical_content(eng.p.spec, 6, 32)
        p_ids, d_ids = [[1, 2], [NULL, 3]], [[4, 5], [NULL, 6]]
        for c in eng.p.caches.values():
            c.fill(content, p_ids)
        for t in eng.p.caches[1].regions:
            t[[1, 2], :64] = torch.randint(0, 256, (2, 64), dtype=torch.uint8)
        eng.move("b", p_ids, d_ids, content, fill=False)
        assert eng.d.caches[0].verify(content, d_ids, 0, 32) == 0
        # the descriptors between decode rank 0 and prefill rank 1 hold Mamba rows only
        if mode == "pull":
            rd = eng.d.engines[0].peers.get("prefill").descs[1]
        else:
            rd = eng.p.engines[1].peers.get("decode").descs[0]
        assert rd.attn_keys == 0 and rd.mamba_rows > 0
    finally:
        eng.close()


def test_hybrid_engine_without_groups_is_refused():
    spec = replace(hybrid("prefill", 1), groups=())
    cache = HybridCache.allocate(spec, 0, 4)
    from kvbridge.nixl import PrefillEngine

    with pytest.raises(ValueError, match="declares no KV-cache groups"):
        PrefillEngine(spec, 0, cache.cache_regions(), CFG)


def test_wrong_group_count_is_a_value_error():
    eng = Engines(hybrid("prefill", 1), hybrid("decode", 1))
    try:
        with pytest.raises(ValueError, match="expected 2 KV-cache group"):
            eng.p.engines[0].hold("x", [[1], [2], [3]])
        with pytest.raises(ValueError, match="has 2 KV-cache groups"):
            eng.d.engines[0].load("x", TransferParams("prefill", "127.0.0.1", 1, 1, ((1,), (2,)), "t"),
                                  [1, 2])
    finally:
        eng.close()


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_layered_push_writes_the_mamba_state_at_finish(p_tp, d_tp):
    eng = Engines(hybrid("prefill", p_tp), hybrid("decode", d_tp), replace(CFG, mode="push"))
    try:
        content = logical_content(eng.p.spec, 8, 32)
        p_ids, d_ids = [[1, 2], [NULL, 3]], [[4, 5], [NULL, 6]]
        for c in eng.p.caches.values():
            c.fill(content, p_ids)
        pre, dec = list(eng.p.engines.values()), list(eng.d.engines.values())
        host, port = dec[0].address
        target = TransferParams("decode", host, port, d_tp, ((4, 5), (NULL, 6)), "tok")
        for e in dec:
            e.expect("c", "prefill", p_tp, "tok", d_ids)
        for e in pre:
            e.push_start("c", p_ids, target)
            e.push_layers("c", [0])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(e.mode._pushes["c"].in_flight or
                                                  e.mode._pushes["c"].waiting for e in pre):
            for e in pre + dec:
                e.poll()
            time.sleep(0.001)
        # layer 0's attention arrived, the Mamba state (written at finish) not yet
        for c in eng.d.caches.values():
            assert c.verify(content.kv, [4, 5], 0, 32, layers=[0]) == 0
            assert not any(t[6].any() for t in c.regions)
        for e in pre:
            e.push_finish("c")
        eng.run("c")
        for c in eng.d.caches.values():
            assert c.verify(content, d_ids, 0, 32) == 0
    finally:
        eng.close()


# ----- sliding window: two groups sharing every region ---------------------------------
def _shared_ranks(role, spec, cfg, serve):
    """Ranks whose regions are each shared by a full-attention layer (entry 2j) and a
    sliding-window layer (entry 2j + 1), as vLLM's hybrid allocator shares tensors."""
    from kvbridge.handshake import new_incarnation
    from kvbridge.nixl import DecodeEngine, PrefillEngine
    from kvbridge.tools.synthetic_cache import SyntheticCache

    cls = PrefillEngine if role == "p" else DecodeEngine
    caches, engines = {}, {}
    inc = new_incarnation()
    for r in range(spec.tp_size):
        c = SyntheticCache.allocate(spec, r, NB)
        c.kv_caches = [t for t in c.kv_caches for _ in range(2)]
        caches[r] = c
        engines[r] = cls(spec, r, c.cache_regions(), cfg, incarnation=inc)
    server = None
    if serve:
        server = engines[0].serve()
        for e in list(engines.values())[1:]:
            e.serve(server)
    return LocalRanks(spec, caches, engines, server)


def sliding(engine_id, tp):
    from kvbridge.topology import CacheGroup, GroupKind

    groups = (CacheGroup(GroupKind.FULL, (0, 2), 16), CacheGroup(GroupKind.SLIDING, (1, 3), 16, 32))
    return EngineSpec(engine_id, tp, 2, 16, 2, 16, "bf16", groups=groups)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 1)])
def test_sliding_window_moves_only_blocks_inside_the_window(p_tp, d_tp, mode):
    from kvbridge.tools.synthetic_cache import logical_kv

    cfg = replace(CFG, mode=mode)
    eng = Engines.__new__(Engines)
    eng.cfg = cfg
    pspec, dspec = sliding("prefill", p_tp), sliding("decode", d_tp)
    eng.p = _shared_ranks("p", pspec, cfg, True)
    eng.d = _shared_ranks("d", dspec, cfg, mode == "push")
    try:
        full, window = logical_kv(pspec, 1, 80), logical_kv(pspec, 2, 80)
        p_full, p_slide = [1, 2, 3, 4, 5], [NULL, NULL, 6, 7, 8]
        d_full, d_slide = [1, 2, 3, 4, 5], [NULL, NULL, NULL, 9, 10]
        for c in eng.p.caches.values():
            c.fill(full, p_full)
            c.fill(window, p_slide[2:], first_token=32)
            for t in c.regions:
                t[NULL] = 0x11  # the prefill's null block: must never be read
        for c in eng.d.caches.values():
            for t in c.regions:
                t[NULL] = 0xA5
                t[6:9] = 0x3C  # decode blocks the request does not use
        eng.move("w", [p_full, p_slide], [d_full, d_slide], None, fill=False)
        for c in eng.d.caches.values():
            assert c.verify(full, d_full, 0, 80) == 0
            assert c.verify(window, [9, 10], 48, 80) == 0
            for t in c.regions:
                assert bool((t[NULL] == 0xA5).all()), "a null block was written"
                assert bool((t[6:9] == 0x3C).all()), "a block outside the request was written"
        # without the null block id, the window's pair (prefill 6, decode null) would move
        assert np.count_nonzero(full) > 0
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_group_moves_only_the_regions_holding_its_layers(mode):
    """Region 1 holds an attention layer only (no Mamba layer shares it): the Mamba group's
    state moves in region 0 alone, and region 1's page with the state page's id is left alone."""
    from kvbridge.handshake import new_incarnation
    from kvbridge.nixl import DecodeEngine, PrefillEngine
    from kvbridge.topology import CacheGroup, GroupKind

    groups = (CacheGroup(GroupKind.FULL, (0, 2), 16), CacheGroup(GroupKind.MAMBA, (1,), 16))
    cfg = replace(CFG, mode=mode)

    def ranks(role, spec, serve):
        cls = PrefillEngine if role == "p" else DecodeEngine
        inc, caches, engines = new_incarnation(), {}, {}
        for r in range(spec.tp_size):
            c = HybridCache.allocate(spec, r, NB)
            c.kv_caches = c.kv_caches[:3]  # attention 0 + Mamba 0 share region 0; attention 1
            caches[r], engines[r] = c, cls(spec, r, c.cache_regions(), cfg, incarnation=inc)
        server = engines[0].serve() if serve else None
        for e in list(engines.values())[1:]:
            if serve:
                e.serve(server)
        return LocalRanks(spec, caches, engines, server)

    pspec = replace(hybrid("prefill", 2), groups=groups)
    dspec = replace(hybrid("decode", 1), groups=groups)
    eng = Engines.__new__(Engines)
    eng.cfg = cfg
    eng.p, eng.d = ranks("p", pspec, True), ranks("d", dspec, mode == "push")
    try:
        assert [g.regions for g in eng.d.engines[0].groups] == [None, (0,)]
        content = logical_content(pspec, 9, 32)
        p_ids, d_ids = [[1, 2], [NULL, 3]], [[4, 5], [NULL, 6]]
        for c in eng.p.caches.values():
            c.fill(content, p_ids)
            c.regions[1][3] = 0x77  # prefill region 1 at the state page id: not state
        dc = eng.d.caches[0]
        dc.regions[1][6] = 0x3C
        eng.move("g", p_ids, d_ids, content, fill=False)
        from kvbridge.tools.synthetic_cache import SyntheticCache

        assert SyntheticCache.verify(dc, content.kv, [4, 5], 0, 32) == 0
        shard = dc.state_shard(content, 0)
        assert np.array_equal(dc.regions[0][6, :shard.size].numpy(), shard)
        assert bool((dc.regions[1][6] == 0x3C).all()), "the Mamba group wrote a region without Mamba"
    finally:
        eng.close()
