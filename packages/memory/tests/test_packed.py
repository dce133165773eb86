"""The packed layout (vLLM >= 0.32: K and V of each head together) in kvbridge.memory."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvbridge.memory import (
    MemoryLayoutError,
    RegionGeometry,
    kernel_spec,
    post_process,
    rank_descriptors,
    regions_from_kv_caches,
)
from kvbridge.topology import (
    KIND_KV,
    EngineSpec,
    HeadOrder,
    Layout,
    PostProcess,
    plan_rank,
    plan_transfer,
)

H, D, N = 2, 4, 4  # heads per rank, head dim, tokens per (kernel) block


def spec(**kw) -> EngineSpec:
    base = dict(engine_id="e", tp_size=2, num_kv_heads=4, head_dim=D, num_layers=3, block_size=N,
                dtype="bf16", layout=Layout.PACKED)
    base.update(kw)
    return EngineSpec(**base)


ELEM = H * N * 2 * D * 2  # heads x tokens x (K and V) x head dim x bf16 = 128 bytes


def _check_regions(regs, caches, nb: int, stride: int = ELEM):
    assert len(regs.regions) == len(caches)
    for layer, (r, t) in enumerate(zip(regs.regions, caches, strict=True)):
        assert r.base_addr == t.data_ptr() and r.num_blocks == nb and r.block_stride == stride
        assert r.element_offsets == (0,) and r.element_bytes == ELEM
        assert r.roles == (((layer, KIND_KV),),)
        assert r.size == nb * stride


def test_vllm_hnd_tensors_one_region_per_layer():
    s = spec()
    caches = {f"model.layers.{i}.attn": torch.zeros(7, H, N, 2 * D, dtype=torch.bfloat16)
              for i in range(3)}
    regs = regions_from_kv_caches(caches, s)
    _check_regions(regs, list(caches.values()), 7)
    assert s.element_bytes == ELEM == s.region_block_bytes
    g = RegionGeometry.from_regions(regs)
    assert g.element_roles == ((0, KIND_KV), (1, KIND_KV), (2, KIND_KV))
    remote = RegionGeometry.from_remote(s, [r.base_addr for r in regs.regions], 7, ELEM,
                                        mem_type="DRAM")
    assert remote == g


@pytest.mark.parametrize("form", ["nhd", "nhd_view_of_hnd", "cpu_rows", "flat_bytes", "2d"])
def test_any_dense_block_shape_is_accepted(form):
    s = spec(head_order=HeadOrder.NHD if form.startswith("nhd") else HeadOrder.HND)
    mk = {
        "nhd": lambda: torch.zeros(5, N, H, 2 * D, dtype=torch.bfloat16),
        # vLLM allocates HND memory and may hand out a logical NHD view of it
        "nhd_view_of_hnd": lambda: torch.zeros(5, H, N, 2 * D, dtype=torch.bfloat16).transpose(1, 2),
        "cpu_rows": lambda: torch.zeros(5, H, 2, N, D, dtype=torch.bfloat16),  # K rows then V rows
        "flat_bytes": lambda: torch.zeros(5, ELEM, dtype=torch.uint8),
        "2d": lambda: torch.zeros(5, H * N * 2 * D, dtype=torch.bfloat16),
    }[form]
    caches = [mk() for _ in range(3)]
    _check_regions(regions_from_kv_caches(caches, s), caches, 5)


def test_kernel_blocks_make_logical_blocks():
    s = spec(block_size=2 * N, kernel_blocks_per_block=2)
    caches = [torch.zeros(10, H, N, 2 * D, dtype=torch.bfloat16) for _ in range(3)]
    regs = regions_from_kv_caches(caches, s)
    _check_regions(regs, caches, 5, stride=2 * ELEM)
    assert kernel_spec(s).element_bytes == ELEM
    with pytest.raises(MemoryLayoutError, match="whole number of logical blocks"):
        regions_from_kv_caches([torch.zeros(9, H, N, 2 * D, dtype=torch.bfloat16)] * 3, s)


def test_wrong_sizes_and_holes_are_refused():
    s = spec()
    with pytest.raises(MemoryLayoutError, match=r"4 x 2 \(K and V\) x 2 bytes\); fix the engine"):
        regions_from_kv_caches([torch.zeros(7, H, N, D, dtype=torch.bfloat16)] * 3, s)  # K only
    with pytest.raises(MemoryLayoutError, match="fix the engine description"):
        # a kv-first tensor handed in for a packed engine: dim 0 would be 2 blocks of everything
        regions_from_kv_caches([torch.zeros(2, 7, H, N, D, dtype=torch.bfloat16)] * 3, s)
    holes = torch.zeros(7, H, N, 4 * D, dtype=torch.bfloat16)[..., : 2 * D]
    with pytest.raises(MemoryLayoutError, match="not a contiguous byte range"):
        regions_from_kv_caches([holes] * 3, s)
    with pytest.raises(MemoryLayoutError, match="block dimension first"):
        regions_from_kv_caches([torch.zeros(7 * ELEM, dtype=torch.uint8)] * 3, s)


def test_descriptors_read_whole_head_slices():
    """P2 -> D1 with 4 heads: D reads each P rank's whole packed element side by side."""
    p, d = spec(engine_id="p"), spec(engine_id="d", tp_size=1)
    plan = plan_rank(d, p, 0)
    dcaches = [torch.zeros(6, 4, N, 2 * D, dtype=torch.bfloat16) for _ in range(3)]
    dgeo = RegionGeometry.from_regions(regions_from_kv_caches(dcaches, d))
    pgeo = RegionGeometry.from_remote(p, [1 << 30, 2 << 30, 3 << 30], 9, ELEM)
    for q in (0, 1):
        rd = rank_descriptors(plan, q, dgeo, pgeo)
        rows = rd.remote_descs(strided=True)
        assert rows.shape == (3, 5)  # one row per layer: O(layers), not O(blocks)
        assert (rows[:, 1] == ELEM).all() and (rows[:, 3] == ELEM).all() and (rows[:, 4] == 9).all()
        local = rd.local_descs(strided=True)
        assert [int(a) for a in local[:, 0]] == [t.data_ptr() + q * ELEM for t in dcaches]
        assert (local[:, 3] == 2 * ELEM).all()
        li, ri = rd.indices([4, 5], [7, 8])
        assert li.tolist() == [4, 5, 10, 11, 16, 17] and ri.tolist() == [7, 8, 16, 17, 25, 26]


