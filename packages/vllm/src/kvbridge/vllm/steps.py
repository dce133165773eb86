"""The scheduler side of the connector as plain state: what each engine step orders.

vLLM's scheduler asks the connector, per request, how many prompt tokens it
can load, tells it which blocks it allocated, and tells it when a request
finished; once per step it asks for the metadata the workers act on. This
module keeps that bookkeeping without importing vLLM: the connector passes
plain values in and ships the :class:`StepOrders` of each step to the workers.

Decode side (pull): a request arriving with a prefill engine's parameters is
*queued* until vLLM allocates its blocks; meanwhile the workers are told to
handshake with that engine and to renew the request's lease every heartbeat.
Once blocks are allocated the workers *load* it; a request that ends before
(aborted) or needs nothing (all its blocks are local) is *released*: the
prefill ranks are told to free its blocks.

Prefill side: a finished request whose KV is wanted elsewhere is *held*: the
workers keep its blocks under a lease, keyed by a fresh request token, and the
request's output carries the parameters the decode engine needs.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.topology import blocks_for_tokens
from kvbridge.vllm.params import (
    ParamsError,
    RemotePrefill,
    decode_remote_prefill,
    encode_remote_prefill,
    is_prefill_request,
    is_remote_prefill,
    transfer_block_ids,
)
from kvbridge.vllm.pushing import PushOrders
from kvbridge.vllm.scheduling import (
    check_remote_blocks,
    check_remote_groups,
    check_remote_parallelism,
    tokens_to_load,
)

__all__ = ["HoldOrder", "LoadOrder", "SchedulerState", "StepOrders"]

log = logging.getLogger("kvbridge.vllm")

#: key set in a decode request's kv_transfer_params once its transfer was ordered
PROCESSED_KEY = "_kvbridge_processed"


@dataclass(frozen=True)
class LoadOrder:
    """Decode: read one request's prompt blocks from its prefill engine."""

    request_id: str  # the decode engine's id of the request
    source: RemotePrefill  # parsed once by the scheduler; source.transfer goes to the engine
    #: for the tokens from computed_tokens on: flat for one KV-cache group, else per group
    local_block_ids: tuple[int, ...] | tuple[tuple[int, ...], ...]
    computed_tokens: int  # leading tokens already present locally (whole blocks), in the
    # unit DecodeEngine.load takes


@dataclass(frozen=True)
class HoldOrder:
    """Prefill: keep one finished request's blocks until the decode side has them."""

    request_id: str
    block_ids: tuple[int, ...] | tuple[tuple[int, ...], ...]  # flat, or per KV-cache group
    token: str


@dataclass(frozen=True)
class StepOrders:
    """Everything the workers do for one engine step (pickled to every worker)."""

    loads: tuple[LoadOrder, ...] = ()
    holds: tuple[HoldOrder, ...] = ()
    #: decode: tell these prefill requests' ranks that nothing will be read
    releases: tuple[RemotePrefill, ...] = ()
    #: decode: queued requests whose prefill lease to renew (handshaking first if needed)
    renewals: tuple[RemotePrefill, ...] = ()
    #: push mode: writes, expectations and failed offers (kvbridge.vllm.pushing)
    push: PushOrders = PushOrders()

    @property
    def empty(self) -> bool:
        return not (self.loads or self.holds or self.releases or self.renewals) and self.push.empty


