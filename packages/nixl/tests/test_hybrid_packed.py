"""Hybrid attention + Mamba-2 caches in vLLM 0.32's packed layout through the engine, with
real NIXL agents (UCX, host memory) and real ZMQ: one page per block, viewed by an attention
layer as fp32 ``[blocks, heads, tokens, 2 * head_dim]`` (HND) and by a Mamba layer as its conv
state followed by its SSM state. Every byte is checked, each head is checked in its slot of
the vLLM-shaped view, and pages the request does not own are checked untouched."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from test_hybrid import CFG, NULL, Engines

from kvbridge.tools.hybrid_cache import HybridCache, logical_content, with_hybrid_groups
from kvbridge.topology import EngineSpec, MambaSpec, TopologyError, mamba_state_bytes

pytestmark = pytest.mark.timeout(120)

#: Granite-4.0-H's cache shape scaled down: conv state (width 3, dim 4 x 8 + 2 x 8) and SSM
#: state (4, 8, 8) in fp32, smaller than one block's packed K+V, as in the real model
MAMBA = MambaSpec(ssm_heads=4, ssm_head_dim=8, state_size=8, n_groups=1, conv_width=3,
                  conv_dtype_size=4, ssm_dtype_size=4)


def packed(engine_id: str, tp: int, kv_heads: int = 2, order: str = "HND",
           block: int = 16, head_dim: int = 8, mamba: MambaSpec = MAMBA) -> EngineSpec:
    return with_hybrid_groups(EngineSpec(engine_id, tp, kv_heads, head_dim, 2, block, "fp32",
                                         layout="packed", head_order=order, mamba=mamba))


def _views(cache: HybridCache) -> list[torch.Tensor]:
    """The attention layers' vLLM-shaped fp32 views ``[blocks, heads, tokens, 2 * head_dim]``."""
    return [t for t in cache.kv_caches if isinstance(t, torch.Tensor)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of fp32 tensors (random bytes include NaNs)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


TP_PAIRS = [(2, 1), (1, 2), (2, 2), (1, 1)]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("p_tp,d_tp", TP_PAIRS, ids=[f"P{p}-D{d}" for p, d in TP_PAIRS])
def test_packed_hybrid_moves_every_head_to_its_slot_and_the_state_to_offset_0(p_tp, d_tp, mode):
    eng = Engines(packed("prefill", p_tp), packed("decode", d_tp), replace(CFG, mode=mode))
    try:
        spec = eng.d.spec
        assert spec.element_bytes * spec.tp_size == 2 * 16 * 2 * 8 * 4
        state = mamba_state_bytes(spec)
        assert state < spec.region_block_bytes  # the attention element fills the page
        content = logical_content(eng.p.spec, 11, 40)  # a partial last block
        p_ids = [[4, 2, 7], [NULL, NULL, 9]]
        d_ids = [[3, 8, 5], [NULL, NULL, 11]]
        for c in eng.p.caches.values():
            for t in c.regions:  # prefill pages outside the request: must never be read
                t[[1, 3, 10]] = 0xEE
        for c in eng.d.caches.values():
            for t in c.regions:
                t[NULL] = 0xA5
                t[[1, 6, 10]] = 0x5A
                t[11] = 0x3C  # the state page: only the state shard's bytes may change
        eng.move("a", p_ids, d_ids, content)
        for c in eng.d.caches.values():
            assert c.verify(content, d_ids, 0, 40) == 0
            for t in c.regions:
                assert bool((t[NULL] == 0xA5).all()) and bool((t[[1, 6, 10]] == 0x5A).all())
                # the Mamba group wrote the state at page offset 0 and nothing past it
                assert bool((t[11, state:] == 0x3C).all()), "attention bytes in the state page"
                assert not bool((t[11, :state] == 0x3C).all())
        # each head sits in its slot of the vLLM-shaped view: decode head h of block 3 is the
        # prefill's head h of block 4, whichever rank holds it
        src = [(q, i) for q in range(p_tp) for i in range(eng.p.spec.heads_per_rank)]
        for r, c in eng.d.caches.items():
            for j in range(spec.heads_per_rank):
                q, i = src[r * spec.heads_per_rank + j]
                for got, want in zip(_views(c), _views(eng.p.caches[q]), strict=True):
                    assert _same(got[3, j], want[4, i])
        # a swapped pair of heads would show (the check can fail)
        if spec.heads_per_rank == 2:
            c = eng.d.caches[0]
            v = _views(c)[0]
            v[3] = v[3].flip(0).clone()
            assert c.verify(content, d_ids, 0, 40) > 0
    finally:
        eng.close()


def test_granite_pages_move_p2_to_d1_as_vllm_shapes_them():
    """The real GraniteMoeHybrid page: 65536 bytes = fp32 [2 heads, 128 tokens, 64] or the conv
    state (3 x 288 fp32) then the SSM state (8 x 32 x 16 fp32), 19840 bytes."""
    granite = MambaSpec(ssm_heads=8, ssm_head_dim=32, state_size=16, n_groups=1, conv_width=3,
                        conv_dtype_size=4, ssm_dtype_size=4)
    pspec = packed("prefill", 2, block=128, head_dim=32, mamba=granite)
    dspec = packed("decode", 1, block=128, head_dim=32, mamba=granite)
    eng = Engines(pspec, dspec, replace(CFG, mode="pull"))
    try:
        dc = eng.d.caches[0]
        assert dc.regions[0].shape[1] == 65536 and _views(dc)[0].shape[1:] == (2, 128, 64)
        assert [tuple(s.shape[1:]) for s in dc.kv_caches[1]] == [(3456,), (16384,)]
        content = logical_content(pspec, 3, 200)
        p_ids, d_ids = [[5, 2], [NULL, 7]], [[1, 6], [NULL, 9]]
        for t in dc.regions:
            t[9] = 0x3C
        eng.move("g", p_ids, d_ids, content)
        assert dc.verify(content, d_ids, 0, 200) == 0
        for t in dc.regions:
            assert bool((t[9, 19840:] == 0x3C).all())
        p1 = eng.p.caches[1]
        assert _same(_views(dc)[1][1, 1], _views(p1)[1][5, 0])  # block 1 <- 5
        # prefill rank 1's SSM heads 4..7 land in the second half of the decode SSM state
        ssm = dc.kv_caches[1][1][9].view(torch.float32).view(8, 32, 16)
        theirs = eng.p.caches[1].kv_caches[1][1][7].view(torch.float32).view(4, 32, 16)
        assert _same(ssm[4:], theirs)
    finally:
        eng.close()


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_nhd_packed_hybrids_split_by_head_are_refused(p_tp, d_tp):
    eng = Engines(packed("prefill", p_tp, order="NHD"), packed("decode", d_tp, order="NHD"),
                  replace(CFG, mode="pull"))
    try:
        with pytest.raises(TopologyError, match=r"HND \(vLLM's LBHNC layout"):
            eng.d.engines[0].plan_for(eng.p.spec)
    finally:
        eng.close()


def test_nhd_packed_hybrids_move_between_equal_tp():
    eng = Engines(packed("prefill", 2, order="NHD"), packed("decode", 2, order="NHD"),
                  replace(CFG, mode="push"))
    try:
        content = logical_content(eng.p.spec, 4, 32)
        p_ids, d_ids = [[1, 2], [NULL, 3]], [[4, 5], [NULL, 6]]
        eng.move("n", p_ids, d_ids, content)
        for c in eng.d.caches.values():
            assert c.verify(content, d_ids, 0, 32) == 0
            assert np.count_nonzero(c.regions[0][6].numpy()) > 0
    finally:
        eng.close()
