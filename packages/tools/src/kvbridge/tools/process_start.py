"""How harness processes start: the multiprocessing context of :mod:`.harness`."""

from __future__ import annotations

import multiprocessing as mp
import os


def start_context(method: str = "spawn"):
    """A multiprocessing context for engine processes.

    ``spawn`` (the default) starts a fresh interpreter per process. ``forkserver``
    forks them from a server that imported torch, NIXL and the harness once: a
    restart then takes about a second instead of a fresh interpreter's import
    time (what the soak's restarts need). The server inherits this process's
    environment when it starts (the first process started through the context).
    """
    if method != "forkserver":
        return mp.get_context(method)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout otherwise
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvbridge.tools.harness", "nixl._api"])
    return ctx
