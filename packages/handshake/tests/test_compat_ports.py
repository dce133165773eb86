"""Compatibility hash and side-channel port plans."""

from __future__ import annotations

import inspect
import itertools

import pytest

from kvbridge.handshake import (
    PROTOCOL_VERSION,
    PortAllocationError,
    SideChannelPorts,
    compat_fields,
    compatibility_hash,
    side_channel_port,
)

BASE = dict(model="Qwen/Qwen3-8B", dtype="bf16", cache_dtype="fp8", layout="kv-first",
            attention_backend="FLASH_ATTN")


def test_hash_is_deterministic_hex():
    h = compatibility_hash(**BASE)
    assert h == compatibility_hash(**BASE)
    assert len(h) == 64 and int(h, 16) >= 0


@pytest.mark.parametrize("field,value", [
    ("model", "Qwen/Qwen3-14B"), ("dtype", "fp16"), ("cache_dtype", "bf16"),
    ("layout", "blocks-first"), ("attention_backend", "FLASHINFER"),
])
def test_hash_changes_with_each_field(field, value):
    assert compatibility_hash(**{**BASE, field: value}) != compatibility_hash(**BASE)


def test_hash_covers_protocol_version_and_extra():
    h = compatibility_hash(**BASE)
    assert compatibility_hash(**BASE, protocol_version=PROTOCOL_VERSION + 1) != h
    e1 = compatibility_hash(**BASE, extra={"quant": "awq", "rope": "yarn"})
    assert e1 != h
    assert e1 == compatibility_hash(**BASE, extra={"rope": "yarn", "quant": "awq"})
    assert e1 != compatibility_hash(**BASE, extra={"quant": "gptq", "rope": "yarn"})
    # an extra key cannot impersonate a main field
    assert compatibility_hash(**{**BASE, "model": "x"}) != compatibility_hash(
        **{**BASE, "model": "x"}, extra={"model": "y"})


def test_hash_never_includes_tp_size():
    params = inspect.signature(compatibility_hash).parameters
    assert not any("tp" in p or "rank" in p for p in params)


def test_dtype_aliases_and_backend_case_fold():
    h = compatibility_hash(**BASE)
    assert compatibility_hash(**{**BASE, "dtype": "torch.bfloat16"}) == h
    assert compatibility_hash(**{**BASE, "dtype": "BFloat16"}) == h
    assert compatibility_hash(**{**BASE, "attention_backend": "flash_attn"}) == h
    assert compat_fields(**BASE)["cache_dtype"] == "fp8_e4m3"  # one dtype table: fp8 is e4m3
    assert compatibility_hash(**{**BASE, "cache_dtype": "float8_e4m3fn"}) == h


# ----- ports -----------------------------------------------------------------

def test_ports_never_collide_within_the_plan():
    plan = SideChannelPorts(20000, replicas_per_engine=3, ports_per_replica=8, engines=4)
    ports = [plan.port(engine_index=e, replica=r, rank=k)
             for e, r, k in itertools.product(range(4), range(3), range(8))]
    assert len(set(ports)) == len(ports) == 96
    assert sorted(ports) == plan.all_ports() == list(range(20000, 20096))


def test_port_formula():
    assert side_channel_port(5600) == 5600
    assert side_channel_port(5600, engine_index=1) == 5601
    assert side_channel_port(5600, engine_index=2, replica=1, rank=3, replicas_per_engine=2,
                             ports_per_replica=4) == 5600 + (2 * 2 + 1) * 4 + 3


def test_out_of_bound_indices_raise_instead_of_colliding():
    with pytest.raises(PortAllocationError, match="replicas_per_engine"):
        side_channel_port(5600, replica=1)
    with pytest.raises(PortAllocationError, match="ports_per_replica"):
        side_channel_port(5600, rank=1)
    with pytest.raises(PortAllocationError, match="engines"):
        SideChannelPorts(5600, engines=2).port(engine_index=2)
    with pytest.raises(PortAllocationError):
        side_channel_port(5600, engine_index=-1)
    with pytest.raises(PortAllocationError):
        side_channel_port(0)
    with pytest.raises(PortAllocationError):
        side_channel_port(5600, rank=True)  # type: ignore[arg-type]


def test_overflow_past_65535_raises():
    assert side_channel_port(65535) == 65535
    with pytest.raises(PortAllocationError, match="65535"):
        side_channel_port(65535, engine_index=1)
    with pytest.raises(PortAllocationError, match="65535"):
        SideChannelPorts(65000, replicas_per_engine=4, ports_per_replica=16, engines=10)
    with pytest.raises(PortAllocationError):
        SideChannelPorts(65536)
    with pytest.raises(PortAllocationError, match="engines="):
        SideChannelPorts(5600).all_ports()
