"""EngineFacts round trips, metadata consistency checks, schema evolution."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from handshake_helpers import make_metadata, make_spec, mamba_spec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.handshake import (
    AgentMetadata,
    EngineFacts,
    InvalidMetadata,
    check_metadata,
    decode_metadata,
    encode_metadata,
    metadata_problems,
)
from kvbridge.topology import ConvLayout, EngineSpec, HeadOrder, Layout, MambaSpec, TopologyError


def test_engine_facts_carries_every_engine_spec_field():
    spec_fields = [f.name for f in dataclasses.fields(EngineSpec)]
    assert list(EngineFacts.__struct_fields__) == spec_fields
    mamba_fields = [f.name for f in dataclasses.fields(MambaSpec)]
    from kvbridge.handshake import MambaSpecFacts

    assert list(MambaSpecFacts.__struct_fields__) == mamba_fields


SPECS = [
    make_spec(2),
    make_spec(8, num_kv_heads=4),  # replicated heads
    make_spec(4, layout=Layout.BLOCKS_FIRST, head_order=HeadOrder.NHD, dtype="fp8"),
    make_spec(2, use_mla=True, num_kv_heads=1, head_dim=576),
    make_spec(1, cross_layer=True, kernel_blocks_per_block=2, block_size=32),
    make_spec(2, block_bytes=2 * 16 * 128 * 8 * 2 + 512, layout=Layout.BLOCKS_FIRST,
              extra=(("quant", "none"), ("rope", "yarn"))),
    mamba_spec(2),
    make_spec(4, layout=Layout.PACKED, kernel_blocks_per_block=2, block_size=32),
    make_spec(2, layout=Layout.PACKED, head_order=HeadOrder.NHD, block_bytes=8 * 32 * 128 * 2 + 64),
    make_spec(2, engine_id="h", num_kv_heads=8, layout=Layout.BLOCKS_FIRST,
              mamba=MambaSpec(ssm_heads=32, ssm_head_dim=64, state_size=64, n_groups=2,
                              conv_width=4, conv_layout=ConvLayout.TOKEN_FIRST)),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.engine_id}-{s.layout.value}-tp{s.tp_size}")
def test_engine_facts_round_trip_exact(spec):
    facts = EngineFacts.from_spec(spec)
    assert facts.to_spec() == spec
    # through the wire too: enums travel as their string values
    wire = msgspec.msgpack.encode(facts)
    assert spec.layout.value.encode() in wire
    back = msgspec.msgpack.decode(wire, type=EngineFacts)
    assert back == facts
    assert back.to_spec() == spec
    assert isinstance(back.to_spec().layout, Layout)


@st.composite
def engine_specs(draw) -> EngineSpec:
    heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8, 16) if t % heads == 0 or heads % t == 0]))
    kbpb = draw(st.sampled_from([1, 2, 4]))
    hybrid = draw(st.booleans())
    mla = not hybrid and draw(st.booleans())
    layout = Layout.BLOCKS_FIRST if hybrid else (
        Layout.KV_FIRST if mla else draw(st.sampled_from(list(Layout))))
    mamba = None
    if hybrid:
        mamba = MambaSpec(ssm_heads=32, ssm_head_dim=64, state_size=16, n_groups=draw(
            st.sampled_from([1, 2, 8])), conv_width=4,
            conv_layout=draw(st.sampled_from(list(ConvLayout))))
    extra = tuple(draw(st.lists(st.tuples(st.text(max_size=5), st.text(max_size=5)), max_size=3)))
    return EngineSpec(
        engine_id=draw(st.text(min_size=1, max_size=12)), tp_size=tp,
        num_kv_heads=heads, head_dim=draw(st.sampled_from([64, 128])),
        num_layers=draw(st.integers(1, 100)), block_size=16 * kbpb * draw(st.integers(1, 4)),
        dtype=draw(st.sampled_from(["bf16", "fp16", "fp8", "fp32"])),
        kernel_blocks_per_block=kbpb, layout=layout,
        head_order=draw(st.sampled_from(list(HeadOrder))), use_mla=mla, mamba=mamba,
        # a packed cross-layer cache is not supported (yet)
        cross_layer=layout is not Layout.PACKED and draw(st.booleans()), extra=extra,
    )


@settings(max_examples=150, deadline=None)
@given(engine_specs())
def test_engine_facts_round_trip_property(spec):
    facts = msgspec.msgpack.decode(msgspec.msgpack.encode(EngineFacts.from_spec(spec)),
                                   type=EngineFacts)
    assert facts.to_spec() == spec


def test_packed_spec_round_trips_through_metadata():
    spec = make_spec(4, num_kv_heads=8, layout=Layout.PACKED, kernel_blocks_per_block=2,
                     block_size=32)
    md = make_metadata(spec, 3)
    assert md.layout == "packed" and len(md.region_base_addrs) == 4  # one region per layer
    assert md.block_lens == [2 * 32 * 2 * 128 * 2] * 4  # 2 heads x K and V x 32 tokens x 128 x bf16
    assert metadata_problems(md) == []
    back = decode_metadata(encode_metadata(md))
    assert back == md and back.engine.to_spec() == spec and back.engine.to_spec().is_packed
    # the metadata's own layout field must agree with the engine facts
    assert any("layout" in p for p in metadata_problems(msgspec.structs.replace(md, layout="kv-first")))
    # facts that describe an impossible packed engine are refused, not decoded into one
    bad = msgspec.structs.replace(md.engine, use_mla=True, num_kv_heads=1)
    assert any("packed layout" in p for p in metadata_problems(msgspec.structs.replace(md, engine=bad)))


def test_invalid_engine_facts_raise_topology_errors():
    facts = EngineFacts.from_spec(make_spec(2))
    with pytest.raises(ValueError):
        msgspec.structs.replace(facts, layout="sideways").to_spec()
    with pytest.raises(TopologyError):
        msgspec.structs.replace(facts, tp_size=3).to_spec()  # 16 heads over 3 ranks


def test_consistent_metadata_has_no_problems():
    for spec in SPECS:
        for rank in range(spec.tp_size):
            md = make_metadata(spec, rank)
            assert metadata_problems(md) == []
            assert check_metadata(md) is md
            assert decode_metadata(encode_metadata(md)) == md


BAD = {
    "empty engine id": dict(engine_id=""),
    "rank outside tp": dict(rank=2),
    "negative device": dict(device_id=-1),
    "zero blocks": dict(num_blocks=0),
    "memory type": dict(memory_type="HBM"),
    "layout value": dict(layout="sideways"),
    "head order": dict(head_order="DHN"),
    "no agent metadata": dict(agent_metadata=b""),
    "region counts": dict(block_lens=[4096]),
    "no regions": dict(region_base_addrs=[], region_sizes=[], block_lens=[]),
    "region too small": dict(num_blocks=65),
    "address overflow": dict(region_base_addrs=[(1 << 64) - 10] * 8),
    "zero block len": dict(block_lens=[0] * 8),
    "engine id vs facts": dict(engine_id="other"),
    "tp vs facts": dict(tp_size=4),
    "block size vs facts": dict(block_size=32),
    "kernel blocks": dict(kernel_blocks_per_block=3),
    "layout vs facts": dict(layout="blocks-first"),
    "invalid engine facts": dict(engine=EngineFacts(engine_id="prefill-0", tp_size=2,
                                                    num_kv_heads=3, head_dim=128, num_layers=4,
                                                    block_size=16)),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_inconsistency_is_reported(name):
    md = make_metadata(make_spec(2), 0)
    assert len(md.region_base_addrs) == 8
    bad = msgspec.structs.replace(md, **BAD[name])
    problems = metadata_problems(bad)
    assert problems, name
    with pytest.raises(InvalidMetadata) as info:
        check_metadata(bad)
    assert "inconsistent" in str(info.value)


def test_problem_messages_name_the_field():
    md = make_metadata(make_spec(2), 0)
    msg = " ".join(metadata_problems(msgspec.structs.replace(md, num_blocks=65)))
    assert "region 0" in msg and "num_blocks 65" in msg
    msg = " ".join(metadata_problems(msgspec.structs.replace(md, memory_type="HBM")))
    assert "memory_type" in msg and "DRAM" in msg


# ----- schema evolution ------------------------------------------------------

def _as_dict(md: AgentMetadata) -> dict:
    return msgspec.msgpack.decode(encode_metadata(md))


def test_older_payload_without_newer_fields_decodes():
    md = make_metadata(mamba_spec(2), 1)
    old = _as_dict(md)
    # fields with defaults are the ones a later version may have added
    for key in ("dtype", "kernel_blocks_per_block", "head_order", "use_mla", "cross_layer",
                "block_bytes", "extra"):
        old["engine"].pop(key)
    old["engine"]["mamba"] = {k: v for k, v in old["engine"]["mamba"].items()
                              if k not in ("conv_dtype_size", "ssm_dtype_size", "conv_layout")}
    back = decode_metadata(msgspec.msgpack.encode(old))
    assert back.engine.dtype == "bf16" and back.engine.extra == ()
    assert back.engine.mamba.conv_layout == "dim-first"
    assert back.engine.to_spec() == mamba_spec(2)  # defaults equal what was dropped
    assert metadata_problems(back) == []


def test_newer_payload_with_unknown_fields_decodes():
    md = make_metadata(make_spec(4), 3)
    new = _as_dict(md)
    new["rdma_keys"] = [b"k1", b"k2"]
    new["future"] = {"nested": [1, 2, {"x": None}]}
    new["engine"]["speculative_layers"] = 2
    back = decode_metadata(msgspec.msgpack.encode(new))
    assert back == md


def test_required_field_missing_is_a_clear_decode_error():
    d = _as_dict(make_metadata(make_spec(2), 0))
    del d["agent_metadata"]
    with pytest.raises(msgspec.ValidationError, match="agent_metadata"):
        decode_metadata(msgspec.msgpack.encode(d))


def test_encoded_size_is_compact_for_160_regions():
    spec = make_spec(8, layers=80, num_kv_heads=8)
    md = make_metadata(spec, 0)
    assert len(md.region_base_addrs) == 160
    data = encode_metadata(md)
    # 160 regions x (address, size, block length) must not cost more than ~20 bytes each
    assert len(data) < 160 * 20 + 1024, len(data)


def test_payload_with_a_dropped_field_decodes():
    """Earlier kvbridge versions sent ``ssm_sizes`` (never read); the decoder ignores it."""
    md = make_metadata(mamba_spec(2), 1)
    old = _as_dict(md)
    old["ssm_sizes"] = [4096, 65536]
    back = decode_metadata(msgspec.msgpack.encode(old))
    assert back == md and metadata_problems(back) == []


def test_groups_travel_in_the_engine_facts():
    import msgspec

    from kvbridge.handshake import CacheGroupFacts, EngineFacts
    from kvbridge.topology import CacheGroup, EngineSpec, GroupKind

    groups = (CacheGroup(GroupKind.FULL, (1, 3), 16), CacheGroup(GroupKind.SLIDING, (0, 2), 16, 128))
    s = EngineSpec("p", 2, 4, 64, 4, 16, groups=groups)
    facts = EngineFacts.from_spec(s)
    assert facts.groups[1] == CacheGroupFacts(kind="sliding", layers=(0, 2), block_size=16,
                                              sliding_window=128)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(facts), type=EngineFacts)
    assert back.to_spec() == s
    # an older peer sends no groups: one FULL group of every layer
    old = msgspec.msgpack.encode({k: v for k, v in msgspec.to_builtins(facts).items() if k != "groups"})
    assert msgspec.msgpack.decode(old, type=EngineFacts).to_spec().groups == ()
