"""Deployment-shape flags shared by ``kvbridge plan`` and the commands other packages add.

:func:`add_shape_arguments` declares the flags on an ``argparse`` parser and
:func:`engines_from_args` turns the parsed flags into the (prefill, decode)
engine descriptions.
"""

from __future__ import annotations

import argparse

from .dtypes import dtype_size
from .spec import EngineSpec, HeadOrder, Layout, MambaSpec

_DTYPES = ("bf16", "fp16", "fp32", "fp8")


def add_shape_arguments(parser: argparse.ArgumentParser, *, defaults: dict | None = None,
                        mamba: bool = False) -> None:
    """The deployment-shape flags shared by ``plan``, ``demo`` and ``bench``; with
    ``mamba`` also ``--mamba`` (a hybrid attention + Mamba-2 model)."""
    d = {
        "prefill_tp": None, "decode_tp": None, "kv_heads": None, "head_dim": 128, "layers": 80,
        "dtype": "bf16", "prefill_block_size": 16, "decode_block_size": 16,
        "ssm_heads": 64, "ssm_head_dim": 64, "ssm_state": 128, "ssm_groups": 8, "conv_width": 3,
    }
    d.update(defaults or {})
    req = {k: d[k] is None for k in ("prefill_tp", "decode_tp", "kv_heads")}
    parser.add_argument("--prefill-tp", type=int, required=req["prefill_tp"], default=d["prefill_tp"],
                        metavar="N", help="prefill engine TP size")
    parser.add_argument("--decode-tp", type=int, required=req["decode_tp"], default=d["decode_tp"],
                        metavar="M", help="decode engine TP size")
    parser.add_argument("--kv-heads", type=int, required=req["kv_heads"], default=d["kv_heads"],
                        metavar="K", help="total KV heads of the model")
    parser.add_argument("--head-dim", type=int, default=d["head_dim"], metavar="D",
                        help=f"head dimension (default {d['head_dim']})")
    parser.add_argument("--layers", type=int, default=d["layers"], metavar="L",
                        help=f"attention layers (default {d['layers']})")
    parser.add_argument("--dtype", choices=_DTYPES, default=d["dtype"],
                        help=f"KV cache dtype (default {d['dtype']})")
    parser.add_argument("--prefill-block-size", type=int, default=d["prefill_block_size"], metavar="B",
                        help=f"prefill block size in tokens (default {d['prefill_block_size']})")
    parser.add_argument("--decode-block-size", type=int, default=d["decode_block_size"], metavar="B",
                        help=f"decode block size in tokens (default {d['decode_block_size']})")
    parser.add_argument("--layout", choices=[x.value for x in Layout], default=None,
                        help="cache layout of both engines: kv-first, blocks-first, or packed (K and V "
                        "of each head together, vLLM >= 0.32) (default kv-first"
                        + ("; blocks-first with --mamba, which takes blocks-first or packed)" if mamba else ")"))
    parser.add_argument("--head-order", choices=[x.value for x in HeadOrder], default="HND",
                        help="order inside a K/V element on both engines (default HND)")
    parser.add_argument("--mla", action="store_true", help="MLA latent cache (one replicated latent)")
    if mamba:
        parser.add_argument("--mamba", action="store_true", help="hybrid attention + Mamba-2 model")
        for flag, key, what in (("--ssm-heads", "ssm_heads", "Mamba SSM heads"),
                                ("--ssm-head-dim", "ssm_head_dim", "Mamba SSM head dimension"),
                                ("--ssm-state", "ssm_state", "Mamba SSM state size"),
                                ("--ssm-groups", "ssm_groups", "Mamba B/C groups"),
                                ("--conv-width", "conv_width", "Mamba conv state columns")):
            parser.add_argument(flag, type=int, default=d[key], metavar="N",
                                help=f"{what}, with --mamba (default {d[key]})")


def engines_from_args(args: argparse.Namespace) -> tuple[EngineSpec, EngineSpec]:
    """Build (prefill, decode) specs from the shape flags; raises TopologyError."""
    mamba = None
    layout = args.layout
    if getattr(args, "mamba", False):
        if layout is None:
            layout = Layout.BLOCKS_FIRST.value
        mamba = MambaSpec(ssm_heads=getattr(args, "ssm_heads", 64),
                          ssm_head_dim=getattr(args, "ssm_head_dim", 64),
                          state_size=getattr(args, "ssm_state", 128),
                          n_groups=getattr(args, "ssm_groups", 8),
                          conv_width=getattr(args, "conv_width", 3),
                          conv_dtype_size=dtype_size(args.dtype), ssm_dtype_size=4)
    if layout is None:
        layout = Layout.KV_FIRST.value
    common = dict(
        num_kv_heads=args.kv_heads, head_dim=args.head_dim, num_layers=args.layers, dtype=args.dtype,
        layout=layout, head_order=args.head_order, use_mla=args.mla, mamba=mamba,
    )
    prefill = EngineSpec("prefill", tp_size=args.prefill_tp, block_size=args.prefill_block_size,
                         block_bytes=getattr(args, "prefill_block_bytes", None), **common)
    decode = EngineSpec("decode", tp_size=args.decode_tp, block_size=args.decode_block_size,
                        block_bytes=getattr(args, "decode_block_bytes", None), **common)
    return prefill, decode
