"""Host staging copies and payload tensor helpers on real tensors."""

from __future__ import annotations

import itertools

import pytest
import torch
from kvbridge.memory import (
    HostStaging,
    MemoryLayoutError,
    merge_heads,
    regions_from_kv_caches,
    slice_heads,
    split_kv,
)
from kvbridge.topology import EngineSpec, Layout, head_range, receive_sources


def _staging_roundtrip(device: str):
    s = EngineSpec(engine_id="e", tp_size=1, num_kv_heads=2, head_dim=4, num_layers=2,
                   block_size=4, dtype="fp32")
    caches = [torch.randn(2, 8, 4, 2, 4, device=device) for _ in range(2)]
    regs = regions_from_kv_caches(caches, s)
    st = HostStaging.allocate(regs, pin_memory=False)
    assert st.regions.mem_type == "DRAM" and len(st.regions.regions) == 4
    assert st.regions.regions[0].block_stride == regs.regions[0].block_stride
    descs = st.regions.registration_descs(merge_adjacent=False)
    assert sorted(descs[:, 0].tolist()) == sorted(b.data_ptr() for b in st.buffers)
    assert (descs[:, 2] == 0).all()
    for b in st.buffers:
        b.zero_()
    st.to_host([1, 5])
    host_k0 = st.buffers[0].view(torch.float32).view(8, 4, 2, 4)
    assert torch.equal(host_k0[[1, 5]], caches[0][0, [1, 5]].cpu())
    assert host_k0[[0, 2, 3, 4, 6, 7]].eq(0).all()
    # receive: new bytes in host blocks 2, 3 land on the device, nothing else changes
    before = [c.clone() for c in caches]
    for b in st.buffers:
        b.fill_(7)
    st.to_device([2, 3])
    for c, old in zip(caches, before, strict=True):
        assert c[:, [2, 3]].view(-1).view(torch.int32).eq(0x07070707).all()
        assert torch.equal(c[:, [0, 1, 4, 5, 6, 7]], old[:, [0, 1, 4, 5, 6, 7]])
    with pytest.raises(MemoryLayoutError, match="outside"):
        st.to_host([8])


def test_staging_roundtrip_cpu():
    _staging_roundtrip("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staging_roundtrip_cuda():
    _staging_roundtrip("cuda")


def test_split_kv_all_forms():
    kv = torch.arange(2 * 3 * 5).view(2, 3, 5)
    k, v = split_kv(kv, Layout.KV_FIRST)
    assert torch.equal(k, kv[0]) and torch.equal(v, kv[1])
    bf = kv.transpose(0, 1)
    k2, v2 = split_kv(bf, "blocks-first")
    assert torch.equal(k2, kv[0]) and torch.equal(v2, kv[1])
    k3, v3 = split_kv((kv[0], kv[1]), Layout.KV_FIRST)
    assert k3 is kv[0] or torch.equal(k3, kv[0])
    with pytest.raises(MemoryLayoutError):
        split_kv(torch.zeros(3, 4), Layout.KV_FIRST)
    with pytest.raises(MemoryLayoutError):
        split_kv((kv[0], kv[1][:2]), Layout.KV_FIRST)


@pytest.mark.parametrize("K", [1, 2, 4, 8])
def test_slice_and_merge_reassemble_every_receiver_shard(K):
    full = torch.arange(3 * K * 5).view(3, K, 5)  # [blocks, heads, dim]
    tps = [t for t in range(1, 9) if (t <= K and K % t == 0) or (t > K and t % K == 0)]
    for s_tp, r_tp in itertools.product(tps, tps):
        if max(s_tp, r_tp) % min(s_tp, r_tp):
            continue

        def shard(tp, r):
            h = head_range(tp, K, r)
            return full[:, h.start:h.stop]

        for rr in range(r_tp):
            senders = receive_sources(s_tp, r_tp, rr)
            # whole shards and per-receiver slices both merge to the receiver's shard
            whole = {q: shard(s_tp, q) for q in senders}
            slices = {q: slice_heads(whole[q], num_heads=K, sender_tp=s_tp, sender_rank=q,
                                     receiver_tp=r_tp, receiver_rank=rr, dim=1) for q in senders}
            for shards in (whole, slices):
                got = merge_heads(shards, num_heads=K, sender_tp=s_tp, receiver_tp=r_tp,
                                  receiver_rank=rr, dim=1)
                assert torch.equal(got, shard(r_tp, rr)), (s_tp, r_tp, rr)


def test_payload_errors_name_the_problem():
    full = torch.zeros(2, 4, 3)
    with pytest.raises(MemoryLayoutError, match="holds none"):
        slice_heads(full[:, :2], num_heads=4, sender_tp=2, sender_rank=0, receiver_tp=4,
                    receiver_rank=3, dim=1)
    with pytest.raises(MemoryLayoutError, match="heads along dim"):
        slice_heads(full, num_heads=4, sender_tp=2, sender_rank=0, receiver_tp=4,
                    receiver_rank=0, dim=1)
    with pytest.raises(MemoryLayoutError, match="needs one of sender ranks"):
        merge_heads({0: full[:, :1]}, num_heads=4, sender_tp=4, receiver_tp=2, receiver_rank=0,
                    dim=1)
