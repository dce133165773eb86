"""Pull mode, worker half: holds (prefill), loads, releases and lease renewals (decode)."""

from __future__ import annotations

import logging
import time

from kvbridge.nixl import DecodeEngine, PrefillEngine, timeline_mark
from kvbridge.topology import Released, TransferParams
from kvbridge.vllm.modes import Orders
from kvbridge.vllm.params import RemotePrefill
from kvbridge.vllm.pull.orders import PullOrders
from kvbridge.vllm.rank_engines import RankEngines

__all__ = ["PullWorker", "transfer_params"]

log = logging.getLogger("kvbridge.vllm")


def transfer_params(rp: RemotePrefill) -> TransferParams:
    """The transfer engine's record of a decode request's source (block ids per group)."""
    return TransferParams(engine_id=rp.engine_id, host=rp.host, port=rp.port, tp_size=rp.tp_size,
                          block_ids=rp.block_ids, token=rp.token, incarnation=rp.incarnation,
                          request_id=rp.request_id)


class PullWorker(RankEngines):
    """One TP rank in pull mode: the prefill engine holds finished requests' blocks under
    a lease, the decode engine reads them (see :class:`RankEngines`)."""

    def __init__(self, rank, roles, *, single_group: bool = True) -> None:
        super().__init__(rank, roles, single_group=single_group)
        self._held: dict[str, float] = {}  # held prefill request -> when the hold began

    def _served_engine(self) -> PrefillEngine | DecodeEngine | None:
        return self.prefill

    def _sent(self, released: Released) -> bool:
        began = self._held.pop(released.request_id, None)
        if began is None:
            return False
        log.debug("kvbridge: rank %d released request %s after %.1f ms held (%s)", self.rank,
                  released.request_id, (time.monotonic() - began) * 1e3, released.reason)
        return True

    def _drop_holds(self) -> set[str]:
        held = set(self._held)
        self._held.clear()
        return held

    def start(self, orders: PullOrders) -> None:
        """Carry out one step's orders; never waits for a peer. While asleep (sleep mode)
        holds are freed at once and loads fail (their blocks are recomputed)."""
        if orders.empty:
            return
        if self.asleep:
            log.warning("kvbridge: rank %d is asleep (vLLM sleep mode freed its KV cache): "
                        "%d hold(s) freed, %d load(s) failed", self.rank, len(orders.holds),
                        len(orders.loads))
        for h in orders.holds:
            if self.prefill is None:
                self._free_now.add(h.request_id)
                continue
            try:
                self.prefill.hold(h.request_id, h.block_ids, h.token)
                self._held[h.request_id] = time.monotonic()
            except ValueError as exc:
                log.error("kvbridge: cannot hold request %s (%s); freeing its blocks", h.request_id, exc)
                self._free_now.add(h.request_id)
        dec = self.decode
        for ld in orders.loads:
            if dec is None:
                self._load_failed(ld.request_id, ld.local_block_ids)
                continue
            timeline_mark("load_start", ld.request_id)
            try:
                dec.load(ld.request_id, transfer_params(ld.source), ld.local_block_ids,
                         ld.computed_tokens)
                self._load_started(ld.request_id, ld.local_block_ids)
            except ValueError as exc:
                log.error("kvbridge: cannot load request %s: %s", ld.request_id, exc)
                self._load_failed(ld.request_id, ld.local_block_ids)
        if dec is not None:
            for verb, call, sources in (("release", dec.release, orders.releases),
                                        ("renew", dec.renew, orders.renewals)):
                for rp in sources:
                    try:
                        call(transfer_params(rp))
                    except ValueError as exc:
                        log.warning("kvbridge: cannot %s request %s at %s: %s", verb,
                                    rp.request_id, rp.engine_id, exc)

    def save_layer(self, layer_name: str, orders: Orders) -> None:
        """Nothing: the decode side reads the blocks where they are."""

    def finish_saves(self, orders: Orders) -> None:
        """Nothing: the blocks are held in place."""
