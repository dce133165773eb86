"""The engine processes of :mod:`.harness`: one loop per process, driven over a pipe.

Each process runs some ranks of one engine (:class:`.local_ranks.LocalRanks`) and
answers the parent's commands (fill, hold, load, ...); decode processes verify
every received byte against the expected shard and report it.
"""

from __future__ import annotations

import os
import time
import traceback
from multiprocessing.connection import Connection, wait

import torch

from kvbridge.nixl import EngineConfig
from kvbridge.topology import BlockIds, EngineSpec

from .hybrid_cache import logical_content
from .local_ranks import LocalRanks


def per_group(spec: EngineSpec, blocks) -> BlockIds:
    """The harness's block list of a request as the engines take it: the harness names an
    engine with one KV-cache group by one flat list, an engine with groups by one list per
    group (in the order of ``spec.groups``)."""
    if len(spec.groups) <= 1:
        return (tuple(int(b) for b in blocks),)
    return tuple(tuple(int(b) for b in g) for g in blocks)


def child_main(conn: Connection, role: str, spec: EngineSpec, ranks: list[int], num_blocks: int,
           config: EngineConfig, incarnation: str, serve_first: bool, host: str = "127.0.0.1") -> None:
    """The process's loop; the first process of an engine (``serve_first``) serves the
    engine's metadata on ``host`` (an address of this process's network namespace)."""
    import logging

    logging.basicConfig(level=os.environ.get("KVBRIDGE_LOG", "WARNING"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout otherwise
    try:
        _child_loop(conn, role, spec, ranks, num_blocks, config, incarnation, serve_first, host)
    except Exception:
        try:
            conn.send(("crash", traceback.format_exc()))
        except Exception:  # noqa: S110 - parent gone
            pass


def _child_loop(conn, role, spec, ranks, num_blocks, config, incarnation, serve_first, host) -> None:
    torch.set_num_threads(1)
    local = LocalRanks.start(role, spec, ranks, num_blocks, config, incarnation=incarnation,
                             serve=serve_first, host=host)
    caches, engines, server = local.caches, local.engines, local.server
    if server is not None:
        conn.send(("ready", server.host, server.port, None))
    else:
        conn.send(("ready", None, None, {r: e.metadata() for r, e in engines.items()}))
    st = _State(role, ranks, caches, engines)
    pending, loaded_at, call_us = st.pending, st.loaded_at, st.call_us
    to_verify: list[tuple[int, str]] = []
    verify_now = False
    last_cmd = time.monotonic()
    running = True
    # a pull-mode prefill rank whose agent runs NIXL's progress thread needs no Python for the
    # decode rank's READs: its poll() only releases blocks, and at the busy 0.2 ms it would take
    # CPU time from the copies (on the 2-core VM); a vLLM prefill engine polls once per step
    held_wait = 0.002 if role == "p" and config.mode == "pull" and config.agent.progress_thread else 0.0002
    while running:
        busy = to_verify or any(len(e.tracker) if role == "d" else e.held for e in engines.values())
        # wait in select() (GIL released) rather than spin: the engine worker thread needs the GIL;
        # an engine whose worker reported something (posted READs) wakes the wait at once
        wait_s = 0.0002 if to_verify or role == "d" else held_wait
        while conn in wait([conn, *engines.values()], wait_s if busy else 0.005):
            cmd, arg = conn.recv()
            last_cmd = time.monotonic()
            if cmd == "close":
                running = False
                break
            if cmd == "verify":  # fire and forget: check what has arrived as soon as idle
                verify_now = True
                continue
            if cmd == "publish":  # other processes' ranks, served by this process
                for md in arg:
                    server.set_metadata(md.rank, md)
                conn.send(("ok", None))
            elif cmd == "advertise":
                for e in engines.values():
                    e.advertise(*arg)
                conn.send(("ok", None))
            elif cmd == "fill":
                seed, ntok, block_ids = arg
                kv = logical_content(spec, seed, ntok)
                for r in ranks:
                    caches[r].fill(kv, block_ids)
                conn.send(("ok", None))
            elif cmd == "clear":  # zero blocks ahead of requests submitted with cleared=True
                for r in ranks:
                    caches[r].clear(list(arg))
                conn.send(("ok", None))
            elif cmd in _REQUEST_COMMANDS:
                _request_command(cmd, arg, st)
                conn.send(("ok", None))
            elif cmd == "batch":  # several requests in one message, as an engine's step hands them over
                kind, items = arg
                if kind not in _REQUEST_COMMANDS:
                    conn.send(("error", f"cannot batch command {kind!r}"))
                    continue
                for item in items:
                    _request_command(kind, item, st)
                conn.send(("ok", None))
            elif cmd == "stats":
                conn.send(("stats", {r: (e.stats, e.resource_counts()) for r, e in engines.items()}))
            elif cmd == "peaks":
                conn.send(("peaks", st.peaks()))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        if not running:
            break
        st.sample()
        for r, e in engines.items():
            if role == "p":
                for rel in e.poll():
                    conn.send(("released", (r, rel.request_id, rel.reason)))
            else:
                ev = e.poll()
                t_done = time.monotonic()
                for rid in ev.done:
                    conn.send(("done", (r, rid, t_done, loaded_at.get(rid, t_done),
                                        call_us.pop((r, rid), 0.0))))
                    to_verify.append((r, rid))
                for f in ev.failed:
                    call_us.pop((r, f.request_id), None)
                    conn.send(("failed", (r, f.request_id, f.kind.value, f.invalid_block_ids, f.message)))
        # verify received bytes only while no transfer is in flight, so that checking one
        # request never delays noticing that another one completed
        # (and only once the parent asked, or nothing happened for a while: the parent may be
        # about to submit the next request)
        if (role == "d" and to_verify and not any(len(e.tracker) for e in engines.values())
                and (verify_now or time.monotonic() - last_cmd > 0.5)):
            r, rid = to_verify.pop(0)
            seed, ntok, computed, local_ids, pspec, verify = pending[rid]
            bad = -1
            if verify:  # the decode engine has post-processed the blocks (pull and push)
                bad = caches[r].verify(logical_content(spec, seed, ntok), local_ids, computed, ntok)
            conn.send(("verified", (r, rid, bad)))
            if not any(x[1] == rid for x in to_verify):
                pending.pop(rid, None)
                loaded_at.pop(rid, None)
            if not to_verify:
                verify_now = False
    local.close()
    conn.send(("closed", None))


_REQUEST_COMMANDS = ("hold", "push", "load", "expect")


class _State:
    """What a harness process keeps about its requests, and the peak counts of requests and
    NIXL transfer handles its ranks had outstanding at once (``peaks`` reports them)."""

    def __init__(self, role: str, ranks: list[int], caches: dict, engines: dict) -> None:
        self.role, self.ranks, self.caches, self.engines = role, ranks, caches, engines
        self.pending: dict[str, tuple] = {}  # decode: rid -> (seed, ntok, computed, local ids, pspec, verify)
        self.loaded_at: dict[str, float] = {}
        self.call_us: dict[tuple[int, str], float] = {}
        self.peak_requests = dict.fromkeys(ranks, 0)
        self.peak_transfers = dict.fromkeys(ranks, 0)
        for e in engines.values():  # from here on: not the warm-up READ of the engine's start
            e.agent.take_transfers_peak()

    def outstanding(self, r: int) -> int:
        """Requests the rank has not finished with: loading or awaited (decode), held (prefill)."""
        e = self.engines[r]
        return e.pending if self.role == "d" else e.held

    def sample(self) -> None:
        """Update the request peaks (the handle peaks come from the agent, exact:
        :meth:`peaks`)."""
        for r in self.ranks:
            self.peak_requests[r] = max(self.peak_requests[r], self.outstanding(r))

    def peaks(self) -> dict[int, tuple[int, int]]:
        """rank -> (most requests outstanding at once, most NIXL transfer handles alive at once)."""
        for r in self.ranks:
            self.peak_transfers[r] = max(self.peak_transfers[r],
                                         self.engines[r].agent.take_transfers_peak())
        return {r: (self.peak_requests[r], self.peak_transfers[r]) for r in self.ranks}


def _request_command(cmd: str, arg: tuple, st: _State) -> None:
    """Hand one request to every rank of this process (``hold``/``push`` on a prefill,
    ``load``/``expect`` on a decode process)."""
    ranks, engines, caches = st.ranks, st.engines, st.caches
    if cmd == "hold":
        rid, block_ids, token = arg
        for r in ranks:
            engines[r].hold(rid, per_group(engines[r].spec, block_ids), token)
    elif cmd == "push":
        rid, block_ids, target = arg
        for r in ranks:
            engines[r].push(rid, per_group(engines[r].spec, block_ids), target)
    else:
        rid, params, local_ids, computed, seed, ntok, pspec, verify, *rest = arg
        if rest[0] if rest else verify:  # zeroed first, so that bytes the transfer failed to write show
            for r in ranks:
                caches[r].clear(local_ids)
        st.loaded_at[rid] = time.monotonic()
        for r in ranks:
            ids = per_group(engines[r].spec, local_ids)
            if cmd == "load":
                t_call = time.perf_counter()
                engines[r].load(rid, params, ids, computed)
                st.call_us[(r, rid)] = (time.perf_counter() - t_call) * 1e6
            else:  # push: the decode engine is told the prefill geometry it rearranges from
                engines[r].expect(rid, params.engine_id, params.tp_size, params.token, ids,
                                  prefill_block_size=pspec.block_size,
                                  prefill_head_order=pspec.head_order,
                                  prefill_kernel_blocks_per_block=pspec.kernel_blocks_per_block)
        st.pending[rid] = (seed, ntok, computed, list(local_ids), pspec, verify)
    for r in ranks:  # count what was just handed over, before any completion is polled
        st.peak_requests[r] = max(st.peak_requests[r], st.outstanding(r))
