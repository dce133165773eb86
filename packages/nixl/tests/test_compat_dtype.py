"""The compatibility hash covers the configured KV-cache dtype, not only the tensors' one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbridge.nixl import EngineConfig, engine_compat_hash, engine_compat_info
from kvbridge.topology import EngineSpec, Layout

# an FP8 cache as vLLM hands it over: uint8 tensors whatever the FP8 format
SPEC = EngineSpec(engine_id="E", tp_size=1, num_kv_heads=2, head_dim=16, num_layers=2,
                  block_size=16, dtype="uint8", layout=Layout.PACKED)


def test_two_fp8_formats_in_uint8_tensors_hash_apart() -> None:
    e4m3 = EngineConfig(kv_cache_dtype="fp8_e4m3")
    e5m2 = EngineConfig(kv_cache_dtype="fp8_e5m2")
    assert engine_compat_hash(SPEC, e4m3) != engine_compat_hash(SPEC, e5m2)
    # vLLM's "fp8" is fp8_e4m3: the spellings pair
    assert engine_compat_hash(SPEC, EngineConfig(kv_cache_dtype="fp8")) == engine_compat_hash(SPEC, e4m3)
    assert engine_compat_info(SPEC, e4m3)["cache_dtype"] == "fp8_e4m3"
    assert engine_compat_info(SPEC, e4m3)["dtype"] == "uint8"


def test_without_a_configured_dtype_the_tensor_dtype_is_hashed() -> None:
    fp32 = replace(SPEC, dtype="fp32")
    assert engine_compat_info(fp32, EngineConfig())["cache_dtype"] == "fp32"
    assert engine_compat_hash(fp32, EngineConfig()) == engine_compat_hash(
        fp32, EngineConfig(kv_cache_dtype="float32"))
    assert engine_compat_hash(SPEC, EngineConfig()) != engine_compat_hash(
        SPEC, EngineConfig(kv_cache_dtype="fp8"))


def test_an_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: unknown dtype 'nvfp4'"):
        EngineConfig(kv_cache_dtype="nvfp4")
