"""Worked examples for real deployment shapes, with the expected numbers derived by hand."""

from __future__ import annotations

import re

import pytest

from kvbridge.topology import (
    EngineSpec,
    Layout,
    MambaSpec,
    ReadOp,
    TopologyError,
    plan_rank,
    plan_transfer,
)

HB = 16 * 128 * 2  # one head over a 16-token block, head dim 128, bf16: 4096 bytes


def llama70b(engine_id: str, tp: int, **kw) -> EngineSpec:
    args = dict(num_kv_heads=8, head_dim=128, num_layers=80, block_size=16, dtype="bf16")
    args.update(kw)
    return EngineSpec(engine_id, tp_size=tp, **args)


def test_p8_to_d2_reads_four_ranks_each():
    plan = plan_transfer(llama70b("p", 8), llama70b("d", 2))
    assert plan.tp_ratio == -4
    d1 = plan.rank(1)
    assert d1.handshake_ranks == (4, 5, 6, 7)
    assert d1.notify_only_ranks == ()
    assert d1.reads == tuple(ReadOp(4 + i, 0, HB, i * HB) for i in range(4))
    assert [q.notifications_per_request for q in plan.prefill_ranks] == [1] * 8
    assert plan.prefill_ranks[5].consumer_ranks == (1,)
    # 80 layers x K and V regions x 4 reads
    assert plan.descriptors_per_block(0) == 80 * 2 * 4


def test_p2_to_d8_reads_one_head_at_an_offset():
    plan = plan_transfer(llama70b("p", 2), llama70b("d", 8))
    assert plan.tp_ratio == 4
    d5 = plan.rank(5)
    assert d5.handshake_ranks == (1,)
    assert d5.reads == (ReadOp(1, HB, HB, 0),)  # head 5 is the second head of P1 (heads 4..7)
    assert [q.notifications_per_request for q in plan.prefill_ranks] == [4, 4]
    assert plan.prefill_ranks[1].consumer_ranks == (4, 5, 6, 7)


def test_p16_to_d8_duplicate_heads_are_notified_not_read():
    plan = plan_transfer(llama70b("p", 16), llama70b("d", 8))
    assert plan.tp_ratio == -2
    for r in range(8):
        p = plan.rank(r)
        assert p.handshake_ranks == (2 * r, 2 * r + 1)
        assert p.reads == (ReadOp(2 * r, 0, HB, 0),)
        assert p.notify_only_ranks == (2 * r + 1,)
    assert all(q.notifications_per_request == 1 for q in plan.prefill_ranks)
    assert plan.prefill_ranks[3].notify_only_from == (1,)
    assert any("duplicate heads" in w for w in plan.warnings)


def test_mla_p8_to_d4_reads_first_source_only():
    mk = lambda i, tp: EngineSpec(i, tp_size=tp, num_kv_heads=1, head_dim=576, num_layers=61,
                                  block_size=64, dtype="fp8", use_mla=True)
    plan = plan_transfer(mk("p", 8), mk("d", 4))
    latent = 64 * 576 * 1
    for r in range(4):
        p = plan.rank(r)
        assert p.reads == (ReadOp(2 * r, 0, latent, 0),)
        assert p.notify_only_ranks == (2 * r + 1,)
    assert plan.decode_layout.regions == 61 and not plan.decode_layout.separate_kv_regions


def hybrid(engine_id: str, tp: int, kv_heads: int = 8) -> EngineSpec:
    return EngineSpec(
        engine_id, tp_size=tp, num_kv_heads=kv_heads, head_dim=128, num_layers=4, block_size=16,
        layout=Layout.BLOCKS_FIRST,
        mamba=MambaSpec(ssm_heads=64, ssm_head_dim=64, state_size=128, n_groups=8, conv_width=3),
    )


