"""Describing vLLM KV-cache tensors as kvbridge engines (kvbridge.vllm.cachespec)."""

from __future__ import annotations

import pytest

from kvbridge.topology import HeadOrder, Layout
from kvbridge.vllm.cachespec import (
    CacheShapeError,
    LayerTensor,
    ModelFacts,
    dtype_name,
    engine_spec_for,
    layer_sort_key,
    model_identity,
)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def permuted(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a logical ``shape`` whose memory order is ``order`` (outermost first)."""
    phys = contiguous_strides(tuple(shape[i] for i in order))
    out = [0] * len(shape)
    for pos, dim in enumerate(order):
        out[dim] = phys[pos]
    return tuple(out)


FACTS = ModelFacts(engine_id="E", tp_size=2, num_kv_heads=8, head_dim=64, block_size=32,
                   num_blocks=100)


def layers(shape, stride=None, dtype="float32", n=3):
    stride = stride or contiguous_strides(shape)
    return [LayerTensor(f"model.layers.{i}.self_attn.attn", shape, stride, dtype) for i in range(n)]


def test_vllm_032_packed_hnd_cache() -> None:
    # vLLM 0.32 (CPU backend and LBHNC): [blocks, heads, tokens, 2 * head]
    spec = engine_spec_for(FACTS, layers((100, 4, 32, 128)))
    assert spec.layout is Layout.PACKED and spec.head_order is HeadOrder.HND
    assert (spec.tp_size, spec.num_kv_heads, spec.head_dim, spec.num_layers) == (2, 8, 64, 3)
    assert spec.dtype == "fp32" and spec.kernel_blocks_per_block == 1 and spec.block_size == 32
    # one block of one layer on one rank: 4 heads x 32 tokens x (K and V of 64) x 4 bytes
    assert spec.region_block_bytes == 4 * 32 * 128 * 4


def test_packed_nhd_order_comes_from_the_strides() -> None:
    shape = (100, 4, 32, 128)
    spec = engine_spec_for(FACTS, layers(shape, permuted(shape, (0, 2, 1, 3))))  # LBNHC
    assert spec.layout is Layout.PACKED and spec.head_order is HeadOrder.NHD


def test_kernel_blocks_smaller_than_scheduler_blocks() -> None:
    spec = engine_spec_for(FACTS, layers((200, 4, 16, 128)))
    assert spec.kernel_blocks_per_block == 2 and spec.kernel_block_size == 16


def test_older_vllm_layouts() -> None:
    # [2, blocks, tokens, heads, head] (FlashAttention NHD) and [2, blocks, heads, tokens, head]
    kv_nhd = engine_spec_for(FACTS, layers((2, 100, 32, 4, 64)))
    assert (kv_nhd.layout, kv_nhd.head_order) == (Layout.KV_FIRST, HeadOrder.NHD)
    kv_hnd = engine_spec_for(FACTS, layers((2, 100, 4, 32, 64)))
    assert (kv_hnd.layout, kv_hnd.head_order) == (Layout.KV_FIRST, HeadOrder.HND)
    # [blocks, 2, heads, tokens, head] (FlashInfer HND)
    bf = engine_spec_for(FACTS, layers((100, 2, 4, 32, 64), dtype="bfloat16"))
    assert (bf.layout, bf.head_order, bf.dtype) == (Layout.BLOCKS_FIRST, HeadOrder.HND, "bf16")


def test_mla_latent_cache() -> None:
    facts = ModelFacts(engine_id="E", tp_size=4, num_kv_heads=1, head_dim=576, block_size=64,
                       num_blocks=10, use_mla=True)
    spec = engine_spec_for(facts, layers((10, 64, 576), dtype="bfloat16"))
    assert spec.use_mla and spec.layout is Layout.KV_FIRST and spec.head_dim == 576
    assert spec.is_replicated  # every rank holds the whole latent
    # vLLM 0.32's CPU_MLA cache: [blocks, 1, tokens, latent] describes the same
    four = engine_spec_for(facts, layers((10, 1, 64, 576), dtype="bfloat16"))
    assert four == spec
    with pytest.raises(CacheShapeError, match="MLA cache must be"):
        engine_spec_for(facts, layers((10, 2, 64, 576)))


def test_replicated_heads_when_tp_exceeds_kv_heads() -> None:
    facts = ModelFacts(engine_id="E", tp_size=4, num_kv_heads=2, head_dim=32, block_size=32,
                       num_blocks=8)
    spec = engine_spec_for(facts, layers((8, 1, 32, 64)))
    assert spec.heads_per_rank == 1 and spec.is_replicated


@pytest.mark.parametrize(("shape", "match"), [
    ((100, 3, 32, 128), "expected \\[blocks, 4 heads"),  # wrong head count for TP 2 of 8 heads
    ((100, 4, 32, 64), "packed per head"),  # content is not K and V
    ((100, 32, 4, 64, 2), "not a layout kvbridge knows"),
    ((99, 4, 32, 128), "whole multiple"),  # blocks do not match the scheduler's count
])
def test_unknown_or_inconsistent_shapes_are_refused(shape, match) -> None:
    with pytest.raises(CacheShapeError, match=match):
        engine_spec_for(FACTS, layers(shape))


def test_layers_must_agree() -> None:
    mixed = layers((100, 4, 32, 128), n=2) + [
        LayerTensor("model.layers.2.self_attn.attn", (100, 4, 32, 128),
                    contiguous_strides((100, 4, 32, 128)), "bfloat16")]
    with pytest.raises(CacheShapeError, match="layers differ"):
        engine_spec_for(FACTS, mixed)
    with pytest.raises(CacheShapeError, match="no KV-cache tensors"):
        engine_spec_for(FACTS, [])


def test_tp_that_cannot_place_heads_is_refused() -> None:
    facts = ModelFacts(engine_id="E", tp_size=3, num_kv_heads=8, head_dim=64, block_size=32,
                       num_blocks=100)
    with pytest.raises(CacheShapeError, match="TP"):
        engine_spec_for(facts, layers((100, 3, 32, 128)))


def test_dtype_names() -> None:
    assert dtype_name("torch.float32") == "fp32"
    assert dtype_name("torch.bfloat16") == "bf16"
    assert dtype_name("torch.float8_e4m3fn") == "fp8_e4m3"
    with pytest.raises(CacheShapeError, match="float64"):
        dtype_name("torch.float64")


def test_layer_order_is_numeric() -> None:
    names = ["model.layers.10.attn", "model.layers.2.attn", "model.layers.1.attn"]
    assert sorted(names, key=layer_sort_key) == [
        "model.layers.1.attn", "model.layers.2.attn", "model.layers.10.attn"]


def test_model_identity_ignores_where_the_checkpoint_lives() -> None:
    a = model_identity(["LlamaForCausalLM"], hidden_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32, vocab_size=1024)
    b = model_identity(["LlamaForCausalLM"], hidden_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32, vocab_size=1024)
    c = model_identity(["LlamaForCausalLM"], hidden_size=128, num_layers=3, num_heads=4,
                       num_kv_heads=2, head_dim=32, vocab_size=1024)
    assert a == b != c and "LlamaForCausalLM" in a
