#!/usr/bin/env python3
"""Build a tiny random Llama checkpoint locally (no download) for vLLM e2e tests.

    python scripts/make_tiny_llama.py OUT_DIR [--layers 2] [--kv-heads 2] [--seed 0]

The weights are random but fixed by the seed, so two runs give identical files
and engines built from the same directory compute identical tokens. Run it with
the e2e environment's Python (it needs torch and transformers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build(
    out_dir: Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = 1024,
    intermediate: int = 256,
    max_positions: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a LlamaForCausalLM with random weights to ``out_dir`` and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden != heads * head_dim:
        raise ValueError(
            f"hidden ({hidden}) must equal heads * head_dim ({heads} * {head_dim}); "
            "change --hidden, --heads or --head-dim"
        )
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype=dtype,
    )
    model = LlamaForCausalLM(config)
    # Default init (std 0.02) makes logits nearly flat, so greedy decoding would hinge
    # on rounding noise. Larger weights give decisive argmaxes that survive TP splits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / (p.shape[-1] ** 0.5) * 2.0)
            elif "norm" in name:
                p.fill_(1.0)
    model = model.to(getattr(torch, dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "kvbridge_tiny_llama.json").write_text(
        json.dumps(
            {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
             "head_dim": head_dim, "vocab": vocab, "seed": seed, "dtype": dtype},
            indent=1,
        )
    )
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    out = build(
        args.out_dir, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, head_dim=args.head_dim, vocab=args.vocab,
        intermediate=args.intermediate, max_positions=args.max_positions,
        seed=args.seed, dtype=args.dtype,
    )
    print(f"tiny llama written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