def test_mamba_hybrid_p4_to_d1():
    p = plan_rank(hybrid("d", 1), hybrid("p", 4), 0)
    m = p.mamba
    assert m.fa_source_ranks == (0, 1, 2, 3) and m.all_source_ranks == (0, 1, 2, 3)
    assert (m.num_fa_reads, m.num_mamba_reads) == (4, 4)
    assert m.fa_descriptor_bytes == 2 * HB  # the remote rank's 2 heads: min of both element sizes
    assert dict(m.fa_head_slots) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert m.needs_split_handles and m.fa_emptied_ranks == ()
    assert m.fa_rank_offset == 0
    # x of P2 (16 SSM heads x 64 dim x width 3 x 2 B) lands at the third quarter of local x
    x2 = next(x for x in m.mamba_pieces if x.name == "x" and x.remote_rank == 2)
    assert (x2.remote_offset, x2.length, x2.local_offset) == (0, 16 * 64 * 3 * 2, 2 * 16 * 64 * 3 * 2)
    # each source rank fills: one attention piece + x, B, C, SSM pieces
    assert all(len(fa) == 1 and len(mm) == 4 for _, fa, mm in m.local_split)


def test_mamba_hybrid_p1_to_d4():
    for r in range(4):
        p = plan_rank(hybrid("d", 4), hybrid("p", 1), r)
        m = p.mamba
        assert m.all_source_ranks == (0,) and (m.num_fa_reads, m.num_mamba_reads) == (1, 1)
        assert m.fa_rank_offset == r * 2 * HB
        assert m.fa_descriptor_bytes == 2 * HB
        assert not m.needs_split_handles
        ssm = next(x for x in m.mamba_pieces if x.name == "ssm")
        unit = 64 * 128 * 4
        assert ssm.length == 16 * unit


def test_mamba_hybrid_duplicate_fa_heads_read_for_mamba_only():
    p = plan_rank(hybrid("d", 1, kv_heads=2), hybrid("p", 4, kv_heads=2), 0)
    m = p.mamba
    assert m.fa_source_ranks == (0, 2)
    assert m.all_source_ranks == (0, 1, 2, 3)
    assert m.fa_emptied_ranks == (1, 3)
    assert m.remote_replicated and m.remote_physical_heads == 1
    assert p.notify_only_ranks == ()  # everyone is read, for Mamba at least


def test_non_divisible_tp_sizes_are_served_by_interval_reads():
    mk = lambda i, tp: EngineSpec(i, tp_size=tp, num_kv_heads=6, head_dim=64, num_layers=2, block_size=16)
    plan = plan_transfer(mk("p", 3), mk("d", 2))
    hb = 16 * 64 * 2
    assert plan.tp_ratio is None
    assert plan.rank(0).reads == (ReadOp(0, 0, 2 * hb, 0), ReadOp(1, 0, hb, 2 * hb))
    assert plan.rank(1).reads == (ReadOp(1, hb, hb, 0), ReadOp(2, 0, 2 * hb, hb))
    assert [q.notifications_per_request for q in plan.prefill_ranks] == [1, 2, 1]


def test_block_size_ratio_names_say_their_direction():
    bigger_decode = plan_transfer(llama70b("p", 1, block_size=16), llama70b("d", 1, block_size=64))
    bigger_prefill = plan_transfer(llama70b("p", 1, block_size=32), llama70b("d", 1, block_size=16))
    assert bigger_decode.block_size_ratio == 4
    assert bigger_prefill.block_size_ratio == 2  # larger / smaller, whichever side
    assert bigger_decode.decode_over_prefill_block_size == 4
    assert type(bigger_decode.decode_over_prefill_block_size) is int
    assert bigger_prefill.decode_over_prefill_block_size == 0.5
    assert not hasattr(bigger_prefill, "signed_block_size_ratio")


def test_block_size_mismatch_reads_in_units_of_the_smaller_block():
    plan = plan_transfer(llama70b("p", 1, block_size=16), llama70b("d", 1, block_size=64))
    assert plan.block_size_ratio == 4
    assert plan.rank(0).unit_tokens == 16
    assert plan.post_process.needed and plan.post_process.units_per_block == 4


