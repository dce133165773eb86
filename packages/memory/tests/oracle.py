"""Byte-level oracle: shard a full KV cache, move bytes by descriptors, compare.

Independent of kvbridge.memory's internals: the caches are built here from a
full, unsharded cache with a distinct int32 code at every
(layer, K/V, token, head, dim) and every Mamba state entry, laid out in memory
the way an engine would; kvbridge only sees the tensors, the topology plan and
the block ids. Copies are plain byte copies on one uint8 arena per rank.

Packed caches (vLLM >= 0.32) hold K and V of each head together. With HND the
memory of one kernel block is ``[heads, ...]`` and each head's slice is either
K rows then V rows (``[2, tokens, dim]``, vLLM's CPU backend, ``packed_inner
="kv-rows"``) or K|V per token (``[tokens, 2, dim]``, FlashAttention,
``"token-kv"``); with NHD it is ``[tokens, heads, 2, dim]``. Both engines use
the same arrangement (same backend); kvbridge never looks inside a head slice,
so every arrangement must come out byte-exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvbridge.memory import (
    RegionGeometry,
    kernel_spec,
    post_process,
    rank_descriptors,
    regions_from_kv_caches,
)
from kvbridge.topology import EngineSpec, HeadOrder, Layout, head_range, plan_transfer

SENTINEL = -7  # fills everything the request does not own
REMOTE_JUNK = -9  # fills unused slots on the prefill side


def _align(x: int, a: int = 16) -> int:
    return -(-x // a) * a


@dataclass
class Case:
    K: int
    p_tp: int
    d_tp: int
    layers: int = 2
    head_dim: int = 2
    layout: Layout = Layout.KV_FIRST
    p_order: HeadOrder = HeadOrder.HND
    d_order: HeadOrder = HeadOrder.HND
    p_block: int = 4
    d_block: int = 4
    p_kernel: int = 1
    d_kernel: int = 1
    mla: bool = False
    cross_layer: bool = False
    mamba: object = None  # MambaSpec | None
    tokens: int = 13
    skip_blocks: int = 0
    p_extra_blocks: int = 3
    d_extra_blocks: int = 2
    mamba_remote_pages: int = 2
    mamba_local_pages: int = 1
    strided: bool = False
    seed: int = 0
    device: str = "cpu"
    #: per-side overrides of ``layout`` / ``cross_layer`` (mixed-layout pairs)
    p_layout: Layout | None = None
    d_layout: Layout | None = None
    p_cross: bool | None = None
    d_cross: bool | None = None
    #: packed layout: inside of one head slice ("kv-rows": K rows then V rows, "token-kv": K|V
    #: per token; HND only) and the tensor handed to kvbridge ("4d": vLLM's logical
    #: [blocks, heads, tokens, 2*dim] / [blocks, tokens, heads, 2*dim]; "permuted": the other
    #: order's logical view of the same memory; "flat": [blocks, block numel])
    packed_inner: str = "kv-rows"
    packed_view: str = "4d"
    #: int32 words of padding at the end of every kernel block (every kernel-block slice of a
    #: Mamba page), like allocators that round pages up; not for cross-layer caches. The
    #: engine description stays the computed one (a Mamba page's block_bytes includes it).
    pad_words: int = 0

    def side_layout(self, side: str) -> Layout:
        own = self.p_layout if side == "p" else self.d_layout
        return self.layout if own is None else own

    def side_cross(self, side: str) -> bool:
        own = self.p_cross if side == "p" else self.d_cross
        return self.cross_layer if own is None else own

    def spec(self, side: str) -> EngineSpec:
        tp = self.p_tp if side == "p" else self.d_tp
        extra = {}
        if self.mamba is not None:
            extra["block_bytes"] = self.page_bytes(side)
        return EngineSpec(
            engine_id=f"engine-{side}",
            tp_size=tp,
            num_kv_heads=self.K,
            head_dim=self.head_dim,
            num_layers=self.layers,
            block_size=self.p_block if side == "p" else self.d_block,
            dtype="fp32",
            kernel_blocks_per_block=self.p_kernel if side == "p" else self.d_kernel,
            layout=self.side_layout(side),
            head_order=self.p_order if side == "p" else self.d_order,
            use_mla=self.mla,
            mamba=self.mamba,
            cross_layer=self.side_cross(side),
            **extra,
        )

    # Mamba page: attention K+V of one logical block, or the state, padded
    def page_bytes(self, side: str) -> int:
        tp = self.p_tp if side == "p" else self.d_tp
        bs = self.p_block if side == "p" else self.d_block
        n = self.p_kernel if side == "p" else self.d_kernel
        heads = max(1, self.K // tp)
        attn_kernel = 2 * heads * (bs // n) * self.head_dim * 4
        state = mamba_rank_bytes(self.mamba, tp)
        per_kernel = max(attn_kernel, _align(-(-state // n))) + 4 * self.pad_words
        return per_kernel * n


def mamba_rank_bytes(m, tp: int) -> int:
    heads, groups = max(1, m.ssm_heads // tp), max(1, m.n_groups // tp)
    conv = (heads * m.ssm_head_dim + 2 * groups * m.state_size) * m.conv_width * 4
    return conv + heads * m.ssm_head_dim * m.state_size * 4


@dataclass
class Rank:
    spec: EngineSpec
    rank: int
    arena: torch.Tensor  # uint8, whole cache of this rank
    caches: list = field(default_factory=list)  # what regions_from_kv_caches gets
    attn: list = field(default_factory=list)  # per layer canonical int32 view [kinds, NBk, kbs, h, D]
    conv: list = field(default_factory=list)  # per layer int32 [NB, conv_ch, W]
    ssm: list = field(default_factory=list)  # per layer int32 [NB, h, hd, N]


def _canonical_view(mem: torch.Tensor, spec: EngineSpec, kinds_first: bool) -> torch.Tensor:
    """Memory-ordered int32 tensor -> canonical [kinds, NBk, kbs, h, D] view (no copy)."""
    if spec.use_mla:
        # mem [NBk, kbs, D] -> [1, NBk, kbs, 1, D]
        return mem.unsqueeze(0).unsqueeze(3)
    t = mem if kinds_first else mem.transpose(0, 1)  # [kinds, NBk, ...elem]
    if spec.head_order is HeadOrder.HND:  # elem [h, kbs, D]
        return t.transpose(2, 3)
    return t


def build_rank(case: Case, spec: EngineSpec, rank: int, num_blocks: int, fill: int) -> Rank:
    ksp = kernel_spec(spec)
    n = spec.kernel_blocks_per_block
    nbk = num_blocks * n
    kbs = ksp.block_size
    h = ksp.heads_per_rank
    D = spec.head_dim
    kinds = 1 if spec.use_mla else 2
    L = spec.num_layers
    elem_shape = (kbs, D) if spec.use_mla else ((h, kbs, D) if spec.head_order is HeadOrder.HND else (kbs, h, D))
    elem_numel = int(np.prod(elem_shape))
    r = Rank(spec, rank, torch.empty(0))
    if spec.mamba is not None:
        page = case.page_bytes("p" if spec.engine_id.endswith("p") else "d")
        arena = torch.full((L * num_blocks * page // 4,), fill, dtype=torch.int32, device=case.device)
        m = spec.mamba
        mh, mg = max(1, m.ssm_heads // spec.tp_size), max(1, m.n_groups // spec.tp_size)
        conv_ch = mh * m.ssm_head_dim + 2 * mg * m.state_size
        for layer in range(L):
            base = layer * num_blocks * page // 4
            pw = page // 4
            kw = pw // n
            mem = arena.as_strided((nbk, 2) + elem_shape,
                                   (kw, elem_numel) + _contig(elem_shape), base)
            r.caches.append(mem)
            r.attn.append(_canonical_view(mem, spec, kinds_first=False))
        for layer in range(L):
            base = layer * num_blocks * page // 4
            pw = page // 4
            conv = arena.as_strided((num_blocks, conv_ch, m.conv_width), (pw, m.conv_width, 1), base)
            ssm_off = conv_ch * m.conv_width
            ssm = arena.as_strided((num_blocks, mh, m.ssm_head_dim, m.state_size),
                                   (pw, m.ssm_head_dim * m.state_size, m.state_size, 1), base + ssm_off)
            r.caches.append((conv, ssm))
            r.conv.append(conv)
            r.ssm.append(ssm)
        r.arena = arena.view(torch.uint8)
        return r
    if spec.cross_layer:
        if case.pad_words:
            raise ValueError("the oracle pads kernel blocks of per-layer caches only")
        arena = torch.full((nbk * L * kinds * elem_numel,), fill, dtype=torch.int32, device=case.device)
        big = arena.view((nbk, L, kinds) + elem_shape)
        r.caches.append(big.squeeze(2) if spec.use_mla else big)
        for layer in range(L):
            mem = big[:, layer]  # [NBk, kinds, ...]
            if spec.use_mla:
                r.attn.append(mem[:, 0].unsqueeze(0).unsqueeze(3))
            else:
                r.attn.append(_canonical_view(mem, spec, kinds_first=False))
        r.arena = arena.view(torch.uint8)
        return r
    pad = case.pad_words
    # one kernel block: its elements (K and V, the latent, or one packed K+V element), then pad
    # words; kv-first keeps K and V in separate halves, each [blocks, element + pad]
    per_block = (elem_numel + pad) if spec.separate_kv_regions or spec.use_mla else (
        kinds * elem_numel + pad)
    per_layer = (2 if spec.separate_kv_regions else 1) * nbk * per_block
    arena = torch.full((L * per_layer,), fill, dtype=torch.int32, device=case.device)
    if spec.is_packed:
        for layer in range(L):
            flat = arena[layer * per_layer:(layer + 1) * per_layer]
            blocks = flat.view(nbk, per_block)[:, :2 * elem_numel]
            canon, logical = _packed_views(case, spec, blocks, h, kbs, D)
            r.attn.append(canon)
            if case.packed_view == "flat":
                r.caches.append(blocks)
            elif case.packed_view == "permuted":
                r.caches.append(logical.transpose(1, 2))
            else:
                r.caches.append(logical)
        r.arena = arena.view(torch.uint8)
        return r
    for layer in range(L):
        flat = arena[layer * per_layer:(layer + 1) * per_layer]
        if spec.use_mla:
            mem = flat.view(nbk, per_block)[:, :elem_numel].unflatten(1, elem_shape)
            r.attn.append(_canonical_view(mem, spec, True))
        elif spec.layout is Layout.KV_FIRST:
            mem = flat.view(2, nbk, per_block)[:, :, :elem_numel].unflatten(2, elem_shape)
            r.attn.append(_canonical_view(mem, spec, True))
        else:
            mem = flat.view(nbk, per_block)[:, :2 * elem_numel].unflatten(1, (2,) + elem_shape)
            r.attn.append(_canonical_view(mem, spec, False))
        r.caches.append(mem)
    r.arena = arena.view(torch.uint8)
    return r


def _packed_views(case: Case, spec: EngineSpec, blocks: torch.Tensor, h: int, kbs: int,
                  D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(canonical [2, NBk, kbs, h, D] view, vLLM-style logical tensor) of one packed layer;
    ``blocks`` is ``[NBk, block words]`` (block rows may be padded apart)."""
    if spec.head_order is HeadOrder.NHD:
        mem = blocks.unflatten(1, (kbs, h, 2, D))  # per token, per head: K | V
        return mem.permute(3, 0, 1, 2, 4), blocks.unflatten(1, (kbs, h, 2 * D))
    if case.packed_inner == "kv-rows":
        mem = blocks.unflatten(1, (h, 2, kbs, D))  # per head: K rows, then V rows
        canon = mem.permute(2, 0, 3, 1, 4)
    elif case.packed_inner == "token-kv":
        mem = blocks.unflatten(1, (h, kbs, 2, D))  # per head, per token: K | V
        canon = mem.permute(3, 0, 2, 1, 4)
    else:
        raise ValueError(f"unknown packed_inner {case.packed_inner!r}")
    return canon, blocks.unflatten(1, (h, kbs, 2 * D))