class SchedulerState:
    """Scheduler-side bookkeeping of one engine (see the module docstring).

    ``producer``/``consumer`` follow vLLM's ``kv_role``. ``address`` is the
    side channel the prefill workers are served on; ``incarnation`` (set with
    :meth:`set_incarnation` once the workers registered) identifies this start
    of the engine. ``group_kinds`` names the kind of each KV-cache group of a
    hybrid model in vLLM's order (``"full"``, ``"sliding"``, ``"mamba"``; empty:
    one full-attention group). ``equal_tp_only``, when set, says why this engine
    loads only from prefill engines of its own TP size (others are computed locally).
    """

    def __init__(self, *, engine_id: str, block_size: int, tp_size: int, address: tuple[str, int],
                 producer: bool, consumer: bool, heartbeat_s: float, mode: str = "pull",
                 clock: Callable[[], float] = time.monotonic, group_kinds: Sequence[str] = (),
                 equal_tp_only: str | None = None) -> None:
        if block_size < 1 or tp_size < 1:
            raise ValueError(f"block_size and tp_size must be >= 1, got {block_size}, {tp_size}")
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.address = address
        self.producer = producer
        self.consumer = consumer
        self.heartbeat_s = heartbeat_s
        self.mode = mode
        self.incarnation = ""
        self.group_kinds = tuple(group_kinds)
        self.equal_tp_only = equal_tp_only
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

    def set_incarnation(self, incarnation: str) -> None:
        self.incarnation = incarnation

    # ----- decode side ----------------------------------------------------
    def _source(self, request_id: str, params: Mapping[str, Any] | None, num_prompt_tokens: int
                ) -> RemotePrefill | None:
        """The prefill source of a decode request, or None (then it is computed locally).

        The parameters are parsed and checked on the first call for a request; later
        calls return that result until the request is forgotten.
        """
        if not self.consumer or not is_remote_prefill(params):
            return None
        if request_id in self._sources:
            return self._sources[request_id]
        if len(self._sources) > 65536:  # requests that never finished: keep the table bounded
            self._sources.clear()
        self._sources[request_id] = rp = self._parse(request_id, params, num_prompt_tokens)
        return rp

    def _parse(self, request_id: str, params: Mapping[str, Any] | None, num_prompt_tokens: int
               ) -> RemotePrefill | None:
        try:
            rp = decode_remote_prefill(params)  # type: ignore[arg-type]
            if not rp.from_kvbridge:
                raise ParamsError(
                    "they carry no kvbridge_token: they were made by another connector; run the "
                    "prefill engine with KVBridgeConnector too"
                )
            if rp.mode != self.mode:
                raise ParamsError(f"the prefill engine uses {rp.mode} mode, this engine {self.mode}; "
                                  "configure both engines with the same mode")
            check_remote_parallelism(rp)
            check_remote_groups(rp, self.group_kinds)
            if self.equal_tp_only and rp.transfer.tp_size != self.tp_size:
                raise ParamsError(f"the prefill engine runs TP {rp.transfer.tp_size} and this "
                                  f"engine TP {self.tp_size}: {self.equal_tp_only}")
            check_remote_blocks(rp, num_prompt_tokens, rp.block_size or self.block_size,
                                self.group_kinds)
        except ParamsError as exc:
            log.warning("request %s: ignoring its kv_transfer_params (%s); its prompt is "
                        "computed locally", request_id, exc)
            return None
        return rp

    def matched_tokens(self, request_id: str, params: Mapping[str, Any] | None,
                       num_prompt_tokens: int, num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM's ``get_num_new_matched_tokens``: tokens to load and whether asynchronously.

        Every prompt token the prefill engine computed (vLLM >= 0.32 recomputes
        the last prompt token itself to sample from it).
        """
        rp = self._source(request_id, params, num_prompt_tokens)
        if rp is None:
            return 0, False
        n = tokens_to_load(rp, num_prompt_tokens, num_computed_tokens)
        return (n, True) if n > 0 else (0, False)

    def on_new_request(self, request_id: str, params: Mapping[str, Any] | None,
                       num_prompt_tokens: int) -> None:
        """A decode request arrived: handshake now and keep its lease while it queues."""
        rp = self._source(request_id, params, num_prompt_tokens)
        if rp is not None and self.mode == "pull":
            self._queued[request_id] = rp
            self._renew_now.append(rp)

    def after_alloc(self, request_id: str, params: MutableMapping[str, Any] | None,
                    num_prompt_tokens: int, unhashed_block_ids: Sequence[Sequence[int]],
                    computed_blocks: int, num_external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc``: order the load (once per request)."""
        if params is None or not params.get("do_remote_prefill") or params.get(PROCESSED_KEY):
            return
        rp = self._source(request_id, params, num_prompt_tokens)
        params["do_remote_prefill"] = False  # one transfer per request, even if rescheduled
        params[PROCESSED_KEY] = True
        self._queued.pop(request_id, None)
        self._sources.pop(request_id, None)
        if rp is None:
            return
        if num_external_tokens <= 0:
            # everything decode needs is local already (a full prefix-cache hit): free the
            # prefill blocks at once (notify-only), never leave them to the lease
            log.debug("request %s: every block it needs is in the local prefix cache; releasing "
                      "request %s of engine %s without reading", request_id,
                      rp.transfer.request_id, rp.transfer.engine_id)
            self._releases.append(rp)
            return
        ids = transfer_block_ids([[int(b) for b in g] for g in unhashed_block_ids])
        self._loads.append(LoadOrder(request_id, rp, ids, computed_blocks * self.block_size))

    # ----- both sides -----------------------------------------------------
    def finished(self, request_id: str, params: MutableMapping[str, Any] | None, *,
                 completed: bool, block_ids: Sequence[Sequence[int]], num_computed_tokens: int,
                 num_prompt_tokens: int) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: (hold the blocks?, kv_transfer_params for the output).

        ``completed`` is True when the request finished normally (length or
        stop), False when it was aborted or failed.
        """
        self._queued.pop(request_id, None)
        rp = self._source(request_id, params, num_prompt_tokens)  # None once loaded
        self._sources.pop(request_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill") and not params.get(PROCESSED_KEY):
            # a decode request that ends before its blocks were allocated: free the prefill side
            params["do_remote_prefill"] = False
            params[PROCESSED_KEY] = True
            if rp is not None:
                self._releases.append(rp)
            return False, None
        if not is_prefill_request(params) or not completed:
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
        self._holds.append(HoldOrder(request_id, transfer_block_ids(groups), token))
        host, port = self.address
        out = encode_remote_prefill(RemotePrefill.of(
            engine_id=self.engine_id, host=host, port=port, request_id=request_id,
            block_ids=groups, tp_size=self.tp_size, num_tokens=num_computed_tokens,
            mode="pull", token=token, block_size=self.block_size, incarnation=self.incarnation,
        ))
        return True, out

    def take_orders(self) -> StepOrders:
        """The orders of this step; resets the per-step state."""
        now = self._clock()
        renewals = self._renew_now
        if self._queued and now - self._last_heartbeat >= self.heartbeat_s:
            self._last_heartbeat = now
            seen = {(r.transfer.engine_id, r.transfer.request_id) for r in renewals}
            renewals = renewals + [r for r in self._queued.values()
                                   if (r.transfer.engine_id, r.transfer.request_id) not in seen]
        orders = StepOrders(tuple(self._loads), tuple(self._holds), tuple(self._releases),
                            tuple(renewals))
        self._loads, self._holds, self._releases, self._renew_now = [], [], [], []
        return orders

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop per-request state of finished requests (bounded memory)."""
        for rid in request_ids:
            self._queued.pop(rid, None)
            self._sources.pop(rid, None)

    @property
    def queued(self) -> int:
        return len(self._queued)
