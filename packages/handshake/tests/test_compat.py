"""The compatibility hash."""

from __future__ import annotations

import inspect

import pytest

from kvbridge.handshake import (
    PROTOCOL_VERSION,
    compat_fields,
    compatibility_hash,
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
