"""Push mode, decode side: :class:`PushReceiver`, which waits for the prefill ranks' WRITEs.

:meth:`~kvbridge.nixl.DecodeEngine.expect` plans the request from the prefill
facts the caller names and waits for a WRITTEN notification from every source
rank (or a FAILED one: that rank gave the request up, so it fails at once); the
decode rank never handshakes. The prefill side is
:class:`~kvbridge.nixl.push.PushWrites`.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from kvbridge.topology import FailureKind, HeadOrder

from .config import provisional_spec
from .messages import Kind, Notification, parse_notification
from .modes import DecodeMode, Load
from .peers import Peer
from .timeline import mark


class PushReceiver(DecodeMode):
    """Decode side of push mode.

    A WRITTEN notification may arrive before the caller named its request with
    :meth:`expect` (in vLLM the prefill engine can finish writing before the
    decode engine's next step): such notifications are kept, at most
    :attr:`MAX_EARLY` of them for at most ``transfer_timeout_s``, and applied
    when the request is expected. Those never claimed count as unknown.
    """

    name = "push"
    MAX_EARLY = 4096

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._early: dict[str, list[tuple[float, Notification]]] = {}
        self._early_count = 0

    def expect(self, request_id: str, prefill_engine_id: str, prefill_tp: int, token: str,
               local_ids: np.ndarray, prefill_block_size: int | None,
               prefill_head_order: HeadOrder | str | None,
               prefill_kernel_blocks_per_block: int | None,
               groups: tuple[np.ndarray, ...]) -> None:
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
        plan = e.plan_for(pspec)
        sources = tuple(e.rank_plan(plan).source_ranks) if local_ids.size else ()
        ld = Load(request_id, Peer(prefill_engine_id, "", 0, prefill_tp, plan=plan), None, local_ids, 0,
                  token, expect_from=sources, groups=groups)
        e.add(ld, time.monotonic(), ready=True)
        e.posted(ld, sources)
        for _t, n in self._early.pop(request_id, ()):
            self._early_count -= 1
            self._apply(n)

    def _keep_early(self, n: Notification) -> None:
        e, now = self.engine, time.monotonic()
        self._expire_early(now)
        if self._early_count >= self.MAX_EARLY:
            e.stats.notifications_unknown += 1
            return
        self._early.setdefault(n.request_id, []).append((now, n))
        self._early_count += 1

    def _expire_early(self, now: float) -> None:
        """Drop kept notifications older than the transfer timeout (counted as unknown)."""
        if not self._early:
            return
        horizon = now - self.engine.config.transfer_timeout_s
        for rid in [r for r, kept in self._early.items() if kept[0][0] < horizon]:
            gone = self._early.pop(rid)
            self._early_count -= len(gone)
            self.engine.stats.notifications_unknown += len(gone)

    def keep_alive(self, now: float) -> None:
        self._expire_early(now)

    def advance(self) -> None:
        """Count WRITTEN notifications: each completes one source rank of a request."""
        e = self.engine
        for _sender, msgs in e.agent.notifications().items():
            for raw in msgs:
                n = parse_notification(raw, e.notif_key)
                e.stats.notifications_received += 1
                if n is None or n.kind not in (Kind.WRITTEN, Kind.FAILED):
                    e.stats.notifications_malformed += 1
                    continue
                if not n.authentic:
                    e.stats.notifications_unauthenticated += 1
                    continue
                if e.load_of(n.request_id) is None:
                    self._keep_early(n)
                    continue
                self._apply(n)

    def _apply(self, n: Notification) -> None:
        e = self.engine
        ld = e.load_of(n.request_id)
        if ld is None:
            e.stats.notifications_unknown += 1
            return
        if n.token != ld.token:
            e.stats.notifications_bad_token += 1
            return
        # in WRITTEN messages the rank/TP fields name the prefill rank and TP
        if n.decode_tp != ld.peer.tp_size or n.decode_rank not in ld.expect_from:
            e.stats.notifications_malformed += 1
            return
        if n.kind is Kind.FAILED:
            t = e.tracker.get(n.request_id)
            if t is not None and n.decode_rank in t.outstanding:  # never retract a part written
                e.fail(n.request_id, FailureKind.TRANSFER,
                       f"prefill rank {n.decode_rank} of {ld.peer.engine_id!r} gave the push up")
            return
        mark("arrived", n.request_id, rank=n.decode_rank)
        e.part_done(ld, n.decode_rank)
