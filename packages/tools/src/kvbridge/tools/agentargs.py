"""The NIXL agent's command-line settings shared by ``kvbridge demo`` and ``kvbridge bench``."""

from __future__ import annotations

import argparse

from kvbridge.nixl import AgentConfig


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    """``--ucx-threads``, ``--progress-delay-us`` and ``--ucx-param`` (UCX_* environment
    variables reach UCX as they are: ``UCX_TLS``, ``UCX_MAX_RMA_RAILS``, ...)."""
    d = AgentConfig()
    p.add_argument("--ucx-threads", type=int, default=d.num_threads, metavar="N",
                   help=f"UCX worker threads per agent (default {d.num_threads})")
    p.add_argument("--progress-delay-us", default=str(d.progress_delay_us), metavar="US",
                   help="NIXL's native progress thread: microseconds between polls when idle (rounded "
                        f"up to whole ms by UCX; 0 spins), or 'off' for no thread (default "
                        f"{d.progress_delay_us})")
    p.add_argument("--ucx-param", action="append", default=[], metavar="KEY=VALUE",
                   help="a UCX backend init parameter, e.g. split_batch_size=256 (repeatable)")


def agent_config(args: argparse.Namespace, backends: tuple[str, ...] = ("UCX",),
                 telemetry: bool = True) -> AgentConfig:
    """The :class:`AgentConfig` the arguments of :func:`add_agent_arguments` describe."""
    off = str(args.progress_delay_us).strip().lower() == "off"
    params = []
    for kv in args.ucx_param:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise SystemExit(f"--ucx-param takes KEY=VALUE, got {kv!r}")
        params.append(("UCX", key.strip(), value.strip()))
    return AgentConfig(backends=backends, num_threads=args.ucx_threads, telemetry=telemetry,
                       progress_thread=not off, progress_delay_us=0 if off else int(args.progress_delay_us),
                       backend_params=tuple(params))
