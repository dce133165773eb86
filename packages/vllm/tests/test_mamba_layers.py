"""Mamba geometry from vLLM's layer objects (kvbridge.vllm.mamba_layers): what vLLM computed
for the running engine, not the model configuration's attribute names, so a single group
that vLLM replicates over TP ranks is told from groups that shard, and two engines of
different TP sizes describe the same model alike."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import vllm_shapes as vs

from kvbridge.topology import (
    ConvLayout,
    EngineSpec,
    GroupKind,
    Layout,
    TopologyError,
    check_compatible,
)
from kvbridge.vllm import ConnectorConfig, register_caches
from kvbridge.vllm.cachespec import CacheShapeError
from kvbridge.vllm.kv_cache_groups import GroupFacts, mamba_spec_for
from kvbridge.vllm.mamba_layers import (
    MambaLayerGeometry,
    layer_geometry,
    mamba_layer_geometry,
    mamba_spec_from_layers,
)

CFG = ConnectorConfig(ucx_threads=0, huge_pages=False)

# Zamba2 of scripts/make_tiny_hybrids.py: 4 SSM heads of 64, 1 group, state 16, kernel 4
ZAMBA2 = dict(heads=4, head_dim=64, state=16, groups=1)
# Nemotron-H of scripts/make_tiny_hybrids.py: 8 heads of 32, 2 groups (they shard over TP 2)
NEMOTRONH = dict(heads=8, head_dim=32, state=16, groups=2)


def _spec(layer: object, *, tp: int, dim_first: bool = True, dtypes=("fp32", "fp32")):
    geo = layer_geometry(layer)
    assert geo is not None
    return mamba_spec_from_layers({"m": geo}, tp_size=tp, state_shapes=geo.state_shapes(dim_first=dim_first),
                                  state_dtypes=dtypes, mamba_type=geo.mamba_type, dim_first=dim_first)


def _engine(m, tp: int) -> EngineSpec:
    return EngineSpec(f"e{tp}", tp, 4, 64, 4, 256, dtype="fp32", layout=Layout.PACKED, mamba=m)


@pytest.mark.parametrize("model", [ZAMBA2, NEMOTRONH])
def test_layers_describe_the_same_model_at_every_tp_size(model) -> None:
    """The check that refused Zamba2 at TP 2 -> 1 ("n_groups=1 vs n_groups=2"): both
    engines now describe the checkpoint's groups, and the handshake's compatibility check
    accepts them."""
    specs = {tp: _spec(vs.MambaMixer2(**model, tp=tp), tp=tp) for tp in (1, 2)}
    assert specs[1] == specs[2]
    assert specs[1].n_groups == model["groups"] and specs[1].ssm_heads == model["heads"]
    assert specs[1].conv_width == 3 and specs[1].conv_layout is ConvLayout.DIM_FIRST
    check_compatible(_engine(specs[1], 1), _engine(specs[2], 2))


def test_replicated_group_is_told_from_sharded_groups() -> None:
    """At TP 2 both models hold one group per rank; only vLLM's layers tell that Zamba2's is
    a copy of its single group and Nemotron-H's are two different groups."""
    z, n = (layer_geometry(vs.MambaMixer2(**m, tp=2)) for m in (ZAMBA2, NEMOTRONH))
    assert z is not None and n is not None
    assert (z.n_groups, z.allocated_groups, z.replicated) == (1, 2, True)
    assert (n.n_groups, n.allocated_groups, n.replicated) == (2, 2, False)
    # per-rank conv channels: x (heads/2 * head_dim) + B and C (one group of 16 each)
    assert z.state_shapes(dim_first=True) == ((128 + 32, 3), (2, 64, 16))
    assert n.state_shapes(dim_first=False) == ((3, 128 + 32), (4, 32, 16))


