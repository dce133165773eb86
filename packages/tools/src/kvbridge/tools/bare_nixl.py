"""Bare NIXL, no engine: the reference ``kvbridge bench`` compares the engines with.

The same caches (:class:`~.synthetic.SyntheticCache`), huge-page advice,
descriptor rows (:func:`kvbridge.memory.rank_descriptors`) and index arrays as
the engines, but driven straight through :class:`~kvbridge.nixl.NixlAgent`:
one process holds the source cache, this process READs from it with
``make_prepped_xfer``, ``transfer`` and a busy ``check_xfer_state`` loop. No
worker thread, no notifications, no ledger: what the engine adds on top of this
is its overhead.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

from kvbridge.memory import RegionGeometry, advise_huge_pages, kernel_spec, rank_descriptors
from kvbridge.nixl import AgentConfig, NixlAgent
from kvbridge.topology import EngineSpec, element_layout, plan_rank

from .process_start import start_context
from .synthetic_cache import SyntheticCache


def _source(conn: Connection, spec: EngineSpec, num_blocks: int, config: AgentConfig) -> None:
    """Child: allocate and register a source cache, answer with its agent metadata, then
    wait until told to stop (letting NIXL progress when it runs no progress thread)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    cache = SyntheticCache.allocate(spec, 0, num_blocks)
    regions = cache.cache_regions(spec)
    for r in cache.regions:  # touch every page, as a filled cache would be
        r.fill_(1)
    advise_huge_pages((int(a), int(n)) for a, n, _ in regions.registration_descs())
    agent = NixlAgent(f"bare-source-{os.getpid()}", replace(config, telemetry=False))
    agent.register(regions.registration_descs())
    conn.send((agent.metadata(), [r.base_addr for r in regions.regions],
               [r.block_stride for r in regions.regions]))
    while not conn.poll(None if config.progress_thread else 0.002):
        agent.progress()
    agent.close()


@dataclass
class BareReader:
    """This process's side of the reference: a destination cache and lists for the source."""

    spec: EngineSpec
    num_blocks: int
    #: the agents' configuration (both sides; the source without telemetry)
    agent: AgentConfig = AgentConfig(telemetry=False)
    start_method: str = "spawn"

    def __enter__(self) -> BareReader:
        spec = self.spec
        self._ctx = start_context(self.start_method)
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_source, args=(child, spec, self.num_blocks, self.agent),
                                       daemon=True)
        self._proc.start()
        child.close()
        self.cache = SyntheticCache.allocate(spec, 0, self.num_blocks)
        regions = self.cache.cache_regions(spec)
        for r in self.cache.regions:
            r.fill_(0)
        advise_huge_pages((int(a), int(n)) for a, n, _ in regions.registration_descs())
        self.nixl = NixlAgent(f"bare-reader-{os.getpid()}", self.agent)
        self.nixl.register(regions.registration_descs())
        if not self._conn.poll(300):
            raise RuntimeError("the bare-NIXL source process did not start within 300 s")
        meta, bases, strides = self._conn.recv()
        self.peer = self.nixl.add_remote(meta)
        remote = RegionGeometry.from_remote(spec, bases, self.num_blocks, strides, mem_type="DRAM")
        local = RegionGeometry.from_regions(regions)
        peer_spec = replace(spec, engine_id=f"{spec.engine_id}-source")
        plan = plan_rank(kernel_spec(spec), kernel_spec(peer_spec), 0)
        self.descs = rank_descriptors(plan, 0, local, remote)
        self._lists: dict[bool, tuple] = {}
        return self

    def lists(self, strided: bool):
        if strided not in self._lists:
            d = self.descs
            self._lists[strided] = (
                self.nixl.prepare(None, d.local_descs(strided=True), allow_strided=strided),
                self.nixl.prepare(self.peer, d.remote_descs(strided=True), allow_strided=strided))
        return self._lists[strided]

    def read_seconds(self, local_ids, remote_ids, strided: bool = True) -> float:
        """Seconds from block ids to a completed READ (index arrays, handle, post, busy poll)."""
        loc, rem = self.lists(strided)
        t = time.perf_counter()
        li, ri = self.descs.indices(local_ids, remote_ids)
        x = self.nixl.make_transfer("READ", loc, li, rem, ri)
        st = self.nixl.post(x)
        while st == "PROC":
            st = self.nixl.state(x)
        dt = time.perf_counter() - t
        self.nixl.release_transfer(x)
        if st != "DONE":
            raise RuntimeError(f"bare-NIXL READ ended in {st}")
        return dt

    @property
    def block_bytes(self) -> int:
        return self.spec.region_block_bytes * element_layout(self.spec).regions

    def __exit__(self, *exc: object) -> None:
        try:
            self._conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
        self.nixl.close()
