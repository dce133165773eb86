"""Push mode, scheduler half: the decode engine allocates first, the prefill engine writes.

The router gives one request to both engines with the same transfer id (the
parameters: :mod:`kvbridge.vllm.params`).

Decode side: vLLM allocates the request's blocks (the prompt is an asynchronous
load), and the scheduler sends them to the prefill engine's side channel in a
push offer (:func:`kvbridge.handshake.send_push_offer`, on a background thread,
:class:`~kvbridge.vllm.push.offers.OfferThread`). The accept names the prefill
engine's facts; the next step orders every decode worker to *expect* the request
(:meth:`kvbridge.nixl.DecodeEngine.expect`). An offer that fails fails the
request's load, so vLLM recomputes it.

Prefill side: the side-channel server hands each offer to
:meth:`PushScheduler.on_offer`. vLLM asks the connector how many tokens a waiting
request can load; a push request answers "ask again later" until its offer
arrived (at most ``wait_s``; then it is computed without a transfer). The step
that computes the last prompt chunk orders every prefill worker to *push* the
request into the decode engine's blocks: layer by layer inside the forward pass
(``save_kv_layer``) or the whole request after it (``wait_for_save``). When the
request finishes, its blocks stay allocated until the workers report the push
released (written, failed or timed out).

Pull-mode requests are refused (logged once, computed without a transfer).
Plain values in and out: this module imports nothing from vLLM.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.handshake import PROTOCOL_VERSION, PushAccept, PushOffer
from kvbridge.topology import TransferParams, blocks_for_tokens
from kvbridge.vllm.modes import Allocation, SchedulerMode, StepProgress
from kvbridge.vllm.params import (
    BlockIds,
    ParamsError,
    PushDecode,
    PushPrefill,
    Route,
    decode_push_decode,
    decode_push_prefill,
    encode_pushed,
    route,
)
from kvbridge.vllm.push.offers import OfferThread
from kvbridge.vllm.push.orders import ExpectOrder, PushOrder, PushOrders

__all__ = ["PushScheduler"]

log = logging.getLogger("kvbridge.vllm")

#: offers kept at most (a prefill engine that never sees the matching request drops the oldest)
MAX_OFFERS = 65536
#: a decode engine allocating a batch sends its offers back to back; a prefill request whose
#: offer came waits while other push requests still lack theirs and the last offer arrived
#: less than BATCH_WINDOW_S ago (at most BATCH_CAP_S after its own), so the batch is
#: computed in one step rather than one request per forward pass
BATCH_WINDOW_S = 0.005
BATCH_CAP_S = 0.05
#: an offer is written into only while younger than this share of the transfer timeout
#: (the decode engine's deadline runs from about the offer's arrival; the rest of the
#: timeout is left for the WRITEs to land before it gives up and may reuse the blocks)
OFFER_LIFETIME_SHARE = 0.9


@dataclass
class _Waiting:
    """A prefill request bound (or waiting) for its decode engine's offer."""

    transfer_id: str
    since: float
    num_prompt_tokens: int
    offer: PushOffer | None = None
    offer_at: float = 0.0
    released: bool = False  # told vLLM to schedule it
    block_ids: BlockIds = ()  # its blocks so far, per KV-cache group
    ordered: bool = False
    pushed: bool = False


def _extended(have: BlockIds, new: BlockIds) -> BlockIds:
    """``have`` with a step's newly allocated blocks appended, per group (once: a group
    whose new blocks are already there is left as it is)."""
    out = []
    for i, group in enumerate(new):
        mine = have[i] if i < len(have) else ()
        out.append(mine + group if group and group[0] not in mine else mine)
    return tuple(out) + have[len(new):]


