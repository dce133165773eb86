"""The transfer engine: one :class:`PrefillEngine` or :class:`DecodeEngine` per TP rank.

Pull mode (default): the decode rank handshakes with the prefill ranks it
needs, prepares descriptor lists once per (prefill engine, rank), and posts one
READ per source rank per request, each carrying a completion notification.
Prefill ranks that hold only duplicate data get a notification without a read.
The prefill rank counts notifications and releases a request's blocks when
every assigned decode rank has reported, or when the request's lease lapses.

Push mode: the decode rank announces its blocks (:meth:`DecodeEngine.expect`);
the prefill rank handshakes with the decode ranks it serves and WRITEs into
them, notifying each; the decode rank completes when every source rank has
written.

Threading: each engine has one background worker thread for handshakes
(side-channel I/O and loading remote agents). Every NIXL call goes through the
agent's lock, so the worker and the caller's thread never call NIXL at the same
time. Nothing the caller calls blocks on a peer: :meth:`poll` only looks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import zmq

from kvbridge.handshake import (
    AgentMetadata,
    EngineFacts,
    HandshakeError,
    MetadataServer,
    compatibility_hash,
    fetch_metadata,
    new_incarnation,
)
from kvbridge.memory import (
    CacheRegions,
    HugePageResult,
    RankDescriptors,
    RegionGeometry,
    advise_huge_pages,
    kernel_spec,
    post_process,
    rank_descriptors,
    regions_from_kv_caches,
)
from kvbridge.topology import (
    EngineSpec,
    HeadOrder,
    RankPlan,
    TopologyError,
    TransferPlan,
    plan_transfer,
)

from .agent import AgentConfig, NixlAgent, NixlError, PreparedList, Transfer
from .ledger import DecodeTracker, Failed, FailureKind, PrefillLedger, Released, State
from .messages import Kind, Notification, encode_notification, new_token, parse_notification
from .stats import Stats

log = logging.getLogger("kvbridge.nixl")


@dataclass(frozen=True)
class TransferRecord:
    """One finished transfer (NIXL telemetry), for callers that keep per-transfer figures."""

    op: str  # "READ" or "WRITE"
    peer_engine: str
    bytes: int
    descriptors: int
    post_us: int
    xfer_us: int


def _record_done(agent: NixlAgent, stats: Stats, transfer: Transfer,
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
class EngineConfig:
    """Engine knobs (all times in seconds)."""

    agent: AgentConfig = field(default_factory=AgentConfig)
    mode: str = "pull"
    lease_s: float = 30.0
    renew_interval_s: float = 10.0
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 60.0
    allow_strided: bool = True
    mem_type: str = "DRAM"
    #: back host-memory (DRAM) caches with transparent huge pages before registering them
    #: (``kvbridge.memory.advise_huge_pages``): host READs pin pages as they copy, and on
    #: 4 KiB pages that costs about a third of the bandwidth; ignored for VRAM
    huge_pages: bool = True
    #: build and post READs on the worker thread, so load() and poll() never wait for NIXL
    #: (over UCX in host memory NIXL performs the copy inside the post call)
    post_in_background: bool = True
    #: model identity and attention backend for the handshake's compatibility hash
    model: str = "kvbridge-synthetic"
    attention_backend: str = "kvbridge"
    #: refuse peers whose compatibility hash differs (turn off only when you vouch for the pair)
    enforce_compat: bool = True
    #: how often the engine's worker lets NIXL progress while idle (seconds; 0: only in
    #: poll() and while transfers run). Without it, and without NIXL's progress thread
    #: (``AgentConfig.progress_thread``), a peer's connection set-up waits for this
    #: side's next poll()
    progress_interval_s: float = 0.001
    #: keep one :class:`TransferRecord` per finished transfer (drain with ``take_records()``);
    #: at most ``max_records`` are kept between drains
    record_transfers: bool = False
    max_records: int = 4096

    def __post_init__(self) -> None:
        if self.mode not in ("pull", "push"):
            raise ValueError(f"mode must be 'pull' or 'push', got {self.mode!r}")
        for name in ("lease_s", "renew_interval_s", "handshake_timeout_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive seconds")
        if not 0 <= self.progress_interval_s <= 1:
            raise ValueError(f"progress_interval_s must be within [0, 1] seconds, got "
                             f"{self.progress_interval_s!r}")


@dataclass(frozen=True)
class TransferParams:
    """What a prefill engine hands out for one request (through the router to the decode engine).

    ``request_id`` is the id the prefill engine holds the request under; the
    decode side names it in its notifications. Empty means the decode side uses
    the same id as the prefill side.
    """

    engine_id: str
    host: str
    port: int
    tp_size: int
    block_ids: tuple[int, ...]
    token: str
    incarnation: str = ""
    request_id: str = ""


@dataclass(frozen=True)
class PushTarget:
    """Push mode: where a prefill engine writes one request (the decode engine's blocks)."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    block_ids: tuple[int, ...]
    token: str
    computed_tokens: int = 0


@dataclass(frozen=True)
class DecodeEvents:
    done: list[str]
    failed: list[Failed]


def _provisional(spec: EngineSpec, engine_id: str, tp_size: int) -> EngineSpec:
    """A peer engine of the same model with another TP size (its TP-only facts are exact)."""
    return replace(spec, engine_id=engine_id, tp_size=tp_size, block_bytes=None)


# ---------------------------------------------------------------------------
# shared machinery


@dataclass(eq=False)
class _Peer:
    """One remote engine as seen from this rank."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    incarnation: str = ""
    state: str = "handshaking"  # -> ready | failed
    error: str = ""
    plan: TransferPlan | None = None
    infos: dict[int, AgentMetadata] = field(default_factory=dict)
    agents: dict[int, str] = field(default_factory=dict)  # remote rank -> agent name
    remote_lists: dict[int, PreparedList] = field(default_factory=dict)
    local_lists: dict[int, PreparedList] = field(default_factory=dict)
    spec: EngineSpec | None = None  # the peer engine, from its metadata
    descs: dict[int, RankDescriptors] = field(default_factory=dict)  # remote rank -> descriptors
    handshake_ms: float = 0.0
    #: handshake phases (ms): side-channel metadata, loading + connecting agents, list preparation
    phases_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)


def _check_block_ids(ids: np.ndarray, num_blocks: int, what: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)][:5].tolist()
        raise ValueError(f"{what} block ids {bad} are outside 0..{num_blocks - 1}")


class HandshakeFailed(HandshakeError):
    """The peer's metadata does not describe what the request said (TP size, incarnation)."""


def engine_compat_hash(spec: EngineSpec, config: EngineConfig) -> str:
    """The handshake compatibility hash of an engine.

    Cache layouts are not hashed: kvbridge plans transfers between different
    layouts and the topology planner refuses pairs it cannot serve.
    """
    return compatibility_hash(model=config.model, dtype=spec.dtype, cache_dtype=spec.dtype,
                              layout="kvbridge-planned", attention_backend=config.attention_backend)


class _RankEngine:
    role = "?"

    def __init__(self, spec: EngineSpec, rank: int, cache: CacheRegions | Sequence | dict,
                 config: EngineConfig | None = None, *, incarnation: str | None = None):
        """``cache``: this rank's :class:`~kvbridge.memory.CacheRegions`, or its KV-cache
        tensors (one entry per layer), turned into regions with
        :func:`~kvbridge.memory.regions_from_kv_caches`."""
        if not 0 <= rank < spec.tp_size:
            raise ValueError(f"rank {rank} is outside TP size {spec.tp_size}")
        if spec.mamba is not None:
            raise TopologyError("the NIXL engine does not transfer Mamba hybrid caches yet")
        regions = cache if isinstance(cache, CacheRegions) else regions_from_kv_caches(cache, spec)
        if regions.spec != spec:
            raise ValueError(
                f"the cache regions were made for engine {regions.spec.engine_id!r} with another "
                f"description than engine {spec.engine_id!r}; build them with this engine's spec"
            )
        self.spec, self.rank, self.regions = spec, rank, regions
        self.geometry = RegionGeometry.from_regions(regions)
        self.config = config or EngineConfig()
        self.incarnation = incarnation or new_incarnation()
        self.compat_hash = engine_compat_hash(spec, self.config)
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
        self.agent = NixlAgent(f"{spec.engine_id}/{self.role}{rank}/{self.incarnation}", self.config.agent)
        try:
            self.agent.register(regions.registration_descs(), self.config.mem_type)
        except Exception:
            self.agent.close()
            raise
        self.server: MetadataServer | None = None
        self._own_server = False
        self._advertised: tuple[str, int] | None = None
        self._zmq = zmq.Context(io_threads=1)
        self._peers: dict[str, _Peer] = {}
        self._jobs: queue.Queue[object] = queue.Queue()
        self._results: queue.Queue[tuple[_Peer, str | None]] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name=f"kvbridge-handshake-{rank}", daemon=True)
        self._worker.start()
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
        """This rank's handshake metadata (NIXL agent metadata and cache geometry)."""
        regs = self.regions.regions
        return AgentMetadata(
            engine_id=self.spec.engine_id, incarnation=self.incarnation, rank=self.rank,
            tp_size=self.spec.tp_size, agent_name=self.agent.name, agent_metadata=self.agent.metadata(),
            memory_type=self.config.mem_type, device_id=self.regions.device_id,
            region_base_addrs=[r.base_addr for r in regs], region_sizes=[r.size for r in regs],
            num_blocks=self.regions.num_blocks, block_lens=[r.block_stride for r in regs],
            block_size=self.spec.block_size, kernel_blocks_per_block=self.spec.kernel_blocks_per_block,
            layout=self.spec.layout.value, head_order=self.spec.head_order.value,
            attention_backend=self.config.attention_backend, engine=EngineFacts.from_spec(self.spec),
        )

    def serve(self, server: MetadataServer | None = None, host: str = "127.0.0.1",
              port: int = 0) -> MetadataServer:
        """Publish this rank's metadata on ``server`` (shared by an engine's local ranks) or a new one."""
        if server is None:
            server = MetadataServer({self.rank: self.metadata()}, compat_hash=self.compat_hash,
                                    host=host, port=port)
            self._own_server = True
        else:
            if server.compat_hash != self.compat_hash:
                raise ValueError("the metadata server was created with another compatibility hash")
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

    # ----- handshakes (worker thread) ----------------------------------------
    def _descriptors(self, peer: _Peer, q: int, plan: TransferPlan) -> tuple[RankDescriptors, bool]:
        """Descriptors for peer rank ``q``, and whether this rank is the plan's local (decode) side."""
        raise NotImplementedError

    def _peer_ranks(self, peer: _Peer, plan: TransferPlan) -> tuple[list[int], list[int]]:
        """(ranks to handshake with, ranks that get lists prepared)."""
        raise NotImplementedError

    def _plan_for(self, peer_spec: EngineSpec) -> TransferPlan:
        raise NotImplementedError

    def _run_job(self, job: object) -> None:
        raise NotImplementedError

    def _sweep(self, transfers: dict[int, Transfer], peer_engine: str) -> tuple[list[int], int | None]:
        """Check the transfers of one request, keyed by peer rank, in order.

        Finished ones are counted, released and removed from ``transfers``;
        returns their ranks and the rank of the first one that ended in error
        (None if none did; the sweep stops there).
        """
        done: list[int] = []
        for rank, x in list(transfers.items()):
            st = self.agent.state(x)
            if st == "PROC":
                continue
            if st != "DONE":
                return done, rank
            _record_done(self.agent, self.stats, x, self._records, peer_engine)
            del transfers[rank]
            done.append(rank)
        return done, None

    def _work(self) -> None:
        interval = self.config.progress_interval_s
        while True:
            try:
                peer = self._jobs.get(timeout=interval) if interval else self._jobs.get()
            except queue.Empty:
                # no NIXL progress thread (it spins a core): keep connection set-up and
                # notifications moving while the owner is between poll() calls
                try:
                    self.agent.progress()
                except Exception as exc:  # never let the worker die; poll() reports NIXL errors
                    log.debug("rank %d: background NIXL progress failed: %s", self.rank, exc)
                continue
            if peer is None:
                return
            if not isinstance(peer, _Peer):
                self._run_job(peer)
                continue
            t0 = time.perf_counter()
            try:
                self._handshake(peer)
                err = None
            except (HandshakeError, NixlError, TopologyError, ValueError) as exc:
                err = str(exc)
            except Exception as exc:  # never let the worker die on a peer's input
                err = f"{type(exc).__name__}: {exc}"
            peer.handshake_ms = (time.perf_counter() - t0) * 1e3
            self._results.put((peer, err))

    def _handshake(self, peer: _Peer) -> None:
        timeout = self.config.handshake_timeout_s
        t0 = time.perf_counter()
        guess = self._plan_for(_provisional(self.spec, peer.engine_id, peer.tp_size))
        ranks, _ = self._peer_ranks(peer, guess)
        infos = fetch_metadata(peer.host, peer.port, ranks, engine_id=peer.engine_id,
                               compat_hash=self.compat_hash if self.config.enforce_compat else None,
                               timeout=timeout / 2, retries=1,
                               context=self._zmq)
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
        plan = self._plan_for(first.spec())
        if list(self._peer_ranks(peer, plan)[0]) != list(ranks):  # pragma: no cover - same TP/heads
            raise HandshakeFailed("the peer's engine changes which ranks to handshake with")
        _, listed = self._peer_ranks(peer, plan)
        if peer.incarnation and first.incarnation != peer.incarnation:
            raise HandshakeFailed(
                f"engine {peer.engine_id!r} is incarnation {first.incarnation}, the request was "
                f"issued by {peer.incarnation}: it restarted after issuing the request"
            )
        peer.incarnation = first.incarnation
        peer.plan, peer.infos, peer.spec = plan, infos, first.spec()
        t1 = time.perf_counter()
        for q in ranks:
            peer.agents[q] = self.agent.add_remote(infos[q].agent_metadata)
            self.agent.connect(peer.agents[q])
        t2 = time.perf_counter()
        for q in listed:
            rd, local_side = self._descriptors(peer, q, plan)
            mine = rd.local_descs(strided=True) if local_side else rd.remote_descs(strided=True)
            theirs = rd.remote_descs(strided=True) if local_side else rd.local_descs(strided=True)
            peer.local_lists[q] = self.agent.prepare(None, mine, self.config.mem_type,
                                                     self.config.allow_strided)
            peer.remote_lists[q] = self.agent.prepare(peer.agents[q], theirs, self.config.mem_type,
                                                      self.config.allow_strided)
            peer.descs[q] = rd
        peer.phases_ms = ((t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.perf_counter() - t2) * 1e3)

    def _remote_geometry(self, peer: _Peer, q: int) -> RegionGeometry:
        """Peer rank ``q``'s regions from its handshake numbers (checked against its description)."""
        inf = peer.infos[q]
        try:
            return RegionGeometry.from_remote(peer.spec, inf.region_base_addrs, inf.num_blocks,
                                              inf.block_lens, device_id=inf.device_id,
                                              mem_type=inf.memory_type)
        except ValueError as exc:
            raise HandshakeFailed(f"engine {peer.engine_id!r} rank {q}: {exc}") from exc

    def _drop_peer(self, peer: _Peer, stale: bool = True) -> None:
        """Forget a peer engine: its lists, transfers and agents."""
        if self._peers.get(peer.engine_id) is peer:
            del self._peers[peer.engine_id]
        for name in peer.agents.values():
            self.agent.remove_remote(name)
        for lst in peer.local_lists.values():
            self.agent.release_list(lst)
        peer.local_lists.clear()
        peer.remote_lists.clear()
        peer.descs.clear()
        peer.agents.clear()
        peer.state = "failed"
        if stale:
            self.stats.stale_agents_dropped += 1

    def _start_handshake(self, engine_id: str, host: str, port: int, tp_size: int,
                         incarnation: str) -> _Peer:
        peer = _Peer(engine_id, host, port, tp_size, incarnation)
        self._peers[engine_id] = peer
        self._jobs.put(peer)
        return peer

    def _peer_for(self, engine_id: str, host: str, port: int, tp_size: int, incarnation: str) -> _Peer:
        """The known peer, or a new handshake when unknown, moved, resized or restarted."""
        peer = self._peers.get(engine_id)
        if peer is not None and (
            (peer.host, peer.port, peer.tp_size) != (host, port, tp_size)
            or (incarnation and peer.incarnation and incarnation != peer.incarnation)
        ):
            if peer.state == "ready":
                log.info("engine %s changed (restart or move): handshaking again", engine_id)
                self._drop_peer(peer)
            peer = None
        if peer is None or peer.state == "failed":
            peer = self._start_handshake(engine_id, host, port, tp_size, incarnation)
        return peer

    def _drain_handshakes(self) -> list[tuple[_Peer, str | None]]:
        out = []
        while True:
            try:
                peer, err = self._results.get_nowait()
            except queue.Empty:
                return out
            if self._peers.get(peer.engine_id) is not peer:  # superseded meanwhile
                for name in peer.agents.values():
                    self.agent.remove_remote(name)
                continue
            self.stats.handshakes += 1
            self.stats.handshake_ms += peer.handshake_ms
            if err is None:
                peer.state = "ready"
                meta_ms, agents_ms, lists_ms = peer.phases_ms
                log.info("handshake with engine %s (TP %d) took %.1f ms: metadata %.1f ms, agents "
                         "%.1f ms, lists %.1f ms", peer.engine_id, peer.tp_size, peer.handshake_ms,
                         meta_ms, agents_ms, lists_ms)
            else:
                log.warning("handshake with engine %s failed: %s", peer.engine_id, err)
                peer.error = err
                self._drop_peer(peer, stale=False)
            out.append((peer, err))

    def wait_idle_handshakes(self, timeout_s: float) -> None:
        """Poll until no handshake is running (for tests and benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while any(p.state == "handshaking" for p in self._peers.values()):
            if time.monotonic() > deadline:
                raise TimeoutError("handshakes still running")
            time.sleep(0.001)
            self._poll_handshakes()

    def _poll_handshakes(self) -> None:
        raise NotImplementedError

    def resource_counts(self) -> dict[str, int]:
        c = self.agent.counts()
        c["peers"] = len(self._peers)
        return c

    # ----- teardown ---------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join(timeout=self.config.handshake_timeout_s * 4 + 1)
        for peer in list(self._peers.values()):
            self._drop_peer(peer, stale=False)
        if self._own_server and self.server is not None:
            self.server.close()
        self._zmq.term()
        self.agent.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------
# decode side


@dataclass(eq=False)
class _Load:
    request_id: str
    peer: _Peer
    params: TransferParams | None
    local_ids: np.ndarray
    computed_tokens: int
    token: str
    transfers: dict[int, Transfer] = field(default_factory=dict)
    last_renew: float = 0.0
    expect_from: tuple[int, ...] = ()

    @property
    def remote_id(self) -> str:
        """The id the prefill engine holds this request under (named in notifications)."""
        return (self.params.request_id if self.params is not None else "") or self.request_id


class DecodeEngine(_RankEngine):
    """One decode rank: loads requests' blocks from prefill engines (pull) or receives them (push)."""

    role = "d"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tracker = DecodeTracker(self.stats)
        self._loads: dict[str, _Load] = {}
        self._push_waiting: dict[str, set[int]] = {}
        self._posted: queue.Queue[tuple[_Load, dict[int, Transfer], str | None, float]] = queue.Queue()
        self._orphans: list[Transfer] = []
        self._silent: set[str] = set()  # releases: notify-only loads nobody waits for
        self._renewals: dict[tuple[str, str], TransferParams] = {}  # (engine, remote id) -> params

    # planning hooks
    def _plan_for(self, peer_spec: EngineSpec) -> TransferPlan:
        return plan_transfer(kernel_spec(peer_spec), kernel_spec(self.spec))

    def _rank_plan(self, plan: TransferPlan) -> RankPlan:
        return plan.decode_ranks[self.rank]

    def _peer_ranks(self, peer: _Peer, plan: TransferPlan) -> tuple[list[int], list[int]]:
        rp = self._rank_plan(plan)
        return list(rp.handshake_ranks), list(rp.source_ranks)

    def _descriptors(self, peer, q, plan):
        return rank_descriptors(self._rank_plan(plan), q, self.geometry,
                                self._remote_geometry(peer, q)), True

    # ----- public API -------------------------------------------------------
    def load(self, request_id: str, params: TransferParams, local_block_ids: Sequence[int],
             computed_tokens: int = 0) -> None:
        """Start loading a request's blocks (pull mode). Never blocks on the peer.

        ``local_block_ids`` are this engine's blocks for the tokens from
        ``computed_tokens`` on (tokens already present locally: a prefix hit);
        ``params.block_ids`` are the prefill engine's blocks for all tokens.
        """
        if self.config.mode != "pull":
            raise ValueError("load() is the pull-mode entry point; this engine is in push mode (use expect())")
        lids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
        _check_block_ids(lids, self.geometry.num_blocks, "local")
        if computed_tokens < 0 or computed_tokens % self.spec.block_size:
            raise ValueError(
                f"computed_tokens must be a non-negative multiple of the decode block size "
                f"{self.spec.block_size} (whole blocks already present), got {computed_tokens}"
            )
        peer = self._peer_for(params.engine_id, params.host, params.port, params.tp_size,
                              params.incarnation)
        now = time.monotonic()
        self.tracker.add(request_id, params.engine_id, lids.tolist(), now + self.config.transfer_timeout_s,
                         ready=peer.state == "ready")
        self._loads[request_id] = _Load(request_id, peer, params, lids, computed_tokens, params.token,
                                        last_renew=now)
        if peer.state == "ready":
            self._post(self._loads[request_id])

    def prepare(self, params: TransferParams) -> None:
        """Start the handshake with ``params``' prefill engine now, if it is not known yet.

        Lets a caller overlap the handshake with whatever precedes :meth:`load`
        (a request queued for local blocks). Never blocks on the peer.
        """
        if self.config.mode != "pull":
            raise ValueError("prepare() is for pull mode; in push mode the prefill side handshakes")
        self._peer_for(params.engine_id, params.host, params.port, params.tp_size, params.incarnation)

    def renew(self, params: TransferParams) -> None:
        """Renew the prefill lease of a request this rank has not started loading yet.

        The RENEW notifications go out on the next :meth:`poll` once the
        handshake with that engine is done (it is started here if needed).
        Requests being loaded are renewed by the engine itself.
        """
        self.prepare(params)
        self._renewals[(params.engine_id, params.request_id)] = params

    def release(self, params: TransferParams) -> None:
        """Tell the prefill ranks this rank will not read a request, so they free its blocks.

        For requests the caller dropped (aborted before loading, or fully
        present locally). Nothing is reported for it by :meth:`poll`; if the
        prefill engine cannot be reached its lease frees the blocks.
        """
        if not params.request_id:
            raise ValueError("release() needs params.request_id (the prefill-side request id)")
        rid = f"release/{params.engine_id}/{params.request_id}/{params.token}"
        if rid in self.tracker:
            return
        self._renewals.pop((params.engine_id, params.request_id), None)
        self._silent.add(rid)
        self.load(rid, params, [], 0)

    def expect(self, request_id: str, prefill_engine_id: str, prefill_tp: int, token: str,
               local_block_ids: Sequence[int], *, prefill_block_size: int | None = None,
               prefill_head_order: HeadOrder | str | None = None,
               prefill_kernel_blocks_per_block: int | None = None) -> None:
        """Push mode: wait for the prefill ranks that write this rank's share of a request.

        The decode rank never handshakes in push mode, so the caller names the
        prefill engine's cache facts that decide how received blocks must be
        rearranged: ``prefill_block_size`` (tokens per logical block),
        ``prefill_head_order`` (``HND`` or ``NHD``) and
        ``prefill_kernel_blocks_per_block``. Left out, each is the decode
        engine's own value, except that ``prefill_kernel_blocks_per_block``
        defaults to 1 (not kernel-split) when ``prefill_block_size`` is given.
        The request is planned with these values; when the plan needs
        post-processing (HND <-> NHD, or several smaller prefill units per
        decode block holding several heads) the engine applies
        :func:`kvbridge.memory.post_process` to the request's blocks once every
        source rank has written, before reporting it done. Wrong values are not
        detected (push notifications do not carry the prefill geometry): the
        received blocks would be rearranged wrongly. Raises ``ValueError``
        (:class:`~kvbridge.topology.TopologyError`) when the pair cannot be planned.
        """
        if self.config.mode != "push":
            raise ValueError("expect() is the push-mode entry point; this engine is in pull mode")
        lids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
        _check_block_ids(lids, self.geometry.num_blocks, "local")
        pspec = _provisional(self.spec, prefill_engine_id, prefill_tp)
        if prefill_block_size is not None or prefill_kernel_blocks_per_block is not None:
            bs = self.spec.block_size if prefill_block_size is None else prefill_block_size
            kb = prefill_kernel_blocks_per_block
            if kb is None:
                kb = self.spec.kernel_blocks_per_block if prefill_block_size is None else 1
            pspec = replace(pspec, block_size=bs, kernel_blocks_per_block=kb)
        if prefill_head_order is not None:
            pspec = replace(pspec, head_order=HeadOrder(prefill_head_order))
        plan = self._plan_for(pspec)
        sources = tuple(self._rank_plan(plan).source_ranks) if lids.size else ()
        now = time.monotonic()
        t = self.tracker.add(request_id, prefill_engine_id, lids.tolist(),
                             now + self.config.transfer_timeout_s, ready=True)
        self._loads[request_id] = _Load(request_id, _Peer(prefill_engine_id, "", 0, prefill_tp, plan=plan),
                                        None, lids, 0, token, expect_from=sources)
        self._push_waiting[request_id] = set(sources)
        self.tracker.posted(t.request_id, sources)
        if not sources:
            self._loads.pop(request_id, None)
            self._push_waiting.pop(request_id, None)

    def poll(self) -> DecodeEvents:
        """Advance handshakes, transfers, timeouts and lease renewals; return finished requests.

        Never waits: while the worker thread is inside a NIXL call, this round is skipped.
        """
        if self.agent.try_lock():
            try:
                self._poll_handshakes()
                if self.config.mode == "pull":
                    self._drain_posted()
                    self._poll_transfers()
                else:
                    self._poll_push()
                now = time.monotonic()
                for t in self.tracker.overdue(now):
                    self._fail(t.request_id, FailureKind.TIMEOUT,
                               f"not complete within {self.config.transfer_timeout_s:.1f} s")
                if self.config.mode == "pull":
                    self._renew(now)
                    self._send_renewals()
            finally:
                self.agent.unlock()
        done, failed = self.tracker.take_done(), self.tracker.take_failed()
        if self._silent:
            quiet = self._silent
            self._silent = quiet - set(done) - {f.request_id for f in failed}
            done = [r for r in done if r not in quiet]
            failed = [f for f in failed if f.request_id not in quiet]
        return DecodeEvents(done, failed)

    @property
    def pending(self) -> int:
        return len(self.tracker)

    # ----- internals --------------------------------------------------------
    def _poll_handshakes(self) -> None:
        for peer, err in self._drain_handshakes():
            if err is None:
                for t in self.tracker.handshake_done(peer.engine_id):
                    ld = self._loads[t.request_id]
                    ld.peer = peer  # it may have waited on a handshake this one superseded
                    self._post(ld)
            else:
                for f in self.tracker.handshake_failed(peer.engine_id, err):
                    self._loads.pop(f.request_id, None)

    def _notify(self, peer: _Peer, q: int, ld: _Load, kind: Kind) -> None:
        self._send(peer, q, ld.remote_id, ld.token, kind)

    def _send(self, peer: _Peer, q: int, remote_id: str, token: str, kind: Kind) -> None:
        msg = encode_notification(Notification(kind, remote_id, self.spec.tp_size, self.rank, token))
        self.agent.notify(peer.agents[q], msg)
        self.stats.notifications_sent += 1

    def _send_renewals(self) -> None:
        """RENEW the leases of requests announced with :meth:`renew` whose peer is ready."""
        for key, params in list(self._renewals.items()):
            peer = self._peers.get(params.engine_id)
            if peer is not None and peer.state == "handshaking":
                continue  # try again on the next poll
            del self._renewals[key]
            if peer is None or peer.state != "ready":
                continue  # the handshake failed: the lease will lapse, nothing to renew with
            for q in self._rank_plan(peer.plan).handshake_ranks:
                try:
                    self._send(peer, q, params.request_id, params.token, Kind.RENEW)
                    self.stats.leases_renewed += 1
                except NixlError:
                    break

    def _post(self, ld: _Load) -> None:
        """Build and post the READs of a request whose peer is ready (on the worker thread by default)."""
        if self.config.post_in_background:
            self._jobs.put(ld)
        else:
            self._run_job(ld)
            self._drain_posted()

    def _run_job(self, ld: object) -> None:
        if not isinstance(ld, _Load):
            return
        t0 = time.perf_counter()
        parts: dict[int, Transfer] = {}
        prep = 0.0
        try:
            prep = self._build(ld, parts)
            peer = ld.peer
            for q, x in parts.items():
                if self.agent.post(x) == "ERR":
                    raise NixlError(f"posting the READ from engine {peer.engine_id!r} rank {q} failed")
            rp = self._rank_plan(peer.plan)
            for q in (rp.notify_only_ranks if parts else rp.handshake_ranks):
                self._notify(peer, q, ld, Kind.DONE)
            err = None
        except NixlError as exc:  # the peer may be dead or restarted
            err = f"NIXL: {exc}"
        except (ValueError, KeyError) as exc:
            err = str(exc) or type(exc).__name__
        except Exception as exc:  # the worker must survive anything
            err = f"{type(exc).__name__}: {exc}"
        self._posted.put((ld, parts, err, prep if prep else (time.perf_counter() - t0) * 1e6))

    def _build(self, ld: _Load, parts: dict[int, Transfer]) -> float:
        """Make one READ per source rank (not posted); returns the microseconds it took."""
        t0 = time.perf_counter()
        peer = ld.peer
        plan = peer.plan
        rp = self._rank_plan(plan)
        rids = np.asarray(ld.params.block_ids, dtype=np.int64)
        skip = ld.computed_tokens // self.spec.block_size
        msg = encode_notification(Notification(Kind.DONE, ld.remote_id, self.spec.tp_size, self.rank,
                                               ld.token))
        for q in rp.source_ranks:
            li, ri = peer.descs[q].indices(ld.local_ids, rids, local_skip_blocks=skip)
            if li.size == 0:  # full prefix hit (or nothing to read): notify every rank instead
                break
            parts[q] = self.agent.make_transfer("READ", peer.local_lists[q], li, peer.remote_lists[q], ri,
                                                msg)
        return (time.perf_counter() - t0) * 1e6

    def _drain_posted(self) -> None:
        """Apply the worker's posting results (caller thread)."""
        for x in list(self._orphans):
            if self.agent.release_transfer(x):
                self._orphans.remove(x)
        while True:
            try:
                ld, parts, err, prep_us = self._posted.get_nowait()
            except queue.Empty:
                return
            rid = ld.request_id
            if self._loads.get(rid) is not ld:  # failed or timed out meanwhile
                self._orphans.extend(x for x in parts.values() if not self.agent.release_transfer(x))
                continue
            self.stats.prep_us += int(prep_us)
            self.stats.posts += 1
            ld.transfers.update(parts)
            if err is not None:
                self._fail(rid, FailureKind.POST, err)
                if err.startswith("NIXL: ") and ld.peer.state == "ready":
                    # posting to this engine failed in NIXL: handshake again next time
                    for other, ol in list(self._loads.items()):
                        if ol.peer is ld.peer and not ol.transfers:
                            self._fail(other, FailureKind.POST, err)
                    self._drop_peer(ld.peer)
                continue
            self.tracker.posted(rid, list(parts))
            if not parts:
                self._loads.pop(rid, None)

    def _release_load(self, ld: _Load) -> None:
        for x in ld.transfers.values():
            if not self.agent.release_transfer(x):
                # still active in NIXL (e.g. a timed-out READ): retried on every poll until released
                log.warning("NIXL refused to release an active transfer of %s; retrying later", ld.request_id)
                self._orphans.append(x)
        ld.transfers.clear()

    def _fail(self, rid: str, kind: FailureKind, message: str) -> None:
        ld = self._loads.pop(rid, None)
        if ld is not None:
            self._release_load(ld)
            self._push_waiting.pop(rid, None)
        if rid in self.tracker:
            self.tracker.fail(rid, kind, message)

    def _poll_transfers(self) -> None:
        broken: list[_Peer] = []
        for rid, ld in list(self._loads.items()):
            t = self.tracker.get(rid)
            if t is None or t.state is not State.POSTED:
                continue
            done, bad = self._sweep(ld.transfers, ld.peer.engine_id)
            for q in done:
                self._part_done(ld, q)
            if bad is not None:
                self._fail(rid, FailureKind.TRANSFER,
                           f"READ from engine {ld.peer.engine_id!r} rank {bad} ended in error")
                if ld.peer not in broken:
                    broken.append(ld.peer)
        for peer in broken:  # a failing peer is presumed restarted or dead: handshake again next time
            for rid, ld in list(self._loads.items()):
                if ld.peer is peer:
                    self._fail(rid, FailureKind.TRANSFER, f"engine {peer.engine_id!r} failed a transfer")
            self._drop_peer(peer)

    def _part_done(self, ld: _Load, part: int) -> None:
        """One source rank of ``ld`` finished (pull: its READ completed; push: it wrote).

        On the last one the request's blocks are post-processed before the
        request is reported done; if that fails the request fails instead.
        """
        rid = ld.request_id
        t = self.tracker.get(rid)
        if t is None or t.state is not State.POSTED or part not in t.outstanding:
            return
        if len(t.outstanding) == 1:  # the last part: rearrange before anyone sees "done"
            try:
                self._post_process(ld)
            except Exception as exc:  # a failed rearrangement leaves garbage: recompute the blocks
                self._fail(rid, FailureKind.POST, f"post-processing the received blocks failed: {exc}")
                return
        if self.tracker.part_done(rid, part):
            self._loads.pop(rid, None)
            self._push_waiting.pop(rid, None)

    def _post_process(self, ld: _Load) -> None:
        """Rearrange a completed request's blocks in place when the plan says so
        (HND <-> NHD, several smaller prefill blocks per decode block)."""
        pp = ld.peer.plan.post_process
        if pp.needed and ld.local_ids.size:
            post_process(self.regions, ld.local_ids, pp, self.spec)

    def _renew(self, now: float) -> None:
        every = self.config.renew_interval_s
        for ld in self._loads.values():
            if now - ld.last_renew < every or ld.peer.state != "ready":
                continue
            ld.last_renew = now
            for q in self._rank_plan(ld.peer.plan).handshake_ranks:
                try:
                    self._notify(ld.peer, q, ld, Kind.RENEW)
                    self.stats.leases_renewed += 1
                except NixlError:
                    pass

    def _poll_push(self) -> None:
        for _sender, raw in self._iter_notifs():
            n = parse_notification(raw)
            self.stats.notifications_received += 1
            if n is None or n.kind is not Kind.WRITTEN:
                self.stats.notifications_malformed += 1
                continue
            ld = self._loads.get(n.request_id)
            if ld is None:
                self.stats.notifications_unknown += 1
                continue
            if n.token != ld.token:
                self.stats.notifications_bad_token += 1
                continue
            # in WRITTEN messages the rank/TP fields name the prefill rank and TP
            if n.decode_tp != ld.peer.tp_size or n.decode_rank not in ld.expect_from:
                self.stats.notifications_malformed += 1
                continue
            self._part_done(ld, n.decode_rank)

    def _iter_notifs(self):
        for sender, msgs in self.agent.notifications().items():
            for m in msgs:
                yield sender, m


