"""Property tests of the read planner over every valid deployment shape.

The checks re-derive head ownership independently of the planner: a read that
moves bytes [a, a+n) of remote rank q's unit must carry exactly the heads the
local rank keeps at [b, b+n) of its unit, and together the reads must carry
each local head once.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.topology import (
    EngineSpec,
    HeadOrder,
    Layout,
    MambaSpec,
    TopologyError,
    plan_transfer,
)


def _valid_tps(k: int, limit: int = 16) -> list[int]:
    return [t for t in range(1, limit + 1) if (t <= k and k % t == 0) or (t > k and t % k == 0)]


def _heads(tp: int, k: int, rank: int) -> list[int]:
    """Independent re-statement of head placement from the design notes."""
    if tp <= k:
        per = k // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * k // tp]


@st.composite
def shapes(draw, mla: bool = False, mamba: bool = False):
    k = 1 if mla else draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    tps = _valid_tps(k)
    if mla:
        tps = list(range(1, 17))
    p_tp = draw(st.sampled_from(tps))
    d_tp = draw(st.sampled_from(tps))
    base = draw(st.sampled_from([16, 32]))
    if mamba:
        p_bs = d_bs = base
    else:
        p_bs = base * draw(st.sampled_from([1, 1, 2, 4]))
        d_bs = base * draw(st.sampled_from([1, 1, 2, 4]))
    layout = Layout.BLOCKS_FIRST if mamba else draw(st.sampled_from(list(Layout)))
    if mla:
        layout = Layout.KV_FIRST
    # kernel splits on either side (logical blocks of 2 or 4 physical ones)
    p_kernel = draw(st.sampled_from([1, 1, 2, 4]))
    d_kernel = draw(st.sampled_from([1, 1, 2, 4]))
    p_order = d_order = HeadOrder.HND
    if layout is Layout.PACKED:
        # packed pairs need equal kernel (physical) block sizes and one head order; the
        # logical block sizes may still differ through kernel splits
        p_kernel = draw(st.sampled_from([1, 1, 2, 4]))
        d_kernel = draw(st.sampled_from([1, 1, 2, 4]))
        p_bs, d_bs = base * p_kernel, base * d_kernel
        p_order = d_order = draw(st.sampled_from([HeadOrder.HND, HeadOrder.HND, HeadOrder.NHD]))
    head_dim = draw(st.sampled_from([8, 64, 128]))
    m = None
    if mamba:
        ssm_heads = draw(st.sampled_from([16, 32]))
        groups = draw(st.sampled_from([1, 2, 4, 8, 16]))
        m = MambaSpec(ssm_heads=ssm_heads, ssm_head_dim=8, state_size=16, n_groups=groups, conv_width=3)
    common = dict(num_kv_heads=8 if mla else k, head_dim=head_dim, num_layers=2, dtype="bf16",
                  layout=layout, use_mla=mla, mamba=m)
    prefill = EngineSpec("p", tp_size=p_tp, block_size=p_bs, kernel_blocks_per_block=p_kernel,
                         head_order=p_order, **common)
    decode = EngineSpec("d", tp_size=d_tp, block_size=d_bs, kernel_blocks_per_block=d_kernel,
                        head_order=d_order, **common)
    return prefill, decode


def _check_plan(prefill: EngineSpec, decode: EngineSpec) -> None:
    packed = decode.layout is Layout.PACKED
    try:
        plan = plan_transfer(prefill, decode)
    except TopologyError as exc:
        if packed:
            # the only refusal for the packed pairs drawn: heads split across ranks
            # while heads are not contiguous (NHD)
            assert prefill.head_order is HeadOrder.NHD and "HND" in str(exc), exc
            return
        raise AssertionError(f"a valid pair was refused: {exc}") from exc
    k = decode.kv_heads_for_placement
    unit_tokens = min(prefill.kernel_block_size, decode.kernel_block_size)
    # one head per token: head_dim values of K (or V), of K and V together when packed
    uhb = unit_tokens * decode.head_dim * decode.dtype_size * (2 if packed else 1)
    if packed:
        assert unit_tokens == prefill.kernel_block_size == decode.kernel_block_size
        assert not plan.post_process.needed, "a packed pair must never need post-processing"
        assert plan.decode_layout.element_roles == tuple((layer, 2) for layer in range(decode.num_layers))
        # the layout is per logical block: kernel_blocks_per_block units of every head
        assert plan.decode_layout.element_bytes == (
            decode.heads_per_rank * uhb * decode.kernel_blocks_per_block)
    # a remote HND kernel block [heads, T_r, dim] larger than the unit: one unit of one head
    # is contiguous, heads are T_r rows apart, so each head is its own read
    per_head = (prefill.kernel_block_size > unit_tokens and prefill.head_order is HeadOrder.HND
                and prefill.heads_per_rank > 1 and not decode.use_mla)
    remote_head = prefill.kernel_block_size * (uhb // unit_tokens)  # a head over a P kernel block
    remote_units = prefill.kernel_block_size // unit_tokens
    sent: dict[int, int] = {}
    for p in plan.decode_ranks:
        mine = _heads(decode.tp_size, k, p.local_rank)
        assert p.local_unit_bytes == len(mine) * uhb
        assert p.reads_per_head == per_head
        assert p.remote_unit_stride == (uhb if per_head else p.remote_unit_bytes)
        got: list[int] = []
        for r in p.reads:
            theirs = _heads(prefill.tp_size, k, r.remote_rank)
            assert p.remote_unit_bytes == len(theirs) * uhb
            assert r.length > 0 and r.length % uhb == 0
            assert 0 <= r.local_offset and r.local_offset + r.length <= p.local_unit_bytes
            # every unit's piece stays inside the remote kernel-block element
            last = r.remote_offset + (remote_units - 1) * p.remote_unit_stride + r.length
            assert 0 <= r.remote_offset and last <= remote_units * p.remote_unit_bytes
            if per_head:
                assert r.length == uhb and r.remote_offset % remote_head == 0
                first, n = r.remote_offset // remote_head, 1
            else:
                assert r.remote_offset + r.length <= p.remote_unit_bytes
                first, n = r.remote_offset // uhb, r.length // uhb
            carried = theirs[first : first + n]
            slots = mine[r.local_offset // uhb : r.local_offset // uhb + n]
            assert carried == slots, (r, theirs, mine)
            got.extend(carried)
        assert sorted(got) == mine, "reads must carry every local head exactly once"
        if packed and decode.head_order is HeadOrder.NHD:
            # heads interleave per token: only whole elements can be moved
            assert all(r.length == p.local_unit_bytes == p.remote_unit_bytes for r in p.reads)
        assert set(p.source_ranks) <= set(p.handshake_ranks)
        assert set(p.notify_only_ranks) == set(p.handshake_ranks) - set(p.source_ranks)
        assert len(set(p.handshake_ranks)) == len(p.handshake_ranks)
        assert all(0 <= q < prefill.tp_size for q in p.handshake_ranks)
        if plan.tp_ratio is not None:
            ratio = plan.tp_ratio
            if ratio > 0:
                assert p.handshake_ranks == (p.local_rank // ratio,)
            else:
                m = -ratio
                assert p.handshake_ranks == tuple(p.local_rank * m + i for i in range(m))
        for q in p.handshake_ranks:  # exactly one message per handshake rank per request
            sent[q] = sent.get(q, 0) + 1
    for q in plan.prefill_ranks:
        assert q.notifications_per_request == sent.get(q.rank, 0)
    if decode.mamba is not None:
        _check_mamba(prefill, decode, plan)


def _check_mamba(prefill: EngineSpec, decode: EngineSpec, plan) -> None:
    mm = decode.mamba
    for p in plan.decode_ranks:
        f = p.mamba
        assert f is not None
        assert set(f.fa_source_ranks) | {x.remote_rank for x in f.mamba_pieces} == set(f.all_source_ranks)
        assert set(f.all_source_ranks) == set(p.source_ranks)
        assert f.num_fa_reads == len(f.fa_source_ranks)
        assert set(f.fa_emptied_ranks) == set(f.all_source_ranks) - set(f.fa_source_ranks)
        assert f.needs_split_handles == (len(f.all_source_ranks) > 1)
        assert [q for q, _ in f.fa_head_slots] == list(f.fa_source_ranks)
        if p.reads_per_head:  # one attention descriptor carries one head
            assert f.fa_descriptor_bytes == p.remote_unit_stride
            assert all(r.length == f.fa_descriptor_bytes for r in p.reads)
        # every piece's local units must be the local rank's own units of that dimension
        for name, units, unit in (
            ("x", mm.ssm_heads, mm.ssm_head_dim * mm.conv_width * mm.conv_dtype_size),
            ("B", mm.n_groups, mm.state_size * mm.conv_width * mm.conv_dtype_size),
            ("C", mm.n_groups, mm.state_size * mm.conv_width * mm.conv_dtype_size),
            ("ssm", mm.ssm_heads, mm.ssm_head_dim * mm.state_size * mm.ssm_dtype_size),
        ):
            pieces = [x for x in f.mamba_pieces if x.name == name]
            mine = _heads(decode.tp_size, units, p.local_rank)
            lbase = _piece_base(decode, name)
            got = []
            for x in pieces:
                theirs = _heads(prefill.tp_size, units, x.remote_rank)
                rbase = _piece_base(prefill, name)
                assert x.length % unit == 0 and x.length > 0
                assert (x.remote_offset - rbase) % unit == 0 and (x.local_offset - lbase) % unit == 0
                n = x.length // unit
                r0, l0 = (x.remote_offset - rbase) // unit, (x.local_offset - lbase) // unit
                assert r0 + n <= len(theirs) and l0 + n <= len(mine)
                carried = theirs[r0 : r0 + n]
                assert carried == mine[l0 : l0 + n], (name, x, theirs, mine)
                got.extend(carried)
            assert sorted(got) == mine, f"Mamba {name} units must each be read exactly once"
        if prefill.tp_size > decode.tp_size:
            m = prefill.tp_size // decode.tp_size
            if mm.ssm_heads >= prefill.tp_size:
                assert f.num_mamba_reads == m  # Mamba needs all |ratio| ranks


def _piece_base(spec: EngineSpec, name: str) -> int:
    """Offset of a Mamba piece in one rank's page, recomputed from the shapes."""
    m, t = spec.mamba, spec.tp_size
    x = max(1, m.ssm_heads // t) * m.ssm_head_dim * m.conv_width * m.conv_dtype_size
    bc = max(1, m.n_groups // t) * m.state_size * m.conv_width * m.conv_dtype_size
    return {"x": 0, "B": x, "C": x + bc, "ssm": x + 2 * bc}[name]


@settings(max_examples=400, deadline=None)
@given(shapes())
def test_attention_plans_cover_heads_exactly(shape):
    _check_plan(*shape)


@settings(max_examples=150, deadline=None)
@given(shapes(mla=True))
def test_mla_plans(shape):
    prefill, decode = shape
    _check_plan(prefill, decode)
    plan = plan_transfer(prefill, decode)
    for p in plan.decode_ranks:
        assert len(p.reads) == 1 and p.reads[0].length == p.local_unit_bytes
        if prefill.tp_size > decode.tp_size and plan.tp_ratio is not None:
            assert len(p.notify_only_ranks) == -plan.tp_ratio - 1


@settings(max_examples=200, deadline=None)
@given(shapes(mamba=True))
def test_mamba_plans(shape):
    prefill, decode = shape
    try:
        plan_transfer(prefill, decode)
    except TopologyError as exc:
        # groups or SSM heads that cannot be placed on one side
        assert "Mamba" in str(exc)
        return
    _check_plan(prefill, decode)


@st.composite
def packed_vs_other(draw):
    """A packed engine against an engine that differs in layout, head order or kernel block size."""
    k = draw(st.sampled_from([1, 2, 4, 8]))
    tps = _valid_tps(k, 8)
    what = draw(st.sampled_from(["layout", "order", "kernel"]))
    base = dict(num_kv_heads=k, head_dim=draw(st.sampled_from([8, 128])), num_layers=2,
                layout=Layout.PACKED)
    a = dict(base, tp_size=draw(st.sampled_from(tps)), block_size=16)
    b = dict(base, tp_size=draw(st.sampled_from(tps)), block_size=16)
    if what == "layout":
        b["layout"] = draw(st.sampled_from([Layout.KV_FIRST, Layout.BLOCKS_FIRST]))
        b["head_order"] = draw(st.sampled_from(list(HeadOrder)))
    elif what == "order":
        a["head_order"], b["head_order"] = draw(st.permutations([HeadOrder.HND, HeadOrder.NHD]))
    else:
        # logical sizes may even be equal: the kernel (physical) sizes decide
        b["block_size"] = draw(st.sampled_from([16, 32, 64]))
        b["kernel_blocks_per_block"] = draw(st.sampled_from(
            [n for n in (1, 2, 4) if b["block_size"] // n != 16]))
    pair = [EngineSpec("a", **a), EngineSpec("b", **b)]
    if draw(st.booleans()):
        pair.reverse()
    return what, pair[0], pair[1]


@settings(max_examples=200, deadline=None)
@given(packed_vs_other())
def test_packed_pairs_only_with_packed_of_same_order_and_kernel_size(case):
    what, prefill, decode = case
    needle = {"layout": "both engines must use the same vLLM-style packed cache",
              "order": "same head order", "kernel": "equal kernel (physical) block sizes"}[what]
    try:
        plan_transfer(prefill, decode)
    except TopologyError as exc:
        assert needle in str(exc), exc
        if what == "layout":
            assert "packed" in str(exc) and ("kv-first" in str(exc) or "blocks-first" in str(exc))
    else:
        raise AssertionError(f"{what}: {prefill} -> {decode} was planned")
