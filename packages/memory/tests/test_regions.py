"""Regions from real torch tensors: layouts, dedup, registration, clear errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvbridge.memory import MemoryLayoutError, RegionGeometry, regions_from_kv_caches
from kvbridge.topology import EngineSpec, HeadOrder, Layout, MambaSpec


def spec(**kw) -> EngineSpec:
    base = dict(engine_id="e", tp_size=1, num_kv_heads=2, head_dim=4, num_layers=2, block_size=4,
                dtype="bf16")
    base.update(kw)
    return EngineSpec(**base)


def test_kv_first_gives_separate_k_and_v_regions():
    s = spec()
    caches = {f"l{i}": torch.zeros(2, 10, 4, 2, 4, dtype=torch.bfloat16) for i in range(2)}
    regs = regions_from_kv_caches(caches, s)
    assert len(regs.regions) == 4
    k0, v0 = regs.regions[0], regs.regions[1]
    t = caches["l0"]
    assert k0.base_addr == t[0].data_ptr() and v0.base_addr == t[1].data_ptr()
    assert k0.block_stride == 4 * 2 * 4 * 2 and k0.num_blocks == 10 and k0.size == 10 * 64
    assert k0.element_offsets == (0,) and k0.element_bytes == 64
    assert k0.roles == (((0, 0),),) and v0.roles == (((0, 1),),)
    assert regs.regions[2].roles == (((1, 0),),)
    assert k0.mem_type == "DRAM" and k0.device_id == 0
    descs = regs.registration_descs()
    assert descs.dtype == np.uint64 and descs.shape == (2, 3)  # K and V of a layer are adjacent
    assert int(descs[0, 1]) == 2 * 640
    assert regs.registration_descs(merge_adjacent=False).shape == (4, 3)


def test_gpu_regions_register_adjacent_ranges_apart_and_overlapping_ones_together():
    s = spec()
    caches = [torch.zeros(2, 10, 4, 2, 4, dtype=torch.bfloat16) for _ in range(2)]
    host = regions_from_kv_caches(caches, s)
    # as if these adjacent ranges were CUDA memory: they may be two allocations
    gpu = dataclasses.replace(host, mem_type="VRAM")
    rows = gpu.registration_descs()
    assert rows.shape == (4, 3)
    assert [int(a) for a in rows[:, 0]] == sorted(r.base_addr for r in host.regions)
    assert gpu.registration_descs(merge_adjacent=True).shape == (2, 3)
    k = host.regions[0]
    shared = dataclasses.replace(gpu, regions=(k, dataclasses.replace(k, base_addr=k.base_addr + 64)))  # overlapping
    merged = shared.registration_descs()
    assert merged.shape == (1, 3) and int(merged[0, 1]) == k.size + 64


def test_blocks_first_one_region_with_k_then_v():
    s = spec(layout=Layout.BLOCKS_FIRST)
    caches = [torch.zeros(6, 2, 4, 2, 4, dtype=torch.bfloat16) for _ in range(2)]
    regs = regions_from_kv_caches(caches, s)
    assert len(regs.regions) == 2
    r = regs.regions[0]
    assert r.element_offsets == (0, 64) and r.block_stride == 128 and r.num_blocks == 6


def test_hnd_permuted_view_is_accepted():
    # memory [2, blocks, heads, tokens, dim], viewed as [2, blocks, tokens, heads, dim]
    s = spec(head_order=HeadOrder.HND)
    mem = torch.zeros(2, 5, 2, 4, 4, dtype=torch.bfloat16)
    regs = regions_from_kv_caches([mem.transpose(2, 3), mem.transpose(2, 3)], dataclasses.replace(s, num_layers=2))
    assert regs.regions[0].block_stride == 64


def test_mla_single_region_per_layer():
    s = spec(num_kv_heads=1, use_mla=True, head_dim=8)
    regs = regions_from_kv_caches([torch.zeros(7, 4, 8, dtype=torch.bfloat16)] * 1, dataclasses.replace(s, num_layers=1))
    assert len(regs.regions) == 1 and regs.regions[0].element_offsets == (0,)


def test_shared_tensor_is_registered_once_with_both_roles():
    s = spec(layout=Layout.BLOCKS_FIRST)
    t = torch.zeros(6, 2, 4, 2, 4, dtype=torch.bfloat16)
    regs = regions_from_kv_caches({"a": t, "b": t}, s)
    assert len(regs.regions) == 1
    assert regs.regions[0].roles == (((0, 0), (1, 0)), ((0, 1), (1, 1)))


def test_cross_layer_single_tensor_and_per_layer_views_agree():
    s = spec(cross_layer=True, layout=Layout.BLOCKS_FIRST)
    big = torch.zeros(5, 2, 2, 4, 2, 4, dtype=torch.bfloat16)
    one = regions_from_kv_caches(big, s)
    views = regions_from_kv_caches([big[:, 0], big[:, 1]], s)
    assert len(one.regions) == 1 and one.regions == views.regions
    assert one.regions[0].element_offsets == (0, 64, 128, 192)
    assert one.regions[0].roles == (((0, 0),), ((0, 1),), ((1, 0),), ((1, 1),))


def test_kernel_blocks_count_as_logical_blocks():
    s = spec(block_size=8, kernel_blocks_per_block=2)
    regs = regions_from_kv_caches([torch.zeros(2, 10, 4, 2, 4, dtype=torch.bfloat16)] * 2, s)
    assert regs.num_blocks == 5 and regs.regions[0].block_stride == 128
    with pytest.raises(MemoryLayoutError, match="whole number of logical blocks"):
        regions_from_kv_caches([torch.zeros(2, 9, 4, 2, 4, dtype=torch.bfloat16)] * 2, s)


def test_hybrid_mamba_page_shared_by_attention_and_state():
    m = MambaSpec(ssm_heads=2, ssm_head_dim=2, state_size=2, n_groups=1, conv_width=2)
    s = spec(layout=Layout.BLOCKS_FIRST, num_layers=1, mamba=m, block_bytes=256)
    pages = torch.zeros(4, 256, dtype=torch.uint8)
    attn = pages.view(torch.bfloat16).as_strided((4, 2, 4, 2, 4), (128, 32, 8, 4, 1))
    conv = pages[:, :24].view(torch.bfloat16).view(4, 6, 2)
    ssm = pages[:, 24:56].view(torch.float32).view(4, 2, 2, 2)
    regs = regions_from_kv_caches([attn, (conv, ssm)], s)
    assert len(regs.regions) == 1
    r = regs.regions[0]
    assert r.block_stride == 256 and r.mamba_layers == (0,) and r.element_offsets == (0, 64)
    bad_ssm = pages[:, 32:64].view(torch.float32).view(4, 2, 2, 2)
    with pytest.raises(MemoryLayoutError, match="right after the conv state"):
        regions_from_kv_caches([attn, (conv, bad_ssm)], s)


def test_non_contiguous_blocks_are_refused():
    s = spec()
    t = torch.zeros(2, 10, 4, 4, 4, dtype=torch.bfloat16)[:, :, :, :2]  # every block has holes
    with pytest.raises(MemoryLayoutError, match="not a contiguous byte range"):
        regions_from_kv_caches([t, t], s)
    interleaved = torch.zeros(4, 2, 10, 2, 4, dtype=torch.bfloat16).permute(1, 2, 0, 3, 4)
    with pytest.raises(MemoryLayoutError, match="not a contiguous byte range"):
        regions_from_kv_caches([interleaved, interleaved], s)


def test_inconsistent_block_counts_and_sizes_are_refused():
    s = spec()
    a = torch.zeros(2, 10, 4, 2, 4, dtype=torch.bfloat16)
    b = torch.zeros(2, 8, 4, 2, 4, dtype=torch.bfloat16)
    with pytest.raises(MemoryLayoutError, match="number of blocks"):
        regions_from_kv_caches([a, b], s)
    wrong = torch.zeros(2, 10, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(MemoryLayoutError, match="fix the engine description"):
        regions_from_kv_caches([wrong, wrong], s)
    with pytest.raises(MemoryLayoutError, match="first dimension"):
        regions_from_kv_caches([a.transpose(0, 1).contiguous()] * 2, s)


def test_overlapping_tensors_with_different_blocks_are_refused():
    s = spec(layout=Layout.BLOCKS_FIRST)
    mem = torch.zeros(20 * 256, dtype=torch.uint8)
    a = mem[: 10 * 128].view(torch.bfloat16).view(10, 2, 4, 2, 4)
    b = mem[64: 64 + 5 * 256].view(torch.bfloat16).as_strided((5, 2, 4, 2, 4), (128, 32, 8, 4, 1))
    with pytest.raises(MemoryLayoutError, match="overlaps"):
        regions_from_kv_caches([a, b], s)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_regions_and_mixed_devices():
    s = spec()
    a = torch.zeros(2, 10, 4, 2, 4, dtype=torch.bfloat16, device="cuda")
    regs = regions_from_kv_caches([a, a.clone()], s)
    assert regs.mem_type == "VRAM" and regs.regions[0].mem_type == "VRAM"
    with pytest.raises(MemoryLayoutError, match="different devices"):
        regions_from_kv_caches([a, a.cpu()], s)


def test_byte_view_aliases_the_cache():
    s = spec(layout=Layout.BLOCKS_FIRST)
    caches = [torch.zeros(6, 2, 4, 2, 4, dtype=torch.bfloat16) for _ in range(2)]
    regs = regions_from_kv_caches(caches, s)
    v = regs.byte_view(1)
    assert v.shape == (6, 128)
    v[3].fill_(0x3F)  # bf16 0x3F3F
    assert caches[1][3].float().ne(0).all() and caches[1][2].eq(0).all() and caches[0].eq(0).all()


def test_geometry_from_regions_matches_from_remote_numbers():
    s = spec(block_size=8, kernel_blocks_per_block=2)
    caches = [torch.zeros(2, 12, 4, 2, 4, dtype=torch.bfloat16) for _ in range(2)]
    regs = regions_from_kv_caches(caches, s)
    g = RegionGeometry.from_regions(regs)
    r = RegionGeometry.from_remote(s, [x.base_addr for x in regs.regions], 6, 128, device_id=0,
                                   mem_type="DRAM")
    assert g == r and g.num_kernel_blocks == 12 and g.kernel_strides == (64,) * 4
    with pytest.raises(MemoryLayoutError, match="sent 3 regions"):
        RegionGeometry.from_remote(s, [1, 2, 3], 6, 128)
    with pytest.raises(MemoryLayoutError, match="does not match the engine description"):
        RegionGeometry.from_remote(s, [x.base_addr for x in regs.regions], 6, 64)


def test_positions_and_group_regions():
    """Every region records the kv_caches positions it holds; a group's layers select regions."""
    import torch

    from kvbridge.memory import regions_from_kv_caches
    from kvbridge.topology import EngineSpec

    spec = EngineSpec("e", 1, 2, 8, 3, 4, "fp32", layout="blocks-first")
    shared = torch.zeros(6, 2, 2, 4, 8)
    caches = {"a": shared, "b": torch.zeros(6, 2, 2, 4, 8), "c": shared, "d": torch.zeros(6, 2, 2, 4, 8)}
    regs = regions_from_kv_caches(caches, spec)
    assert [r.positions for r in regs.regions] == [(0, 2), (1,), (3,)]
    assert regs.group_regions([2]) == (0,)
    assert regs.group_regions([1, 3]) == (1, 2)
    assert regs.group_regions([7]) == ()