def test_larger_prefill_hnd_blocks_with_several_heads_are_read_head_by_head():
    # kvbridge plan --prefill-tp 4 --decode-tp 2 --kv-heads 8 --prefill-block-size 32
    #               --decode-block-size 16: a P kernel block is [2 heads, 32 tokens, 128] and a
    # 16-token unit of one head is 4096 contiguous bytes, the heads 8192 bytes apart
    plan = plan_transfer(llama70b("p", 4, block_size=32), llama70b("d", 2, block_size=16))
    d1 = plan.rank(1)
    assert d1.unit_tokens == 16 and d1.reads_per_head
    assert d1.local_unit_bytes == 4 * HB and d1.remote_unit_bytes == 2 * HB
    assert d1.remote_unit_stride == HB  # unit u of a head is at + u * 4096
    assert d1.reads == (
        ReadOp(2, 0, HB, 0), ReadOp(2, 2 * HB, HB, HB),  # P2's heads 4 and 5
        ReadOp(3, 0, HB, 2 * HB), ReadOp(3, 2 * HB, HB, 3 * HB),  # P3's heads 6 and 7
    )
    assert plan.descriptors_per_block(1) == 80 * 2 * 4  # one decode block is one unit
    assert not plan.post_process.needed  # lands as [heads, 16 tokens, dim] already
    # D TP 1 from P TP 1, 32 -> 8 tokens: 8 heads each read on its own, 4 units per P block
    plan = plan_transfer(llama70b("p", 1, block_size=32), llama70b("d", 1, block_size=8))
    p0 = plan.rank(0)
    hb8 = HB // 2
    assert p0.remote_unit_stride == hb8 and p0.remote_unit_bytes == 8 * hb8
    assert p0.reads == tuple(ReadOp(0, h * 4 * hb8, hb8, h * hb8) for h in range(8))
    # NHD decode: the per-head units arrive HND and are rearranged on receive
    plan = plan_transfer(llama70b("p", 2, block_size=32),
                         llama70b("d", 2, block_size=16, head_order="NHD"))
    assert plan.post_process.needed and plan.post_process.units_per_block == 1
    # kernel splits: logical 32 on both sides, P kernel 32, D kernel 16
    plan = plan_transfer(llama70b("p", 2, block_size=32),
                         llama70b("d", 4, block_size=32, kernel_blocks_per_block=2))
    # D3 holds heads 6, 7 = positions 2, 3 of P1, whose heads span 32 tokens (2 * HB) each
    assert plan.rank(3).reads == (ReadOp(1, 4 * HB, HB, 0), ReadOp(1, 6 * HB, HB, HB))
    assert plan.rank(3).remote_unit_stride == HB


def test_other_block_size_shapes_keep_contiguous_units():
    for p, d in (
        (llama70b("p", 1, block_size=16), llama70b("d", 1, block_size=64)),  # local larger
        (llama70b("p", 8, block_size=32), llama70b("d", 8, block_size=16)),  # one head per P rank
        (llama70b("p", 2, block_size=32, head_order="NHD"),
         llama70b("d", 2, block_size=16, head_order="NHD")),  # NHD: units are token ranges
    ):
        for r in plan_transfer(p, d).decode_ranks:
            assert r.remote_unit_stride == r.remote_unit_bytes and not r.reads_per_head


@pytest.mark.parametrize(
    "prefill, decode, needle",
    [
        (dict(tp=3), dict(tp=1), "cannot be split evenly over TP 3"),
        (dict(tp=12), dict(tp=1), "not a multiple of it"),
        (dict(tp=2, block_size=24), dict(tp=2, block_size=16), "larger block size must be a multiple"),
        (dict(tp=2, head_order="NHD"), dict(tp=1), "set its KV cache layout to HND"),
        (dict(tp=1, num_kv_heads=4), dict(tp=1), "num_kv_heads differs"),
        (dict(tp=1, dtype="fp8"), dict(tp=1), "kv-cache dtype"),
    ],
)
def test_invalid_pairs_say_what_to_change(prefill, decode, needle):
    with pytest.raises(TopologyError, match=needle):
        pt, dt = prefill.pop("tp"), decode.pop("tp")
        plan_transfer(llama70b("p", pt, **prefill), llama70b("d", dt, **decode))


