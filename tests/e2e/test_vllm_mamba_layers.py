"""kvbridge.vllm.mamba_layers against vLLM's real ``MambaMixer2`` (no engine): the layers of
the tiny Zamba2 (one B/C group, replicated over TP ranks) and Nemotron-H (two groups,
sharded) built as rank 0 of TP 1 and TP 2, read from the static forward context as the
connector reads them, checked against vLLM's own state shapes. The TP group is a stand-in
(world size, rank); everything else is vLLM's, so a renamed attribute in a new vLLM
release fails here before a user meets it."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm.distributed.parallel_state as parallel_state  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2  # noqa: E402

from kvbridge.vllm.mamba_layers import mamba_layer_geometry, mamba_spec_from_layers  # noqa: E402

#: (heads, head_dim, groups) of scripts/make_tiny_hybrids.py's Zamba2 and Nemotron-H
MODELS = {"zamba2": (4, 64, 1), "nemotronh": (8, 32, 2)}


def _engine_layers(model: str, tp: int) -> tuple[VllmConfig, dict[str, tuple]]:
    """Two Mamba layers of ``model`` as rank 0 of a TP ``tp`` engine builds them; their
    names -> vLLM's per-rank (conv, SSM) state shapes."""
    heads, head_dim, groups = MODELS[model]
    cfg = VllmConfig()
    shapes = {}
    tp_group = SimpleNamespace(world_size=tp, rank_in_group=0, rank=0)
    with mock.patch.object(parallel_state, "_TP", tp_group), set_current_vllm_config(cfg):
        for i in (0, 2):
            layer = MambaMixer2(hidden_size=128, ssm_state_size=16, conv_kernel_size=4,
                                intermediate_size=heads * head_dim, use_conv_bias=True,
                                use_bias=False, n_groups=groups, num_heads=heads, head_dim=head_dim,
                                model_config=SimpleNamespace(dtype=torch.float32),
                                cache_config=cfg.cache_config, prefix=f"model.layers.{i}.mixer")
            shapes[f"model.layers.{i}.mixer"] = tuple(layer.get_state_shape())
    return cfg, shapes


@pytest.mark.parametrize("model", sorted(MODELS))
def test_vllms_mixer_gives_one_model_geometry_at_every_tp_size(model: str) -> None:
    specs = {}
    for tp in (1, 2):
        cfg, shapes = _engine_layers(model, tp)
        layers = mamba_layer_geometry(cfg, list(shapes))
        assert set(layers) == set(shapes)
        (state,) = set(shapes.values())
        assert len(state) == 2, state  # conv and SSM state, nothing else
        dim_first = state[0][0] > state[0][1]
        specs[tp] = mamba_spec_from_layers(layers, tp_size=tp, state_shapes=state,
                                           state_dtypes=("fp32", "fp32"), mamba_type="MAMBA2",
                                           dim_first=dim_first)
        geo = layers["model.layers.0.mixer"]
        assert geo.replicated is (tp == 2 and MODELS[model][2] == 1)
    heads, head_dim, groups = MODELS[model]
    assert specs[1] == specs[2]
    assert (specs[1].ssm_heads, specs[1].ssm_head_dim, specs[1].n_groups, specs[1].state_size,
            specs[1].conv_width) == (heads, head_dim, groups, 16, 3)
