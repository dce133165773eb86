"""The proof: descriptors + post-processing reproduce every decode rank's shard byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from oracle import Case, run_case

import kvbridge.memory.descriptors as descriptors
from kvbridge.memory import kernel_spec
from kvbridge.topology import HeadOrder, Layout, MambaSpec, TopologyError, plan_transfer

H, N = HeadOrder.HND, HeadOrder.NHD
P = Layout.PACKED


def _mamba(**kw) -> MambaSpec:
    base = dict(ssm_heads=8, ssm_head_dim=2, state_size=2, n_groups=2, conv_width=2,
                conv_dtype_size=4)
    base.update(kw)
    return MambaSpec(**base)


PINNED = {
    "tp8_to_tp2": Case(K=8, p_tp=8, d_tp=2),
    "tp2_to_tp8": Case(K=8, p_tp=2, d_tp=8, strided=True),
    "equal_tp_blocks_first": Case(K=4, p_tp=4, d_tp=4, layout=Layout.BLOCKS_FIRST),
    "duplicate_remote_heads": Case(K=2, p_tp=8, d_tp=2),
    "duplicate_remote_heads_to_tp1": Case(K=2, p_tp=8, d_tp=1, strided=True),
    "replicated_both": Case(K=2, p_tp=4, d_tp=8),
    "larger_local_blocks_hnd": Case(K=4, p_tp=2, d_tp=2, p_block=4, d_block=8),
    "larger_local_blocks_split_to_nhd": Case(K=4, p_tp=4, d_tp=2, p_block=2, d_block=8, d_order=N),
    "hnd_to_nhd": Case(K=8, p_tp=2, d_tp=4, d_order=N, layout=Layout.BLOCKS_FIRST),
    "nhd_to_hnd": Case(K=4, p_tp=2, d_tp=2, p_order=N, d_order=H),
    "nhd_small_blocks_to_hnd_large": Case(K=4, p_tp=2, d_tp=2, p_order=N, d_order=H, p_block=2,
                                          d_block=8, tokens=21),
    "larger_remote_blocks_nhd": Case(K=4, p_tp=2, d_tp=2, p_block=8, d_block=4, p_order=N,
                                     d_order=N),
    # larger prefill (kernel) blocks holding several heads in HND: read head by head
    "larger_remote_blocks_hnd_tp4_to_tp2": Case(K=8, p_tp=4, d_tp=2, p_block=8, d_block=4),
    "larger_remote_blocks_hnd_tp2_to_tp4": Case(K=8, p_tp=2, d_tp=4, p_block=8, d_block=2,
                                                tokens=21, strided=True),
    "larger_remote_blocks_hnd_same_tp_prefix_hit": Case(K=4, p_tp=1, d_tp=1, p_block=8,
                                                        d_block=2, skip_blocks=3, tokens=19),
    "larger_remote_blocks_hnd_tp_up_prefix_hit": Case(K=8, p_tp=2, d_tp=8, p_block=8, d_block=4,
                                                      skip_blocks=2, tokens=23, strided=True),
    "larger_remote_blocks_hnd_to_nhd": Case(K=8, p_tp=2, d_tp=2, p_block=8, d_block=4,
                                            d_order=N, layout=Layout.BLOCKS_FIRST),
    "larger_remote_blocks_hnd_local_kernel_split": Case(K=8, p_tp=4, d_tp=2, p_block=8,
                                                        d_block=8, d_kernel=2, skip_blocks=1,
                                                        tokens=21),
    "larger_remote_blocks_hnd_kernel_split_both": Case(K=4, p_tp=1, d_tp=2, p_block=16,
                                                       p_kernel=2, d_block=4, d_kernel=2,
                                                       skip_blocks=2, tokens=22, strided=True),
    "larger_remote_blocks_hnd_non_dividing_tp": Case(K=6, p_tp=2, d_tp=3, p_block=4, d_block=2),
    "larger_remote_blocks_hnd_mixed_layouts": Case(K=4, p_tp=2, d_tp=1, p_block=8, d_block=2,
                                                   p_layout=Layout.KV_FIRST,
                                                   d_layout=Layout.BLOCKS_FIRST, skip_blocks=1),
    "larger_remote_blocks_hnd_cross_layer": Case(K=4, p_tp=1, d_tp=2, p_block=8, d_block=4,
                                                 layout=Layout.BLOCKS_FIRST, cross_layer=True),
    # kernel blocks (Mamba pages) padded past their elements: padding must stay untouched
    "padded_blocks_kv_first": Case(K=4, p_tp=1, d_tp=1, pad_words=2),
    "padded_blocks_first_tp_split": Case(K=8, p_tp=2, d_tp=4, layout=Layout.BLOCKS_FIRST,
                                         pad_words=3, d_kernel=2, d_block=8, p_block=4),
    "padded_larger_remote_blocks_hnd": Case(K=8, p_tp=4, d_tp=2, p_block=8, d_block=4,
                                            pad_words=1, skip_blocks=1, strided=True),
    "padded_mla": Case(K=1, p_tp=2, d_tp=1, mla=True, head_dim=4, pad_words=5),
    "padded_packed": Case(K=4, p_tp=2, d_tp=4, layout=P, pad_words=2, packed_view="flat"),
    "padded_mamba_pages": Case(K=4, p_tp=2, d_tp=4, layout=Layout.BLOCKS_FIRST, mamba=_mamba(),
                               pad_words=4),
    "kernel_split_both": Case(K=4, p_tp=2, d_tp=4, p_kernel=2, d_kernel=2, p_block=8, d_block=8),
    "kernel_split_local_only": Case(K=4, p_tp=4, d_tp=2, d_kernel=2, p_block=4, d_block=8),
    "prefix_hit": Case(K=4, p_tp=2, d_tp=4, skip_blocks=2, tokens=17),
    "prefix_hit_block_ratio": Case(K=4, p_tp=2, d_tp=2, p_block=2, d_block=4, skip_blocks=1,
                                   tokens=11, strided=True),
    "mla_tp4_to_tp2": Case(K=1, p_tp=4, d_tp=2, mla=True, head_dim=4),
    "mla_block_ratio": Case(K=1, p_tp=2, d_tp=4, mla=True, head_dim=4, p_block=8, d_block=2),
    "non_dividing_tp": Case(K=1, p_tp=3, d_tp=2),
    "cross_layer": Case(K=4, p_tp=2, d_tp=4, cross_layer=True, layout=Layout.BLOCKS_FIRST),
    "cross_layer_mla": Case(K=1, p_tp=2, d_tp=1, cross_layer=True, mla=True, head_dim=4),
    "mamba_more_decode_ranks": Case(K=4, p_tp=2, d_tp=4, layout=Layout.BLOCKS_FIRST,
                                    mamba=_mamba()),
    "mamba_fewer_decode_ranks": Case(K=2, p_tp=8, d_tp=2, layout=Layout.BLOCKS_FIRST,
                                     mamba=_mamba(n_groups=4), strided=True),
    "mamba_kernel_split": Case(K=4, p_tp=4, d_tp=2, layout=Layout.BLOCKS_FIRST, p_block=8,
                               d_block=8, p_kernel=2, d_kernel=2, mamba=_mamba(), tokens=20),
    # different layouts on the two sides: elements pair by (layer, kind)
    "blocks_first_to_kv_first": Case(K=4, p_tp=2, d_tp=2, p_layout=Layout.BLOCKS_FIRST,
                                     d_layout=Layout.KV_FIRST, strided=True),
    "kv_first_to_blocks_first_tp": Case(K=8, p_tp=8, d_tp=2, p_layout=Layout.KV_FIRST,
                                        d_layout=Layout.BLOCKS_FIRST),
    "blocks_first_to_kv_first_block_ratio": Case(K=4, p_tp=2, d_tp=4, p_block=2, d_block=8,
                                                 p_layout=Layout.BLOCKS_FIRST,
                                                 d_layout=Layout.KV_FIRST, skip_blocks=1,
                                                 tokens=21),
    "kv_first_kernel_split_to_blocks_first": Case(K=4, p_tp=4, d_tp=2, p_kernel=2, p_block=8,
                                                  d_block=4, p_layout=Layout.KV_FIRST,
                                                  d_layout=Layout.BLOCKS_FIRST, d_order=N),
    "cross_layer_to_kv_first": Case(K=4, p_tp=2, d_tp=4, layout=Layout.BLOCKS_FIRST,
                                    p_cross=True, d_cross=False, d_layout=Layout.KV_FIRST),
    "kv_first_to_cross_layer": Case(K=4, p_tp=4, d_tp=2, p_layout=Layout.KV_FIRST,
                                    d_layout=Layout.BLOCKS_FIRST, d_cross=True, strided=True),
    # packed (vLLM >= 0.32): K and V of each head together; pairs only with packed
    "packed_tp4_to_tp2": Case(K=8, p_tp=4, d_tp=2, layout=P),
    "packed_tp2_to_tp4_replicated": Case(K=2, p_tp=2, d_tp=4, layout=P, strided=True),
    "packed_tp8_to_tp2_duplicates": Case(K=2, p_tp=8, d_tp=2, layout=P, packed_inner="token-kv"),
    "packed_tp1_to_tp1": Case(K=4, p_tp=1, d_tp=1, layout=P, tokens=16),
    "packed_tp2_to_tp8_prefix_hit": Case(K=8, p_tp=2, d_tp=8, layout=P, skip_blocks=2, tokens=17,
                                         packed_view="flat", strided=True),
    "packed_kernel_split_decode": Case(K=4, p_tp=2, d_tp=4, layout=P, p_block=4, d_block=8,
                                       d_kernel=2, skip_blocks=1, tokens=21),
    "packed_kernel_split_prefill": Case(K=4, p_tp=4, d_tp=2, layout=P, p_block=8, p_kernel=2,
                                        d_block=4, packed_inner="token-kv"),
    "packed_non_dividing_tp": Case(K=6, p_tp=3, d_tp=2, layout=P, packed_view="permuted"),
    "packed_nhd_same_tp": Case(K=4, p_tp=2, d_tp=2, layout=P, p_order=N, d_order=N,
                               packed_view="permuted"),
    "packed_nhd_one_head_per_rank": Case(K=4, p_tp=8, d_tp=4, layout=P, p_order=N, d_order=N),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_oracle_pinned(name):
    stats = run_case(PINNED[name])
    assert stats["descs"] > 0
    if name == "mamba_fewer_decode_ranks":
        assert stats.get("emptied", 0) > 0  # duplicate-head ranks read for Mamba only


def _tps(K: int) -> list[int]:
    return [t for t in range(1, 9) if (t <= K and K % t == 0) or (t > K and t % K == 0)]


@st.composite
def cases(draw) -> Case:
    kind = draw(st.sampled_from(["attn"] * 4 + ["mla", "mamba", "mamba", "cross", "packed",
                                                "packed"]))
    if kind == "packed":
        return draw(packed_cases())
    mla = kind == "mla"
    K = 1 if mla else draw(st.sampled_from([1, 2, 4, 8] if kind != "mamba" else [2, 4, 8]))
    tps = _tps(K) if kind != "mamba" else [t for t in _tps(K) if 8 % t == 0]
    p_tp, d_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    if kind == "mamba":
        layout = Layout.BLOCKS_FIRST
    elif mla:
        layout = Layout.KV_FIRST
    else:
        layout = draw(st.sampled_from([Layout.KV_FIRST, Layout.BLOCKS_FIRST]))
    # the two sides' layouts drawn independently (elements pair by (layer, kind))
    d_layout = layout
    if kind in ("attn", "cross"):
        d_layout = draw(st.sampled_from([Layout.KV_FIRST, Layout.BLOCKS_FIRST]))
    p_cross = d_cross = kind == "cross"
    if kind == "cross":
        p_cross, d_cross = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
    p_block = draw(st.sampled_from([2, 4, 8]))
    d_block = p_block if kind in ("mamba", "cross") else draw(st.sampled_from([2, 4, 8]))
    p_kernel = draw(st.sampled_from([k for k in (1, 2) if p_block % (2 * k) == 0] or [1]))
    d_kernel = draw(st.sampled_from([k for k in (1, 2) if d_block % (2 * k) == 0] or [1]))
    tokens = draw(st.integers(1, 26))
    d_blocks = -(-tokens // d_block)
    mamba = None
    if kind == "mamba":
        mamba = _mamba(ssm_head_dim=draw(st.sampled_from([1, 2])),
                       state_size=draw(st.sampled_from([1, 2])),
                       n_groups=draw(st.sampled_from([1, 2, 4, 8])),
                       conv_width=draw(st.sampled_from([1, 2, 3])))
    case = Case(
        K=K, p_tp=p_tp, d_tp=d_tp, layers=draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from([1, 2])) * (2 if mla else 1), layout=layout,
        p_order=draw(st.sampled_from([H, N])), d_order=draw(st.sampled_from([H, N])),
        p_block=p_block, d_block=d_block, p_kernel=p_kernel, d_kernel=d_kernel, mla=mla,
        cross_layer=kind == "cross", mamba=mamba, tokens=tokens,
        p_layout=layout, d_layout=d_layout, p_cross=p_cross, d_cross=d_cross,
        skip_blocks=draw(st.integers(0, d_blocks)) if draw(st.booleans()) else 0,
        mamba_remote_pages=draw(st.integers(1, 2)), mamba_local_pages=1,
        strided=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
        pad_words=0 if kind == "cross" else draw(st.sampled_from([0, 0, 1, 3])),
    )
    try:
        plan_transfer(kernel_spec(case.spec("p")), kernel_spec(case.spec("d")))
    except TopologyError:
        assume(False)  # a pair the topology rightly refuses
    return case


@st.composite
def packed_cases(draw) -> Case:
    """Packed on both sides (it pairs with nothing else): one head order and one inner
    arrangement (one backend), equal kernel block sizes, logical sizes through kernel splits."""
    K = draw(st.sampled_from([1, 2, 4, 8]))
    tps = _tps(K)
    p_tp, d_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    order = draw(st.sampled_from([H, H, N]))
    kb = draw(st.sampled_from([1, 2, 4]))
    p_kernel, d_kernel = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    tokens = draw(st.integers(1, 26))
    d_block = kb * d_kernel
    d_blocks = -(-tokens // d_block)
    case = Case(
        K=K, p_tp=p_tp, d_tp=d_tp, layers=draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from([1, 2, 3])), layout=P, p_order=order, d_order=order,
        p_block=kb * p_kernel, d_block=d_block, p_kernel=p_kernel, d_kernel=d_kernel,
        tokens=tokens, skip_blocks=draw(st.integers(0, d_blocks)) if draw(st.booleans()) else 0,
        strided=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
        packed_inner=draw(st.sampled_from(["kv-rows", "token-kv"])),
        packed_view=draw(st.sampled_from(["4d", "permuted", "flat"])),
        pad_words=draw(st.sampled_from([0, 0, 2])),
    )
    try:
        plan_transfer(kernel_spec(case.spec("p")), kernel_spec(case.spec("d")))
    except TopologyError as exc:
        # the only refusal here: heads split across ranks while they interleave per token
        assert order is N and "HND" in str(exc), exc
        assume(False)
    return case


@st.composite
def larger_remote_hnd_cases(draw) -> Case:
    """Prefill kernel blocks larger than the decode ones, several heads per prefill rank, HND
    on the prefill side: every unit is read head by head. TP splits both ways, kernel splits
    on either side, both per-layer layouts drawn per side or a cross-layer cache on both,
    prefix hits, padding."""
    K = draw(st.sampled_from([2, 4, 8]))
    p_tp = draw(st.sampled_from([t for t in _tps(K) if K // t >= 2]))
    fewer = [t for t in _tps(K) if t < p_tp]  # decode TP below prefill TP: several sources
    d_tp = draw(st.sampled_from(fewer if fewer and draw(st.booleans()) else _tps(K)))
    p_kb = draw(st.sampled_from([2, 4, 8]))
    d_kb = draw(st.sampled_from([t for t in (1, 2, 4) if t < p_kb and p_kb % t == 0]))
    p_kernel, d_kernel = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    tokens = draw(st.integers(1, 30))
    d_block = d_kb * d_kernel
    d_blocks = -(-tokens // d_block)
    # a cross-layer cache on both sides (one side only cannot have a block-size mismatch)
    cross = draw(st.sampled_from([False, False, False, True]))
    layouts = [Layout.BLOCKS_FIRST] if cross else [Layout.KV_FIRST, Layout.BLOCKS_FIRST]
    return Case(
        K=K, p_tp=p_tp, d_tp=d_tp, layers=draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from([1, 2])), cross_layer=cross,
        p_layout=draw(st.sampled_from(layouts)), d_layout=draw(st.sampled_from(layouts)),
        p_order=H, d_order=draw(st.sampled_from([H, N])),
        p_block=p_kb * p_kernel, d_block=d_block, p_kernel=p_kernel, d_kernel=d_kernel,
        tokens=tokens, skip_blocks=draw(st.integers(0, d_blocks)) if draw(st.booleans()) else 0,
        strided=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
        pad_words=0 if cross else draw(st.sampled_from([0, 0, 1])),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(larger_remote_hnd_cases())
def test_oracle_grid_larger_remote_hnd_blocks(case):
    stats = run_case(case)
    assert stats["per_head"], "the case should read larger remote HND blocks head by head"
    event(f"tp={'down' if case.p_tp > case.d_tp else 'up' if case.p_tp < case.d_tp else 'equal'}")
    event(f"kernel_split={(case.p_kernel, case.d_kernel) != (1, 1)}")
    event(f"cross_layer={case.cross_layer}")
    event(f"prefix_hit={case.skip_blocks > 0}")
    event(f"post_process={stats['post']}")


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.filter_too_much,
                                                                   HealthCheck.too_slow])
@given(cases())
def test_oracle_grid(case):
    stats = run_case(case)
    kind = ("mla" if case.mla else "mamba" if case.mamba else "cross" if case.cross_layer
            else "packed" if case.layout is P else "attn")
    if kind == "packed":
        event(f"packed={case.p_order.value}/{case.packed_inner}/{case.packed_view}")
        event(f"packed_kernel_split={case.p_kernel != case.d_kernel}")
    event(f"kind={kind}")
    mixed = (case.side_layout("p"), case.side_cross("p")) != (case.side_layout("d"),
                                                               case.side_cross("d"))
    event(f"mixed_layout={mixed}")
    event(f"post_process={stats['post']}")
    event(f"block_ratio={case.p_block != case.d_block}")
    event(f"prefix_hit={case.skip_blocks > 0}")
    event(f"padded={case.pad_words > 0}")
    event(f"reads_per_head={stats['per_head']}")


def test_oracle_catches_a_wrong_offset(monkeypatch):
    """The oracle is sensitive: shifting every local descriptor by one element byte fails it."""
    real = descriptors.rank_descriptors

    def shifted(*args, **kwargs):
        rd = real(*args, **kwargs)
        rd.local_rows[:, 0] += np.uint64(4)
        return rd

    monkeypatch.setattr("oracle.rank_descriptors", shifted)
    with pytest.raises(AssertionError):
        run_case(Case(K=8, p_tp=8, d_tp=2))
    with pytest.raises(AssertionError):
        run_case(PINNED["packed_tp4_to_tp2"])


def test_oracle_catches_k_only_head_slices_for_packed(monkeypatch):
    """A planner that forgot that a packed head slice holds K and V (half-length reads at
    half offsets) is caught."""
    import kvbridge.topology.plan as plan_mod

    monkeypatch.setattr(plan_mod, "_unit_head_bytes",
                        lambda local, remote: plan_mod.unit_tokens(local, remote)
                        * local.head_dim * local.dtype_size)
    with pytest.raises(AssertionError):
        run_case(PINNED["packed_tp2_to_tp8_prefix_hit"])


def test_oracle_packed_arrangements_really_differ():
    """The inner arrangements put the same values at different bytes, so an oracle run that
    passes for each of them shows that kvbridge moved whole head slices without looking in."""
    from oracle import Full, build_rank, fill_attention

    arenas = []
    for inner in ("kv-rows", "token-kv"):
        case = Case(K=2, p_tp=1, d_tp=1, layout=P, packed_inner=inner, tokens=8)
        r = build_rank(case, case.spec("d"), 0, 2, 0)
        fill_attention(r, Full(case), [0, 1], 0, 8)
        assert r.caches[0].shape == (2, 2, 4, 4)  # vLLM's [blocks, heads, tokens, 2 * dim]
        arenas.append(r.arena.clone())
    assert not torch.equal(arenas[0], arenas[1])
    assert torch.equal(arenas[0].sort().values, arenas[1].sort().values)


def test_oracle_catches_contiguous_units_in_larger_remote_hnd_blocks(monkeypatch):
    """A planner that took one unit of a larger HND prefill block holding several heads for one
    byte range (the tokens of every head side by side) is caught."""
    import kvbridge.topology.plan as plan_mod

    monkeypatch.setattr(plan_mod, "_remote_units_cut_heads", lambda local, remote: False)
    for name in ("larger_remote_blocks_hnd_tp4_to_tp2", "larger_remote_blocks_hnd_tp2_to_tp4"):
        with pytest.raises(AssertionError):
            run_case(PINNED[name])


def test_oracle_catches_writes_into_padding(monkeypatch):
    """Descriptors one word too long write only into the padding after each element: no
    element view sees it, the untouched-bytes check does."""
    real = descriptors.rank_descriptors

    def longer(*args, **kwargs):
        rd = real(*args, **kwargs)
        rd.local_rows[:, 1] += np.uint64(4)
        rd.remote_rows[:, 1] += np.uint64(4)
        return rd

    monkeypatch.setattr("oracle.rank_descriptors", longer)
    for name in ("padded_blocks_kv_first", "padded_mla"):
        with pytest.raises(AssertionError, match="outside the request's elements"):
            run_case(PINNED[name])


def test_oracle_catches_missing_post_process(monkeypatch):
    monkeypatch.setattr("oracle.post_process", lambda *a, **k: None)
    with pytest.raises(AssertionError):
        run_case(PINNED["hnd_to_nhd"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(PINNED))
def test_oracle_pinned_cuda(name):
    case = PINNED[name]
    case = Case(**{**case.__dict__, "device": "cuda"})
    run_case(case)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much,
                                                                  HealthCheck.too_slow])
@given(st.one_of(cases(), larger_remote_hnd_cases()))
def test_oracle_grid_cuda(case):
    """The hypothesis grid (fewer examples) with every rank's cache in CUDA memory."""
    run_case(Case(**{**case.__dict__, "device": "cuda"}))
