"""The remote engines a rank knows: one :class:`Peer` per engine id, and the one way to forget one.

A peer is created when a request first names its engine (or names it at a new
address, TP size or incarnation: a restart), handshaken on the worker thread,
and dropped by :meth:`PeerTable.drop`, which releases everything the rank built
for it: the remote agents (and with them the transfers and remote lists bound to
them), the local descriptor lists and the descriptor tables. Every way a peer
ends (a failed handshake, a failed transfer, a restart, a handshake superseded
while it ran, the engine closing) goes through that one method.

Threads: the caller thread owns the table and ``Peer.state``; the worker thread
fills a peer during its handshake and then sets ``handshaked`` (and ``error``),
and reads ``state`` and :meth:`PeerTable.is_current` only to skip work for a
peer that is gone.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvbridge.handshake import AgentMetadata
from kvbridge.memory import RankDescriptors
from kvbridge.topology import EngineSpec, TransferPlan

from .agent import NixlAgent, PreparedList
from .stats import Stats

log = logging.getLogger("kvbridge.nixl")


@dataclass(frozen=True)
class ThreadUsage:
    """The calling thread's CPU seconds and context switches so far (see :func:`thread_usage`)."""

    cpu_s: float = 0.0
    preempted: int = 0  # involuntary switches: the scheduler gave the core to another thread
    waited: int = 0  # voluntary switches: the thread blocked (a lock, I/O, a peer)
    runnable_s: float = 0.0  # time spent ready to run but waiting for a CPU (Linux)

    def __sub__(self, earlier: ThreadUsage) -> ThreadUsage:
        """The usage between ``earlier`` and this reading."""
        return ThreadUsage(self.cpu_s - earlier.cpu_s, self.preempted - earlier.preempted,
                           self.waited - earlier.waited, self.runnable_s - earlier.runnable_s)


def thread_usage() -> ThreadUsage:
    """This thread's usage: CPU time from the thread's CPU clock, context switches from
    ``getrusage(RUSAGE_THREAD)`` and the wait for a CPU from ``/proc/thread-self/schedstat``
    (the last two on Linux only). ``getrusage``'s CPU times are not used: for a running
    thread they lag by up to a scheduler tick, enough to make a few milliseconds' CPU time
    exceed their wall time."""
    try:
        ru = resource.getrusage(resource.RUSAGE_THREAD)
    except (AttributeError, OSError):
        return ThreadUsage(time.thread_time(), 0, 0)
    try:
        with open("/proc/thread-self/schedstat") as f:
            runnable_s = int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        runnable_s = 0.0
    return ThreadUsage(time.thread_time(), ru.ru_nivcsw, ru.ru_nvcsw, runnable_s)


@dataclass(frozen=True)
class PhaseDetail:
    """Where a handshake's time went on the worker thread, per phase (metadata, agents, lists):
    the agents phase split into loading the metadata and connecting, and per phase the thread's
    CPU time, its time ready to run but waiting for a CPU, and how often it was preempted or
    blocked. Wall time far above CPU time with a long wait for a CPU means the cores were busy
    elsewhere; with neither, the thread was blocked (a lock, I/O, a peer)."""

    load_ms: float = 0.0
    connect_ms: float = 0.0
    #: the worker thread's usage during each phase (metadata, agents, lists)
    usage: tuple[ThreadUsage, ...] = (ThreadUsage(), ThreadUsage(), ThreadUsage())

    def __str__(self) -> str:
        cpu = "/".join(f"{u.cpu_s * 1e3:.1f}" for u in self.usage)
        ready = "/".join(f"{u.runnable_s * 1e3:.1f}" for u in self.usage)
        pre = "/".join(str(u.preempted) for u in self.usage)
        wait = "/".join(str(u.waited) for u in self.usage)
        return (f"agents: load {self.load_ms:.1f} ms, connect {self.connect_ms:.1f} ms; worker thread "
                f"per phase (metadata/agents/lists): CPU {cpu} ms, waiting for a CPU {ready} ms, "
                f"preempted {pre}, blocked {wait} times")


