"""The ``kvbridge`` command.

``kvbridge plan`` lives here (standard library only). Other packages add
subcommands through the entry-point group ``kvbridge.commands``: each entry
point is a callable taking the remaining ``argv`` and returning an exit code
(kvbridge-nixl adds ``demo`` and ``bench``).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import entry_points

from .dtypes import dtype_size
from .errors import TopologyError
from .render import plan_to_json, plan_to_svg, plan_to_text
from .spec import EngineSpec, HeadOrder, Layout, MambaSpec
from .transfer import TransferPlan, plan_transfer

ENTRY_POINT_GROUP = "kvbridge.commands"
_DTYPES = ("bf16", "fp16", "fp32", "fp8")


def add_shape_arguments(parser: argparse.ArgumentParser, *, defaults: dict | None = None) -> None:
    """The deployment-shape flags shared by ``plan``, ``demo`` and ``bench``."""
    d = {
        "prefill_tp": None, "decode_tp": None, "kv_heads": None, "head_dim": 128, "layers": 80,
        "dtype": "bf16", "prefill_block_size": 16, "decode_block_size": 16,
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
                        "of each head together, vLLM >= 0.32) (default kv-first; blocks-first with --mamba)")
    parser.add_argument("--head-order", choices=[x.value for x in HeadOrder], default="HND",
                        help="order inside a K/V element on both engines (default HND)")
    parser.add_argument("--mla", action="store_true", help="MLA latent cache (one replicated latent)")


def engines_from_args(args: argparse.Namespace) -> tuple[EngineSpec, EngineSpec]:
    """Build (prefill, decode) specs from the shape flags; raises TopologyError."""
    mamba = None
    layout = args.layout
    if getattr(args, "mamba", False):
        if layout is None:
            layout = Layout.BLOCKS_FIRST.value
        mamba = MambaSpec(ssm_heads=64, ssm_head_dim=64, state_size=128, n_groups=8, conv_width=3,
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


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbridge plan",
        description="Plan a prefill/decode KV-cache transfer: which ranks read what, and what "
        "each prefill rank waits for. Defaults describe a Llama-70B-like model.",
    )
    add_shape_arguments(p, defaults={"kv_heads": 8})
    p.add_argument("--mamba", action="store_true", help="hybrid attention + Mamba-2 model")
    p.add_argument("--prefill-block-bytes", type=int, default=None, metavar="X",
                   help="measured bytes of one block of one layer region on a prefill rank")
    p.add_argument("--decode-block-bytes", type=int, default=None, metavar="Y",
                   help="measured bytes of one block of one layer region on a decode rank")
    p.add_argument("--json", action="store_true", help="print the kvbridge.plan/1 JSON document")
    p.add_argument("--svg", metavar="FILE", help="also write a picture of the plan to FILE")
    return p


def run_plan(argv: list[str]) -> int:
    parser = _plan_parser()
    args = parser.parse_args(argv)
    try:
        prefill, decode = engines_from_args(args)
        plan: TransferPlan = plan_transfer(prefill, decode)
    except TopologyError as exc:
        print(f"kvbridge plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_to_json(plan), indent=2))
    else:
        sys.stdout.write(plan_to_text(plan))
    if args.svg:
        try:
            with open(args.svg, "w", encoding="utf-8") as fh:
                fh.write(plan_to_svg(plan))
        except OSError as exc:
            print(f"kvbridge plan: error: cannot write {args.svg}: {exc}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"wrote {args.svg}")
    return 0


def _plugin_commands() -> dict:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plugins = _plugin_commands()
    commands = {"plan": "plan a prefill/decode transfer (this package)"}
    for name in sorted(plugins):
        commands.setdefault(name, f"from {plugins[name].value.split(':')[0]}")
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvbridge <command> [options]\n\ncommands:")
        for name, what in commands.items():
            print(f"  {name:<8} {what}")
        if "demo" not in commands:
            print("\n(install kvbridge-nixl for the demo and bench commands)")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "plan":
        return run_plan(rest)
    ep = plugins.get(cmd)
    if ep is None:
        hint = " (install kvbridge-nixl for demo and bench)" if cmd in ("demo", "bench") else ""
        print(f"kvbridge: unknown command {cmd!r}{hint}; commands: {', '.join(commands)}", file=sys.stderr)
        return 2
    return int(ep.load()(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
