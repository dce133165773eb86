"""Block ids, head placement, pairwise engine checks, engine validation."""

from __future__ import annotations

import pytest

from kvbridge.topology import (
    KIND_K,
    KIND_KV,
    KIND_V,
    EngineSpec,
    Layout,
    ReadOp,
    TopologyError,
    block_size_ratio,
    blocks_for_tokens,
    check_compatible,
    element_kinds,
    element_layout,
    head_range,
    kernel_block_ids,
    plan_rank,
    ranks_holding,
)


def spec(engine_id="e", tp=1, **kw):
    args = dict(num_kv_heads=8, head_dim=64, num_layers=2, block_size=16)
    args.update(kw)
    return EngineSpec(engine_id, tp_size=tp, **args)


def test_head_placement_sharded_and_replicated():
    assert [list(head_range(4, 8, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(head_range(8, 2, r)) for r in range(8)] == [[0]] * 4 + [[1]] * 4
    assert list(ranks_holding(8, 2, 1)) == [4, 5, 6, 7]
    assert list(ranks_holding(4, 8, 5)) == [2]


def test_kernel_block_ids():
    assert kernel_block_ids([3, 7], 2) == [6, 7, 14, 15]


def test_block_size_ratio_and_blocks_for_tokens():
    assert block_size_ratio(16, 64) == 4
    with pytest.raises(TopologyError):
        block_size_ratio(16, 24)
    assert blocks_for_tokens(33, 16) == 3 and blocks_for_tokens(0, 16) == 0


def test_pairwise_checks_refuse_conflicts():
    local = spec("local", tp=2)
    with pytest.raises(TopologyError, match="same engine id"):
        check_compatible(local, spec("local", tp=4))
    assert plan_rank(local, spec("p0", tp=4), 1).handshake_ranks == (2, 3)
    with pytest.raises(TopologyError, match="num_kv_heads differs"):
        check_compatible(local, spec("p1", tp=1, num_kv_heads=4))


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(tp=0), "tp_size must be a positive integer"),
        (dict(block_size=16, kernel_blocks_per_block=3), "kernel block size must divide"),
        (dict(use_mla=True, layout="blocks-first"), "use layout kv-first"),
        (dict(dtype="fp9"), "unknown dtype"),
        (dict(block_bytes=100), "smaller than"),
        (dict(layout="diagonal"), "diagonal"),
        (dict(layout="packed", use_mla=True, num_kv_heads=1), "cannot use the packed layout; use layout kv-first"),
        (dict(layout="packed", cross_layer=True), "cross-layer cache with the packed layout is not supported yet"),
        (dict(layout="packed", block_bytes=2 * 8 * 16 * 64 * 2 - 2), "smaller than"),
    ],
)
def test_engine_spec_validation(kw, needle):
    tp = kw.pop("tp", 1)
    with pytest.raises(ValueError, match=needle):
        spec(tp=tp, **kw)


def test_element_layouts():
    kv = element_layout(spec(tp=2))
    assert kv.separate_kv_regions and kv.regions == 4 and kv.elements_per_block == 1
    assert kv.element_bytes == 4 * 16 * 64 * 2
    bf = element_layout(spec(tp=2, layout=Layout.BLOCKS_FIRST))
    assert not bf.separate_kv_regions and bf.regions == 2
    assert bf.element_offsets == (0, kv.element_bytes)
    cl = element_layout(spec(tp=2, cross_layer=True))
    assert cl.regions == 1 and cl.elements_per_block == 4
    assert cl.element_roles == ((0, 0), (0, 1), (1, 0), (1, 1))
    # the single block holds every layer's K and V (found by the memory oracle)
    assert cl.element_offsets == tuple(i * kv.element_bytes for i in range(4))
    assert cl.region_block_bytes == 4 * kv.element_bytes
    measured = spec(tp=2, layout=Layout.BLOCKS_FIRST, block_bytes=2 * kv.element_bytes + 512)
    assert measured.region_block_bytes == 2 * kv.element_bytes + 512
    pk = element_layout(spec(tp=2, layout=Layout.PACKED))
    assert not pk.separate_kv_regions and pk.regions == 2 and pk.elements_per_block == 1
    assert pk.element_bytes == pk.region_block_bytes == 2 * kv.element_bytes
    assert pk.element_offsets == (0,) and pk.element_roles == ((0, KIND_KV), (1, KIND_KV))
    assert element_kinds(spec(layout=Layout.PACKED)) == (KIND_KV,) == (2,)
    assert element_kinds(spec()) == (KIND_K, KIND_V) == (0, 1)
    assert element_kinds(spec(use_mla=True, num_kv_heads=1)) == (KIND_K,)


def test_packed_pairs_only_with_packed():
    local = spec("local", tp=2, layout=Layout.PACKED)
    with pytest.raises(TopologyError, match="same vLLM-style packed cache"):
        check_compatible(local, spec("p0", tp=4))
    hb = 2 * 16 * 64 * 2  # one head's K and V over a block
    plan = plan_rank(local, spec("p1", tp=4, layout=Layout.PACKED), 1)
    assert plan.reads == (ReadOp(2, 0, 2 * hb, 0), ReadOp(3, 0, 2 * hb, 2 * hb))


def test_one_dtype_table_folds_every_spelling() -> None:
    from kvbridge.topology import (
        DTYPE_ALIASES,
        DTYPE_SIZES,
        TopologyError,
        canonical_dtype,
        dtype_size,
    )

    for alias, name in DTYPE_ALIASES.items():
        assert canonical_dtype(alias) == name and name in DTYPE_SIZES
        assert dtype_size(alias) == DTYPE_SIZES[name]
    assert canonical_dtype("torch.BFloat16") == "bf16"
    assert dtype_size("float8_e4m3fn") == 1 and dtype_size("fp32") == 4
    with pytest.raises(TopologyError, match="unknown dtype 'float64'"):
        canonical_dtype("float64")
