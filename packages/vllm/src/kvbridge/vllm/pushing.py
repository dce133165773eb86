"""Push mode through vLLM: the decode engine allocates first, the prefill engine writes.

The router (or any client) gives one request to both engines with the same
transfer id, and tells the decode engine where the prefill engine's side
channel is::

    decode:  {"do_remote_prefill": true, "transfer_mode": "push",
              "kvbridge_transfer_id": ID, "remote_host": P_HOST, "remote_port": P_PORT}
    prefill: {"do_remote_decode": true, "transfer_mode": "push",
              "kvbridge_transfer_id": ID}

Decode side: vLLM allocates the request's blocks (the prompt is an asynchronous
load), and the scheduler sends them to the prefill engine's side channel in a
push offer (:func:`kvbridge.handshake.send_push_offer`, on a background thread).
The accept names the prefill engine's facts; the next step orders every decode
worker to *expect* the request (:meth:`kvbridge.nixl.DecodeEngine.expect`). An
offer that fails fails the request's load, so vLLM recomputes it.

Prefill side: the side-channel server hands each offer to :meth:`PushState.on_offer`.
vLLM asks the connector how many tokens a waiting request can load; a push
request answers "ask again later" until its offer arrived (at most
``wait_s``; then it is computed without a transfer). The step that computes
the last prompt chunk orders every prefill worker to *push* the request into
the decode engine's blocks: layer by layer inside the forward pass
(``save_kv_layer``) or the whole request after it (``wait_for_save``). When the
request finishes, its blocks stay allocated until the workers report the push
released (written, failed or timed out).

Plain values in and out: this module imports nothing from vLLM.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.topology import blocks_for_tokens

__all__ = ["ExpectOrder", "PushOrder", "PushOrders", "PushState", "is_push"]

log = logging.getLogger("kvbridge.vllm")

TRANSFER_ID_KEY = "kvbridge_transfer_id"
#: offers kept at most (a prefill engine that never sees the matching request drops the oldest)
MAX_OFFERS = 65536
#: a decode engine allocating a batch sends its offers back to back; a prefill request whose
#: offer came waits while other push requests still lack theirs and the last offer arrived
#: less than BATCH_WINDOW_S ago (at most BATCH_CAP_S after its own), so the batch is
#: computed in one step rather than one request per forward pass
BATCH_WINDOW_S = 0.005
BATCH_CAP_S = 0.05


def is_push(params: Mapping[str, Any] | None) -> bool:
    """True for kv_transfer_params of a push-mode request (either side)."""
    return bool(params) and params.get("transfer_mode") == "push"


def _transfer_id(params: Mapping[str, Any]) -> str:
    tid = params.get(TRANSFER_ID_KEY)
    if not isinstance(tid, str) or not 0 < len(tid) <= 256:
        raise ValueError(f"kv_transfer_params[{TRANSFER_ID_KEY!r}] must be a string of 1..256 "
                         f"characters naming the transfer (the same on both requests), got {tid!r}")
    return tid


@dataclass(frozen=True)
class PushOrder:
    """Prefill worker: write one request's blocks into a decode engine."""

    request_id: str
    block_ids: tuple[int, ...]
    #: kvbridge.nixl.TransferParams of the decode side (engine, side channel, TP, its
    #: blocks for the tokens from ``computed_tokens`` on, the token it expects)
    target: Any
    layerwise: bool


@dataclass(frozen=True)
class ExpectOrder:
    """Decode worker: wait for the prefill ranks that write one request."""

    request_id: str
    prefill_engine_id: str
    prefill_tp: int
    token: str
    local_block_ids: tuple[int, ...]
    prefill_block_size: int
    prefill_kernel_blocks_per_block: int
    prefill_head_order: str


@dataclass(frozen=True)
class PushOrders:
    """The push-mode part of one step's orders."""

    pushes: tuple[PushOrder, ...] = ()
    #: prefill: finished requests whose blocks vLLM frees once their push is released
    sent: tuple[str, ...] = ()
    expects: tuple[ExpectOrder, ...] = ()
    #: decode: requests whose offer failed, with their local blocks (to recompute)
    failed: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.pushes or self.sent or self.expects or self.failed)


