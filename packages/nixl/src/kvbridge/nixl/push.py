"""Push mode: prefill ranks WRITE into decode ranks, which wait for them.

Decode side: :class:`~kvbridge.nixl.push_receive.PushReceiver`.

Prefill side (:class:`PushWrites`): :meth:`~kvbridge.nixl.PrefillEngine.push`
finds or starts the handshake with the decode engine, then writes one WRITE per
decode rank it feeds, each carrying a WRITTEN notification, and releases the
request's blocks when the WRITEs completed (or failed, or timed out: then it
tells the decode ranks with a FAILED notification).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from kvbridge.topology import FailureKind, Released, TransferParams

from .agent import NixlError, Transfer
from .groups import flat_ids, group_arrays, pair_indices
from .messages import Kind, Notification, encode_notification
from .modes import PrefillMode
from .peers import Peer
from .timeline import mark

log = logging.getLogger("kvbridge.nixl")


@dataclass(eq=False)
class Push:
    """One request a prefill rank writes into a decode engine.

    Whole-request pushes (``layered`` False) write every layer in one WRITE per
    decode rank, each carrying that rank's WRITTEN notification. Layered pushes
    write the layers the caller names as it computes them (several WRITEs per
    decode rank) and notify each decode rank once every WRITE of the request
    completed: the last batch's WRITEs carry the notifications when every earlier
    WRITE was seen complete before they are posted (NIXL then sends each as its
    WRITE completes, with no further call from here), else they are sent
    separately once all WRITEs completed.
    """

    request_id: str
    peer: Peer
    target: TransferParams
    #: this rank's block ids, one array per KV-cache group
    groups: tuple[np.ndarray, ...]
    layered: bool = False
    transfers: dict[tuple[int, int], Transfer] = field(default_factory=dict)
    deadline: float = 0.0
    waiting: bool = True  # for the handshake with the decode engine
    #: (layers, Mamba state) batches named before the handshake was done (posted once it is)
    #: and whether the batch is the push's last
    asked: list[tuple[tuple[int, ...], bool, bool]] = field(default_factory=list)
    #: layers handed out for writing so far
    sent: set[int] = field(default_factory=set)
    #: no more layers will be named (whole-request pushes start closed)
    closing: bool = True
    #: background posting jobs not reported back yet
    in_flight: int = 0
    seq: int = 0
    #: finished (written, failed or timed out): posting jobs still queued post nothing more
    finished: bool = False
    #: the release of a push that finished with posting jobs still in flight, reported once
    #: they all came back and their WRITE handles were released (see PushWrites._finish)
    pending_release: Released | None = None
    #: layered: the WRITTEN notifications were sent (by the worker as soon as it saw every WRITE
    #: complete, or by poll()); ``lock`` makes that happen once
    notified: bool = False
    #: layered: the last batch's WRITEs carry the WRITTEN notifications (set before posting them)
    attached: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: every WRITE the worker posted for this push (appended on the worker thread only)
    posted: list[Transfer] = field(default_factory=list)
    #: a posting job of this push failed (set on the worker thread)
    post_failed: bool = False

    @property
    def tag(self) -> str:
        """The request's name in timeline lines: the decode engine's id when known."""
        return self.target.request_id or self.request_id


@dataclass(frozen=True, eq=False)
class WritesPosted:
    """Worker event: WRITEs of ``push`` were posted, one per decode rank in ``parts`` (keyed
    by decode rank; ``error`` None), or posting them failed."""

    push: Push
    parts: dict[int, Transfer]
    error: str | None


class PushWrites(PrefillMode):
    """Prefill side of push mode."""

    name = "push"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._pushes: dict[str, Push] = {}
        #: layered pushes closed by write_layers (every layer named) whose finish() is to come
        self._closed_early: set[str] = set()
        #: finished pushes whose blocks stay held until their posting jobs came back
        self._draining: list[Push] = []
        self._released: list[Released] = []

    @property
    def held(self) -> int:
        return len(self._pushes) + len(self._draining)

    # ----- entry points (caller thread) -------------------------------------------
    def push(self, request_id: str, block_ids: tuple[np.ndarray, ...], target: TransferParams) -> None:
        mark("forward_end", target.request_id or request_id)
        self._start(request_id, block_ids, target, layered=False)

    def start(self, request_id: str, block_ids: tuple[np.ndarray, ...], target: TransferParams) -> None:
        self._start(request_id, block_ids, target, layered=True)

    def write_layers(self, request_id: str, layers: tuple[int, ...]) -> None:
        p = self._open(request_id)
        if p.closing:
            raise ValueError(f"push of {request_id!r} is finished: no more layers can be written")
        new = tuple(sorted({int(x) for x in layers} - p.sent))
        bad = [x for x in new if not 0 <= x < self.engine.spec.num_layers]
        if bad:
            raise ValueError(f"layers {bad} are outside this model's {self.engine.spec.num_layers} layers")
        if not new:
            return
        p.sent.update(new)
        mark("saved", p.tag, layers=",".join(map(str, new)))
        if len(p.sent) == self.engine.spec.num_layers and all(g.attention for g in self.engine.groups):
            # every layer is in the cache and there is no Mamba state to wait for: close now,
            # so decode is told when these WRITEs land, not after the forward pass's tail
            self._closed_early.add(request_id)
            self._close(p, new)
        else:
            self._ask(p, new, False)

    def _ask(self, p: Push, layers: tuple[int, ...], mamba: bool, last: bool = False) -> None:
        if p.waiting:
            p.asked.append((layers, mamba, last))
        else:
            self._dispatch(p, layers, mamba, last)

    def finish(self, request_id: str) -> None:
        if request_id in self._closed_early:  # closed when its last layer was named
            self._closed_early.discard(request_id)
            p = self._pushes.get(request_id)
            mark("forward_end", p.tag if p is not None else request_id)
            return
        p = self._open(request_id)
        if p.closing:
            return
        mark("forward_end", p.tag)
        self._close(p)

    def _close(self, p: Push, named: tuple[int, ...] = ()) -> None:
        """No more layers will be named: write ``named`` (the layers that completed the push)
        or the rest, and notify once all is written."""
        p.closing = True
        rest = tuple(x for x in range(self.engine.spec.num_layers) if x not in p.sent)
        p.sent.update(rest)
        batches = [(layers, False) for layers in (named, rest) if layers]
        if any(not g.attention for g in self.engine.groups):  # the Mamba state, once complete
            batches.append(((), True))
        for i, (layers, mamba) in enumerate(batches):
            self._ask(p, layers, mamba, last=i == len(batches) - 1)
        if not p.waiting and self.engine.config.post_in_background:
            peer = p.peer
            self.engine.submit(lambda: self._notify_when_written(p, peer))

    def _notify_when_written(self, p: Push, peer: Peer) -> None:
        """Worker thread, after the push's last posting job: wait (``drive``) for its WRITEs and
        send the WRITTEN notifications at once, rather than at this engine's next ``poll()``
        (a vLLM step away: the decode engine would wait for it). Leaves it to ``poll()`` when
        the WRITEs take longer than ``complete_in_background_s`` or anything went wrong."""
        e = self.engine

        def written() -> None:
            with p.lock:
                if (p.notified or p.finished or p.asked or not e.peers.is_current(peer)
                        or not self._all_written(p)):
                    return
                if p.attached:  # the last WRITEs carried them: NIXL sent them as it saw each done
                    self._notified(p)
                    return
                try:
                    self._notify_all(p)
                except NixlError:  # poll() tries again and fails the push if it must
                    return

        e.drive(list(p.posted), written)

    def _all_written(self, p: Push) -> bool:
        """Every WRITE posted for ``p`` so far was seen complete (released ones were)."""
        return not p.post_failed and all(x.released or self.engine.agent.state(x) == "DONE"
                                         for x in p.posted)

    def _open(self, request_id: str) -> Push:
        p = self._pushes.get(request_id)
        if p is None or not p.layered:
            raise ValueError(f"no layered push of request {request_id!r} is open on this rank "
                             "(start it with push_start(); it may have failed or timed out)")
        return p

    def _start(self, request_id: str, block_ids: tuple[np.ndarray, ...], target: TransferParams, *,
               layered: bool) -> None:
        e = self.engine
        if request_id in self._pushes:
            raise ValueError(f"request {request_id!r} is already being pushed by this rank")
        peer = e.peers.for_request(target.engine_id, target.host, target.port, target.tp_size, "")
        p = Push(request_id, peer, target, block_ids, layered=layered, closing=not layered,
                 deadline=time.monotonic() + e.config.transfer_timeout_s)
        self._pushes[request_id] = p
        if peer.state == "ready":
            self._ready(p)

    def on_handshake(self, peer: Peer, err: str | None) -> None:
        for p in [p for p in self._pushes.values() if p.waiting and p.peer is peer]:
            if err is None:
                self._ready(p)
            else:
                self._finish(p, f"handshake failed: {err}", FailureKind.HANDSHAKE)

    def _ready(self, p: Push) -> None:
        """The decode engine is known: write what was asked for meanwhile."""
        p.waiting = False
        if not p.layered:
            self._dispatch(p, None, True)
            return
        asked, p.asked = p.asked, []
        for layers, mamba, last in asked:
            self._dispatch(p, layers, mamba, last)

    # ----- posting (worker thread with post_in_background, else here) ----------------
    def _dispatch(self, p: Push, layers: tuple[int, ...] | None, mamba: bool, last: bool = False) -> None:
        e, peer = self.engine, p.peer
        p.in_flight += 1
        if e.config.post_in_background:
            e.submit(lambda: self._post_and_drive(p, peer, layers, mamba, last))
        else:
            self.on_event(self._post_job(p, peer, layers, mamba, last))

    def _post_and_drive(self, p: Push, peer: Peer, layers: tuple[int, ...] | None,
                        mamba: bool, last: bool) -> None:
        """Worker thread: post, report, then check the WRITEs until they complete (see
        ``RankEngine.drive``), so the prefill side learns of them before its next poll."""
        e = self.engine
        event = self._post_job(p, peer, layers, mamba, last)
        e.report(event)
        if event.error is None and e.config.complete_in_background_s > 0:
            xs = event.parts.values()
            carried = last and p.attached  # these WRITEs carry the notifications (not earlier ones)

            def written() -> None:
                if event.parts:
                    mark("written", p.tag, layers="all" if layers is None else ",".join(map(str, layers)))
                if carried and all(e.agent.state(x) == "DONE" for x in xs):
                    with p.lock:
                        if not p.notified:
                            self._notified(p)

            e.drive(xs, written)

    def _post_job(self, p: Push, peer: Peer, layers: tuple[int, ...] | None,
                  mamba: bool, last: bool = False) -> WritesPosted:
        """Build and post the WRITEs of the attention ``layers`` (None: the whole request, with
        notifications; empty: none) and, with ``mamba``, of the Mamba state; returns the event
        that reports them. The ``last`` batch of a layered push carries the notifications
        when every earlier WRITE is complete already (:attr:`Push.attached`)."""
        e, plan = self.engine, peer.plan
        parts: dict[int, Transfer] = {}
        err = None
        try:
            if p.finished:  # timed out or failed while this job waited: its blocks are released
                return WritesPosted(p, parts, None)
            if not (peer.usable and e.peers.is_current(peer)):
                raise ValueError(f"engine {peer.engine_id!r} was dropped before the WRITE was posted")
            mark("posted", p.tag, layers="all" if layers is None else ",".join(map(str, layers)))
            skip = p.target.computed_tokens // peer.spec.block_size
            read_by = plan.prefill_ranks[e.rank].read_by
            bound = min((peer.infos[r].num_blocks for r in read_by), default=1)
            target_ids = group_arrays(p.target.block_ids, len(e.groups), bound, "decode")
            p.attached = last and layers is not None and self._all_written(p)
            msg = self._written(p) if layers is None or p.attached else b""
            for r in read_by:
                ti, mi = pair_indices(peer.descs[r], e.groups, target_ids, p.groups, skip=skip,
                                      null=e.config.null_block_id, layers=layers or None,
                                      attention=layers is None or bool(layers), mamba=mamba)
                if mi.size == 0:
                    if msg:
                        e.agent.notify(peer.agents[r], msg)
                    continue
                x = e.agent.make_transfer("WRITE", peer.local_lists[r], mi, peer.remote_lists[r], ti, msg)
                parts[r] = x
                p.posted.append(x)
                peer.marks.setdefault("posted", time.perf_counter())
                if e.agent.post(x) == "ERR":
                    raise NixlError(f"posting the WRITE to engine {peer.engine_id!r} rank {r} failed")
        except (NixlError, ValueError, KeyError) as exc:
            err = str(exc) or type(exc).__name__
        except Exception as exc:  # the worker must survive anything
            err = f"{type(exc).__name__}: {exc}"
        if err is not None:
            p.post_failed = True  # never notify early: a layer may be missing
        return WritesPosted(p, parts, err)

    def _written(self, p: Push, kind: Kind = Kind.WRITTEN) -> bytes:
        e = self.engine
        # named by the decode engine's id of the request when the target gives one
        return encode_notification(Notification(kind, p.target.request_id or p.request_id,
                                                e.spec.tp_size, e.rank, p.target.token), e.notif_key)

    def _tell_failed(self, p: Push) -> None:
        """A push given up: tell the decode ranks it feeds at once, so that they recompute
        instead of waiting for their transfer timeout (best effort: without a handshake, or
        with the decode engine gone, they time out as before)."""
        if p.waiting or not self.engine.peers.is_current(p.peer):
            return
        try:
            self._notify_all(p, Kind.FAILED)
        except (NixlError, ValueError, KeyError) as exc:
            log.debug("push of %s: telling the decode engine it failed did not work: %s", p.request_id, exc)

    def on_event(self, event: object) -> None:
        if not isinstance(event, WritesPosted):
            return
        p, parts, err = event.push, event.parts, event.error
        p.in_flight -= 1
        if p.finished:  # failed or timed out meanwhile
            self.engine.drop_transfers(parts.values())
            if not p.in_flight and p.pending_release is not None:
                self._draining.remove(p)
                self._report(p.pending_release)
                p.pending_release = None
            return
        for r, x in parts.items():
            p.seq += 1
            p.transfers[(r, p.seq)] = x
        if err is not None:
            self._finish(p, err, FailureKind.POST)

    def _notify_all(self, p: Push, kind: Kind = Kind.WRITTEN) -> None:
        """Tell every decode rank this rank fed that its part is written (a layered push
        complete) or, with ``Kind.FAILED``, that it never will be."""
        e = self.engine
        msg = self._written(p, kind)
        for r in p.peer.plan.prefill_ranks[e.rank].read_by:
            e.agent.notify(p.peer.agents[r], msg)
            e.stats.notifications_sent += 1
        if kind is Kind.WRITTEN:
            mark("notified", p.tag)
            p.notified = True

    def _notified(self, p: Push) -> None:
        """The last WRITEs of ``p``, which carried the WRITTEN notifications, completed: NIXL
        sent the notifications (the check that saw each WRITE complete did). Call under
        ``p.lock``."""
        self.engine.stats.notifications_sent += len(p.peer.plan.prefill_ranks[self.engine.rank].read_by)
        mark("notified", p.tag)
        p.notified = True

    def _finish(self, p: Push, error: str | None, kind: FailureKind | None = None) -> None:
        """End a push: release its WRITE handles, then its blocks. A posting job still
        queued on the worker then posts nothing; one already posting reports its WRITEs
        back to :meth:`on_event`, which releases them. Until every job came back the
        blocks stay held (a WRITE reading them may still be in flight) and the release
        is reported only then, so a released request never leaves a WRITE handle behind."""
        e = self.engine
        p.finished = True
        e.drop_transfers(p.transfers.values())
        p.transfers.clear()
        self._pushes.pop(p.request_id, None)
        if error is None:
            e.stats.requests_done += 1
            reason = "written"
        else:
            log.warning("push of %s failed: %s", p.request_id, error)
            e.stats.fail((kind or FailureKind.TRANSFER).value)
            reason = "push-failed"
            self._tell_failed(p)
        released = Released(p.request_id, tuple(flat_ids(p.groups, None).tolist()), reason)
        if p.in_flight:
            p.pending_release = released
            self._draining.append(p)
        else:
            self._report(released)

    def _report(self, released: Released) -> None:
        self.engine.stats.requests_released += 1
        self._released.append(released)

    def poll(self, now: float) -> list[Released]:
        broken = []
        for p in list(self._pushes.values()):
            if p.waiting:
                if now >= p.deadline:
                    self._finish(p, "timed out waiting for the handshake", FailureKind.TIMEOUT)
                continue
            _, bad = self.engine.sweep(p.transfers, p.peer.engine_id)
            if bad is not None:
                self._finish(p, f"WRITE to rank {bad[0]} ended in error", FailureKind.TRANSFER)
                broken.append(p.peer)
            elif p.closing and not p.transfers and not p.in_flight and not p.asked:
                if p.layered:
                    with p.lock:
                        try:
                            if p.notified:
                                pass
                            elif p.attached:  # the sweep saw the last WRITEs complete
                                self._notified(p)
                            else:
                                self._notify_all(p)
                        except NixlError as exc:
                            self._finish(p, str(exc), FailureKind.TRANSFER)
                            continue
                self._finish(p, None)
            elif now >= p.deadline:
                self._finish(p, "WRITE timed out", FailureKind.TIMEOUT)
        for peer in broken:
            if peer.state == "ready":
                self.engine.peers.drop(peer)
        out, self._released = self._released, []
        return out
