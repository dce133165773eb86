"""The ``kvbridge`` command.

``kvbridge plan`` lives here (standard library only). Other packages add
subcommands through the entry-point group ``kvbridge.commands``: each entry
point is a callable taking the remaining ``argv`` and returning an exit code
(kvbridge-tools adds ``demo`` and ``bench``).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import entry_points

from .errors import TopologyError
from .render import plan_to_json, plan_to_svg, plan_to_text
from .shapes import add_shape_arguments, engines_from_args
from .transfer import TransferPlan, plan_transfer

ENTRY_POINT_GROUP = "kvbridge.commands"

__all__ = ["ENTRY_POINT_GROUP", "add_shape_arguments", "engines_from_args", "main", "run_plan"]


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbridge plan",
        description="Plan a prefill/decode KV-cache transfer: which ranks read what, and what "
        "each prefill rank waits for. Defaults describe a Llama-70B-like model.",
    )
    add_shape_arguments(p, defaults={"kv_heads": 8}, mamba=True)
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
            print("\n(install kvbridge-tools for the demo and bench commands)")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "plan":
        return run_plan(rest)
    ep = plugins.get(cmd)
    if ep is None:
        hint = " (install kvbridge-tools for demo and bench)" if cmd in ("demo", "bench") else ""
        print(f"kvbridge: unknown command {cmd!r}{hint}; commands: {', '.join(commands)}", file=sys.stderr)
        return 2
    return int(ep.load()(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