@dataclass
class _Waiting:
    """A prefill request bound (or waiting) for its decode engine's offer."""

    transfer_id: str
    since: float
    num_prompt_tokens: int
    offer: Any = None  # kvbridge.handshake.PushOffer once it arrived
    offer_at: float = 0.0
    released: bool = False  # told vLLM to schedule it
    block_ids: tuple[int, ...] = ()
    ordered: bool = False
    pushed: bool = False


class PushState:
    """Push-mode bookkeeping of one engine's scheduler (see the module docstring).

    ``send_offer(host, port, **fields)`` sends one offer and returns the accept
    (:func:`kvbridge.handshake.send_push_offer` with the engine's key bound);
    ``facts()`` returns this engine's facts for an accept, or None before the
    workers registered.
    """

    def __init__(self, *, engine_id: str, block_size: int, tp_size: int, address: tuple[str, int],
                 layerwise: bool, wait_s: float, send_offer: Callable[..., Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.address = address
        self.layerwise = layerwise
        self.wait_s = wait_s
        self.incarnation = ""
        self.accept_facts: dict[str, Any] | None = None
        self._send_offer = send_offer
        self._clock = clock
        self._lock = threading.Lock()
        # prefill side
        self._offers: dict[str, tuple[float, Any]] = {}  # transfer id -> (arrival, offer)
        self._last_offer = float("-inf")
        self._waiting: dict[str, _Waiting] = {}
        self._pushes: list[PushOrder] = []
        self._sent: list[str] = []
        # decode side (the offer thread appends under the lock)
        self._expects: list[ExpectOrder] = []
        self._failed: list[tuple[str, tuple[int, ...]]] = []
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    # ----- prefill side ---------------------------------------------------------
    def on_offer(self, offer: Any) -> Any:
        """The side-channel server's offer handler (server thread): keep the offer and
        return this engine's accept (a :class:`kvbridge.handshake.PushAccept`)."""
        from kvbridge.handshake import PROTOCOL_VERSION, PushAccept

        facts = self.accept_facts
        if facts is None:
            raise ValueError(f"engine {self.engine_id!r} has not registered its KV cache yet")
        with self._lock:
            if len(self._offers) >= MAX_OFFERS:
                oldest = min(self._offers, key=lambda k: self._offers[k][0])
                del self._offers[oldest]
            self._offers[offer.transfer_id] = (self._clock(), offer)
            self._last_offer = self._clock()
        return PushAccept(protocol_version=PROTOCOL_VERSION, transfer_id=offer.transfer_id,
                          engine_id=self.engine_id, tp_size=self.tp_size, incarnation=self.incarnation,
                          **facts)

    def prefill_matched(self, request_id: str, params: Mapping[str, Any],
                        num_prompt_tokens: int) -> tuple[int | None, bool]:
        """A push prefill request waits (None: ask again) until its offer arrived."""
        w = self._waiting.get(request_id)
        if w is None:
            try:
                tid = _transfer_id(params)
            except ValueError as exc:
                log.warning("request %s: %s; it is computed without a transfer", request_id, exc)
                return 0, False
            w = self._waiting[request_id] = _Waiting(tid, self._clock(), num_prompt_tokens)
        if w.offer is None:
            with self._lock:
                got = self._offers.pop(w.transfer_id, None)
            if got is not None:
                w.offer_at, w.offer = got
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
            if burst and any(o.offer is None for r, o in self._waiting.items() if r != request_id):
                return None, False  # more offers of this batch are coming
            w.released = True
        return 0, False

    def prefill_after_alloc(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        w = self._waiting.get(request_id)
        if w is not None and w.offer is not None and block_ids:
            w.block_ids = tuple(int(b) for b in block_ids[0])

    def prefill_step(self, progress: Sequence[tuple[str, int, int, Sequence[Sequence[int]] | None]]
                     ) -> None:
        """This step's scheduled requests: (id, tokens computed before, tokens scheduled now,
        newly allocated blocks per group or None). A push request whose prompt completes in
        this step is ordered to its workers now (before the forward pass)."""
        from kvbridge.nixl import TransferParams

        for rid, before, now, new_blocks in progress:
            w = self._waiting.get(rid)
            if w is None or w.offer is None or w.ordered:
                continue
            if new_blocks and new_blocks[0]:
                extra = tuple(int(b) for b in new_blocks[0])
                if extra[:1] and extra[0] not in w.block_ids:
                    w.block_ids = w.block_ids + extra
            if before + now < w.num_prompt_tokens:
                continue  # a chunk of a longer prompt: push with the last one
            o = w.offer
            w.ordered = True
            ids = w.block_ids[:blocks_for_tokens(w.num_prompt_tokens, self.block_size)]
            target_ids = tuple(o.block_ids[0]) if o.block_ids else ()
            if not target_ids or not ids:
                continue  # the decode engine needs nothing (all of it cached there)
            target = TransferParams(engine_id=o.engine_id, host=o.host, port=o.port, tp_size=o.tp_size,
                                    block_ids=target_ids, token=o.token, incarnation=o.incarnation,
                                    request_id=o.request_id, computed_tokens=o.computed_tokens)
            self._pushes.append(PushOrder(rid, ids, target, self.layerwise))
            w.pushed = True

    def prefill_finished(self, request_id: str) -> bool:
        """A push prefill request finished: True when its blocks must stay allocated until
        its workers report the push released."""
        w = self._waiting.pop(request_id, None)
        if w is None or not w.pushed:
            return False
        self._sent.append(request_id)
        return True

    @property
    def pending(self) -> bool:
        """Whether push work is waiting (vLLM keeps stepping while it is)."""
        return bool(self._waiting or self._pushes or self._sent or self._expects or self._failed
                    or not self._jobs.empty())

    # ----- decode side ----------------------------------------------------------
    def decode_matched(self, request_id: str, params: Mapping[str, Any], num_prompt_tokens: int,
                       num_computed_tokens: int) -> tuple[int, bool]:
        """Every prompt token beyond the local ones arrives from the prefill engine."""
        try:
            _transfer_id(params)
            _address(params)
        except ValueError as exc:
            log.warning("request %s: %s; its prompt is computed locally", request_id, exc)
            return 0, False
        n = max(num_prompt_tokens - num_computed_tokens, 0)
        return (n, True) if n > 0 else (0, False)

    def decode_after_alloc(self, request_id: str, params: MutableMapping[str, Any],
                           block_ids: Sequence[Sequence[int]], computed_blocks: int,
                           num_external_tokens: int) -> None:
        """Offer the allocated blocks to the prefill engine (once per request)."""
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if rescheduled
        try:
            tid = _transfer_id(params)
            host, port = _address(params)
        except ValueError as exc:
            log.warning("request %s: %s", request_id, exc)
            return
        groups = tuple(tuple(int(b) for b in g) for g in block_ids) if num_external_tokens > 0 else ((),)
        token = secrets.token_hex(16)
        fields = dict(transfer_id=tid, engine_id=self.engine_id, address=self.address,
                      tp_size=self.tp_size, block_size=self.block_size, block_ids=groups,
                      token=token, computed_tokens=computed_blocks * self.block_size,
                      incarnation=self.incarnation, request_id=request_id)
        expect = bool(groups and groups[0])  # nothing to receive: the offer only frees prefill
        self._submit(lambda: self._offer(request_id, host, port, fields, expect=expect))

    def _offer(self, request_id: str, host: str, port: int, fields: dict[str, Any], *,
               expect: bool) -> None:
        """Offer thread: send one offer; queue the expect (or the failure) for the next step."""
        local = tuple(fields["block_ids"][0]) if fields["block_ids"] else ()
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

    def _submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvbridge-push-offers", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - the thread serves every later offer
                log.exception("kvbridge: a push offer job failed")

    # ----- both -----------------------------------------------------------------
    def take(self) -> PushOrders:
        """This step's push orders; resets them."""
        with self._lock:
            expects, failed = tuple(self._expects), tuple(self._failed)
            self._expects, self._failed = [], []
        out = PushOrders(tuple(self._pushes), tuple(self._sent), expects, failed)
        self._pushes, self._sent = [], []
        return out

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=5)
            self._thread = None


def _address(params: Mapping[str, Any]) -> tuple[str, int]:
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not host:
        raise ValueError("push kv_transfer_params need remote_host: the prefill engine's side-channel host")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"push kv_transfer_params need remote_port (the prefill engine's side-channel "
                         f"port, 1..65535), got {port!r}")
    return host, port