def test_gated_delta_net_maps_value_heads_and_key_groups() -> None:
    """GDN's SSM state is [value heads, value dim, key dim]; with unequal key and value head
    dims the mapping shows (value heads as SSM heads, key heads as groups)."""
    layer = vs.GatedDeltaNet(k_heads=2, v_heads=4, k_dim=64, v_dim=128, tp=2)
    geo = layer_geometry(layer)
    assert geo is not None and geo.mamba_type == "GDN_ATTN"
    assert geo.state_shapes(dim_first=True) == (((2 * 2 * 64 + 4 * 128) // 2, 3), (2, 128, 64))
    m = _spec(layer, tp=2, dtypes=("bf16", "bf16"))
    assert (m.ssm_heads, m.ssm_head_dim, m.state_size, m.n_groups) == (4, 128, 64, 2)
    # the shapes-only fallback reads vLLM's GDN state the same way
    facts = GroupFacts(GroupKind.MAMBA, ("m",), 512, state_shapes=geo.state_shapes(dim_first=True),
                       state_dtypes=("bf16", "bf16"), mamba_type="GDN_ATTN")
    assert mamba_spec_for(facts, tp_size=2, dim_first=True) == m


def test_layers_that_disagree_with_vllms_cache_spec_are_refused() -> None:
    geo = layer_geometry(vs.MambaMixer2(**ZAMBA2, tp=2))
    assert geo is not None
    shapes = geo.state_shapes(dim_first=True)
    with pytest.raises(CacheShapeError, match="KV-cache spec holds"):  # conv layout swapped
        mamba_spec_from_layers({"m": geo}, tp_size=2, state_shapes=shapes, state_dtypes=("fp32",) * 2,
                               mamba_type="MAMBA2", dim_first=False)
    with pytest.raises(CacheShapeError, match="TP 2, the engine runs TP 1"):
        mamba_spec_from_layers({"m": geo}, tp_size=1, state_shapes=shapes, state_dtypes=("fp32",) * 2,
                               mamba_type="MAMBA2", dim_first=True)
    with pytest.raises(CacheShapeError, match="holds GDN_ATTN state"):
        mamba_spec_from_layers({"m": geo}, tp_size=2, state_shapes=shapes, state_dtypes=("fp32",) * 2,
                               mamba_type="GDN_ATTN", dim_first=True)
    other = replace(geo, state_size=32)
    with pytest.raises(CacheShapeError, match="different geometries"):
        mamba_spec_from_layers({"a": geo, "b": other}, tp_size=2, state_shapes=shapes,
                               state_dtypes=("fp32",) * 2, mamba_type="MAMBA2", dim_first=True)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    (dict(n_groups=2, allocated_groups=4, tp_size=4), "replicates only a single group"),
    (dict(heads=6, tp_size=4, allocated_groups=4, n_groups=1), "do not split over TP 4"),
    (dict(head_dim=0), "head_dim must be a positive integer"),
])
def test_impossible_geometry_is_refused(kwargs, fragment: str) -> None:
    base = dict(mamba_type="MAMBA2", tp_size=2, heads=8, head_dim=32, state_size=16, n_groups=2,
                allocated_groups=2, conv_kernel=4)
    with pytest.raises(CacheShapeError, match=fragment):
        MambaLayerGeometry(**{**base, **kwargs})


def test_layers_kvbridge_cannot_read_are_left_out() -> None:
    attn = SimpleNamespace(num_heads=4)  # an attention layer: no Mamba backend
    no_norm = vs.MambaMixer2(**ZAMBA2)
    del no_norm.ssm_state_size  # another layer class: not described from guesses
    ctx = {"a": attn, "m": no_norm, "z": vs.MambaMixer2(**ZAMBA2)}
    cfg = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx))
    assert set(mamba_layer_geometry(cfg, ["a", "m", "z", "absent"])) == {"z"}
    assert mamba_layer_geometry(SimpleNamespace(), ["z"]) == {}


def _granite_tp2(layers: bool):
    """One rank of the tiny Granite at TP 2 (1 group, replicated; conv (128 + 2 * 16, 3)): the
    caches of the TP 1
    fixture, state shapes halved, and vLLM's layers (or none) in the forward context."""
    fam = vs.granite()
    half = vs.MambaSpec(512, ((160, 3), (4, 32, 16)), (vs.torch.float32,) * 2,
                        65536)
    mixers = {n: vs.MambaMixer2(heads=8, head_dim=32, state=16, groups=1, tp=2)
              for n in ("model.layers.0.mixer", "model.layers.2.mixer")}
    fam.kv_cache_config.kv_cache_groups[0] = vs.KVCacheGroupSpec(
        fam.kv_cache_config.kv_cache_groups[0].layer_names, half)
    nb = fam.kv_cache_config.num_blocks
    for i, off in ((1, 0), (3, nb * 65536)):  # one KV head per rank: 256 tokens fill the page
        fam.caches[f"model.layers.{i}.self_attn.attn"] = vs._attn(fam.buffers[0], off, nb, 256,
                                                                  vs.torch.float32, heads=1)
    fam.kv_cache_config.kv_cache_groups[1] = vs.KVCacheGroupSpec(
        fam.kv_cache_config.kv_cache_groups[1].layer_names, vs.FullAttentionSpec(256))
    fam.kv_cache_config.__post_init__()
    fam.vllm_config.parallel_config.tensor_parallel_size = 2
    fam.vllm_config.compilation_config.static_forward_context = mixers if layers else {}
    return fam


def test_registration_takes_the_groups_from_vllms_layers() -> None:
    """Granite at TP 2 per rank holds 128 x channels + one B and one C group; registration
    describes the checkpoint's single group (as the TP 1 engine does), not two."""
    fam = _granite_tp2(layers=True)
    assert mamba_layer_geometry(fam.vllm_config, ["model.layers.0.mixer"])["model.layers.0.mixer"].replicated
    tp1 = vs.granite(dim_first=True)
    reg1 = register_caches(tp1.vllm_config, tp1.kv_cache_config, tp1.caches, CFG, engine_id="a",
                           attention_backend="t", conv_dim_first=True)
    reg2 = register_caches(fam.vllm_config, fam.kv_cache_config, fam.caches, CFG, engine_id="b",
                           attention_backend="t", conv_dim_first=True)
    assert reg1.spec.mamba == reg2.spec.mamba and reg2.spec.mamba.n_groups == 1
    # without vLLM's layers the shapes alone read as two sharded groups, which the
    # handshake refuses against an engine that read them: the layers make the difference
    bare = _granite_tp2(layers=False)
    reg_bare = register_caches(bare.vllm_config, bare.kv_cache_config, bare.caches, CFG,
                               engine_id="c", attention_backend="t", conv_dim_first=True)
    assert reg_bare.spec.mamba.n_groups == 2
    with pytest.raises(TopologyError, match="Mamba"):
        check_compatible(reg2.spec, reg_bare.spec)
