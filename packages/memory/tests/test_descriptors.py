"""Descriptor rows and request indices against straightforward references."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.memory import MemoryLayoutError, RegionGeometry, kernel_spec, rank_descriptors
from kvbridge.memory.descriptors import expand_strided
from kvbridge.topology import (
    EngineSpec,
    HeadOrder,
    Layout,
    block_size_ratio,
    kernel_block_ids,
    plan_rank,
)


def spec(eid, tp, bs, n=1, order=HeadOrder.HND, K=8, layers=3):
    return EngineSpec(engine_id=eid, tp_size=tp, num_kv_heads=K, head_dim=4, num_layers=layers,
                      block_size=bs, kernel_blocks_per_block=n, head_order=order)


def geo(s: EngineSpec, nb: int, base: int) -> RegionGeometry:
    lay_regions = 2 * s.num_layers
    blen = kernel_spec(s).region_block_bytes * s.kernel_blocks_per_block
    addrs = [base + i * nb * blen for i in range(lay_regions)]
    return RegionGeometry.from_remote(s, addrs, nb, blen, device_id=3, mem_type="DRAM")


def test_strided_rows_expand_to_the_flat_list_region_major_block_minor():
    loc, rem = spec("d", 2, 16), spec("p", 8, 16)
    lg, rg = geo(loc, 50, 1 << 20), geo(rem, 70, 1 << 30)
    plan = plan_rank(loc, rem, 1)
    for q in plan.source_ranks:
        rd = rank_descriptors(plan, q, lg, rg)
        rows = rd.remote_descs(strided=True)
        assert rows.shape == (6, 5)  # O(regions): 3 layers x K/V x 1 read
        flat = rd.remote_descs()
        assert flat.shape == (6 * 70, 3) and flat.dtype == np.uint64
        assert (flat == expand_strided(rows)).all()
        # descriptor i*num_blocks + b is block b of region i
        i, b = 4, 33
        assert int(flat[i * 70 + b, 0]) == rg.base_addrs[i] + b * rg.block_strides[i]
        local = rd.local_descs()
        read = plan.reads_from(q)[0]
        assert int(local[i * 50 + b, 0]) == lg.base_addrs[i] + b * lg.block_strides[i] + read.local_offset
        assert (local[:, 1] == read.length).all() and (local[:, 2] == 3).all()


def _match_units(local_ids, remote_ids, local_block_size, remote_block_size):
    """Reference pairing: (local block, local unit, remote block, remote unit) in token order.

    The blocks of both sides hold the same tokens in order; a block of the larger
    size is ``ratio`` consecutive units. Units past the end of the shorter list
    are left out.
    """
    ratio = block_size_ratio(local_block_size, remote_block_size)
    lu = ratio if local_block_size > remote_block_size else 1
    ru = ratio if remote_block_size > local_block_size else 1
    n = min(len(local_ids) * lu, len(remote_ids) * ru)
    return [(local_ids[g // lu], g % lu, remote_ids[g // ru], g % ru) for g in range(n)]


def _reference_indices(rd, lg, rg, plan, q, lids, rids, skip):
    """Per-unit Python reference built on a unit-by-unit token-order pairing."""
    lk = kernel_block_ids(list(lids), lg.kernel_blocks_per_block)
    rk = kernel_block_ids(list(rids), rg.kernel_blocks_per_block)
    # local ids start `skip` logical blocks into the prompt: pad with placeholders
    pad = skip * lg.kernel_blocks_per_block
    matches = _match_units([-1] * pad + lk, rk, lg.kernel_block_tokens, rg.kernel_block_tokens)
    matches = [m for m in matches if m[0] >= 0]
    keys = rd.attn_keys
    out = set()
    for key in range(keys):
        for l_block, l_unit, r_block, r_unit in matches:
            li = (key * rd.local_units + l_unit) * lg.num_kernel_blocks + l_block
            ri = (key * rd.remote_units + r_unit) * rg.num_kernel_blocks + r_block
            out.add((li, ri))
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([(2, 8), (8, 2), (4, 4), (1, 8)]),
    st.sampled_from([(16, 16), (16, 32), (32, 16), (16, 64)]),
    st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]),
    st.integers(1, 200),
    st.integers(0, 4),
    st.integers(0, 2**16),
)
def test_indices_match_the_unit_pairing_reference(tps, sizes, kernels, tokens, skip, seed):
    d_tp, p_tp = tps
    d_bs, p_bs = sizes
    loc = spec("d", d_tp, d_bs, kernels[0], order=HeadOrder.NHD if d_bs > p_bs else HeadOrder.HND)
    rem = spec("p", p_tp, p_bs, kernels[1], order=HeadOrder.NHD if p_bs > d_bs else HeadOrder.HND)
    try:
        plan = plan_rank(kernel_spec(loc), kernel_spec(rem), 0)
    except ValueError:
        return
    rng = np.random.default_rng(seed)
    nl, nr = -(-tokens // d_bs), -(-tokens // p_bs)
    skip = min(skip, nl)
    lg, rg = geo(loc, nl + 5, 1 << 20), geo(rem, nr + 5, 1 << 32)
    lids = rng.permutation(nl + 5)[skip:nl]
    rids = rng.permutation(nr + 5)[:nr]
    for q in plan.source_ranks:
        rd = rank_descriptors(plan, q, lg, rg)
        li, ri = rd.indices(lids, rids, local_skip_blocks=skip)
        assert li.dtype == np.int32 and ri.dtype == np.int32
        got = set(zip(li.tolist(), ri.tolist(), strict=True))
        assert len(got) == len(li)
        assert got == _reference_indices(rd, lg, rg, plan, q, lids, rids, skip)


def test_consecutive_blocks_give_consecutive_indices():
    loc, rem = spec("d", 2, 16), spec("p", 2, 16)
    lg, rg = geo(loc, 100, 1 << 20), geo(rem, 100, 1 << 32)
    plan = plan_rank(loc, rem, 0)
    rd = rank_descriptors(plan, 0, lg, rg)
    li, ri = rd.indices(range(10, 20), range(40, 50))
    assert (np.diff(li.reshape(6, 10), axis=1) == 1).all()
    assert (np.diff(ri.reshape(6, 10), axis=1) == 1).all()
    assert li[0] == 10 and ri[0] == 40 and li[10] == 110


def test_prefix_hit_default_follows_the_vllm_convention():
    loc, rem = spec("d", 2, 16), spec("p", 2, 16)
    lg, rg = geo(loc, 100, 1 << 20), geo(rem, 100, 1 << 32)
    rd = rank_descriptors(plan_rank(loc, rem, 0), 0, lg, rg)
    li, ri = rd.indices([7, 8], [1, 2, 3, 4])  # two blocks already computed locally
    assert li[:2].tolist() == [7, 8] and ri[:2].tolist() == [3, 4]


def test_plans_on_logical_and_kernel_specs_agree():
    # topology plans transfer units on physical (kernel) blocks, so a plan made on
    # the logical specs gives exactly the descriptors of one made on kernel_spec()
    loc, rem = spec("d", 2, 32, n=2), spec("p", 2, 32, n=2)
    lg, rg = geo(loc, 10, 1 << 20), geo(rem, 10, 1 << 32)
    a = rank_descriptors(plan_rank(loc, rem, 0), 0, lg, rg)
    b = rank_descriptors(plan_rank(kernel_spec(loc), kernel_spec(rem), 0), 0, lg, rg)
    for strided in (False, True):
        assert np.array_equal(a.remote_descs(strided=strided), b.remote_descs(strided=strided))
        assert np.array_equal(a.local_descs(strided=strided), b.local_descs(strided=strided))


def test_bad_ids_and_peers_are_refused():
    loc, rem = spec("d", 2, 16), spec("p", 4, 16)
    lg, rg = geo(loc, 10, 1 << 20), geo(rem, 10, 1 << 32)
    plan = plan_rank(loc, rem, 0)
    with pytest.raises(MemoryLayoutError, match="not a peer"):
        rank_descriptors(plan, 3, lg, rg)
    rd = rank_descriptors(plan, 0, lg, rg)
    with pytest.raises(MemoryLayoutError, match="outside"):
        rd.indices([10], [0])
    with pytest.raises(MemoryLayoutError, match="group"):
        rd.indices([1], [1], group="ssm")
    with pytest.raises(MemoryLayoutError, match="no Mamba state"):
        rd.indices([1], [1], group="mamba")
    other = spec("p", 4, 16, layers=2)
    with pytest.raises(MemoryLayoutError, match="must describe the same layers"):
        rank_descriptors(plan, 0, lg, geo(other, 10, 1 << 32))
    # elements whose roles are unknown cannot pair across different layouts
    bfs = replace(spec("p", 4, 16), layout=Layout.BLOCKS_FIRST)
    blen = bfs.region_block_bytes
    bf = RegionGeometry.from_remote(bfs, [(1 << 32) + i * 10 * blen for i in range(3)], 10, blen)
    assert len(rank_descriptors(plan, 0, lg, bf).remote_rows) > 0  # roles known: pairs
    with pytest.raises(MemoryLayoutError, match="same KV-cache layout"):
        rank_descriptors(plan, 0, lg, replace(bf, element_roles=()))


def test_larger_remote_hnd_blocks_are_read_per_head_at_the_unit_stride():
    # P: TP 2, 4 heads per rank, 32-token blocks [4, 32, 4] bf16; D: TP 4, 2 heads, 16 tokens.
    # Unit u (16 tokens) of P head h sits at h * 32 rows + u * 16 rows of the P element.
    loc, rem = spec("d", 4, 16), spec("p", 2, 32)
    row = 4 * 2  # head_dim 4 x bf16
    lg, rg = geo(loc, 10, 1 << 20), geo(rem, 6, 1 << 32)
    plan = plan_rank(loc, rem, 1)  # heads 2 and 3 = positions 2, 3 of P0
    assert plan.remote_unit_stride == 16 * row and plan.reads_per_head
    rd = rank_descriptors(plan, 0, lg, rg)
    assert (rd.local_units, rd.remote_units) == (1, 2)
    rows = rd.remote_descs(strided=True)
    assert len(rows) == 6 * 2 * 2  # regions x reads (one per head) x units
    got = rows[:4, 0].astype(np.int64) - rg.base_addrs[0]
    # (head 2, unit 0), (head 2, unit 1), (head 3, unit 0), (head 3, unit 1)
    assert got.tolist() == [2 * 32 * row, 2 * 32 * row + 16 * row, 3 * 32 * row, 3 * 32 * row + 16 * row]
    assert (rows[:, 1] == 16 * row).all()
    local = rd.local_descs(strided=True)
    assert (local[:2, 0].astype(np.int64) - lg.base_addrs[0]).tolist() == [0, 16 * row]
    # decode block b (tokens 16b..16b+15) pairs with unit b % 2 of P block b // 2
    li, ri = rd.indices([7, 3, 5], [4, 1])
    flat_r = rd.remote_descs()
    flat_l = rd.local_descs()
    first = [(int(flat_l[i, 0]) - lg.base_addrs[0], int(flat_r[j, 0]) - rg.base_addrs[0])
             for i, j in zip(li[:3].tolist(), ri[:3].tolist(), strict=True)]
    blen_l, blen_r = lg.block_strides[0], rg.block_strides[0]
    assert sorted(first) == sorted([
        (7 * blen_l, 4 * blen_r + 2 * 32 * row),
        (3 * blen_l, 4 * blen_r + 2 * 32 * row + 16 * row),
        (5 * blen_l, 1 * blen_r + 2 * 32 * row),
    ])


def test_a_stride_that_leaves_the_remote_element_is_refused():
    loc, rem = spec("d", 4, 16), spec("p", 2, 32)
    lg, rg = geo(loc, 10, 1 << 20), geo(rem, 6, 1 << 32)
    plan = plan_rank(loc, rem, 1)
    bad = replace(plan, remote_unit_stride=plan.remote_unit_bytes)
    with pytest.raises(MemoryLayoutError, match="plan does not match this cache"):
        rank_descriptors(bad, 0, lg, rg)


@pytest.mark.parametrize("loc_tp,rem_tp,rem_bs", [(1, 2, 16), (2, 1, 8), (2, 2, 32)])
def test_layer_selection_splits_a_request_into_its_layers(loc_tp, rem_tp, rem_bs):
    """Each layer's indices touch that layer's regions only, and the layers together are
    exactly the whole request's indices (as a set; the order within a layer is kept)."""
    loc, rem = spec("d", loc_tp, 16, layers=3), spec("p", rem_tp, rem_bs, layers=3)
    lg, rg = geo(loc, 40, 1 << 20), geo(rem, 60, 1 << 30)
    plan = plan_rank(loc, rem, 0)
    lids, rids = [3, 9, 4], list(range(5, 5 + 3 * 16 // rem_bs))
    for q in plan.source_ranks:
        rd = rank_descriptors(plan, q, lg, rg)
        li, ri = rd.indices(lids, rids)
        per_layer = [rd.indices(lids, rids, layers=[layer]) for layer in range(3)]
        pairs = {(int(a), int(b)) for a, b in zip(li, ri, strict=True)}
        got = [{(int(a), int(b)) for a, b in zip(*p, strict=True)} for p in per_layer]
        assert set().union(*got) == pairs and sum(map(len, got)) == len(pairs)
        local = rd.local_descs()
        for layer, (lsel, _) in enumerate(per_layer):
            assert len(lsel) > 0
            # kv-first: regions 2*layer (K) and 2*layer+1 (V) of the local cache
            lo, hi = lg.base_addrs[2 * layer], lg.base_addrs[2 * layer + 1] + 40 * lg.block_strides[0]
            addrs = local[lsel, 0]
            assert ((addrs >= lo) & (addrs < hi)).all()
        both = rd.indices(lids, rids, layers=[0, 2])
        assert len(both[0]) == len(per_layer[0][0]) + len(per_layer[2][0])


def test_layer_selection_needs_known_roles():
    loc, rem = spec("d", 1, 16), spec("p", 1, 16)
    lg = replace(geo(loc, 10, 1 << 20), element_roles=())
    plan = plan_rank(loc, rem, 0)
    rd = rank_descriptors(plan, 0, lg, geo(rem, 10, 1 << 30))
    with pytest.raises(MemoryLayoutError, match="cannot select single layers"):
        rd.indices([1], [1], layers=[0])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 60), st.integers(0, 70), st.integers(0, 8), st.integers(0, 2**16))