class PushScheduler(SchedulerMode):
    """Push-mode bookkeeping of one engine's scheduler (see the module docstring).

    ``send_offer(host, port, **fields)`` sends one offer and returns the accept
    (:func:`kvbridge.handshake.send_push_offer` with the engine's key bound). The
    accept's facts come from :meth:`set_served` (until then offers are refused).
    """

    def __init__(self, *, engine_id: str, block_size: int, tp_size: int, address: tuple[str, int],
                 layerwise: bool, wait_s: float, send_offer: Callable[..., PushAccept],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.address = address
        self.layerwise = layerwise
        self.wait_s = wait_s
        self.incarnation = ""
        self.accept_facts: dict[str, Any] | None = None
        self.offer_handler = self.on_offer
        self._send_offer = send_offer
        self._clock = clock
        self._lock = threading.Lock()
        #: each request's push parameters, parsed once (None: refused, logged once)
        self._parsed: dict[str, PushDecode | PushPrefill | None] = {}
        self._refused: set[str] = set()  # pull-mode requests (logged once)
        self._offered: set[str] = set()  # decode requests whose offer was sent (once)
        # prefill side
        self._offers: dict[str, tuple[float, PushOffer]] = {}  # transfer id -> (arrival, offer)
        self._last_offer = float("-inf")
        self._waiting: dict[str, _Waiting] = {}
        self._pushes: list[PushOrder] = []
        self._sent: list[str] = []
        # decode side (the offer thread appends under the lock)
        self._expects: list[ExpectOrder] = []
        self._failed: list[tuple[str, BlockIds]] = []
        self._offer_thread = OfferThread()

    def set_served(self, incarnation: str, facts: Mapping[str, Any]) -> None:
        self.incarnation = incarnation
        self.accept_facts = dict(facts)

    # ----- every request ----------------------------------------------------------
    def _route(self, request_id: str, params: Mapping[str, Any] | None) -> Route:
        """The request's part; pull-mode transfers are refused once, and a decode request
        whose offer was sent is no longer one."""
        r = route(params)
        if not r.push:
            if r.transfer and request_id not in self._refused:
                self._refused.add(request_id)
                log.warning("request %s: ignoring its kv_transfer_params (the prefill engine uses "
                            "pull mode, this engine push; configure both engines with the same "
                            "mode); its prompt is computed without a transfer", request_id)
            return Route()
        return r.transferred() if request_id in self._offered else r

    def _parse(self, request_id: str, params: Mapping[str, Any], r: Route,
               what: str) -> PushDecode | PushPrefill | None:
        if request_id not in self._parsed:
            try:
                self._parsed[request_id] = (decode_push_decode(params) if r.decode
                                            else decode_push_prefill(params))
            except ParamsError as exc:
                log.warning("request %s: %s; %s", request_id, exc, what)
                self._parsed[request_id] = None
        return self._parsed[request_id]

    def on_new_request(self, request_id: str, params: Mapping[str, Any] | None,
                       num_prompt_tokens: int) -> bool:
        """A push prefill request waits for its offer from now on: the requests that arrived
        together then hold one another back while their offers come in (see
        :data:`BATCH_WINDOW_S`), also those the scheduler did not consider yet."""
        r = self._route(request_id, params)
        if params is not None and r.transfer and not r.decode:
            self._awaiting(request_id, params, r, num_prompt_tokens)
        return False

    def matched_tokens(self, request_id: str, params: Mapping[str, Any] | None,
                       num_prompt_tokens: int, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode: every prompt token beyond the local ones arrives from the prefill engine.
        Prefill: None ("ask again") until the decode engine's offer arrived."""
        r = self._route(request_id, params)
        if params is None or not r.transfer:
            return 0, False
        if r.decode:
            if self._parse(request_id, params, r, "its prompt is computed locally") is None:
                return 0, False
            n = max(num_prompt_tokens - num_computed_tokens, 0)
            return (n, True) if n > 0 else (0, False)
        return self._prefill_matched(request_id, params, r, num_prompt_tokens)

    def after_alloc(self, request_id: str, params: Mapping[str, Any] | None,
                    num_prompt_tokens: int, blocks: Allocation, num_external_tokens: int) -> None:
        r = self._route(request_id, params)
        if r.decode and params is not None:
            self._decode_after_alloc(request_id, params, r, blocks, num_external_tokens)
        elif r.remote_decode:
            w = self._waiting.get(request_id)
            if w is not None and w.offer is not None and blocks.block_ids:
                w.block_ids = blocks.block_ids

    def take_orders(self, progress: Sequence[StepProgress] = ()) -> PushOrders:
        """This step's push orders (``progress``: the step's scheduled requests, whose
        pushes are ordered in the step that completes their prompt); resets them."""
        self._order_pushes(progress)
        with self._lock:
            expects, failed = tuple(self._expects), tuple(self._failed)
            self._expects, self._failed = [], []
        out = PushOrders(tuple(self._pushes), tuple(self._sent), expects, failed)
        self._pushes, self._sent = [], []
        return out

    def finished(self, request_id: str, params: Mapping[str, Any] | None, *, completed: bool,
                 block_ids: BlockIds, num_computed_tokens: int, num_prompt_tokens: int
                 ) -> tuple[bool, dict[str, Any] | None]:
        """A prefill request whose push was ordered keeps its blocks until its workers
        report the push released."""
        r = self._route(request_id, params)
        for done in (self._refused, self._offered):
            done.discard(request_id)
        self._parsed.pop(request_id, None)
        if not r.remote_decode:
            return False, None
        w = self._waiting.pop(request_id, None)
        if w is None or not w.pushed:
            return False, None
        self._sent.append(request_id)
        return True, encode_pushed()

    @property
    def pending(self) -> bool:
        """Whether push work is waiting (vLLM keeps stepping while it is)."""
        return bool(self._waiting or self._pushes or self._sent or self._expects or self._failed
                    or not self._offer_thread.idle)

    def close(self) -> None:
        self._offer_thread.close()

    # ----- prefill side -----------------------------------------------------------
    def on_offer(self, offer: PushOffer) -> PushAccept:
        """The side-channel server's offer handler (server thread): keep the offer and
        return this engine's accept."""
        facts = self.accept_facts
        if facts is None:
            raise ValueError(f"engine {self.engine_id!r} has not registered its KV cache yet")
        now = self._clock()
        with self._lock:
            self._drop_stale_offers(now)
            if len(self._offers) >= MAX_OFFERS:
                oldest = min(self._offers, key=lambda k: self._offers[k][0])
                del self._offers[oldest]
            self._offers.pop(offer.transfer_id, None)  # a repeated offer counts from now
            self._offers[offer.transfer_id] = (now, offer)
            self._last_offer = now
        return PushAccept(protocol_version=PROTOCOL_VERSION, transfer_id=offer.transfer_id,
                          engine_id=self.engine_id, tp_size=self.tp_size, incarnation=self.incarnation,
                          **facts)

    @property
    def offer_lifetime_s(self) -> float:
        """How long an offer may be written into after it arrived."""
        return self.wait_s * OFFER_LIFETIME_SHARE

    def _drop_stale_offers(self, now: float) -> None:
        """Forget offers no request took within :attr:`offer_lifetime_s` (caller holds
        the lock). Their decode engine has given up on them (its own transfer timeout, the
        same ``transfer_timeout_seconds``) and may have handed the blocks to another
        request, so writing into them later would corrupt that request's KV."""
        while self._offers:
            tid = next(iter(self._offers))  # arrival order
            if now - self._offers[tid][0] <= self.offer_lifetime_s:
                return
            del self._offers[tid]
            log.warning("push offer for transfer %s dropped: no request took it within %.0f s",
                        tid, self.offer_lifetime_s)

    def _stale(self, w: _Waiting, request_id: str) -> bool:
        """Whether ``w``'s offer is too old to write into (see :meth:`_drop_stale_offers`);
        logged once, and the request is then computed without a transfer."""
        if self._clock() - w.offer_at <= self.offer_lifetime_s:
            return False
        log.warning("request %s: the decode engine's offer for transfer %s is older than %.0f s "
                    "(of transfer_timeout_seconds); not pushing into blocks it may have reused",
                    request_id, w.transfer_id, self.offer_lifetime_s)
        return True

    def _awaiting(self, request_id: str, params: Mapping[str, Any], r: Route,
                  num_prompt_tokens: int) -> _Waiting | None:
        """The push prefill request's wait for its offer, started on first sight (None: its
        parameters are unusable, it is computed without a transfer)."""
        w = self._waiting.get(request_id)
        if w is None:
            req = self._parse(request_id, params, r, "it is computed without a transfer")
            if req is None:
                return None
            w = self._waiting[request_id] = _Waiting(req.transfer_id, self._clock(), num_prompt_tokens)
        return w

    def _prefill_matched(self, request_id: str, params: Mapping[str, Any], r: Route,
                         num_prompt_tokens: int) -> tuple[int | None, bool]:
        """A push prefill request waits (None: ask again) until its offer arrived."""
        w = self._awaiting(request_id, params, r, num_prompt_tokens)
        if w is None:
            return 0, False
        if w.offer is None:
            with self._lock:
                got = self._offers.pop(w.transfer_id, None)
            if got is not None:
                w.offer_at, w.offer = got
                if self._stale(w, request_id):
                    self._waiting.pop(request_id, None)
                    return 0, False
            elif self._clock() - w.since < self.wait_s:
                return None, False
            else:
                log.warning("request %s: no decode engine offered blocks for transfer %s within "
                            "%.0f s; computing it without a transfer", request_id, w.transfer_id,
                            self.wait_s)
                self._waiting.pop(request_id, None)
                return 0, False
        if not w.released:
            now = self._clock()
            burst = now - self._last_offer < BATCH_WINDOW_S and now - w.offer_at < BATCH_CAP_S
            if burst:
                with self._lock:
                    coming = any(o.offer is None and o.transfer_id not in self._offers
                                 for rid, o in self._waiting.items() if rid != request_id)
                if coming:
                    return None, False  # more offers of this batch are coming
            w.released = True
        return 0, False

    def _order_pushes(self, progress: Sequence[StepProgress]) -> None:
        """A push request whose prompt completes in this step is ordered to its workers now
        (before the forward pass)."""
        for rid, before, now, new_blocks in progress:
            w = self._waiting.get(rid)
            if w is None or w.offer is None or w.ordered:
                continue
            if new_blocks:
                w.block_ids = _extended(w.block_ids, new_blocks)
            if before + now < w.num_prompt_tokens:
                continue  # a chunk of a longer prompt: push with the last one
            o = w.offer
            w.ordered = True
            if self._stale(w, rid):
                continue
            n = blocks_for_tokens(w.num_prompt_tokens, self.block_size)
            ids = tuple(g[:n] for g in w.block_ids)
            target_ids = tuple(tuple(int(b) for b in g) for g in o.block_ids)
            if not (target_ids and target_ids[0]) or not (ids and ids[0]):
                continue  # the decode engine needs nothing (all of it cached there)
            target = TransferParams(engine_id=o.engine_id, host=o.host, port=o.port, tp_size=o.tp_size,
                                    block_ids=target_ids, token=o.token, incarnation=o.incarnation,
                                    request_id=o.request_id, computed_tokens=o.computed_tokens)
            self._pushes.append(PushOrder(rid, ids, target, self.layerwise))
            w.pushed = True

    # ----- decode side ------------------------------------------------------------
    def _decode_after_alloc(self, request_id: str, params: Mapping[str, Any], r: Route,
                            blocks: Allocation, num_external_tokens: int) -> None:
        """Offer the allocated blocks to the prefill engine (once per request)."""
        self._offered.add(request_id)  # one transfer per request, even if rescheduled
        req = self._parse(request_id, params, r, "its prompt is computed locally")
        if not isinstance(req, PushDecode):
            return
        groups: BlockIds = (tuple(tuple(int(b) for b in g) for g in blocks.new_block_ids)
                            if num_external_tokens > 0 else ((),))
        token = secrets.token_hex(16)
        fields = dict(transfer_id=req.transfer_id, engine_id=self.engine_id, address=self.address,
                      tp_size=self.tp_size, block_size=self.block_size, block_ids=groups,
                      token=token, computed_tokens=blocks.first_group_hits * self.block_size,
                      incarnation=self.incarnation, request_id=request_id)
        expect = bool(groups and groups[0])  # nothing to receive: the offer only frees prefill
        self._offer_thread.submit(
            lambda: self._offer(request_id, req.host, req.port, fields, groups, expect=expect))

    def _offer(self, request_id: str, host: str, port: int, fields: dict[str, Any],
               local: BlockIds, *, expect: bool) -> None:
        """Offer thread: send one offer; queue the expect (or the failure) for the next step."""
        try:
            acc = self._send_offer(host, port, **fields)
        except Exception as exc:  # noqa: BLE001 - any failure fails the load, never the engine
            log.warning("request %s: the push offer to %s:%d failed: %s; its prompt is recomputed",
                        request_id, host, port, exc)
            if expect:
                with self._lock:
                    self._failed.append((request_id, local))
            return
        if not expect:
            return
        order = ExpectOrder(request_id, acc.engine_id, acc.tp_size, fields["token"], local,
                            acc.block_size, acc.kernel_blocks_per_block, acc.head_order)
        with self._lock:
            self._expects.append(order)
