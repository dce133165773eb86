"""The multi-process harness with its engines on namespace hosts (the one module of the
netns tests that imports the harness).

:class:`NetnsCluster` is the harness's :class:`Cluster` whose prefill processes
start inside one host of a :mod:`netns_hosts` network and whose decode
processes start inside another: each engine serves its side channel on its
host's address (not 127.0.0.1), and UCX gets an environment that leaves it the
network only (``UCX_TLS=tcp``: no shared memory, no CMA). The parent (the test)
stays where it is and drives the engines over pipes, as the harness always does.

UCX writes its log (``UCX_LOG_LEVEL=info``) to one file per process;
:func:`ucx_transports` reads which transports its endpoints picked.
"""

from __future__ import annotations

import os
import pathlib
import re

from netns_hosts import Host, enter

from kvbridge.tools.engine_process import child_main
from kvbridge.tools.harness import (
    Cluster,
    EngineGroup,
    HarnessError,
    RequestResult,
    spec_pair,
)
from kvbridge.topology import EngineSpec

__all__ = ["NetnsCluster", "HarnessError", "RequestResult", "check_transports", "spec_pair", "ucx_env",
           "ucx_transports"]


def ucx_env(log_dir: pathlib.Path | None = None) -> dict[str, str]:
    """UCX settings for engines on different hosts: TCP only (no shared memory, no CMA), and
    with ``log_dir`` UCX's INFO log, one file per process, where it names its transports."""
    env = {"UCX_TLS": "tcp"}
    if log_dir is not None:
        env |= {"UCX_LOG_LEVEL": "info", "UCX_LOG_FILE": str(log_dir / "ucx.%p.log")}
    return env


def _in_host(host_name: str, address: str, env: dict[str, str], args: tuple) -> None:
    """A harness process's entry point: enter the host, then run the harness's loop with the
    side channel on the host's address."""
    enter(host_name)
    os.environ.update(env)
    child_main(*args, host=address)


class _HostContext:
    """A multiprocessing context whose processes start inside ``host``."""

    def __init__(self, ctx, host: Host, env: dict[str, str]) -> None:
        self._ctx, self._host, self._env = ctx, host, env

    def Pipe(self, *args, **kw):  # noqa: N802 - the multiprocessing context's name
        return self._ctx.Pipe(*args, **kw)

    def Process(self, *, target, args, daemon):  # noqa: N802
        if target is not child_main:
            raise HarnessError(f"a namespace host runs harness processes only, not {target!r}")
        return self._ctx.Process(target=_in_host, args=(self._host.name, self._host.address, self._env, args),
                                 daemon=daemon)


class NetnsCluster(Cluster):
    """A :class:`Cluster` with the prefill engine on ``prefill_host`` and the decode engine on
    ``decode_host``; ``env`` is added to both engines' environment (see :func:`ucx_env`)."""

    def __init__(self, prefill: EngineSpec, decode: EngineSpec, *, prefill_host: Host, decode_host: Host,
                 env: dict[str, str], **kw) -> None:
        self.hosts = {"p": prefill_host, "d": decode_host}
        self.env = dict(env)
        super().__init__(prefill, decode, **kw)

    def _group(self, role: str, spec: EngineSpec, config) -> EngineGroup:
        ctx = _HostContext(self.ctx, self.hosts[role], self.env)
        return EngineGroup(role, spec, self.num_blocks, config, self.ranks_per_process, ctx=ctx)


_EP_CFG = re.compile(r"\bcfg#\d+ (.*)$")  # "<worker> inter-node cfg#1 rma_am(tcp/eth0)  am(tcp/eth0) ..."
_TL = re.compile(r"([a-z_0-9]+)/([A-Za-z0-9_.:-]+)")


def ucx_transports(log_dir: pathlib.Path) -> tuple[set[str], list[str]]:
    """(transport/device pairs UCX's endpoint configurations named, e.g. ``tcp/eth0``; the
    log lines naming them) over every UCX log in ``log_dir``."""
    pairs: set[str] = set()
    lines: list[str] = []
    for f in sorted(log_dir.glob("ucx.*.log")):
        for line in f.read_text(errors="replace").splitlines():
            m = _EP_CFG.search(line)
            if m is None:
                continue
            lines.append(line.strip())
            pairs.update(f"{t}/{d}" for t, d in _TL.findall(m.group(1)))
    return pairs, lines


def check_transports(log_dir: pathlib.Path, host: Host) -> set[str]:
    """Print what UCX's endpoints used (from its logs in ``log_dir``) and fail unless that was
    TCP on ``host``'s link and nothing else; returns the transport/device pairs."""
    pairs, lines = ucx_transports(log_dir)
    print(f"UCX endpoint configurations ({len(lines)} log lines), e.g.:")
    for line in sorted({ln.split("INFO", 1)[-1].strip() for ln in lines})[:4]:
        print("  ", line)
    print(f"UCX transports used: {sorted(pairs)}")
    if not lines:
        raise AssertionError("UCX logged no endpoint configuration (UCX_LOG_LEVEL=info not honoured?)")
    if pairs != {f"tcp/{host.dev}"}:
        raise AssertionError(f"UCX used {sorted(pairs)}, not only tcp/{host.dev}")
    return pairs
