"""Hybrid attention + Mamba-2 models in the packed layout, shaped as vLLM 0.32 (CPU) hands a
GraniteMoeHybrid its caches: one page of 65536 bytes per block, viewed by an attention layer
as fp32 ``[blocks, 2 heads, 128 tokens, 2 x 32]`` (HND) and by a Mamba layer as its conv
state (3 x 288 fp32) followed by its SSM state (8 x 32 x 16 fp32)."""

from __future__ import annotations

import pytest

from kvbridge.topology import (
    KIND_KV,
    ConvLayout,
    EngineSpec,
    MambaSpec,
    ReadOp,
    TopologyError,
    element_layout,
    mamba_state_bytes,
    mamba_state_layout,
    plan_rank,
)

HEAD = 128 * 2 * 32 * 4  # one head's K and V over a block: 32768 bytes


def granite(engine_id="p", tp=1, order="HND", conv=ConvLayout.DIM_FIRST, kv_heads=2):
    m = MambaSpec(ssm_heads=8, ssm_head_dim=32, state_size=16, n_groups=1, conv_width=3,
                  conv_dtype_size=4, ssm_dtype_size=4, conv_layout=conv)
    return EngineSpec(engine_id, tp, kv_heads, 32, 2, 128, "fp32", layout="packed",
                      head_order=order, mamba=m)


def test_granite_page_holds_one_packed_element_or_the_mamba_state():
    s = granite()
    assert s.computed_block_bytes == s.element_bytes == 2 * HEAD == 65536
    assert mamba_state_bytes(s) == 3 * 288 * 4 + 8 * 32 * 16 * 4 == 19840
    lay = element_layout(s)
    assert lay.elements_per_block == 1 and lay.element_offsets == (0,)
    assert lay.element_roles == ((0, KIND_KV), (1, KIND_KV))
    # TP 2: one head per rank; the state shards x and SSM by SSM head, B and C replicated
    s2 = granite(tp=2)
    assert s2.element_bytes == HEAD
    lay2 = mamba_state_layout(s2)
    assert lay2["B"][2] == 4 * 32 * 3 * 4 and lay2["ssm"][2] == (4 * 32 + 2 * 16) * 3 * 4


def test_p2_to_d1_reads_each_head_into_its_slot_of_the_packed_element():
    plan = plan_rank(granite("d"), granite("p", tp=2), 0)
    assert plan.reads == (ReadOp(0, 0, HEAD, 0), ReadOp(1, 0, HEAD, HEAD))
    m = plan.mamba
    assert m.fa_descriptor_bytes == HEAD and m.fa_head_slots == ((0, 0), (1, 1))
    assert m.all_source_ranks == (0, 1) and m.fa_emptied_ranks == ()
    # x of SSM heads 4..7 (4 x 32 channels x 3 columns x 4 bytes) comes from rank 1 to the
    # second half of the local x, and the SSM state of those heads after B and C
    x1 = [p for p in m.mamba_pieces if p.name == "x" and p.remote_rank == 1]
    assert [(p.remote_offset, p.length, p.local_offset) for p in x1] == [(0, 1536, 1536)]
    ssm1 = [p for p in m.mamba_pieces if p.name == "ssm" and p.remote_rank == 1]
    assert [(p.remote_offset, p.length, p.local_offset) for p in ssm1] == [
        (1536 + 2 * 192, 4 * 32 * 16 * 4, 3456 + 4 * 32 * 16 * 4)]


def test_p1_to_d2_reads_its_head_from_the_middle_of_the_packed_element():
    plan = plan_rank(granite("d", tp=2), granite("p"), 1)
    assert plan.reads == (ReadOp(0, HEAD, HEAD, 0),)
    assert plan.mamba.fa_rank_offset == HEAD and plan.mamba.fa_descriptor_bytes == HEAD
    assert plan.mamba.fa_head_slots == ((0, 0),)


def test_equal_tp_reads_whole_elements_whatever_the_head_order():
    for order in ("HND", "NHD"):
        plan = plan_rank(granite("d", tp=2, order=order), granite("p", tp=2, order=order), 1)
        assert plan.reads == (ReadOp(1, 0, HEAD, 0),)
        assert plan.mamba.fa_descriptor_bytes == HEAD


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_nhd_packed_hybrids_cannot_be_split_by_head(p_tp, d_tp):
    with pytest.raises(TopologyError, match=r"HND \(vLLM's LBHNC layout"):
        plan_rank(granite("d", tp=d_tp, order="NHD"), granite("p", tp=p_tp, order="NHD"), 0)
    # one KV head: replicated on both prefill ranks, nothing is split, NHD is fine
    plan = plan_rank(granite("d", order="NHD", kv_heads=1), granite("p", tp=2, order="NHD",
                                                                    kv_heads=1), 0)
    assert plan.reads == (ReadOp(0, 0, HEAD, 0),)


def test_token_first_conv_state_moves_only_between_equal_tp():
    tok = ConvLayout.TOKEN_FIRST
    plan = plan_rank(granite("d", tp=2, conv=tok), granite("p", tp=2, conv=tok), 0)
    assert {p.name for p in plan.mamba.mamba_pieces} == {"x", "B", "C", "ssm"}
    with pytest.raises(TopologyError, match="dim-first"):
        plan_rank(granite("d", conv=tok), granite("p", tp=2, conv=tok), 0)


def test_kv_first_hybrids_are_refused_naming_the_layouts_that_work():
    m = granite().mamba
    with pytest.raises(TopologyError, match="blocks-first or packed"):
        EngineSpec("e", 1, 2, 32, 2, 128, "fp32", layout="kv-first", mamba=m)
