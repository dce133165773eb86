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
    head_dim = draw(st.sampled_from([8, 64, 128]))
    m = None
    if mamba:
        ssm_heads = draw(st.sampled_from([16, 32]))
        groups = draw(st.sampled_from([1, 2, 4, 8, 16]))
        m = MambaSpec(ssm_heads=ssm_heads, ssm_head_dim=8, state_size=16, n_groups=groups, conv_width=3)
    common = dict(num_kv_heads=8 if mla else k, head_dim=head_dim, num_layers=2, dtype="bf16",
                  layout=layout, use_mla=mla, mamba=m)
    prefill = EngineSpec("p", tp_size=p_tp, block_size=p_bs, **common)
    decode = EngineSpec("d", tp_size=d_tp, block_size=d_bs, **common)
    return prefill, decode


def _check_plan(prefill: EngineSpec, decode: EngineSpec) -> None:
    try:
        plan = plan_transfer(prefill, decode)
    except TopologyError as exc:
        # The only refusal for valid single-engine shapes: larger remote HND blocks
        # holding several heads (local tokens not contiguous remotely).
        assert decode.block_size < prefill.block_size and prefill.heads_per_rank > 1, exc
        return
    k = decode.kv_heads_for_placement
    unit_tokens = min(prefill.block_size, decode.block_size)
    uhb = unit_tokens * decode.head_dim * decode.dtype_size
    sent: dict[int, int] = {}
    for p in plan.decode_ranks:
        mine = _heads(decode.tp_size, k, p.local_rank)
        assert p.local_unit_bytes == len(mine) * uhb
        got: list[int] = []
        for r in p.reads:
            theirs = _heads(prefill.tp_size, k, r.remote_rank)
            assert p.remote_unit_bytes == len(theirs) * uhb
            assert r.length > 0 and r.length % uhb == 0
            assert 0 <= r.remote_offset and r.remote_offset + r.length <= p.remote_unit_bytes
            assert 0 <= r.local_offset and r.local_offset + r.length <= p.local_unit_bytes
            n = r.length // uhb
            carried = theirs[r.remote_offset // uhb : r.remote_offset // uhb + n]
            slots = mine[r.local_offset // uhb : r.local_offset // uhb + n]
            assert carried == slots, (r, theirs, mine)
            got.extend(carried)
        assert sorted(got) == mine, "reads must carry every local head exactly once"
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
        # every piece's local units must be the local rank's own units of that dimension
        for name, units, unit in (
            ("x", mm.ssm_heads, mm.ssm_head_dim * mm.conv_width * mm.conv_dtype_size),
            ("B", mm.n_groups, mm.state_size * mm.conv_width * mm.conv_dtype_size),
            ("C", mm.n_groups, mm.state_size * mm.conv_width * mm.conv_dtype_size),
            ("ssm", mm.ssm_heads, mm.ssm_head_dim * mm.state_size * mm.ssm_dtype_size),
        ):
            pieces = [x for x in f.mamba_pieces if x.name == name]
            mine = _heads(decode.tp_size, units, p.local_rank)
            covered = sum(x.length for x in pieces)
            assert covered == len(mine) * unit
            local_starts = sorted(x.local_offset for x in pieces)
            assert len(set(local_starts)) == len(local_starts)
        if prefill.tp_size > decode.tp_size:
            m = prefill.tp_size // decode.tp_size
            if mm.ssm_heads >= prefill.tp_size:
                assert f.num_mamba_reads == m  # Mamba needs all |ratio| ranks


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