def test_mla_mismatch_and_mamba_mismatch_are_refused():
    mla = EngineSpec("p", tp_size=1, num_kv_heads=8, head_dim=128, num_layers=80, block_size=16,
                     use_mla=True)
    with pytest.raises(TopologyError, match="use_mla differs"):
        plan_transfer(mla, llama70b("d", 1))
    with pytest.raises(TopologyError, match="Mamba state differs"):
        plan_transfer(hybrid("p", 1), llama70b("d", 1, num_layers=4, layout=Layout.BLOCKS_FIRST))


def test_conv_state_split_needs_dim_first_layout():
    tok = MambaSpec(ssm_heads=64, ssm_head_dim=64, state_size=128, n_groups=8, conv_width=3,
                    conv_layout="token-first")
    mk = lambda i, tp: EngineSpec(i, tp_size=tp, num_kv_heads=8, head_dim=128, num_layers=4,
                                  block_size=16, layout="blocks-first", mamba=tok)
    with pytest.raises(TopologyError, match="dim-first"):
        plan_transfer(mk("p", 2), mk("d", 1))
    plan_transfer(mk("p", 2), mk("d", 2))  # same TP: no split, any layout works


def test_kernel_block_splits_plan_per_physical_block():
    # logical blocks of 8 tokens split into 2 kernel blocks of 4: each kernel block is
    # [heads, 4, dim], so head offsets are multiples of one head over 4 tokens
    mk = lambda i, tp: EngineSpec(i, tp_size=tp, num_kv_heads=4, head_dim=8, num_layers=1,
                                  block_size=8, kernel_blocks_per_block=2, dtype="fp32")
    plan = plan_transfer(mk("p", 1), mk("d", 2))
    hb = 4 * 8 * 4
    assert plan.rank(1).unit_tokens == 4
    assert plan.rank(1).reads == (ReadOp(0, 2 * hb, 2 * hb, 0),)
    assert plan.descriptors_per_block(1) == 2 * 2  # K and V regions x 2 kernel blocks
    with pytest.raises(TopologyError, match="kernel block sizes 6 and 4"):
        plan_transfer(mk("p", 1), EngineSpec("d", tp_size=1, num_kv_heads=4, head_dim=8, num_layers=1,
                                             block_size=24, kernel_blocks_per_block=4, dtype="fp32"))


# ----- the packed layout (vLLM >= 0.32: K and V of each head together) ------------------------

PHB = 2 * HB  # one head's K and V over a 16-token block: 8192 bytes


def packed70b(engine_id: str, tp: int, **kw) -> EngineSpec:
    return llama70b(engine_id, tp, layout=Layout.PACKED, **kw)


def test_packed_engine_sizes():
    s = packed70b("d", 2)
    kv = llama70b("d", 2)
    assert s.head_bytes == PHB and s.element_bytes == 4 * PHB
    assert s.region_block_bytes == s.computed_block_bytes == 4 * PHB == 2 * kv.region_block_bytes
    assert s.elements_per_block_region == 1 and s.regions_per_layer == 1
    assert not s.separate_kv_regions
    assert s.bytes_per_token == kv.bytes_per_token == 4 * 128 * 2 * 2 * 80  # K and V once each
    lay = plan_transfer(packed70b("p", 4), s).decode_layout
    assert lay.regions == 80 and lay.elements_per_block == 1 and lay.element_offsets == (0,)
    assert lay.element_roles[:2] == ((0, 2), (1, 2))
    # a measured, padded block is accepted like any other layout's
    padded = packed70b("d", 2, block_bytes=4 * PHB + 256)
    assert padded.element_bytes == 4 * PHB + 256


def test_packed_p4_to_d2_reads_two_whole_elements():
    plan = plan_transfer(packed70b("p", 4), packed70b("d", 2))
    assert plan.tp_ratio == -2
    assert plan.rank(1).handshake_ranks == (2, 3)
    # P2 holds heads 4-5, P3 heads 6-7: each whole packed element lands side by side
    assert plan.rank(1).reads == (ReadOp(2, 0, 2 * PHB, 0), ReadOp(3, 0, 2 * PHB, 2 * PHB))
    assert plan.rank(1).local_unit_bytes == 4 * PHB and plan.rank(1).remote_unit_bytes == 2 * PHB
    assert not plan.post_process.needed
    assert plan.descriptors_per_block(0) == 80 * 2  # one region per layer x 2 reads
    assert [q.notifications_per_request for q in plan.prefill_ranks] == [1] * 4


