#!/usr/bin/env python3
"""Build a tiny random Llama checkpoint locally (no download) for vLLM e2e tests.

    python scripts/make_tiny_llama.py OUT_DIR [--layers 2] [--kv-heads 2] [--seed 0] [--word-tokenizer]

The weights are random but fixed by the seed, so two runs give identical files
and engines built from the same directory compute identical tokens. Run it with
the e2e environment's Python (it needs torch and transformers).

With ``--word-tokenizer`` the folder also gets a word-level tokenizer built
locally with the ``tokenizers`` package (no download): token ``i`` is the word
``w<i>`` (0-3 are <pad>, <s>, </s>, <unk>), words are split on whitespace, and a
minimal chat template joins the message contents. Text prompts such as
``"w17 w503 w9"`` then map one word to one token, so OpenAI servers can take
text prompts and chat messages.
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


SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def write_word_tokenizer(out_dir: Path, vocab: int = 1024) -> Path:
    """Write tokenizer.json and tokenizer_config.json for a ``vocab``-word tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    words.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>",
        "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False,
        "model_max_length": 2048, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
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
    ap.add_argument("--word-tokenizer", action="store_true",
                    help="also write a word-level tokenizer (words w0..w<vocab-1>) and a chat template")
    args = ap.parse_args(argv)
    out = build(
        args.out_dir, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, head_dim=args.head_dim, vocab=args.vocab,
        intermediate=args.intermediate, max_positions=args.max_positions,
        seed=args.seed, dtype=args.dtype,
    )
    if args.word_tokenizer:
        write_word_tokenizer(out, args.vocab)
    print(f"tiny llama written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
