"""Free TCP ports for test and benchmark engines (standard library only)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A free port on 127.0.0.1 below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(("", 0))`` goes back to the ephemeral pool when
    released, and an engine's own listeners (UCX, torch.distributed) may take it before the
    engine binds its side channel there: an engine binds its side channel only after its
    NIXL agent opened UCX listeners and connections (CI, 2026-11-29: "Address already in
    use" on 127.0.0.1:39707). Ports below the range are never handed out that way.
    """
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")
