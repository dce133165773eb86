"""The worker side of the connector: one TP rank's transfer engines and their reports.

vLLM runs one worker-side connector per rank. Its :class:`WorkerSide` owns the
rank's :class:`kvbridge.nixl.PrefillEngine` (``kv_producer``) and/or
:class:`kvbridge.nixl.DecodeEngine` (``kv_consumer``), carries out each step's
:class:`~kvbridge.vllm.steps.StepOrders` and reports, between steps, which
requests finished sending or receiving, which receives failed and which local
blocks must be recomputed.

Plain values in and out: this module imports nothing from vLLM (the facade,
:mod:`kvbridge.vllm.connector`, translates), so it runs in tests with real
torch tensors and real NIXL engines.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

from kvbridge.handshake import encode_metadata
from kvbridge.memory import CacheRegions
from kvbridge.nixl import DecodeEngine, EngineConfig, PrefillEngine, Stats
from kvbridge.topology import EngineSpec
from kvbridge.vllm.config import EngineRoles
from kvbridge.vllm.pushing import PushOrder, PushOrders
from kvbridge.vllm.stats import empty_stats, is_empty, stats_delta
from kvbridge.vllm.steps import StepOrders

__all__ = ["TransferResults", "WorkerSide", "per_group"]

#: block ids as the engine takes them: flat (one KV-cache group) or one tuple per group
BlockIds = tuple[int, ...] | tuple[tuple[int, ...], ...]


def per_group(blocks: BlockIds | list) -> tuple[tuple[int, ...], ...]:
    """Block ids as one tuple per KV-cache group (a flat list is one group)."""
    blocks = tuple(blocks)
    if blocks and all(isinstance(b, (tuple, list)) for b in blocks):
        return tuple(tuple(int(x) for x in g) for g in blocks)
    return (tuple(int(x) for x in blocks),)

log = logging.getLogger("kvbridge.vllm")


@dataclass(frozen=True)
class TransferResults:
    """What one rank reports between two steps."""

    #: prefill requests whose held blocks vLLM may free now (read, lapsed, or not holdable)
    finished_sending: frozenset[str] = frozenset()
    #: decode requests whose load ended, successfully or not
    finished_recving: frozenset[str] = frozenset()
    #: the subset of ``finished_recving`` whose load failed
    failed_recving: frozenset[str] = frozenset()


class WorkerSide:
    """One TP rank's half of the connector (see the module docstring).

    ``single_group``: vLLM maps failed block ids back to requests only for models
    with one KV-cache group (vLLM 0.32 raises for a flat set of invalid block ids on
    a hybrid model, as block ids are unique per group only); for others the failure
    travels in ``failed_recving``, which makes vLLM recompute (or fail) the whole
    request in every group, and the failed loads' local block ids per group are
    kept for :meth:`take_invalid_groups`.
    """

    def __init__(self, rank: int, roles: EngineRoles, *, single_group: bool = True) -> None:
        self.rank = rank
        self.roles = roles
        self.prefill: PrefillEngine | None = None
        self.decode: DecodeEngine | None = None
        self._single_group = single_group
        self._held: dict[str, float] = {}  # held prefill request -> when the hold began
        self._free_now: set[str] = set()  # holds that failed: report them sent so vLLM frees them
        self._failed_now: dict[str, BlockIds] = {}  # loads refused before starting
        self._invalid: set[int] = set()
        self._loading: dict[str, BlockIds] = {}  # started loads: local block ids (per group)
        self._invalid_groups: dict[str, tuple[tuple[int, ...], ...]] = {}
        self._stats_base: dict[str, Stats] = {}
        # push mode
        self._layer_index: dict[str, int] = {}
        self._step_pushes: list[PushOrder] = []  # this step's writes (saved in the forward pass)
        self._push_sent: set[str] = set()  # finished in the scheduler: report once released
        self._push_released: set[str] = set()  # released before the scheduler said finished
        self._begun: PushOrders | None = None  # the step whose pushes are open
        self._unknown_layers: set[str] = set()

    # ----- registration ----------------------------------------------------
    def register(self, spec: EngineSpec, regions: CacheRegions, config: EngineConfig, *,
                 incarnation: str, address: tuple[str, int], layer_names: tuple[str, ...] = ()) -> None:
        """Register this rank's cache with its engines. ``address`` is the side channel
        the scheduler serves this engine's metadata on; ``layer_names`` are vLLM's names of
        the cache's layers in model order (push mode writes layers by name)."""
        self._layer_index = {n: i for i, n in enumerate(layer_names)}
        if self.roles.producer:
            self.prefill = PrefillEngine(spec, self.rank, regions, config, incarnation=incarnation)
            self.prefill.advertise(*address)
        if self.roles.consumer:
            self.decode = DecodeEngine(spec, self.rank, regions, config, incarnation=incarnation)
        log.info("kvbridge: rank %d registered %d layers (%s %s, %d blocks of %d tokens, %s)",
                 self.rank, spec.num_layers, spec.layout.value, spec.head_order.value,
                 regions.num_blocks, spec.block_size, regions.mem_type)

    def handshake(self) -> tuple[str, bytes] | None:
        """(compatibility hash, encoded metadata) of this rank for the scheduler to serve:
        the engine peers handshake with (pull: the prefill engine, which decode engines
        read; push: the decode engine, which prefill engines write into). None when this
        rank has no such engine."""
        eng = self.prefill
        if self.decode is not None and self.decode.config.mode == "push":
            eng = self.decode
        if eng is None:
            return None
        return eng.compat_hash, encode_metadata(eng.metadata())

    def compat_info(self) -> dict[str, str]:
        """The fields of :meth:`handshake`'s compatibility hash, served beside it so that a
        refused peer is told which differ (empty when this rank has no such engine)."""
        eng = self.prefill
        if self.decode is not None and self.decode.config.mode == "push":
            eng = self.decode
        return {} if eng is None else dict(eng.compat_info)

    # ----- per step --------------------------------------------------------
    def start(self, orders: StepOrders) -> None:
        """Carry out one step's orders; never waits for a peer."""
        if orders.empty:
            return
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
                self._failed_now[ld.request_id] = ld.local_block_ids
                continue
            try:
                dec.load(ld.request_id, ld.source.transfer, ld.local_block_ids, ld.computed_tokens)
                self._loading[ld.request_id] = ld.local_block_ids
            except ValueError as exc:
                log.error("kvbridge: cannot load request %s: %s", ld.request_id, exc)
                self._failed_now[ld.request_id] = ld.local_block_ids
        if not orders.push.empty:
            self._start_push(orders.push)
        if dec is not None:
            for verb, call, sources in (("release", dec.release, orders.releases),
                                        ("renew", dec.renew, orders.renewals)):
                for rp in sources:
                    try:
                        call(rp.transfer)
                    except ValueError as exc:
                        log.warning("kvbridge: cannot %s request %s at %s: %s", verb,
                                    rp.transfer.request_id, rp.transfer.engine_id, exc)

    def begin_saves(self, orders: PushOrders) -> None:
        """Open this step's pushes (once per step: vLLM 0.32 binds a step's metadata before
        the forward pass but calls ``start_load_kv`` after it, so the first
        ``save_kv_layer`` opens them)."""
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

    def _start_push(self, orders: PushOrders) -> None:
        self.begin_saves(orders)
        pre, dec = self.prefill, self.decode
        for rid in orders.sent:
            if rid in self._push_released or pre is None:
                self._push_released.discard(rid)
                self._free_now.add(rid)
            else:
                self._push_sent.add(rid)
        for e in orders.expects:
            if dec is None:
                self._failed_now[e.request_id] = e.local_block_ids
                continue
            try:
                dec.expect(e.request_id, e.prefill_engine_id, e.prefill_tp, e.token, e.local_block_ids,
                           prefill_block_size=e.prefill_block_size,
                           prefill_head_order=e.prefill_head_order,
                           prefill_kernel_blocks_per_block=e.prefill_kernel_blocks_per_block)
                self._loading[e.request_id] = e.local_block_ids
            except ValueError as exc:
                log.error("kvbridge: cannot expect request %s: %s", e.request_id, exc)
                self._failed_now[e.request_id] = e.local_block_ids
        for rid, blocks in orders.failed:
            self._failed_now[rid] = blocks

    def save_layer(self, layer_name: str, orders: PushOrders | None = None) -> None:
        """Inside the forward pass, once vLLM wrote ``layer_name`` of this step: layered
        pushes write that layer now (``orders``: the step's push orders, opened here
        the first time)."""
        if orders is not None and orders.pushes:
            self.begin_saves(orders)
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

    def finish_saves(self, orders: PushOrders | None = None) -> None:
        """After the forward pass: write what this step's pushes have not written yet."""
        if orders is not None and orders.pushes:
            self.begin_saves(orders)
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

    def results(self) -> TransferResults:
        """Requests whose transfer ended on this rank since the last call; a failed
        receive is also a finished one, and its local blocks go to
        :meth:`take_invalid_blocks`."""
        sending, recving, failed = set(self._free_now), set(self._failed_now), set(self._failed_now)
        for rid, blocks in self._failed_now.items():
            self._mark_invalid(rid, blocks)
        self._free_now.clear()
        self._failed_now.clear()
        if self.prefill is not None:
            for r in self.prefill.poll():
                if r.request_id in self._held:
                    began = self._held.pop(r.request_id)
                    log.debug("kvbridge: rank %d released request %s after %.1f ms held (%s)",
                              self.rank, r.request_id, (time.monotonic() - began) * 1e3, r.reason)
                    sending.add(r.request_id)
                elif r.request_id in self._push_sent:
                    self._push_sent.discard(r.request_id)
                    sending.add(r.request_id)
                elif r.reason in ("written", "push-failed"):
                    self._push_released.add(r.request_id)
        if self.decode is not None:
            ev = self.decode.poll()
            recving.update(ev.done)
            for rid in ev.done:
                self._loading.pop(rid, None)
            for f in ev.failed:
                local = self._loading.pop(f.request_id, None)
                log.warning("kvbridge: request %s failed (%s): %s; its %d local blocks must be "
                            "recomputed", f.request_id, f.kind.value, f.message, len(f.invalid_block_ids))
                recving.add(f.request_id)
                failed.add(f.request_id)
                self._mark_invalid(f.request_id, local if local is not None else f.invalid_block_ids)
        return TransferResults(frozenset(sending), frozenset(recving), frozenset(failed))

    def _mark_invalid(self, request_id: str, blocks: BlockIds) -> None:
        """Record a failed load's local blocks (flat, or per KV-cache group)."""
        groups = per_group(blocks)
        if self._single_group:
            for g in groups:
                self._invalid.update(g)
        else:
            self._invalid_groups[request_id] = groups
            log.warning("kvbridge: request %s: invalid local blocks per KV-cache group %s; vLLM "
                        "recomputes (or fails) the request in every group", request_id,
                        [list(g) for g in groups])

    def take_invalid_blocks(self) -> set[int]:
        """Local block ids of failed loads reported since the last call (empty for models
        with several KV-cache groups, see the class docstring)."""
        out, self._invalid = self._invalid, set()
        return out if self._single_group else set()

    def take_invalid_groups(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Models with several KV-cache groups: each failed load's local block ids per group
        (every group's blocks of the request) since the last call."""
        out, self._invalid_groups = self._invalid_groups, {}
        return out

    def take_stats(self) -> dict[str, Any] | None:
        """The interval's :mod:`kvbridge.vllm.stats` data since the last call, or None
        when nothing happened."""
        st = empty_stats()
        for name, eng in (("prefill", self.prefill), ("decode", self.decode)):
            if eng is None:
                continue
            now = copy.deepcopy(eng.stats)
            before = self._stats_base.get(name, Stats())
            self._stats_base[name] = now
            for k, v in stats_delta(now, before).items():
                st[k] += v
            hs = now.handshakes - before.handshakes
            if hs > 0:
                avg = (now.handshake_ms - before.handshake_ms) / hs / 1e3
                st["handshake_duration"].extend([avg] * hs)
            for rec in eng.take_records():
                st["transfer_duration"].append(rec.xfer_us / 1e6)
                st["post_duration"].append(rec.post_us / 1e6)
                st["bytes_transferred"].append(rec.bytes)
                st["num_descriptors"].append(rec.descriptors)
        return None if is_empty(st) else st

    def close(self) -> None:
        for eng in (self.decode, self.prefill):
            if eng is not None:
                eng.close()
        self.decode = self.prefill = None
