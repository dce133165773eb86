"""One TP rank's transfer engines and what both modes' worker halves share.

vLLM runs one worker-side connector per rank. :class:`RankEngines` owns the
rank's :class:`kvbridge.nixl.PrefillEngine` (``kv_producer``) and/or
:class:`kvbridge.nixl.DecodeEngine` (``kv_consumer``), registers the cache with
them, publishes the handshake payload, and reports, between steps, which
requests finished sending or receiving, which receives failed and which local
blocks must be recomputed. The mode's worker half
(:class:`kvbridge.vllm.pull.worker.PullWorker`,
:class:`kvbridge.vllm.push.worker.PushWorker`) adds how it carries out a step's
orders and which released prefill requests it reports sent.

Plain values in and out: this module imports nothing from vLLM (the facade,
:mod:`kvbridge.vllm.connector`, translates), so it runs in tests with real
torch tensors and real NIXL engines.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import select
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from kvbridge.handshake import encode_metadata
from kvbridge.memory import CacheRegions
from kvbridge.nixl import DecodeEngine, EngineConfig, PrefillEngine, Stats, timeline_mark
from kvbridge.topology import BlockIds, EngineSpec, Released
from kvbridge.vllm.config import EngineRoles
from kvbridge.vllm.modes import TransferResults, WorkerMode
from kvbridge.vllm.stats import empty_stats, is_empty, stats_delta

__all__ = ["RankEngines"]

log = logging.getLogger("kvbridge.vllm")

#: while :meth:`RankEngines.results` waits out an idle step, how often it checks for
#: NIXL notifications (which wake nothing by themselves)
IDLE_CHECK_S = 0.0002


@dataclass(frozen=True)
class _Registration:
    """What :meth:`RankEngines.register` was given: enough to register the cache again."""

    spec: EngineSpec
    regions: CacheRegions
    config: EngineConfig
    incarnation: str
    address: tuple[str, int]
    layer_names: tuple[str, ...]


def next_incarnation(incarnation: str) -> str:
    """The incarnation an engine takes when it registers its cache again after sleep mode:
    a new value (peers that hold the old one handshake again, and parameters issued
    before the sleep are refused as from a restarted engine), the same on every rank."""
    return hashlib.sha256(f"{incarnation}|woken".encode()).hexdigest()[:32]


class RankEngines(WorkerMode):
    """One TP rank's half of the connector (see the module docstring).

    ``single_group``: vLLM maps failed block ids back to requests only for models
    with one KV-cache group (vLLM 0.32 raises for a flat set of invalid block ids on
    a hybrid model, as block ids are unique per group only); for others the failure
    travels in ``failed_recving``, which makes vLLM recompute (or fail) the whole
    request in every group, and the failed loads' local block ids per group are
    logged.
    """

    #: whether :meth:`results` waits out idle steps on a decode rank (see there): push mode,
    #: where the decode engine is idle while the prefill engine computes and writes; not
    #: pull mode, where the decode rank's own threads copy (waiting there cost about 5 ms
    #: of decode TTFT per request on the benchmark host; docs/benchmarks.md, "Measurements
    #: behind the defaults")
    idle_waits: bool = False

    def __init__(self, rank: int, roles: EngineRoles, *, single_group: bool = True) -> None:
        self.rank = rank
        self.roles = roles
        self.prefill: PrefillEngine | None = None
        self.decode: DecodeEngine | None = None
        self.layer_names: tuple[str, ...] = ()
        self._single_group = single_group
        self._free_now: set[str] = set()  # prefill requests to report sent (nothing holds them)
        self._failed_now: dict[str, BlockIds] = {}  # loads refused before starting
        self._invalid: set[int] = set()
        self._loading: dict[str, BlockIds] = {}  # started loads: local block ids
        self._stats_base: dict[str, Stats] = {}
        self._registration: _Registration | None = None
        self._asleep = False
        self._stats_kept: dict[str, Any] | None = None  # taken from engines closed by suspend()

    # ----- what a mode adds ------------------------------------------------
    @abstractmethod
    def _served_engine(self) -> PrefillEngine | DecodeEngine | None:
        """The engine peers handshake with (pull: the prefill engine, which decode engines
        read; push: the decode engine, which prefill engines write into)."""

    @abstractmethod
    def _sent(self, released: Released) -> bool:
        """Whether a request the prefill engine released is reported finished sending now."""

    # ----- registration ----------------------------------------------------
    def register(self, spec: EngineSpec, regions: CacheRegions, config: EngineConfig, *,
                 incarnation: str, address: tuple[str, int], layer_names: tuple[str, ...] = ()) -> None:
        """Register this rank's cache with its engines. ``address`` is the side channel
        the scheduler serves this engine's metadata on; ``layer_names`` are vLLM's names of
        the cache's layers in model order (push mode writes layers by name)."""
        self.layer_names = tuple(layer_names)
        self._registration = _Registration(spec, regions, config, incarnation, tuple(address),
                                           self.layer_names)
        if self.roles.producer:
            self.prefill = PrefillEngine(spec, self.rank, regions, config, incarnation=incarnation)
            self.prefill.advertise(*address)
        if self.roles.consumer:
            self.decode = DecodeEngine(spec, self.rank, regions, config, incarnation=incarnation)
        log.info("kvbridge: rank %d registered %d layers (%s %s, %d blocks of %d tokens, %s)",
                 self.rank, spec.num_layers, spec.layout.value, spec.head_order.value,
                 regions.num_blocks, spec.block_size, regions.mem_type)

    def handshake(self) -> tuple[str, bytes] | None:
        """(compatibility hash, encoded metadata) of this rank for the scheduler to serve,
        None when this rank has no engine peers handshake with."""
        eng = self._served_engine()
        if eng is None:
            return None
        return eng.compat_hash, encode_metadata(eng.metadata())

    def compat_info(self) -> dict[str, str]:
        """The fields of :meth:`handshake`'s compatibility hash, served beside it so that a
        refused peer is told which differ (empty when this rank has no such engine)."""
        eng = self._served_engine()
        return {} if eng is None else dict(eng.compat_info)

    # ----- sleep mode ------------------------------------------------------
    @property
    def asleep(self) -> bool:
        """Between :meth:`suspend` and :meth:`resume`: no cache is registered, no engine runs."""
        return self._asleep

    def suspend(self) -> None:
        """Drop the cache's registrations before vLLM frees its memory (sleep mode).

        The engines close: their NIXL agents deregister the cache and end every
        connection and transfer, so no peer can read or write the memory once it is
        gone. What was in flight ends cleanly at the next :meth:`results`: the
        requests the prefill engine held are reported sent (their blocks are vLLM's
        again; a decode engine still reading them fails and recomputes), and this
        rank's started loads are reported failed with their blocks invalid. Until
        :meth:`resume`, orders are refused as :meth:`start` refuses them for an engine
        this rank does not run. Idempotent; nothing to do before :meth:`register`."""
        if self._asleep or self._registration is None:
            return
        self._asleep = True
        for rid, local in self._loading.items():
            self._failed_now[rid] = local
        self._loading.clear()
        self._free_now.update(self._drop_holds())
        self._stats_kept = self.take_stats()  # the closing engines' last interval
        self.close()
        self._stats_base.clear()  # the next engines count from zero
        log.info("kvbridge: rank %d asleep: KV cache deregistered from NIXL, transfers refused "
                 "until vLLM restores the cache", self.rank)

    def resume(self) -> None:
        """Register the cache again after vLLM restored its memory (sleep mode keeps the
        tensors at their addresses), under a new incarnation (:func:`next_incarnation`):
        :meth:`handshake` then returns the new metadata, which vLLM hands the scheduler
        to serve, and peers handshake again. Idempotent."""
        reg = self._registration
        if not self._asleep or reg is None:
            return
        incarnation = next_incarnation(reg.incarnation)
        self.register(reg.spec, reg.regions, reg.config, incarnation=incarnation,
                      address=reg.address, layer_names=reg.layer_names)
        self._asleep = False
        log.info("kvbridge: rank %d awake: KV cache registered again as incarnation %s",
                 self.rank, incarnation)

    def _drop_holds(self) -> set[str]:
        """Forget what this rank holds for peers (sleep mode): the ids to report sent."""
        return set()

    # ----- per step --------------------------------------------------------
    def _load_started(self, request_id: str, local: BlockIds) -> None:
        self._loading[request_id] = local

    def _load_failed(self, request_id: str, local: BlockIds) -> None:
        """A load (or expectation) refused before it started: reported failed next."""
        self._failed_now[request_id] = local

    def results(self, wait_s: float = 0.0) -> TransferResults:
        """Requests whose transfer ended on this rank since the last call; a failed
        receive is also a finished one, and its local blocks go to
        :meth:`take_invalid_blocks`.

        ``wait_s`` > 0 (a step in which vLLM ran nothing), in a mode whose decode ranks
        wait (:attr:`idle_waits`): when nothing ended yet but this rank awaits blocks,
        wait up to ``wait_s`` for a request to end, instead of returning to a vLLM loop
        that would only step again at once. The wait sleeps in ``select()`` on the decode
        engine's wake-up descriptor (anything its transfer thread reports ends the sleep)
        and polls every :data:`IDLE_CHECK_S`, which is when NIXL notifications (push
        mode's WRITTEN and FAILED) are seen. A rank that only
        holds blocks for decode engines (prefill) never waits: measured in pull mode with
        pinned engines on two cores, a prefill engine that waited instead of stepping let
        the decode engine's scheduler process sit 100-300 ms in its core's run queue behind
        the decode worker's spinning main thread while the other core idled, and loads
        stalled that long (docs/benchmarks.md)."""
        r = self._collect()
        if wait_s <= 0 or not r.empty or not self.idle_waits:
            return r
        dec = self.decode
        if dec is None:
            return r
        end = time.monotonic() + wait_s
        fds = [dec.fileno()]
        while dec.pending:
            left = end - time.monotonic()
            if left <= 0:
                break
            select.select(fds, [], [], min(left, IDLE_CHECK_S))
            r = self._collect()
            if not r.empty:
                break
        return r

    def _collect(self) -> TransferResults:
        """One round of :meth:`results`, never waiting."""
        sending, recving, failed = set(self._free_now), set(self._failed_now), set(self._failed_now)
        for rid, blocks in self._failed_now.items():
            self._mark_invalid(rid, blocks)
        self._free_now.clear()
        self._failed_now.clear()
        if self.prefill is not None:
            sending.update(r.request_id for r in self.prefill.poll() if self._sent(r))
        if self.decode is not None:
            ev = self.decode.poll()
            recving.update(ev.done)
            for rid in ev.done:
                self._loading.pop(rid, None)
                timeline_mark("load_reported", rid)
            for f in ev.failed:
                local = self._loading.pop(f.request_id, None)
                log.warning("kvbridge: request %s failed (%s): %s; its %d local blocks must be "
                            "recomputed", f.request_id, f.kind.value, f.message, len(f.invalid_block_ids))
                recving.add(f.request_id)
                failed.add(f.request_id)
                # the engine's failure lists every group's ids in one tuple
                self._mark_invalid(f.request_id, local if local is not None
                                   else (tuple(f.invalid_block_ids),))
        return TransferResults(frozenset(sending), frozenset(recving), frozenset(failed))

    def _mark_invalid(self, request_id: str, blocks: BlockIds) -> None:
        """Record a failed load's local blocks, per KV-cache group."""
        if self._single_group:
            for g in blocks:
                self._invalid.update(g)
        else:
            log.warning("kvbridge: request %s: invalid local blocks per KV-cache group %s; vLLM "
                        "recomputes (or fails) the request in every group", request_id,
                        [list(g) for g in blocks])

    def take_invalid_blocks(self) -> set[int]:
        """Local block ids of failed loads reported since the last call (empty for models
        with several KV-cache groups, see the class docstring)."""
        out, self._invalid = self._invalid, set()
        return out if self._single_group else set()

    def take_stats(self) -> dict[str, Any] | None:
        """The interval's :mod:`kvbridge.vllm.stats` data since the last call, or None
        when nothing happened."""
        st, self._stats_kept = self._stats_kept or empty_stats(), None
        for name, eng in (("prefill", self.prefill), ("decode", self.decode)):
            if eng is None:
                continue
            now = copy.deepcopy(eng.stats)
            before = self._stats_base.get(name, Stats())
            self._stats_base[name] = now
            for k, v in stats_delta(now, before).items():
                st[k] += v
            hs = now.handshakes - before.handshakes
            if hs > 0:
                avg = (now.handshake_ms - before.handshake_ms) / hs / 1e3
                st["handshake_duration"].extend([avg] * hs)
            for rec in eng.take_records():
                st["transfer_duration"].append(rec.xfer_us / 1e6)
                st["post_duration"].append(rec.post_us / 1e6)
                st["bytes_transferred"].append(rec.bytes)
                st["num_descriptors"].append(rec.descriptors)
        return None if is_empty(st) else st

    def close(self) -> None:
        for eng in (self.decode, self.prefill):
            if eng is not None:
                eng.close()
        self.decode = self.prefill = None
