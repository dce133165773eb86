"""Pull mode, scheduler half: what each engine step orders (the decode engine reads).

vLLM's scheduler asks the connector, per request, how many prompt tokens it
can load, tells it which blocks it allocated, and tells it when a request
finished; once per step it asks for the orders the workers act on. This module
keeps that bookkeeping without importing vLLM: the connector passes plain values
in and ships the :class:`~kvbridge.vllm.pull.orders.PullOrders` of each step to
the workers.

Decode side: a request arriving with a prefill engine's parameters is *queued*
until vLLM allocates its blocks; meanwhile the workers are told to handshake
with that engine and to renew the request's lease every heartbeat. Once blocks
are allocated the workers *load* it; a request that ends before (aborted) or
needs nothing (all its blocks are local) is *released*: the prefill ranks are
told to free its blocks.

Prefill side: a finished request whose KV is wanted elsewhere is *held*: the
workers keep its blocks under a lease, keyed by a fresh request token, and the
request's output carries the parameters the decode engine needs.

A request's parameters are never changed: what happened to a request is kept
here, by request id, until it finishes.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvbridge.topology import blocks_for_tokens
from kvbridge.vllm.modes import Allocation, SchedulerMode, StepProgress
from kvbridge.vllm.params import (
    BlockIds,
    ParamsError,
    RemotePrefill,
    Route,
    decode_remote_prefill,
    encode_remote_prefill,
    route,
)
from kvbridge.vllm.pull.orders import HoldOrder, LoadOrder, PullOrders
from kvbridge.vllm.pull.source import (
    check_remote_blocks,
    check_remote_groups,
    check_remote_parallelism,
    tokens_to_load,
)

__all__ = ["PullScheduler"]

log = logging.getLogger("kvbridge.vllm")


class PullScheduler(SchedulerMode):
    """Pull-mode bookkeeping of one engine's scheduler (see the module docstring).

    ``producer``/``consumer`` follow vLLM's ``kv_role``. ``address`` is the
    side channel the prefill workers are served on; ``incarnation`` (set by
    :meth:`set_served` once the workers registered) identifies this start of the
    engine. ``group_kinds`` names the kind of each KV-cache group of a hybrid
    model in vLLM's order (``"full"``, ``"sliding"``, ``"mamba"``; empty: one
    full-attention group). ``equal_tp_only``, when set, says why this engine loads
    only from prefill engines of its own TP size (others are computed locally).
    ``drop_last_token``: a Mamba hybrid, whose prefill requests for a remote decode
    drop their last prompt token (:meth:`on_new_request`).
    """

    def __init__(self, *, engine_id: str, block_size: int, tp_size: int, address: tuple[str, int],
                 producer: bool, consumer: bool, heartbeat_s: float,
                 clock: Callable[[], float] = time.monotonic, group_kinds: Sequence[str] = (),
                 equal_tp_only: str | None = None, drop_last_token: bool = False) -> None:
        if block_size < 1 or tp_size < 1:
            raise ValueError(f"block_size and tp_size must be >= 1, got {block_size}, {tp_size}")
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.address = address
        self.producer = producer
        self.consumer = consumer
        self.heartbeat_s = heartbeat_s
        self.incarnation = ""
        self.group_kinds = tuple(group_kinds)
        self.equal_tp_only = equal_tp_only
        self.drop_last_token = drop_last_token
        self._clock = clock
        self._queued: dict[str, RemotePrefill] = {}  # decode requests not loading yet
        self._loads: list[LoadOrder] = []
        self._holds: list[HoldOrder] = []
        self._releases: list[RemotePrefill] = []
        self._renew_now: list[RemotePrefill] = []
        self._last_heartbeat = clock()
        #: each decode request's kv_transfer_params, parsed once: its source, or None when
        #: they were refused (logged once) and the prompt is computed locally
        self._sources: dict[str, RemotePrefill | None] = {}
        #: decode requests whose transfer was ordered or dropped (once per request)
        self._transferred: set[str] = set()
        #: push-mode requests refused (logged once)
        self._refused: set[str] = set()
        #: prefill requests whose last prompt token was dropped
        self._truncated: set[str] = set()

    def set_served(self, incarnation: str, facts: Mapping[str, Any]) -> None:
        self.incarnation = incarnation

    # ----- every request ----------------------------------------------------
    def _route(self, request_id: str, params: Mapping[str, Any] | None) -> Route:
        """The request's part; push-mode requests are refused once (computed without a
        transfer), and a decode request whose transfer was ordered is no longer one."""
        r = route(params)
        if r.push:
            if request_id not in self._refused:
                self._refused.add(request_id)
                log.warning("request %s asks for a push-mode transfer but this engine runs "
                            "KVBridgeConnector in pull mode (set kv_connector_extra_config['mode'] "
                            "= 'push' on both engines); it is computed without a transfer",
                            request_id)
            return Route()
        return r.transferred() if request_id in self._transferred else r

    def _source(self, request_id: str, r: Route, params: Mapping[str, Any] | None,
                num_prompt_tokens: int) -> RemotePrefill | None:
        """The prefill source of a decode request, or None (then it is computed locally).

        The parameters are parsed and checked on the first call for a request; later
        calls return that result until the request is forgotten.
        """
        if not self.consumer or not r.decode or params is None:
            return None
        if request_id in self._sources:
            return self._sources[request_id]
        if len(self._sources) > 65536:  # requests that never finished: keep the table bounded
            self._sources.clear()
        self._sources[request_id] = rp = self._parse(request_id, params, num_prompt_tokens)
        return rp

    def _parse(self, request_id: str, params: Mapping[str, Any], num_prompt_tokens: int
               ) -> RemotePrefill | None:
        try:
            rp = decode_remote_prefill(params)
            if not rp.from_kvbridge:
                raise ParamsError(
                    "they carry no kvbridge_token: they were made by another connector; run the "
                    "prefill engine with KVBridgeConnector too"
                )
            check_remote_parallelism(rp)
            check_remote_groups(rp, self.group_kinds)
            if self.equal_tp_only and rp.tp_size != self.tp_size:
                raise ParamsError(f"the prefill engine runs TP {rp.tp_size} and this "
                                  f"engine TP {self.tp_size}: {self.equal_tp_only}")
            check_remote_blocks(rp, num_prompt_tokens, rp.block_size or self.block_size,
                                self.group_kinds)
        except ParamsError as exc:
            log.warning("request %s: ignoring its kv_transfer_params (%s); its prompt is "
                        "computed locally", request_id, exc)
            return None
        return rp

    # ----- decode side ------------------------------------------------------
    def on_new_request(self, request_id: str, params: Mapping[str, Any] | None,
                       num_prompt_tokens: int) -> bool:
        """A request arrived. A decode request handshakes now and keeps its lease while it
        queues. On a Mamba hybrid, True for a prefill request (once): drop its last
        prompt token, so the state moved is the one before it, which the decode engine
        then computes itself (a recurrent state cannot take the same token twice)."""
        r = self._route(request_id, params)
        drop = self.drop_last_token and r.prefill and request_id not in self._truncated
        if drop:
            self._truncated.add(request_id)
        rp = self._source(request_id, r, params, num_prompt_tokens)
        if rp is not None:
            self._queued[request_id] = rp
            self._renew_now.append(rp)
        return drop

    def matched_tokens(self, request_id: str, params: Mapping[str, Any] | None,
                       num_prompt_tokens: int, num_computed_tokens: int) -> tuple[int, bool]:
        """Every prompt token the prefill engine computed but the last (vLLM >= 0.32
        recomputes the last prompt token itself to sample from it)."""
        rp = self._source(request_id, self._route(request_id, params), params, num_prompt_tokens)
        if rp is None:
            return 0, False
        n = tokens_to_load(rp, num_prompt_tokens, num_computed_tokens)
        return (n, True) if n > 0 else (0, False)

    def after_alloc(self, request_id: str, params: Mapping[str, Any] | None,
                    num_prompt_tokens: int, blocks: Allocation, num_external_tokens: int) -> None:
        """Order the load into the new blocks (once per request), or the release of the
        prefill blocks when nothing is to be loaded."""
        r = self._route(request_id, params)
        if not r.decode:
            return
        rp = self._source(request_id, r, params, num_prompt_tokens)
        self._transferred.add(request_id)  # one transfer per request, even if rescheduled
        self._queued.pop(request_id, None)
        self._sources.pop(request_id, None)
        if rp is None:
            return
        if num_external_tokens <= 0:
            # everything decode needs is local already (a full prefix-cache hit): free the
            # prefill blocks at once (notify-only), never leave them to the lease
            log.debug("request %s: every block it needs is in the local prefix cache; releasing "
                      "request %s of engine %s without reading", request_id, rp.request_id,
                      rp.engine_id)
            self._releases.append(rp)
            return
        ids = tuple(tuple(int(b) for b in g) for g in blocks.new_block_ids)
        self._loads.append(LoadOrder(request_id, rp, ids, blocks.prefix_hits * self.block_size))

    # ----- both sides -------------------------------------------------------
    def finished(self, request_id: str, params: Mapping[str, Any] | None, *, completed: bool,
                 block_ids: BlockIds, num_computed_tokens: int, num_prompt_tokens: int
                 ) -> tuple[bool, dict[str, Any] | None]:
        """(hold the blocks?, kv_transfer_params for the output): a completed prefill
        request to be decoded elsewhere is held and answers the decode parameters."""
        self._queued.pop(request_id, None)
        r = self._route(request_id, params)
        rp = self._source(request_id, r, params, num_prompt_tokens)  # None once loaded
        self._sources.pop(request_id, None)
        for done in (self._transferred, self._refused, self._truncated):
            done.discard(request_id)
        if r.decode:
            # a decode request that ends before its blocks were allocated: free the prefill side
            if rp is not None:
                self._releases.append(rp)
            return False, None
        if not r.prefill or not completed:
            return False, None
        if not self.producer:
            log.warning("request %s asks for remote decode but this engine's kv_role is not a "
                        "producer; its blocks are freed", request_id)
            return False, None
        if not self.incarnation:
            log.warning("request %s: the workers have not published their metadata; cannot hold "
                        "its blocks for a decode engine", request_id)
            return False, None
        n = blocks_for_tokens(num_computed_tokens, self.block_size)
        groups = tuple(tuple(int(b) for b in g[:n]) for g in block_ids)
        if not groups or not groups[0]:
            return False, None
        token = secrets.token_hex(16)
        self._holds.append(HoldOrder(request_id, groups, token))
        host, port = self.address
        out = encode_remote_prefill(RemotePrefill.of(
            engine_id=self.engine_id, host=host, port=port, request_id=request_id,
            block_ids=groups, tp_size=self.tp_size, num_tokens=num_computed_tokens,
            mode="pull", token=token, block_size=self.block_size, incarnation=self.incarnation,
        ))
        return True, out

    def take_orders(self, progress: Sequence[StepProgress] = ()) -> PullOrders:
        """The orders of this step; resets the per-step state."""
        now = self._clock()
        renewals = self._renew_now
        if self._queued and now - self._last_heartbeat >= self.heartbeat_s:
            self._last_heartbeat = now
            seen = {(r.engine_id, r.request_id) for r in renewals}
            renewals = renewals + [r for r in self._queued.values()
                                   if (r.engine_id, r.request_id) not in seen]
        orders = PullOrders(tuple(self._loads), tuple(self._holds), tuple(self._releases),
                            tuple(renewals))
        self._loads, self._holds, self._releases, self._renew_now = [], [], [], []
        return orders

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop per-request state of requests whose transfer finished (bounded memory)."""
        for rid in request_ids:
            self._queued.pop(rid, None)
            self._sources.pop(rid, None)

    @property
    def queued(self) -> int:
        return len(self._queued)