def test_packed_p2_to_d8_reads_one_head_slice():
    plan = plan_transfer(packed70b("p", 2), packed70b("d", 8))
    d5 = plan.rank(5)
    assert d5.handshake_ranks == (1,)
    assert d5.reads == (ReadOp(1, PHB, PHB, 0),)  # head 5 = the second of P1's heads 4..7
    assert plan.descriptors_per_block(5) == 80


def test_packed_duplicate_and_replicated_heads():
    # P16 -> D8 with 8 heads: P ranks 2r and 2r+1 both hold head r; read one, notify the other
    plan = plan_transfer(packed70b("p", 16), packed70b("d", 8))
    for r in range(8):
        assert plan.rank(r).reads == (ReadOp(2 * r, 0, PHB, 0),)
        assert plan.rank(r).notify_only_ranks == (2 * r + 1,)
    # P2 -> D16 (decode replicates): D ranks 2h and 2h+1 both read head h
    plan = plan_transfer(packed70b("p", 2), packed70b("d", 16))
    assert plan.rank(11).reads == (ReadOp(1, PHB, PHB, 0),)  # head 5
    assert not plan.post_process.needed


def test_packed_non_divisible_tp_reads_head_slices():
    mk = lambda i, tp: EngineSpec(i, tp_size=tp, num_kv_heads=6, head_dim=64, num_layers=2,
                                  block_size=16, layout="packed")
    plan = plan_transfer(mk("p", 3), mk("d", 2))
    hb = 2 * 16 * 64 * 2
    assert plan.rank(1).reads == (ReadOp(1, hb, hb, 0), ReadOp(2, 0, 2 * hb, hb))


def test_packed_kernel_split_with_equal_kernel_blocks():
    # decode logical blocks of 32 tokens made of two 16-token kernel blocks; prefill blocks of 16
    plan = plan_transfer(packed70b("p", 2), packed70b("d", 4, block_size=32, kernel_blocks_per_block=2))
    assert plan.block_size_ratio == 2 and plan.rank(0).unit_tokens == 16
    assert plan.rank(3).reads == (ReadOp(1, 2 * PHB, 2 * PHB, 0),)
    assert plan.descriptors_per_block(3) == 80 * 2  # 2 kernel blocks per decode block
    pp = plan.post_process
    assert not pp.needed and pp.units_per_block == 1


@pytest.mark.parametrize(
    "prefill, decode, needle",
    [
        (dict(tp=2), dict(tp=2, layout=Layout.KV_FIRST), "cache layouts kv-first and packed cannot be paired"),
        (dict(tp=2, layout=Layout.BLOCKS_FIRST), dict(tp=2), "cache layouts packed and blocks-first cannot be paired"),
        (dict(tp=2), dict(tp=2, head_order="NHD"), "same head order"),
        (dict(tp=2, block_size=32), dict(tp=2), "equal kernel (physical) block sizes"),
        (dict(tp=1, block_size=32, kernel_blocks_per_block=2), dict(tp=1, block_size=32),
         "got 32 and 16 tokens"),
        (dict(tp=4, head_order="NHD"), dict(tp=2, head_order="NHD"), "set both engines' KV cache"),
    ],
)
def test_packed_pairs_that_are_refused(prefill, decode, needle):
    pt, dt = prefill.pop("tp"), decode.pop("tp")
    prefill.setdefault("layout", Layout.PACKED)
    decode.setdefault("layout", Layout.PACKED)
    with pytest.raises(TopologyError, match=re.escape(needle)):
        plan_transfer(llama70b("p", pt, **prefill), llama70b("d", dt, **decode))


def test_packed_nhd_is_served_when_no_head_is_split():
    plan = plan_transfer(packed70b("p", 2, head_order="NHD"), packed70b("d", 2, head_order="NHD"))
    assert plan.rank(1).reads == (ReadOp(1, 0, 4 * PHB, 0),) and not plan.post_process.needed