def _contig(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


class Full:
    """The unsharded truth."""

    def __init__(self, case: Case):
        g = case.layers * (1 if case.mla else 2) * case.tokens * case.K * case.head_dim
        heads = 1 if case.mla else case.K
        self.kv = (torch.arange(g, dtype=torch.int32) + 1).view(
            case.layers, 1 if case.mla else 2, case.tokens, heads, case.head_dim)
        self.conv = self.ssm = None
        if case.mamba is not None:
            m = case.mamba
            ch = m.ssm_heads * m.ssm_head_dim + 2 * m.n_groups * m.state_size
            J = case.mamba_remote_pages
            start = g + 1
            self.conv = (torch.arange(case.layers * J * ch * m.conv_width, dtype=torch.int32) + start
                         ).view(case.layers, J, ch, m.conv_width)
            start += self.conv.numel()
            self.ssm = (torch.arange(case.layers * J * m.ssm_heads * m.ssm_head_dim * m.state_size,
                                     dtype=torch.int32) + start
                        ).view(case.layers, J, m.ssm_heads, m.ssm_head_dim, m.state_size)

    def conv_shard(self, m, tp: int, rank: int) -> torch.Tensor:
        """[L, J, ch_r, W] channels of one rank: x heads, then B groups, then C groups."""
        hr = head_range(tp, m.ssm_heads, rank)
        gr = head_range(tp, m.n_groups, rank)
        x = self.conv[:, :, hr.start * m.ssm_head_dim:hr.stop * m.ssm_head_dim]
        b0 = m.ssm_heads * m.ssm_head_dim
        B = self.conv[:, :, b0 + gr.start * m.state_size:b0 + gr.stop * m.state_size]
        c0 = b0 + m.n_groups * m.state_size
        C = self.conv[:, :, c0 + gr.start * m.state_size:c0 + gr.stop * m.state_size]
        return torch.cat([x, B, C], dim=2)

    def ssm_shard(self, m, tp: int, rank: int) -> torch.Tensor:
        hr = head_range(tp, m.ssm_heads, rank)
        return self.ssm[:, :, hr.start:hr.stop]


def fill_attention(rank: Rank, full: Full, ids: list[int], first_block: int, tokens: int):
    """Write the true values of the request's tokens into blocks ``ids`` (block i of the
    list holds prompt block ``first_block + i``). Returns a don't-care mask over
    [NBk, kbs] positions: slots of these blocks past the end of the prompt."""
    spec = rank.spec
    ksp = kernel_spec(spec)
    n, kbs, bs = spec.kernel_blocks_per_block, ksp.block_size, spec.block_size
    heads = head_range(spec.tp_size, spec.kv_heads_for_placement, rank.rank)
    nbk = rank.attn[0].shape[1]
    dont_care = torch.zeros(nbk, kbs, dtype=torch.bool)
    for i, b in enumerate(ids):
        t0 = (first_block + i) * bs
        for k in range(n):
            kb = b * n + k
            ts = t0 + k * kbs
            valid = max(0, min(kbs, tokens - ts))
            dont_care[kb, valid:] = True
            if valid == 0:
                continue
            for layer, att in enumerate(rank.attn):
                src = full.kv[layer, :, ts:ts + valid, heads.start:heads.stop]
                att[:, kb, :valid] = src.to(att.device)
    return dont_care


def fill_mamba(rank: Rank, full: Full, pages: list[int], positions: list[int]):
    m = rank.spec.mamba
    conv = full.conv_shard(m, rank.spec.tp_size, rank.rank)
    ssm = full.ssm_shard(m, rank.spec.tp_size, rank.rank)
    for layer in range(rank.spec.num_layers):
        for page, pos in zip(pages, positions, strict=True):
            rank.conv[layer][page] = conv[layer, pos].to(rank.conv[layer].device)
            rank.ssm[layer][page] = ssm[layer, pos].to(rank.ssm[layer].device)


def _addresses(rd, idx: np.ndarray, side: str, strided: bool) -> tuple[np.ndarray, np.ndarray]:
    """(address, length) of descriptors ``idx`` of one list, in N x 3 or N x 5 form."""
    if not strided:
        descs = rd.remote_descs() if side == "remote" else rd.local_descs()
        return descs[idx, 0].astype(np.int64), descs[idx, 1].astype(np.int64)
    rows = rd.remote_descs(strided=True) if side == "remote" else rd.local_descs(strided=True)
    counts = rows[:, 4].astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    row = np.searchsorted(starts, idx, side="right") - 1
    within = idx - starts[row]
    addr = rows[row, 0].astype(np.int64) + within * rows[row, 3].astype(np.int64)
    return addr, rows[row, 1].astype(np.int64)


def copy_bytes(dst: torch.Tensor, dst_off: np.ndarray, src: torch.Tensor, src_off: np.ndarray,
               lengths: np.ndarray, written: np.ndarray) -> None:
    """dst[dst_off[i]:+len] = src[src_off[i]:+len] for all i; records written bytes."""
    for ln in np.unique(lengths):
        sel = lengths == ln
        ar = np.arange(int(ln), dtype=np.int64)
        d = (dst_off[sel][:, None] + ar).ravel()
        s = (src_off[sel][:, None] + ar).ravel()
        assert d.min() >= 0 and d.max() < dst.numel(), "local descriptor outside the local cache"
        assert s.min() >= 0 and s.max() < src.numel(), "remote descriptor outside the remote cache"
        written[d] += 1
        dt = torch.as_tensor(d, device=dst.device)
        st = torch.as_tensor(s, device=src.device)
        dst[dt] = src[st].to(dst.device)


def run_case(case: Case) -> dict:
    """Run one case end to end; raises AssertionError on any wrong byte. Returns stats."""
    rng = np.random.default_rng(case.seed)
    p_spec, d_spec = case.spec("p"), case.spec("d")
    plan = plan_transfer(kernel_spec(p_spec), kernel_spec(d_spec))
    full = Full(case)
    T = case.tokens
    p_blocks = -(-T // case.p_block)
    d_blocks = -(-T // case.d_block)
    skip = min(case.skip_blocks, d_blocks)
    mp, ml = (case.mamba_remote_pages, case.mamba_local_pages) if case.mamba else (0, 0)
    NBp = p_blocks + mp + case.p_extra_blocks
    NBd = d_blocks + ml + case.d_extra_blocks
    p_perm = rng.permutation(NBp).tolist()
    d_perm = rng.permutation(NBd).tolist()
    p_ids, p_pages = p_perm[:p_blocks], p_perm[p_blocks:p_blocks + mp]
    d_all, d_pages = d_perm[:d_blocks], d_perm[d_blocks:d_blocks + ml]
    d_ids = d_all[skip:]

    # prefill ranks: full request, from handshake numbers on the decode side
    prefill = []
    for q in range(case.p_tp):
        r = build_rank(case, p_spec, q, NBp, REMOTE_JUNK)
        fill_attention(r, full, p_ids, 0, T)
        if case.mamba:
            fill_mamba(r, full, p_pages, list(range(mp)))
        regs = regions_from_kv_caches(r.caches, p_spec)
        geo_local = RegionGeometry.from_regions(regs)
        geo = RegionGeometry.from_remote(
            p_spec, [g.base_addr for g in regs.regions], regs.num_blocks,
            [g.block_stride for g in regs.regions], device_id=regs.device_id, mem_type=regs.mem_type)
        assert geo == geo_local, "handshake geometry differs from the peer's own geometry"
        prefill.append((r, geo))

    stats = {"descs": 0, "rows": 0, "post": plan.post_process.needed,
             "per_head": any(p.reads_per_head for p in plan.decode_ranks)}
    if d_spec.is_packed or p_spec.is_packed:
        assert d_spec.is_packed and p_spec.is_packed, "topology planned a packed/unpacked pair"
        assert not plan.post_process.needed, "a packed pair must never need post-processing"
    for d in range(case.d_tp):
        loc = build_rank(case, d_spec, d, NBd, SENTINEL)
        before = loc.arena.clone()
        regs = regions_from_kv_caches(loc.caches, d_spec)
        lgeo = RegionGeometry.from_regions(regs)
        rp = plan.decode_ranks[d]
        written = np.zeros(loc.arena.numel(), dtype=np.int64)
        base_l = loc.arena.data_ptr()
        mamba_descs = mamba_bytes = 0
        for q in rp.handshake_ranks:
            prank, rgeo = prefill[q]
            rd = rank_descriptors(rp, q, lgeo, rgeo)
            if q in rp.notify_only_ranks:
                assert rd.num_local_descs == 0 and rd.num_remote_descs == 0
            if rp.mamba is not None and q in rp.mamba.fa_emptied_ranks:
                assert rd.attn_keys == 0 and rd.mamba_rows > 0  # read for Mamba state only
                stats["emptied"] = stats.get("emptied", 0) + 1
            assert rd.num_local_descs == len(rd.local_descs())
            assert rd.num_remote_descs == len(rd.remote_descs())
            stats["rows"] += len(rd.local_rows) + len(rd.remote_rows)
            li, ri = rd.indices(d_ids, p_ids, local_skip_blocks=skip)
            if case.mamba:
                mli, mri = rd.indices(d_pages, p_pages, group="mamba")
                mamba_descs += len(mli)
                mamba_bytes += int(_addresses(rd, mli, "local", case.strided)[1].sum())
                li, ri = np.concatenate([li, mli]), np.concatenate([ri, mri])
            assert li.dtype == np.int32 and ri.dtype == np.int32 and len(li) == len(ri)
            if len(li) == 0:
                continue
            la, ll = _addresses(rd, li, "local", case.strided)
            ra, rl = _addresses(rd, ri, "remote", case.strided)
            assert (ll == rl).all(), "local and remote descriptor lengths differ"
            copy_bytes(loc.arena, la - base_l, prank.arena, ra - prank.arena.data_ptr(), ll, written)
            stats["descs"] += len(li)
        assert written.max(initial=0) <= 1, "some local bytes were written twice"
        # what `kvbridge plan` reports for the Mamba state is what the descriptors move
        assert mamba_descs == plan.mamba_descriptors_per_request(d) * len(d_pages)
        assert mamba_bytes == plan.mamba_bytes_per_request(d) * len(d_pages)
        post_process(regs, d_ids, plan.post_process, d_spec)

        # expected: an untouched copy of this rank's cache with the true values filled in
        exp = build_rank(case, d_spec, d, NBd, SENTINEL)
        exp.arena.copy_(before)
        dont_care = fill_attention(exp, full, d_ids, skip, T)
        if case.mamba:
            positions = list(range(mp - ml, mp))
            fill_mamba(exp, full, d_pages, positions)
        for layer in range(d_spec.num_layers):
            got, want = loc.attn[layer].cpu(), exp.attn[layer].cpu()
            mask = ~dont_care[None, :, :, None, None].expand_as(got)
            bad = (got != want) & mask
            if bad.any():
                where = bad.nonzero()[:5].tolist()
                raise AssertionError(
                    f"decode rank {d} layer {layer}: wrong values at [kind, kblock, tok, head, dim] "
                    f"{where}: got {got[bad][:5].tolist()} want {want[bad][:5].tolist()}")
            if case.mamba:  # pages of the attention blocks were checked above
                keep = [b for b in range(NBd) if b not in set(d_ids)]
                for name, a, b in (("conv", loc.conv, exp.conv), ("ssm", loc.ssm, exp.ssm)):
                    assert torch.equal(a[layer][keep].cpu(), b[layer][keep].cpu()), (
                        f"decode rank {d} layer {layer}: wrong {name} state")
        # nothing outside the request may change or be written: not the other blocks and pages,
        # not the padding past the elements (no view above covers it), and not the attention
        # part of the Mamba pages
        allowed = request_bytes(case, d_spec, d, NBd, d_ids, d_pages)
        changed = (loc.arena != before).cpu().numpy()
        for what, bad in (("changed", changed & ~allowed), ("written", (written > 0) & ~allowed)):
            if bad.any():
                where = np.flatnonzero(bad)
                raise AssertionError(
                    f"decode rank {d}: {len(where)} bytes outside the request's elements and "
                    f"state were {what}, first at arena bytes {where[:5].tolist()}")
        stats["outside_bytes"] = stats.get("outside_bytes", 0) + int((~allowed).sum())
    return stats


def request_bytes(case: Case, spec: EngineSpec, rank: int, num_blocks: int, ids: list[int],
                  pages: list[int]) -> np.ndarray:
    """Bool mask over a decode rank's arena bytes: the elements (every token slot) of the
    request's kernel blocks, and the conv and SSM state of its Mamba pages."""
    probe = build_rank(case, spec, rank, num_blocks, 0)
    n = spec.kernel_blocks_per_block
    kids = torch.as_tensor([b * n + k for b in ids for k in range(n)], dtype=torch.long,
                           device=probe.arena.device)
    for att in probe.attn:
        att[:, kids] = 1
    for states in (probe.conv, probe.ssm):
        for t in states:
            t[pages] = 1
    words = probe.arena.view(torch.int32) != 0
    return words.repeat_interleave(4).cpu().numpy()