# ---------------------------------------------------------------------------
# prefill side


@dataclass(eq=False)
class _Push:
    request_id: str
    peer: _Peer
    target: PushTarget
    block_ids: np.ndarray
    transfers: dict[int, Transfer] = field(default_factory=dict)
    deadline: float = 0.0


class PrefillEngine(_RankEngine):
    """One prefill rank: holds requests' blocks until the decode side has them."""

    role = "p"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ledger = PrefillLedger(self._consumers_for, self.config.lease_s, self.stats)
        self._pushes: dict[str, _Push] = {}
        self._push_queue: list[_Push] = []
        self._push_released: list[Released] = []

    def _consumers_for(self, decode_tp: int) -> tuple[int, ...]:
        """The decode ranks (of a decode engine with TP ``decode_tp``) that notify this rank."""
        plan = plan_transfer(self.spec, _provisional(self.spec, self.spec.engine_id + "#decode", decode_tp))
        return plan.prefill_ranks[self.rank].consumer_ranks

    # push-mode planning hooks: the peer is a decode engine
    def _plan_for(self, peer_spec: EngineSpec) -> TransferPlan:
        return plan_transfer(kernel_spec(self.spec), kernel_spec(peer_spec))

    def _peer_ranks(self, peer: _Peer, plan: TransferPlan) -> tuple[list[int], list[int]]:
        read_by = list(plan.prefill_ranks[self.rank].read_by)
        return read_by, read_by

    def _descriptors(self, peer, r, plan):
        # the plan's local side is the decode rank r; this rank is its remote side
        return rank_descriptors(plan.decode_ranks[r], self.rank, self._remote_geometry(peer, r),
                                self.geometry), False

    # ----- public API -------------------------------------------------------
    def hold(self, request_id: str, block_ids: Sequence[int], token: str | None = None) -> TransferParams:
        """Hold a request's blocks under a lease; returns the parameters for the decode side.

        All ranks of one engine must hold a request with the same token: pass
        rank 0's token to the others (or one from :func:`new_token`).
        """
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        _check_block_ids(ids, self.geometry.num_blocks, "prefill")
        token = token or new_token()
        if self.config.mode == "pull":
            self.ledger.hold(request_id, ids.tolist(), token, time.monotonic())
        host, port = self.address
        return TransferParams(self.spec.engine_id, host, port, self.spec.tp_size, tuple(ids.tolist()),
                              token, self.incarnation, request_id)

    def push(self, request_id: str, block_ids: Sequence[int], target: PushTarget) -> None:
        """Push mode: write a request's blocks into the decode engine ``target``."""
        if self.config.mode != "push":
            raise ValueError("push() needs an engine configured with mode='push'")
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        _check_block_ids(ids, self.geometry.num_blocks, "prefill")
        peer = self._peer_for(target.engine_id, target.host, target.port, target.tp_size, "")
        p = _Push(request_id, peer, target, ids, deadline=time.monotonic() + self.config.transfer_timeout_s)
        self._pushes[request_id] = p
        if peer.state == "ready":
            self._post_push(p)
        else:
            self._push_queue.append(p)

    def poll(self) -> list[Released]:
        """Count notifications, expire leases, advance pushes; returns requests whose blocks are free."""
        self._poll_handshakes()
        now = time.monotonic()
        for sender, msgs in self.agent.notifications().items():
            for raw in msgs:
                outcome = self.ledger.on_notification(parse_notification(raw), now)
                if outcome in ("unknown", "bad-token", "malformed", "bad-decode-tp", "unassigned"):
                    log.debug("ignored notification from %s: %s", sender, outcome)
        for rid in self.ledger.expire(now):
            log.warning("request %s: lease of %.1f s lapsed before every decode rank read it; "
                        "releasing its blocks", rid, self.config.lease_s)
        if self.config.mode == "push":
            self._poll_pushes(now)
        out = self.ledger.take_released() + self._push_released
        self._push_released = []
        return out

    @property
    def held(self) -> int:
        return len(self.ledger) + len(self._pushes)

    # ----- push internals ----------------------------------------------------
    def _poll_handshakes(self) -> None:
        for peer, err in self._drain_handshakes():
            waiting = [p for p in self._push_queue if p.peer is peer]
            self._push_queue = [p for p in self._push_queue if p.peer is not peer]
            for p in waiting:
                if err is None:
                    self._post_push(p)
                else:
                    self._finish_push(p, f"handshake failed: {err}", FailureKind.HANDSHAKE)

    def _post_push(self, p: _Push) -> None:
        peer, plan = p.peer, p.peer.plan
        try:
            for r in plan.prefill_ranks[self.rank].read_by:
                skip = p.target.computed_tokens // peer.spec.block_size
                ti, mi = peer.descs[r].indices(np.asarray(p.target.block_ids, dtype=np.int64),
                                               p.block_ids, local_skip_blocks=skip)
                msg = encode_notification(Notification(Kind.WRITTEN, p.request_id, self.spec.tp_size,
                                                       self.rank, p.target.token))
                if mi.size == 0:
                    self.agent.notify(peer.agents[r], msg)
                    continue
                x = self.agent.make_transfer("WRITE", peer.local_lists[r], mi, peer.remote_lists[r], ti, msg)
                p.transfers[r] = x
                if self.agent.post(x) == "ERR":
                    raise NixlError(f"posting the WRITE to engine {peer.engine_id!r} rank {r} failed")
            if not p.transfers:
                self._finish_push(p, None)
        except (NixlError, ValueError) as exc:
            self._finish_push(p, str(exc), FailureKind.POST)

    def _finish_push(self, p: _Push, error: str | None, kind: FailureKind | None = None) -> None:
        for x in p.transfers.values():
            self.agent.release_transfer(x)
        p.transfers.clear()
        self._pushes.pop(p.request_id, None)
        if error is None:
            self.stats.requests_done += 1
            reason = "written"
        else:
            log.warning("push of %s failed: %s", p.request_id, error)
            self.stats.fail((kind or FailureKind.TRANSFER).value)
            reason = "push-failed"
        self.stats.requests_released += 1
        self._push_released.append(Released(p.request_id, tuple(p.block_ids.tolist()), reason))

    def _poll_pushes(self, now: float) -> None:
        broken = []
        for p in list(self._pushes.values()):
            if p in self._push_queue:
                if now >= p.deadline:
                    self._push_queue.remove(p)
                    self._finish_push(p, "timed out waiting for the handshake", FailureKind.TIMEOUT)
                continue
            _, bad = self._sweep(p.transfers, p.peer.engine_id)
            if bad is not None:
                self._finish_push(p, f"WRITE to rank {bad} ended in error", FailureKind.TRANSFER)
                broken.append(p.peer)
            elif not p.transfers:
                self._finish_push(p, None)
            elif now >= p.deadline:
                self._finish_push(p, "WRITE timed out", FailureKind.TIMEOUT)
        for peer in broken:
            if peer.state == "ready":
                self._drop_peer(peer)