def test_same_block_fast_path_equals_the_general_pairing_in_order(n_local, n_remote, skip, seed):
    """Equal blocks, no kernel split, one unit per block: the fast path returns exactly the
    arrays (same order) the general unit pairing does."""
    loc, rem = spec("d", 2, 16), spec("p", 2, 16)
    lg, rg = geo(loc, 80, 1 << 20), geo(rem, 80, 1 << 32)
    rd = rank_descriptors(plan_rank(loc, rem, 0), 0, lg, rg)
    rng = np.random.default_rng(seed)
    lids, rids = rng.permutation(80)[:n_local], rng.permutation(80)[:n_remote]
    fast = rd.indices(lids, rids, local_skip_blocks=skip)
    general = rd._unit_indices(lids.astype(np.int64), rids.astype(np.int64), skip)
    for a, b in zip(fast, general, strict=True):
        assert a.dtype == b.dtype == np.int32
        assert a.tolist() == b.tolist()


@pytest.mark.parametrize("loc_tp,rem_tp,rem_bs", [(1, 2, 16), (2, 1, 8)])
def test_region_selection_keeps_the_descriptors_of_those_regions(loc_tp, rem_tp, rem_bs):
    """``regions=`` (a KV-cache group's regions) keeps exactly the descriptors whose local
    address lies in those regions, and all regions together are the whole request."""
    loc, rem = spec("d", loc_tp, 16, layers=2), spec("p", rem_tp, rem_bs, layers=2)
    lg, rg = geo(loc, 20, 1 << 20), geo(rem, 30, 1 << 30)
    plan = plan_rank(loc, rem, 0)
    lids, rids = [3, 9], list(range(5, 5 + 2 * 16 // rem_bs))
    for q in plan.source_ranks:
        rd = rank_descriptors(plan, q, lg, rg)
        li, _ = rd.indices(lids, rids)
        local = rd.local_descs()
        total = 0
        for region in range(lg.num_regions):
            lsel, rsel = rd.indices(lids, rids, regions=[region])
            assert len(lsel) == len(rsel) > 0
            lo = lg.base_addrs[region]
            addrs = local[lsel, 0]
            assert ((addrs >= lo) & (addrs < lo + 20 * lg.block_strides[region])).all()
            total += len(lsel)
        assert total == len(li)
        assert len(rd.indices(lids, rids, regions=[])[0]) == 0