@dataclass(eq=False)
class Peer:
    """One remote engine as seen from this rank."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    incarnation: str = ""
    state: str = "handshaking"  # -> ready | failed (caller thread)
    #: set by the worker thread when the handshake ended (``error`` empty when it succeeded)
    handshaked: bool = False
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
    phase_detail: PhaseDetail = field(default_factory=PhaseDetail)
    #: ``time.perf_counter()`` marks of this peer's first request, for the log line of its first
    #: completed transfer: created (a request named it), handshake began on the worker, handshake
    #: ended, first transfer posted, first completion seen (0.0: not yet)
    marks: dict[str, float] = field(default_factory=lambda: {"created": time.perf_counter()})

    @property
    def usable(self) -> bool:
        """The handshake succeeded and the peer was not dropped since (either thread)."""
        return self.handshaked and not self.error and self.state != "failed"


def first_done(peer: Peer | None) -> None:
    """Log, once per peer, where its first request's time went (ms after a request first named
    the peer): the handshake's start and end, the first post, the first completion seen."""
    if peer is None or "done" in peer.marks:
        return
    m = peer.marks
    m["done"] = time.perf_counter()
    at = {k: (m[k] - m["created"]) * 1e3 if k in m else float("nan")
          for k in ("handshake", "handshaked", "posted", "done")}
    log.info("first transfer with engine %s: handshake began at %.1f ms, ended at %.1f ms, "
             "first post at %.1f ms, first completion seen at %.1f ms", peer.engine_id,
             at["handshake"], at["handshaked"], at["posted"], at["done"])


class PeerTable:
    """The peers of one rank by engine id; ``start`` queues a peer's handshake on the worker."""

    def __init__(self, agent: NixlAgent, stats: Stats, start: Callable[[Peer], None]) -> None:
        self._agent = agent
        self._stats = stats
        self._start = start
        self._peers: dict[str, Peer] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._peers.values()))

    def get(self, engine_id: str) -> Peer | None:
        return self._peers.get(engine_id)

    def is_current(self, peer: Peer) -> bool:
        """Whether ``peer`` is still the table's entry for its engine (not superseded or dropped)."""
        return self._peers.get(peer.engine_id) is peer

    def for_request(self, engine_id: str, host: str, port: int, tp_size: int, incarnation: str) -> Peer:
        """The known peer, or a new one (its handshake queued) when unknown, failed, moved,
        resized or restarted (another incarnation)."""
        peer = self._peers.get(engine_id)
        if peer is not None and (
            (peer.host, peer.port, peer.tp_size) != (host, port, tp_size)
            or (incarnation and peer.incarnation and incarnation != peer.incarnation)
        ):
            if peer.state == "ready":
                log.info("engine %s changed (restart or move): handshaking again", engine_id)
                self.drop(peer)
            # a peer still handshaking is superseded: dropped when its handshake reports
            peer = None
        if peer is None or peer.state == "failed":
            peer = Peer(engine_id, host, port, tp_size, incarnation)
            self._peers[engine_id] = peer
            self._start(peer)
        return peer

    def drop(self, peer: Peer, stale: bool = True) -> None:
        """Forget a peer: its remote agents (with the transfers and remote lists bound to them),
        its local lists and descriptor tables. ``stale``: count it in
        ``stats.stale_agents_dropped`` (a peer that worked and is presumed restarted or dead).
        Idempotent."""
        if self._peers.get(peer.engine_id) is peer:
            del self._peers[peer.engine_id]
        for name in peer.agents.values():
            self._agent.remove_remote(name)
        for lst in peer.local_lists.values():
            self._agent.release_list(lst)
        peer.local_lists.clear()
        peer.remote_lists.clear()
        peer.descs.clear()
        peer.agents.clear()
        if peer.state != "failed" and stale:
            self._stats.stale_agents_dropped += 1
        peer.state = "failed"

    def close(self) -> None:
        for peer in list(self._peers.values()):
            self.drop(peer, stale=False)
