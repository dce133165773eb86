"""Pull mode (the default): decode ranks READ from prefill ranks, which hold blocks under a lease.

Decode side (:class:`PullReads`): :meth:`~kvbridge.nixl.DecodeEngine.load`
finds or starts the peer's handshake and hands the request to the worker at
once (one hand-off: the worker runs the request after the handshake it may
wait for). The worker builds one READ per source rank, each carrying a DONE
notification, posts them, and notifies the prefill ranks that hold only
duplicate data. ``poll()`` applies the posting results, checks the READs and
renews the leases of requests still in flight.

Prefill side (:class:`PullLeases`): ``hold()`` puts the request in the
engine's lease ledger; the ledger releases it when every assigned decode rank
has notified, or when its lease lapses.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from kvbridge.topology import FailureKind, TransferParams

from .agent import NixlError, Transfer
from .groups import group_arrays, pair_indices
from .ledger import State
from .messages import Kind, Notification, encode_notification
from .modes import DecodeMode, Load, PrefillMode
from .peers import Peer, thread_usage
from .staging import Staged
from .timeline import enabled as timeline_on
from .timeline import mark

log = logging.getLogger("kvbridge.nixl")


GIVEN_UP = "given up before its READs were posted"


class _GivenUp(Exception):
    """The request was given up (failed, timed out) before its READs were posted."""


def _nothing_read(ld: Load) -> None:
    log.info("request %s was given up before its READs were posted; nothing was read into "
             "its blocks", ld.request_id)


@dataclass(frozen=True, eq=False)
class ReadsSkipped:
    """Worker event: ``load``'s READs were not posted (``peer`` failed, was dropped or was
    superseded before the job ran)."""

    load: Load
    peer: Peer


@dataclass(frozen=True, eq=False)
class ReadsPosted:
    """Worker event: ``load``'s READs from ``peer``, one per source rank in ``parts``, were
    posted (``error`` None) or failed to post; ``prep_us``: block ids to READs ready;
    ``staged``: the READs (by source rank) that land in the staging buffer."""

    load: Load
    peer: Peer
    parts: dict[int, Transfer]
    error: str | None
    prep_us: float
    staged: dict[int, Staged]
    #: the posted READs were put on the load (``Load.unreported``) as they were posted
    attached: bool = False


class PullReads(DecodeMode):
    """Decode side of pull mode."""

    name = "pull"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._renewals: dict[tuple[str, str], TransferParams] = {}  # (engine, remote id) -> params

    # ----- entry points (caller thread) ---------------------------------------
    def load(self, request_id: str, params: TransferParams, local_ids: np.ndarray,
             computed_tokens: int, groups: tuple[np.ndarray, ...]) -> None:
        e = self.engine
        peer = e.peers.for_request(params.engine_id, params.host, params.port, params.tp_size,
                                   params.incarnation)
        now = time.monotonic()
        ld = Load(request_id, peer, params, local_ids, computed_tokens, params.token, last_renew=now,
                  groups=groups)
        # from now on the load renews its own lease (_renew_loading); a RENEW still queued
        # could reach the prefill after this load's DONE and be counted there as unknown
        self._renewals.pop((params.engine_id, params.request_id), None)
        e.add(ld, now, ready=peer.state == "ready")
        if peer.state == "ready" or e.config.post_in_background:
            self._post(ld)  # on the worker, after the handshake when one is running

    def prepare(self, params: TransferParams) -> None:
        self.engine.peers.for_request(params.engine_id, params.host, params.port, params.tp_size,
                                      params.incarnation)

    def renew(self, params: TransferParams) -> None:
        self.prepare(params)
        if self._loading(params):
            return  # a request being loaded renews its own lease
        self._renewals[(params.engine_id, params.request_id)] = params

    def _loading(self, params: TransferParams) -> bool:
        return any(ld.params is not None and ld.params.engine_id == params.engine_id
                   and ld.params.request_id == params.request_id
                   for ld in self.engine.loads())

    def release(self, params: TransferParams) -> None:
        e = self.engine
        rid = f"release/{params.engine_id}/{params.request_id}/{params.token}"
        if rid in e.tracker:
            return
        self._renewals.pop((params.engine_id, params.request_id), None)
        e.mute(rid)
        e.load(rid, params, ((),) * len(e.groups), 0)

    # ----- posting --------------------------------------------------------------
    def _post(self, ld: Load) -> None:
        """Build and post the READs of ``ld`` on the worker (or here, without ``post_in_background``)."""
        e, peer = self.engine, ld.peer
        ld.queued_for = peer
        if e.config.post_in_background:
            e.submit(lambda: self._post_and_drive(ld, peer))
        else:
            self.on_event(self._post_job(ld, peer))

    def _post_job(self, ld: Load, peer: Peer) -> ReadsSkipped | ReadsPosted:
        """Build and post one READ per source rank of ``peer`` (worker thread, or the caller's);
        returns the event that reports it."""
        e = self.engine
        if not (peer.usable and e.peers.is_current(peer)):  # failed, dropped or superseded meanwhile
            return ReadsSkipped(ld, peer)
        if e.load_of(ld.request_id) is not ld:  # given up (e.g. timed out) while it waited
            return ReadsSkipped(ld, peer)
        t0 = time.perf_counter()
        parts: dict[int, Transfer] = {}
        staged: dict[int, Staged] = {}
        prep = 0.0
        attached = False
        try:
            prep = self._build(ld, peer, parts, staged)
            # poll() gives requests up only while it holds the agent: holding it here, a request
            # still loading is not given up (its blocks handed back to the engine for reuse)
            # between this check and its posts
            with e.agent.turn():
                if e.load_of(ld.request_id) is not ld:
                    raise _GivenUp
                w0, u0 = time.perf_counter(), thread_usage() if timeline_on() else None
                for q, x in parts.items():
                    peer.marks.setdefault("posted", time.perf_counter())
                    if e.agent.post(x) == "ERR":
                        raise NixlError(f"posting the READ from engine {peer.engine_id!r} rank {q} failed")
                ld.unreported, attached = (parts, staged), True  # fail() now gives them up too
            rp = e.rank_plan(peer.plan)
            # ranks holding nothing this rank needs, and sources with nothing to read for this
            # request (a full prefix hit, only null blocks): notified instead of read
            for q in rp.notify_only_ranks + tuple(q for q in rp.source_ranks if q not in parts):
                self._notify(peer, q, ld.remote_id, ld.token, Kind.DONE)
            err = None
            if u0 is not None:  # the posts' wall time, CPU time and time waiting for a CPU
                u = thread_usage() - u0
                mark("read_posted", ld.request_id, reads=len(parts), prep_ms=f"{prep / 1e3:.2f}",
                     post_ms=f"{(time.perf_counter() - w0) * 1e3:.2f}",
                     post_cpu_ms=f"{u.cpu_s * 1e3:.2f}", runnable_ms=f"{u.runnable_s * 1e3:.2f}")
        except _GivenUp:  # nothing posted; the event's handler releases what was built
            err = GIVEN_UP
        except NixlError as exc:  # the peer may be dead or restarted
            err = f"NIXL: {exc}"
        except (ValueError, KeyError) as exc:
            err = str(exc) or type(exc).__name__
        except Exception as exc:  # the worker must survive anything
            err = f"{type(exc).__name__}: {exc}"
        for q in set(staged) - set(parts):  # planned, but building its READ failed
            e.staging.free(staged.pop(q))
        return ReadsPosted(ld, peer, parts, err, prep if prep else (time.perf_counter() - t0) * 1e6,
                           staged, attached)

    def _post_and_drive(self, ld: Load, peer: Peer) -> None:
        """Worker thread: post ``ld``'s READs, report them, then have them checked until they
        complete (between the worker's later jobs: ``RankEngine.drive``)."""
        e = self.engine
        event = self._post_job(ld, peer)
        e.report(event)
        if (isinstance(event, ReadsPosted) and event.error is None
                and e.config.complete_in_background_s > 0):
            def checked() -> None:
                mark("read_checked", ld.request_id)
                for q, st in event.staged.items():  # copy completed staged READs beside the next ones
                    if event.parts[q].done:
                        e.staging.copy_soon(st)
            e.drive(event.parts.values(), checked)

    def _build(self, ld: Load, peer: Peer, parts: dict[int, Transfer], staged: dict[int, Staged]) -> float:
        """Make one READ per source rank (not posted), into the staging buffer where that pays
        (recorded in ``staged``); returns the microseconds it took."""
        e = self.engine
        t0 = time.perf_counter()
        rp = e.rank_plan(peer.plan)
        if not rp.source_ranks:
            return (time.perf_counter() - t0) * 1e6
        remote_blocks = min(peer.infos[q].num_blocks for q in rp.source_ranks)
        rids = group_arrays(ld.params.block_ids, len(e.groups), remote_blocks, "prefill")
        skip = ld.computed_tokens // e.spec.block_size
        msg = encode_notification(Notification(Kind.DONE, ld.remote_id, e.spec.tp_size, e.rank, ld.token),
                                  e.notif_key)
        for q in rp.source_ranks:
            li, ri = pair_indices(peer.descs[q], e.groups, ld.groups, rids, skip=skip,
                                  null=e.config.null_block_id)
            if li.size == 0:  # nothing to read from q (full prefix hit, null blocks): notified
                continue
            rd = peer.descs[q]
            st = e.staging.plan(rd.local_rows, rd.remote_rows, li, ri) if e.staging is not None else None
            if st is None:
                parts[q] = e.agent.make_transfer("READ", peer.local_lists[q], li, peer.remote_lists[q], ri, msg)
                continue
            staged[q] = st
            parts[q] = e.agent.make_transfer("READ", e.staging.slot_list(e.agent, st.piece), st.slots,
                                             peer.remote_lists[q], ri, msg)
        return (time.perf_counter() - t0) * 1e6

    def _notify(self, peer: Peer, q: int, remote_id: str, token: str, kind: Kind) -> None:
        e = self.engine
        msg = encode_notification(Notification(kind, remote_id, e.spec.tp_size, e.rank, token), e.notif_key)
        e.agent.notify(peer.agents[q], msg)
        e.stats.notifications_sent += 1

    # ----- events (caller thread) -------------------------------------------------
    def on_handshake(self, peer: Peer, err: str | None) -> None:
        e = self.engine
        if err is not None:
            for t in e.tracker.waiting_on(peer.engine_id):
                e.fail(t.request_id, FailureKind.HANDSHAKE, err)
            return
        for t in e.tracker.handshake_done(peer.engine_id):
            ld = e.load_of(t.request_id)
            if ld.queued_for is not peer:  # it waited on a handshake this one superseded
                ld.peer = peer
                self._post(ld)

    def on_event(self, event: object) -> None:
        match event:
            case ReadsPosted():
                self._posted(event)
            case ReadsSkipped():
                self._skipped(event.load, event.peer)

    def _skipped(self, ld: Load, peer: Peer) -> None:
        """The worker did not post ``ld``: its peer failed, was dropped or superseded first."""
        e = self.engine
        if e.load_of(ld.request_id) is None:
            _nothing_read(ld)
        if e.load_of(ld.request_id) is not ld or ld.queued_for is not peer:
            return
        t = e.tracker.get(ld.request_id)
        if t is not None and t.state is State.READY:  # else it waits for the next handshake
            e.fail(ld.request_id, FailureKind.POST,
                    f"engine {peer.engine_id!r} was dropped (restarted or failed) before this "
                    f"request's READs were posted")

    def _posted(self, event: ReadsPosted) -> None:
        e, ld, peer, parts, err = self.engine, event.load, event.peer, event.parts, event.error
        rid = ld.request_id
        if event.attached:
            if ld.unreported is None:
                return  # the request was given up after the posts: fail() gave them up with it
            if ld.unreported[0] is parts:
                ld.unreported = None
        t = e.tracker.get(rid)
        if e.load_of(rid) is not ld or ld.queued_for is not peer or t is None or t.state is not State.READY:
            # failed, timed out or moved to another peer meanwhile
            e.drop_reads(parts, event.staged)
            if err == GIVEN_UP:
                _nothing_read(ld)
            return
        e.stats.prep_us += int(event.prep_us)
        e.stats.posts += 1
        e.stats.staged_reads += len(event.staged)
        ld.transfers.update(parts)
        ld.staged.update(event.staged)
        if err is not None:
            e.fail(rid, FailureKind.POST, err)
            if err.startswith("NIXL: ") and peer.state == "ready":
                # posting to this engine failed in NIXL: handshake again next time
                for ol in e.loads():
                    if ol.peer is peer and not ol.transfers:
                        e.fail(ol.request_id, FailureKind.POST, err)
                e.peers.drop(peer)
            return
        e.posted(ld, parts)

    # ----- poll rounds (caller thread, agent held) -----------------------------------
    def advance(self) -> None:
        e = self.engine
        broken: list[Peer] = []
        for ld in e.loads():
            rid = ld.request_id
            t = e.tracker.get(rid)
            if t is None or t.state is not State.POSTED:
                continue
            for q in list(ld.copying):  # completed READs the copy thread was copying into place
                e.part_done(ld, q)
            if e.load_of(rid) is not ld:
                continue
            done, bad = e.sweep(ld.transfers, ld.peer.engine_id)
            for q in done:
                e.part_done(ld, q)
            if bad is not None:
                e.fail(rid, FailureKind.TRANSFER,
                        f"READ from engine {ld.peer.engine_id!r} rank {bad} ended in error")
                if ld.peer not in broken:
                    broken.append(ld.peer)
        for peer in broken:  # a failing peer is presumed restarted or dead: handshake again next time
            for ld in e.loads():
                if ld.peer is peer:
                    e.fail(ld.request_id, FailureKind.TRANSFER, f"engine {peer.engine_id!r} failed a transfer")
            e.peers.drop(peer)

    def keep_alive(self, now: float) -> None:
        self._renew_loading(now)
        self._send_renewals()

    def _renew_loading(self, now: float) -> None:
        """RENEW the leases of requests in flight, every ``renew_interval_s``."""
        e = self.engine
        every = e.config.renew_interval_s
        for ld in e.loads():
            if now - ld.last_renew < every or ld.peer.state != "ready":
                continue
            ld.last_renew = now
            for q in e.rank_plan(ld.peer.plan).handshake_ranks:
                try:
                    self._notify(ld.peer, q, ld.remote_id, ld.token, Kind.RENEW)
                    e.stats.leases_renewed += 1
                except NixlError:
                    pass

    def _send_renewals(self) -> None:
        """RENEW the leases of requests announced with ``renew()`` whose peer is ready."""
        e = self.engine
        for key, params in list(self._renewals.items()):
            peer = e.peers.get(params.engine_id)
            if peer is not None and peer.state == "handshaking":
                continue  # try again on the next poll
            del self._renewals[key]
            if peer is None or peer.state != "ready":
                continue  # the handshake failed: the lease will lapse, nothing to renew with
            for q in e.rank_plan(peer.plan).handshake_ranks:
                try:
                    self._notify(peer, q, params.request_id, params.token, Kind.RENEW)
                    e.stats.leases_renewed += 1
                except NixlError:
                    break


class PullLeases(PrefillMode):
    """Prefill side of pull mode: held requests wait in the engine's lease ledger."""

    name = "pull"

    def hold(self, request_id: str, block_ids: tuple[int, ...], token: str, now: float) -> None:
        self.engine.ledger.hold(request_id, block_ids, token, now)
