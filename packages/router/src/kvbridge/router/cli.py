"""``kvbridge router`` (also ``python -m kvbridge.router`` and ``kvbridge-router``)."""

from __future__ import annotations

import argparse
import logging
import sys

from .config import MODES, ConfigError, RouterConfig, config_from_mapping, load_config


def build_parser(prog: str = "kvbridge router") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="OpenAI-compatible router for disaggregated prefill/decode serving: each "
        "request is prefilled on a prefill instance and decoded on a decode instance, which pulls "
        "the KV cache (kv_transfer_params). Instances are vLLM OpenAI servers started with "
        "--kv-transfer-config. See docs/serving.md.",
    )
    p.add_argument("--prefill", nargs="+", metavar="URL", default=None,
                   help="prefill instances, e.g. http://10.0.0.5:8100 (none: decode prefills locally)")
    p.add_argument("--decode", nargs="+", metavar="URL", default=None,
                   help="decode instances, e.g. http://10.0.0.6:8200")
    p.add_argument("--config", metavar="FILE",
                   help="JSON file with the RouterConfig fields (prefill, decode, port, timeouts...); "
                   "flags given as well override it")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1; "
                   "0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=None, help="port to listen on (default 8000)")
    p.add_argument("--connect-timeout", type=float, default=None, dest="connect_timeout_s",
                   metavar="S", help="seconds to open an upstream connection (default 5)")
    p.add_argument("--prefill-timeout", type=float, default=None, dest="prefill_timeout_s",
                   metavar="S", help="seconds for a whole prefill request before the next prefill "
                   "instance is tried (default 60)")
    p.add_argument("--decode-timeout", type=float, default=None, dest="decode_timeout_s",
                   metavar="S", help="seconds for a whole decode request, stream included (default 600)")
    p.add_argument("--upstream-keepalive", type=float, default=None, dest="upstream_keepalive_s",
                   metavar="S", help="seconds an idle connection to an instance is kept for reuse "
                   "(default 2); keep it below the instances' keep-alive (vLLM: 5 s)")
    p.add_argument("--health-interval", type=float, default=None, dest="health_interval_s",
                   metavar="S", help="seconds between health-probe rounds (default 2)")
    p.add_argument("--health-timeout", type=float, default=None, dest="health_timeout_s",
                   metavar="S", help="seconds one /health probe may take (default 2)")
    p.add_argument("--unhealthy-after", type=int, default=None, dest="unhealthy_after",
                   metavar="N", help="failed /health probes in a row that take an instance out of "
                   "rotation (default 3; a request that cannot connect takes it out at once)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="the engines' kvbridge transfer mode: pull (default: prefill, then decode "
                   "reads the KV) or push (both requests at once, prefill writes into decode's "
                   "blocks; see docs/serving.md)")
    p.add_argument("--prefill-side-channel", nargs="+", metavar="URL=HOST:PORT", default=None,
                   dest="prefill_side_channels",
                   help="push mode: a prefill instance's kvbridge side channel "
                   "(side_channel_host:side_channel_port), e.g. http://10.0.0.5:8100=10.0.0.5:5600; "
                   "an instance not listed uses its URL's host and port 5600")
    p.add_argument("--prefix-placement", choices=["off", "decode", "both"], default=None,
                   dest="prefix_placement", help="send requests whose prompts start alike to the "
                   "same decode instance (decode) and prefill instance too (both), by consistent "
                   "hashing of the first prompt blocks, so that their prefix caches hit "
                   "(default off: least loaded)")
    p.add_argument("--prefix-block-tokens", type=int, default=None, dest="prefix_block_tokens",
                   metavar="N", help="tokens per block for --prefix-placement (default 16, "
                   "vLLM's block size; text counts 4 characters a token)")
    p.add_argument("--prefix-blocks", type=int, default=None, dest="prefix_blocks", metavar="N",
                   help="leading prompt blocks hashed by --prefix-placement (default 4)")
    p.add_argument("--prefix-load-margin", type=int, default=None, dest="prefix_load_margin",
                   metavar="N", help="requests in flight beyond the least-loaded instance that "
                   "make --prefix-placement pass over a prefix's instance (default 8)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--check", action="store_true",
                   help="print the resolved configuration as JSON and exit")
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    overrides = {k: getattr(args, k) for k in (
        "host", "port", "connect_timeout_s", "prefill_timeout_s", "decode_timeout_s",
        "upstream_keepalive_s", "health_interval_s", "health_timeout_s", "unhealthy_after", "mode",
        "prefix_placement", "prefix_block_tokens", "prefix_blocks", "prefix_load_margin")}
    if args.prefill_side_channels is not None:
        overrides["prefill_side_channels"] = side_channel_args(args.prefill_side_channels)
    if args.prefill is not None:
        overrides["prefill"] = tuple(args.prefill)
    if args.decode is not None:
        overrides["decode"] = tuple(args.decode)
    if args.config:
        return load_config(args.config).with_overrides(**overrides)
    if args.decode is None:
        raise ConfigError("pass --decode URL [URL ...] (and usually --prefill URL [URL ...]), "
                          "or --config FILE")
    data = {k: v for k, v in overrides.items() if v is not None}
    return config_from_mapping(data, "command line")


def side_channel_args(items: list[str]) -> dict[str, str]:
    """``URL=HOST:PORT`` arguments as a mapping (checked by RouterConfig)."""
    out = {}
    for item in items:
        url, sep, where = item.rpartition("=")
        if not sep or not url or not where:
            raise ConfigError(f"--prefill-side-channel {item!r} must be URL=HOST:PORT, e.g. "
                              "http://10.0.0.5:8100=10.0.0.5:5600")
        out[url] = where
    return out


def router_command(argv: list[str], prog: str = "kvbridge router") -> int:
    """Entry point of ``kvbridge router`` (group ``kvbridge.commands``)."""
    args = build_parser(prog).parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if args.check:
        import dataclasses
        import json

        print(json.dumps(dataclasses.asdict(config), indent=1))
        return 0
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):  # one INFO line per upstream call and health probe
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    from .app import serve

    prefill = ", ".join(config.prefill) or "(none: decode prefills locally)"
    if config.mode == "push":
        prefill = ", ".join(f"{u} (side channel {':'.join(map(str, config.side_channel(u)))})"
                            for u in config.prefill) or prefill
    print(f"kvbridge router ({config.mode} mode) on http://{config.host}:{config.port}: prefill "
          f"{prefill}; decode {', '.join(config.decode)}"
          + (f"; prefix-aware placement: {config.prefix_placement}"
             if config.prefix_placement != "off" else ""), flush=True)
    serve(config, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbridge.router`` / ``kvbridge-router``."""
    return router_command(sys.argv[1:] if argv is None else argv, prog="kvbridge-router")
