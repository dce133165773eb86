"""What prefill and decode ranks share: the agent and its registered cache, the metadata this rank
serves, handshakes with peer engines, and teardown.

Threading: each engine has one :class:`~kvbridge.nixl.worker.Worker` for
handshakes (side-channel I/O and loading remote agents) and, in pull mode,
building and posting READs. Every NIXL call goes through the agent's lock, so
the worker and the caller's thread never call NIXL at the same time. Jobs report
back through one event queue that the caller's ``poll()`` drains in order.
Nothing the caller calls blocks on a peer: ``poll()`` only looks.
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import zmq

from kvbridge.handshake import (
    AgentMetadata,
    EngineFacts,
    HandshakeError,
    MetadataServer,
    fetch_metadata,
    new_incarnation,
    normalize_key,
)
from kvbridge.memory import (
    CacheRegions,
    HugePageResult,
    RankDescriptors,
    RegionGeometry,
    advise_huge_pages,
    regions_from_kv_caches,
    use_cache_device,
)
from kvbridge.topology import EngineSpec, TopologyError, TransferPlan, TransferRecord

from .abandoned import Abandoned
from .agent import NixlAgent, NixlError, Transfer
from .config import (
    EngineConfig,
    HandshakeFailed,
    engine_compat_hash,
    engine_compat_info,
    provisional_spec,
)
from .groups import engine_groups
from .messages import notification_key
from .peers import Peer, PeerTable, PhaseDetail, first_done, thread_usage
from .stats import Stats
from .warmup import scratch_buffer, warm_up
from .worker import EventQueue, Job, Worker

log = logging.getLogger("kvbridge.nixl")


def record_done(agent: NixlAgent, stats: Stats, transfer: Transfer,
                records: deque[TransferRecord] | None = None, peer_engine: str = "") -> None:
    """Count a finished transfer (NIXL telemetry into ``stats``) and release its handle."""
    tel = agent.telemetry(transfer)
    if tel is not None:
        stats.bytes += tel.bytes
        stats.descriptors += tel.descriptors
        stats.post_us += tel.post_us
        stats.xfer_us += tel.xfer_us
        if records is not None:
            records.append(TransferRecord(transfer.op, peer_engine, tel.bytes, tel.descriptors,
                                          tel.post_us, tel.xfer_us))
    stats.transfers += 1
    stats.descriptors_posted += transfer.num_descs
    agent.release_transfer(transfer)


@dataclass(frozen=True)
class HandshakeEnded:
    """Worker event: the handshake with ``peer`` ended (``peer.error`` says whether it failed)."""

    peer: Peer


class RankEngine:
    """The base of :class:`~kvbridge.nixl.PrefillEngine` and :class:`~kvbridge.nixl.DecodeEngine`.

    Subclasses set ``self.mode`` (a :mod:`kvbridge.nixl.modes` object) and the
    planning hooks :meth:`plan_for`, :meth:`_peer_ranks` and :meth:`_descriptors`.

    The mode objects reach the engine only through its public attributes (``agent``,
    ``peers``, ``stats``, ``config``, ``spec``, ``rank``, ``groups``, ``notif_key``) and
    this small surface: :meth:`submit` (run a job on the worker thread), :meth:`report`
    (a worker job's event for the next ``poll()``), :meth:`drive` (check just-posted
    transfers on the worker), :meth:`sweep` (check a request's transfers in ``poll()``),
    :meth:`drop_transfers` (release handles, retrying refused ones) and :meth:`plan_for`;
    the roles add theirs (:class:`~kvbridge.nixl.DecodeEngine`: ``add``, ``fail``,
    ``part_done``, ...).
    """

    role = "?"

    def __init__(self, spec: EngineSpec, rank: int, cache: CacheRegions | Sequence | dict,
                 config: EngineConfig | None = None, *, incarnation: str | None = None):
        """``cache``: this rank's :class:`~kvbridge.memory.CacheRegions`, or its KV-cache
        tensors (one entry per layer), turned into regions with
        :func:`~kvbridge.memory.regions_from_kv_caches`."""
        if not 0 <= rank < spec.tp_size:
            raise ValueError(f"rank {rank} is outside TP size {spec.tp_size}")
        regions = cache if isinstance(cache, CacheRegions) else regions_from_kv_caches(cache, spec)
        if regions.spec != spec:
            raise ValueError(
                f"the cache regions were made for engine {regions.spec.engine_id!r} with another "
                f"description than engine {spec.engine_id!r}; build them with this engine's spec"
            )
        config = config or EngineConfig()
        if regions.mem_type != config.mem_type:
            raise ValueError(
                f"the cache of engine {spec.engine_id!r} rank {rank} is in {regions.mem_type} "
                f"memory but EngineConfig.mem_type is {config.mem_type!r}; set mem_type="
                f"{regions.mem_type!r} (VRAM for CUDA tensors, DRAM for host memory)")
        self.spec, self.rank, self.regions = spec, rank, regions
        self.geometry = RegionGeometry.from_regions(regions)
        #: the KV-cache groups with the regions holding their layers (kvbridge.nixl.groups)
        self.groups = engine_groups(spec, regions)
        self.config = config
        self.incarnation = incarnation or new_incarnation()
        self.compat_hash = engine_compat_hash(spec, self.config)
        self.compat_info = engine_compat_info(spec, self.config)
        #: the normalized shared secret, and the subkey that signs notifications (None: no auth)
        self._auth_key = normalize_key(self.config.auth_key)
        self.notif_key = None if self._auth_key is None else notification_key(self._auth_key)
        self.stats = Stats()
        self._records: deque[TransferRecord] | None = (
            deque(maxlen=self.config.max_records) if self.config.record_transfers else None)
        self.huge_pages: HugePageResult | None = None
        if self.config.huge_pages and self.config.mem_type == "DRAM" and regions.mem_type == "DRAM":
            # before registration: pages a backend has pinned can no longer be collapsed
            self.huge_pages = advise_huge_pages(
                (int(a), int(n)) for a, n, _ in regions.registration_descs())
            log.debug("rank %d: %d MiB advised, %d MiB collapsed to huge pages%s", rank,
                      self.huge_pages.advised_bytes >> 20, self.huge_pages.collapsed_bytes >> 20,
                      f" ({'; '.join(self.huge_pages.errors)})" if self.huge_pages.errors else "")
        self.agent = NixlAgent(f"{spec.engine_id}/{self.role}{rank}/{self.incarnation}", self.config.agent,
                               self.config.mem_type)
        #: the warm-up's scratch memory (registered while the agent lives), None without one
        self._scratch = (scratch_buffer() if self.config.warm_up and self.config.mem_type == "DRAM"
                         and self.config.agent.progress_thread else None)
        try:
            self.agent.register(regions.registration_descs(), self.config.mem_type)
            if self._scratch is not None:
                self.agent.register([(self._scratch.ctypes.data, self._scratch.nbytes, 0)], "DRAM")
        except Exception:
            self.agent.close()
            raise
        if self._scratch is not None:
            self._warm_up()
        self.server: MetadataServer | None = None
        self._own_server = False
        self._advertised: tuple[str, int] | None = None
        self._metadata: AgentMetadata | None = None
        self._zmq = zmq.Context(io_threads=1)
        self._events = EventQueue()
        # with NIXL's native progress thread no Python thread needs to let NIXL progress
        interval = 0.0 if self.config.agent.progress_thread else self.config.progress_interval_s
        self._worker = Worker(self.agent, f"kvbridge-handshake-{rank}", interval,
                              cpus=self.config.worker_cpus,
                              idle_interval_s=self.config.idle_progress_interval_s, busy=self._busy,
                              on_start=functools.partial(use_cache_device, regions))
        self.peers = PeerTable(self.agent, self.stats, self._start_handshake)
        self._abandoned = Abandoned(self.agent, self.stats)  # given up, not ended or released yet
        self._busy_until = 0.0  # monotonic time: busy until then (see busy_after_poll_s)
        self._closed = False

    def take_records(self) -> list[TransferRecord]:
        """Per-transfer records since the last call (empty unless ``record_transfers``)."""
        if self._records is None:
            return []
        out = list(self._records)
        self._records.clear()
        return out

    # ----- metadata ---------------------------------------------------------
    def metadata(self) -> AgentMetadata:
        """This rank's handshake metadata (NIXL agent metadata and cache geometry), built once."""
        if self._metadata is None:
            regs = self.regions.regions
            self._metadata = AgentMetadata(
                engine_id=self.spec.engine_id, incarnation=self.incarnation, rank=self.rank,
                tp_size=self.spec.tp_size, agent_name=self.agent.name,
                agent_metadata=self.agent.metadata(), memory_type=self.config.mem_type,
                device_id=self.regions.device_id, region_base_addrs=[r.base_addr for r in regs],
                region_sizes=[r.size for r in regs], num_blocks=self.regions.num_blocks,
                block_lens=[r.block_stride for r in regs], block_size=self.spec.block_size,
                kernel_blocks_per_block=self.spec.kernel_blocks_per_block,
                layout=self.spec.layout.value, head_order=self.spec.head_order.value,
                attention_backend=self.config.attention_backend,
                engine=EngineFacts.from_spec(self.spec),
            )
        return self._metadata

    def serve(self, server: MetadataServer | None = None, host: str = "127.0.0.1",
              port: int = 0) -> MetadataServer:
        """Publish this rank's metadata on ``server`` (shared by an engine's local ranks) or a new one."""
        if server is None:
            server = MetadataServer({self.rank: self.metadata()}, compat_hash=self.compat_hash,
                                    host=host, port=port, auth_key=self._auth_key,
                                    compat_info=self.compat_info)
            self._own_server = True
        else:
            if server.compat_hash != self.compat_hash:
                raise ValueError("the metadata server was created with another compatibility hash")
            if server.authenticated != (self._auth_key is not None):
                raise ValueError("the metadata server and this engine disagree on authentication: "
                                 "create the server with the engine's auth_key")
            server.set_metadata(self.rank, self.metadata())
        self.server = server
        return server

    def advertise(self, host: str, port: int) -> None:
        """Name the side channel that serves this rank when another process runs it."""
        self._advertised = (host, int(port))

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) of the side channel serving this rank."""
        if self._advertised is not None:
            return self._advertised
        if self.server is None:
            raise RuntimeError("this rank is not served yet: call serve() or advertise() first")
        return self.server.host, self.server.port

    # ----- worker pacing -----------------------------------------------------
    def _busy(self) -> bool:
        """Whether a peer may be transferring with this rank now (the worker then lets NIXL
        progress every ``progress_interval_s``, else every ``idle_progress_interval_s``):
        here, within ``busy_after_poll_s`` of the last ``poll()``; the engines add what
        they hold or await. Runs on the worker thread: a cheap snapshot."""
        return time.monotonic() < self._busy_until

    def _polled(self) -> None:
        """Called by ``poll()``: the owner is stepping, so peers may be about to transfer; and
        while the worker has a job queued or running, the owner pauses to let it take the GIL
        (``gil_handoff_s``)."""
        self._busy_until = time.monotonic() + self.config.busy_after_poll_s
        if self.config.gil_handoff_s and self._worker.in_job:
            time.sleep(self.config.gil_handoff_s)

    # ----- planning hooks ---------------------------------------------------
    def plan_for(self, peer_spec: EngineSpec) -> TransferPlan:
        """The transfer plan between this engine and a peer engine described by ``peer_spec``
        (prefill side first); raises :class:`~kvbridge.topology.TopologyError` for a pair it
        cannot serve."""
        raise NotImplementedError

    def _peer_ranks(self, plan: TransferPlan) -> tuple[list[int], list[int]]:
        """(peer ranks to handshake with, peer ranks that get lists prepared)."""
        raise NotImplementedError

    def _descriptors(self, peer: Peer, q: int, plan: TransferPlan) -> tuple[RankDescriptors, bool]:
        """Descriptors for peer rank ``q``, and whether this rank is the plan's local (decode) side."""
        raise NotImplementedError

    def _warm_up(self) -> None:
        """At construction: :func:`~kvbridge.nixl.warmup.warm_up` (best effort)."""
        try:
            ms = warm_up(self.agent, self._scratch, timeout_s=self.config.handshake_timeout_s)
        except Exception as exc:  # the first request pays the connection costs instead
            log.warning("rank %d: NIXL warm-up failed (%s); the first request pays the connection "
                        "set-up instead", self.rank, exc)
        else:
            log.info("rank %d: NIXL warm-up took %.1f ms", self.rank, ms)

    # ----- handshakes -------------------------------------------------------
    def _start_handshake(self, peer: Peer) -> None:
        self._worker.submit(lambda: self._handshake_job(peer))

    def _handshake_job(self, peer: Peer) -> None:
        """Worker thread: handshake with ``peer``, then queue its outcome for the caller."""
        t0 = peer.marks["handshake"] = time.perf_counter()
        try:
            self._handshake(peer)
        except (HandshakeError, NixlError, TopologyError, ValueError) as exc:
            peer.error = str(exc)
        except Exception as exc:  # never let a peer's input kill the worker
            peer.error = f"{type(exc).__name__}: {exc}"
        peer.marks["handshaked"] = time.perf_counter()
        peer.handshake_ms = (peer.marks["handshaked"] - t0) * 1e3
        peer.handshaked = True
        self._events.put(HandshakeEnded(peer))

    def _handshake(self, peer: Peer) -> None:
        timeout = self.config.handshake_timeout_s
        t0, u0 = time.perf_counter(), thread_usage()
        guess = self.plan_for(provisional_spec(self.spec, peer.engine_id, peer.tp_size))
        ranks, _ = self._peer_ranks(guess)
        infos = fetch_metadata(peer.host, peer.port, ranks, engine_id=peer.engine_id,
                               compat_hash=self.compat_hash if self.config.enforce_compat else None,
                               compat_info=self.compat_info, timeout=timeout / 2, retries=1, context=self._zmq,
                               auth_key=self._auth_key)
        first = infos[ranks[0]]
        if first.tp_size != peer.tp_size:
            raise HandshakeFailed(
                f"engine {peer.engine_id!r} says TP {first.tp_size}, the request said {peer.tp_size}"
            )
        if first.memory_type != self.config.mem_type:
            raise HandshakeFailed(
                f"engine {peer.engine_id!r} registered {first.memory_type} memory, this rank "
                f"{self.config.mem_type}; configure both engines with the same memory type"
            )
        plan = self.plan_for(first.spec())
        handshake_ranks, listed = self._peer_ranks(plan)
        if list(handshake_ranks) != list(ranks):  # pragma: no cover - same TP/heads
            raise HandshakeFailed("the peer's engine changes which ranks to handshake with")
        if peer.incarnation and first.incarnation != peer.incarnation:
            raise HandshakeFailed(
                f"engine {peer.engine_id!r} is incarnation {first.incarnation}, the request was "
                f"issued by {peer.incarnation}: it restarted after issuing the request"
            )
        if any(g.regions is not None for g in self.groups):
            for q in ranks:
                if len(infos[q].region_base_addrs) != len(self.regions.regions):
                    raise HandshakeFailed(
                        f"engine {peer.engine_id!r} rank {q} registered "
                        f"{len(infos[q].region_base_addrs)} regions, this rank "
                        f"{len(self.regions.regions)}: KV-cache groups that do not span every "
                        "region need the same cache layout on both engines"
                    )
        peer.incarnation = first.incarnation
        peer.plan, peer.infos, peer.spec = plan, infos, first.spec()
        t1, u1 = time.perf_counter(), thread_usage()
        for q in ranks:
            peer.agents[q] = self.agent.add_remote(infos[q].agent_metadata)
        t_loaded = time.perf_counter()
        for q in ranks:
            self.agent.connect(peer.agents[q])
        t2, u2 = time.perf_counter(), thread_usage()
        for q in listed:
            rd, local_side = self._descriptors(peer, q, plan)
            mine = rd.local_descs(strided=True) if local_side else rd.remote_descs(strided=True)
            theirs = rd.remote_descs(strided=True) if local_side else rd.local_descs(strided=True)
            peer.local_lists[q] = self.agent.prepare(None, mine, self.config.mem_type,
                                                     self.config.allow_strided)
            peer.remote_lists[q] = self.agent.prepare(peer.agents[q], theirs, self.config.mem_type,
                                                      self.config.allow_strided)
            peer.descs[q] = rd
        t3, u3 = time.perf_counter(), thread_usage()
        peer.phases_ms = ((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)
        peer.phase_detail = PhaseDetail(load_ms=(t_loaded - t1) * 1e3, connect_ms=(t2 - t_loaded) * 1e3,
                                        usage=(u1 - u0, u2 - u1, u3 - u2))

    def _remote_geometry(self, peer: Peer, q: int) -> RegionGeometry:
        """Peer rank ``q``'s regions from its handshake numbers (checked against its description)."""
        inf = peer.infos[q]
        try:
            return RegionGeometry.from_remote(peer.spec, inf.region_base_addrs, inf.num_blocks,
                                              inf.block_lens, device_id=inf.device_id,
                                              mem_type=inf.memory_type)
        except ValueError as exc:
            raise HandshakeFailed(f"engine {peer.engine_id!r} rank {q}: {exc}") from exc

    # ----- events from the worker (caller thread) -----------------------------
    def fileno(self) -> int:
        """A file descriptor that becomes readable when the engine's worker has reported
        something (a handshake ended, READs were posted) for :meth:`poll` to apply, or
        saw a request's transfers complete (``complete_in_background_s``).

        Callers that wait in ``select()`` / ``multiprocessing.connection.wait`` between
        ``poll()`` calls can include the engine to call ``poll()`` at once instead of on
        their next timed round; ``poll()`` makes it unreadable again. Transfers the worker
        no longer checks (past ``complete_in_background_s``) and a peer's transfers of this
        rank's blocks do not wake it: keep a timed round while requests are in flight."""
        return self._events.fileno()

    def _drain_events(self) -> None:
        """Apply what the worker reported, in the order it happened."""
        self._events.clear()
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, HandshakeEnded):
                self._handshake_ended(event.peer)
            else:
                self.mode.on_event(event)

    def _handshake_ended(self, peer: Peer) -> None:
        if not self.peers.is_current(peer):  # superseded meanwhile (a restart or move)
            self.peers.drop(peer, stale=False)
            return
        self.stats.handshakes += 1
        self.stats.handshake_ms += peer.handshake_ms
        err = peer.error or None
        if err is None:
            peer.state = "ready"
            meta_ms, agents_ms, lists_ms = peer.phases_ms
            log.info("handshake with engine %s (TP %d) took %.1f ms: metadata %.1f ms, agents "
                     "%.1f ms, lists %.1f ms; queued %.1f ms before it began; %s",
                     peer.engine_id, peer.tp_size, peer.handshake_ms, meta_ms, agents_ms, lists_ms,
                     (peer.marks["handshake"] - peer.marks["created"]) * 1e3, peer.phase_detail)
        else:
            log.warning("handshake with engine %s failed: %s", peer.engine_id, err)
            self.peers.drop(peer, stale=False)
        self.mode.on_handshake(peer, err)

    # ----- the surface the mode objects use ---------------------------------------
    def submit(self, job: Job) -> None:
        """Run ``job`` on this engine's worker thread, after every job submitted before it
        (a request's posting job after the handshake it waits for)."""
        self._worker.submit(job)

    def report(self, event: object) -> None:
        """Worker thread: queue ``event`` for the caller's next ``poll()``, which hands it to
        ``mode.on_event`` (in the order reported) and makes :meth:`fileno` readable."""
        self._events.put(event)

    def sweep(self, transfers: dict[Hashable, Transfer],
              peer_engine: str) -> tuple[list[Hashable], Hashable | None]:
        """Check the transfers of one request, keyed by peer rank (or any key), in order.

        Finished ones are counted, released and removed from ``transfers``;
        returns their keys and the key of the first one that ended in error
        (None if none did; the sweep stops there).
        """
        done: list[Hashable] = []
        for rank, x in list(transfers.items()):
            st = self.agent.state(x)
            if st == "PROC":
                continue
            if st != "DONE":
                return done, rank
            first_done(self.peers.get(peer_engine))
            record_done(self.agent, self.stats, x, self._records, peer_engine)
            del transfers[rank]
            done.append(rank)
        return done, None

    def drive(self, transfers: Iterable[Transfer], then: Callable[[], None] | None = None) -> None:
        """Worker thread: have the transfers just posted checked (:meth:`Worker.watch`: between
        later jobs, every 50 µs backing off to 1 ms) until none is in progress, for at most
        ``complete_in_background_s`` (then ``poll()`` goes on), then call ``then`` there and,
        if all completed, make :meth:`fileno` readable. Returns at once, so the next request's
        posts do not wait; telemetry times completion when a check first sees it."""
        pending, end = list(transfers), time.monotonic() + self.config.complete_in_background_s
        gap = 0.00005
        def check() -> float | None:
            nonlocal pending, gap
            try:
                pending = [x for x in pending if self.agent.state(x) == "PROC"]
            except NixlError:  # the agent was closed: nothing is in progress any more
                pending = []
            if pending and time.monotonic() <= end:
                wait, gap = gap, min(2 * gap, 0.001)
                return wait
            try:
                if then is not None:
                    then()
            finally:
                if not pending:
                    self._events.wake()
            return None

        self._worker.watch(check)

    def drop_transfers(self, transfers: Iterable[Transfer]) -> None:
        """Give transfers up: release their handles, except those still in progress, which
        are kept until they end (:mod:`~kvbridge.nixl.abandoned`; NIXL cannot cancel them)."""
        self._abandoned.drop(transfers)

    def _release_transfers(self) -> None:
        """Release the given-up transfers that have ended since (every ``poll()``)."""
        self._abandoned.sweep()

    def resource_counts(self) -> dict[str, int]:
        """The agent's live resources (:meth:`NixlAgent.counts`), known ``peers``, and those of
        ``transfers`` given up and not released yet (``kept_transfers``, :mod:`.abandoned`)."""
        return {**self.agent.counts(), "peers": len(self.peers), "kept_transfers": len(self._abandoned)}

    # ----- teardown ---------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._worker.close(timeout_s=self.config.handshake_timeout_s * 4 + 1)
        self.peers.close()
        if self._own_server and self.server is not None:
            self.server.close()
        self._zmq.term()
        self._events.close()
        self.agent.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