def test_packed_does_not_pair_with_other_layouts():
    p, d = spec(engine_id="p"), spec(engine_id="d", tp_size=1)
    plan = plan_rank(d, p, 0)
    kv_first = replace(d, layout=Layout.KV_FIRST, num_layers=3)
    bf = replace(d, layout=Layout.BLOCKS_FIRST)
    pgeo = RegionGeometry.from_remote(p, [1 << 30, 2 << 30, 3 << 30], 9, ELEM)
    for other in (kv_first, bf):
        lay_regions = 6 if other.layout is Layout.KV_FIRST else 3
        ogeo = RegionGeometry.from_remote(other, [(i + 1) << 20 for i in range(lay_regions)], 9,
                                          other.region_block_bytes)
        with pytest.raises(MemoryLayoutError, match="pairs only with a packed cache"):
            rank_descriptors(plan, 0, ogeo, pgeo)
        with pytest.raises(MemoryLayoutError, match="pairs only with a packed cache"):
            rank_descriptors(plan, 0, pgeo, ogeo)


def test_post_process_refuses_packed_caches_and_skips_when_not_needed():
    d = spec(engine_id="d", head_order=HeadOrder.NHD)
    caches = [torch.arange(6 * ELEM // 2, dtype=torch.int16).view(torch.bfloat16).view(6, N, H, 2 * D)
              for _ in range(3)]
    before = [c.clone() for c in caches]
    regs = regions_from_kv_caches(caches, d)
    plan = plan_transfer(spec(engine_id="p", head_order=HeadOrder.NHD), d)
    assert not plan.post_process.needed
    post_process(regs, [0, 3], plan.post_process)  # nothing to do, nothing touched
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(caches, before, strict=True))
    forced = PostProcess(True, 1, N, HeadOrder.HND, HeadOrder.NHD)
    with pytest.raises(MemoryLayoutError, match="packed layout.*cannot be rearranged"):
        post_process(regs, [0, 3], forced)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(caches, before, strict=True))


def test_geometry_of_packed_regions_has_packed_roles():
    s = spec()
    caches = [torch.randn(6, H, N, 2 * D).to(torch.bfloat16).transpose(1, 2) for _ in range(3)]
    regs = regions_from_kv_caches(caches, s)
    assert RegionGeometry.from_regions(regs).element_roles == ((0, 2), (1, 2), (2, 2))