def test_packed_hybrid_page_as_vllm_032_hands_it_to_granite():
    """One buffer per (attention, Mamba) pair of layers: 65536-byte pages viewed by attention
    as fp32 [blocks, 2 heads, 128 tokens, 64] (HND) and by Mamba as int8 [blocks, 1, 1, 19840]
    (stride 65536), split here into the conv state (3 x 288 fp32) and the SSM state
    (8 x 32 x 16 fp32)."""
    m = MambaSpec(ssm_heads=8, ssm_head_dim=32, state_size=16, n_groups=1, conv_width=3,
                  conv_dtype_size=4, ssm_dtype_size=4)
    s = EngineSpec("g", 1, 2, 32, 2, 128, "fp32", layout="packed", mamba=m)
    caches = []
    for _ in range(2):
        buf = torch.zeros(6 * 65536, dtype=torch.int8)
        attn = buf.view(torch.float32).view(6, 2, 128, 64)
        page = torch.as_strided(buf, (6, 1, 1, 19840), (65536, 19840, 19840, 1))
        conv = page[:, 0, 0, :3456].view(torch.float32).view(6, 3, 288)
        ssm = page[:, 0, 0, 3456:].view(torch.float32).view(6, 8, 32, 16)
        caches += [attn, (conv, ssm)]
    cr = regions_from_kv_caches(caches, s)
    assert len(cr.regions) == 2 and cr.num_blocks == 6
    for i, r in enumerate(cr.regions):
        assert r.block_stride == r.element_bytes == 65536 and r.element_offsets == (0,)
        assert r.roles == (((i, 2),),) and r.mamba_layers == (i,) and r.positions == (2 * i, 2 * i + 1)
    # a Mamba view that does not start its page is refused
    bad = list(caches)
    conv, ssm = bad[1]
    bad[1] = (conv.view(6, -1)[:, 1:], ssm)
    with pytest.raises(MemoryLayoutError):
        regions_from_kv_caches(bad, s)
