"""Push mode: prefill ranks WRITE into decode ranks, which wait for them.

Decode side (:class:`PushReceiver`): :meth:`~kvbridge.nixl.DecodeEngine.expect`
plans the request from the prefill facts the caller names and waits for a
WRITTEN notification from every source rank; the decode rank never handshakes.

Prefill side (:class:`PushWrites`): :meth:`~kvbridge.nixl.PrefillEngine.push`
finds or starts the handshake with the decode engine, then writes one WRITE per
decode rank it feeds, each carrying a WRITTEN notification, and releases the
request's blocks when the WRITEs completed (or failed, or timed out).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np

from kvbridge.topology import HeadOrder

from .agent import NixlError, Transfer
from .config import TransferParams, provisional_spec
from .ledger import FailureKind, Released
from .messages import Kind, Notification, encode_notification, parse_notification
from .modes import DecodeMode, Load, PrefillMode
from .peers import Peer

log = logging.getLogger("kvbridge.nixl")


class PushReceiver(DecodeMode):
    """Decode side of push mode."""

    name = "push"

    def expect(self, request_id: str, prefill_engine_id: str, prefill_tp: int, token: str,
               local_ids: np.ndarray, prefill_block_size: int | None,
               prefill_head_order: HeadOrder | str | None,
               prefill_kernel_blocks_per_block: int | None) -> None:
        e = self.engine
        pspec = provisional_spec(e.spec, prefill_engine_id, prefill_tp)
        if prefill_block_size is not None or prefill_kernel_blocks_per_block is not None:
            bs = e.spec.block_size if prefill_block_size is None else prefill_block_size
            kb = prefill_kernel_blocks_per_block
            if kb is None:
                kb = e.spec.kernel_blocks_per_block if prefill_block_size is None else 1
            pspec = replace(pspec, block_size=bs, kernel_blocks_per_block=kb)
        if prefill_head_order is not None:
            pspec = replace(pspec, head_order=HeadOrder(prefill_head_order))
        plan = e._plan_for(pspec)
        sources = tuple(e._rank_plan(plan).source_ranks) if local_ids.size else ()
        ld = Load(request_id, Peer(prefill_engine_id, "", 0, prefill_tp, plan=plan), None, local_ids, 0,
                  token, expect_from=sources)
        e._add(ld, time.monotonic(), ready=True)
        e.tracker.posted(request_id, sources)
        if not sources:
            e._loads.pop(request_id, None)

    def advance(self) -> None:
        """Count WRITTEN notifications: each completes one source rank of a request."""
        e = self.engine
        for _sender, msgs in e.agent.notifications().items():
            for raw in msgs:
                n = parse_notification(raw, e.notif_key)
                e.stats.notifications_received += 1
                if n is None or n.kind is not Kind.WRITTEN:
                    e.stats.notifications_malformed += 1
                    continue
                if not n.authentic:
                    e.stats.notifications_unauthenticated += 1
                    continue
                ld = e._loads.get(n.request_id)
                if ld is None:
                    e.stats.notifications_unknown += 1
                    continue
                if n.token != ld.token:
                    e.stats.notifications_bad_token += 1
                    continue
                # in WRITTEN messages the rank/TP fields name the prefill rank and TP
                if n.decode_tp != ld.peer.tp_size or n.decode_rank not in ld.expect_from:
                    e.stats.notifications_malformed += 1
                    continue
                e._part_done(ld, n.decode_rank)


@dataclass(eq=False)
class Push:
    """One request a prefill rank writes into a decode engine."""

    request_id: str
    peer: Peer
    target: TransferParams
    block_ids: np.ndarray
    transfers: dict[int, Transfer] = field(default_factory=dict)
    deadline: float = 0.0
    waiting: bool = True  # for the handshake with the decode engine


class PushWrites(PrefillMode):
    """Prefill side of push mode."""

    name = "push"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._pushes: dict[str, Push] = {}
        self._released: list[Released] = []

    @property
    def held(self) -> int:
        return len(self._pushes)

    def push(self, request_id: str, block_ids: np.ndarray, target: TransferParams) -> None:
        e = self.engine
        peer = e.peers.for_request(target.engine_id, target.host, target.port, target.tp_size, "")
        p = Push(request_id, peer, target, block_ids, deadline=time.monotonic() + e.config.transfer_timeout_s)
        self._pushes[request_id] = p
        if peer.state == "ready":
            self._post(p)

    def on_handshake(self, peer: Peer, err: str | None) -> None:
        for p in [p for p in self._pushes.values() if p.waiting and p.peer is peer]:
            if err is None:
                self._post(p)
            else:
                self._finish(p, f"handshake failed: {err}", FailureKind.HANDSHAKE)

    def _post(self, p: Push) -> None:
        e, peer, plan = self.engine, p.peer, p.peer.plan
        p.waiting = False
        try:
            skip = p.target.computed_tokens // peer.spec.block_size
            target_ids = np.asarray(p.target.block_ids, dtype=np.int64)
            msg = encode_notification(Notification(Kind.WRITTEN, p.request_id, e.spec.tp_size, e.rank,
                                                   p.target.token), e.notif_key)
            for r in plan.prefill_ranks[e.rank].read_by:
                ti, mi = peer.descs[r].indices(target_ids, p.block_ids, local_skip_blocks=skip)
                if mi.size == 0:
                    e.agent.notify(peer.agents[r], msg)
                    continue
                x = e.agent.make_transfer("WRITE", peer.local_lists[r], mi, peer.remote_lists[r], ti, msg)
                p.transfers[r] = x
                if e.agent.post(x) == "ERR":
                    raise NixlError(f"posting the WRITE to engine {peer.engine_id!r} rank {r} failed")
            if not p.transfers:
                self._finish(p, None)
        except (NixlError, ValueError) as exc:
            self._finish(p, str(exc), FailureKind.POST)

    def _finish(self, p: Push, error: str | None, kind: FailureKind | None = None) -> None:
        e = self.engine
        for x in p.transfers.values():
            e.agent.release_transfer(x)
        p.transfers.clear()
        self._pushes.pop(p.request_id, None)
        if error is None:
            e.stats.requests_done += 1
            reason = "written"
        else:
            log.warning("push of %s failed: %s", p.request_id, error)
            e.stats.fail((kind or FailureKind.TRANSFER).value)
            reason = "push-failed"
        e.stats.requests_released += 1
        self._released.append(Released(p.request_id, tuple(p.block_ids.tolist()), reason))

    def poll(self, now: float) -> list[Released]:
        broken = []
        for p in list(self._pushes.values()):
            if p.waiting:
                if now >= p.deadline:
                    self._finish(p, "timed out waiting for the handshake", FailureKind.TIMEOUT)
                continue
            _, bad = self.engine._sweep(p.transfers, p.peer.engine_id)
            if bad is not None:
                self._finish(p, f"WRITE to rank {bad} ended in error", FailureKind.TRANSFER)
                broken.append(p.peer)
            elif not p.transfers:
                self._finish(p, None)
            elif now >= p.deadline:
                self._finish(p, "WRITE timed out", FailureKind.TIMEOUT)
        for peer in broken:
            if peer.state == "ready":
                self.engine.peers.drop(peer)
        out, self._released = self._released, []
        return out
