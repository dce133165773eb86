"""Push mode, worker half: writes (prefill), layer by layer or whole, and expectations (decode)."""

from __future__ import annotations

import logging

from kvbridge.nixl import DecodeEngine, PrefillEngine
from kvbridge.topology import FailureKind, Released
from kvbridge.vllm.push.orders import PushOrder, PushOrders
from kvbridge.vllm.rank_engines import RankEngines

__all__ = ["PushWorker"]

log = logging.getLogger("kvbridge.vllm")


class PushWorker(RankEngines):
    """One TP rank in push mode: the prefill engine writes into the decode engine's
    blocks, the decode engine waits for the writes (see :class:`RankEngines`).

    vLLM 0.32 binds a step's orders before the forward pass but calls ``start_load_kv``
    after it, so whichever of :meth:`save_layer`, :meth:`start` and
    :meth:`finish_saves` sees a step's orders first opens its pushes.
    """

    idle_waits = True  # the decode engine has nothing to do while the prefill computes

    def __init__(self, rank, roles, *, single_group: bool = True) -> None:
        super().__init__(rank, roles, single_group=single_group)
        self._step_pushes: list[PushOrder] = []  # this step's writes (saved in the forward pass)
        self._push_sent: set[str] = set()  # finished in the scheduler: report once released
        self._push_released: set[str] = set()  # released before the scheduler said finished
        self._begun: PushOrders | None = None  # the step whose pushes are open
        self._unknown_layers: set[str] = set()
        self._layer_index: dict[str, int] = {}

    def register(self, *args, **kwargs) -> None:
        super().register(*args, **kwargs)
        self._layer_index = {n: i for i, n in enumerate(self.layer_names)}

    def _served_engine(self) -> PrefillEngine | DecodeEngine | None:
        return self.decode if self.decode is not None else self.prefill

    def _sent(self, released: Released) -> bool:
        rid = released.request_id
        if rid in self._push_sent:
            self._push_sent.discard(rid)
            return True
        if released.reason in ("written", "push-failed"):
            self._push_released.add(rid)
        return False

    def _begin(self, orders: PushOrders) -> None:
        """Open this step's pushes (once per step)."""
        if orders is self._begun:
            return
        self._begun = orders
        pre = self.prefill
        for p in orders.pushes:
            if pre is None:
                continue
            if p.layerwise:
                try:
                    pre.push_start(p.request_id, p.block_ids, p.target)
                except ValueError as exc:
                    log.error("kvbridge: cannot push request %s: %s", p.request_id, exc)
                    self._push_released.add(p.request_id)  # nothing holds its blocks
                    continue
            self._step_pushes.append(p)

    def start(self, orders: PushOrders) -> None:
        """Carry out one step's orders; never waits for a peer."""
        if orders.empty:
            return
        self._begin(orders)
        pre, dec = self.prefill, self.decode
        for rid in orders.sent:
            if rid in self._push_released or pre is None:
                self._push_released.discard(rid)
                self._free_now.add(rid)
            else:
                self._push_sent.add(rid)
        for e in orders.expects:
            if dec is None:
                self._load_failed(e.request_id, e.local_block_ids)
                continue
            try:
                dec.expect(e.request_id, e.prefill_engine_id, e.prefill_tp, e.token, e.local_block_ids,
                           prefill_block_size=e.prefill_block_size,
                           prefill_head_order=e.prefill_head_order,
                           prefill_kernel_blocks_per_block=e.prefill_kernel_blocks_per_block)
                self._load_started(e.request_id, e.local_block_ids)
            except ValueError as exc:
                log.error("kvbridge: cannot expect request %s: %s", e.request_id, exc)
                self._load_failed(e.request_id, e.local_block_ids)
        for rid, blocks in orders.failed:  # its offer, push mode's handshake, failed
            if dec is not None:  # counted as pull mode counts a failed handshake
                dec.stats.fail(FailureKind.HANDSHAKE.value)
            self._load_failed(rid, blocks)

    def save_layer(self, layer_name: str, orders: PushOrders) -> None:
        """Inside the forward pass, once vLLM wrote ``layer_name`` of this step: layered
        pushes write that layer now."""
        if orders.pushes:
            self._begin(orders)
        if not self._step_pushes or self.prefill is None:
            return
        idx = self._layer_index.get(layer_name)
        if idx is None:
            if layer_name not in self._unknown_layers:
                self._unknown_layers.add(layer_name)
                log.warning("kvbridge: layer %r is not a registered cache layer; pushes write it "
                            "with the request's remaining layers after the forward pass", layer_name)
            return
        for p in self._step_pushes:
            if p.layerwise:
                try:
                    self.prefill.push_layers(p.request_id, (idx,))
                except ValueError as exc:  # the push failed meanwhile (reported by poll)
                    log.debug("kvbridge: layer %s of %s not pushed: %s", layer_name, p.request_id, exc)

    def finish_saves(self, orders: PushOrders) -> None:
        """After the forward pass: write what this step's pushes have not written yet."""
        if orders.pushes:
            self._begin(orders)
        pushes, self._step_pushes = self._step_pushes, []
        pre = self.prefill
        for p in pushes:
            try:
                if p.layerwise:
                    pre.push_finish(p.request_id)
                else:
                    pre.push(p.request_id, p.block_ids, p.target)
            except ValueError as exc:
                log.error("kvbridge: cannot push request %s: %s", p.request_id, exc)
                self._push_released.add(p.request_id)
