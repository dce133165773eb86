"""``KVBridgeConnector``: kvbridge as an out-of-tree vLLM KV connector (the facade).

Load it with::

    kv_transfer_config={"kv_connector": "KVBridgeConnector",
                        "kv_connector_module_path": "kvbridge.vllm",
                        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                        "kv_connector_extra_config": {...}}   # see kvbridge.vllm.config

vLLM builds one connector per process and role: a scheduler-side instance in
the engine core and a worker-side instance in each TP worker. This class only
translates: it reads vLLM's objects (requests, block lists, configuration)
into plain values and hands them to the halves of its transfer mode, chosen once
at construction (:mod:`kvbridge.vllm.halves`): a
:class:`~kvbridge.vllm.modes.SchedulerMode` with its
:class:`~kvbridge.vllm.side_channel.SideChannel`, or a
:class:`~kvbridge.vllm.rank_engines.RankEngines`; they import nothing from vLLM.
Version differences live in :mod:`kvbridge.vllm.shims`, the cache description
in :mod:`kvbridge.vllm.registration`, the metrics in :mod:`kvbridge.vllm.metrics`.

This module imports vLLM.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvbridge.nixl import TIMELINE_LOGGER, timeline_mark
from kvbridge.vllm import shims
from kvbridge.vllm.cachespec import CacheShapeError
from kvbridge.vllm.config import (
    ConfigError,
    ConnectorConfig,
    check_engine_support,
    parse_connector_config,
)
from kvbridge.vllm.halves import MODES, scheduler_half, worker_half
from kvbridge.vllm.kv_cache_groups import GroupFacts, attention_block_size, group_facts
from kvbridge.vllm.metrics import KVBridgePromMetrics, KVBridgeStats
from kvbridge.vllm.modes import Orders, SchedulerMode, TransferResults
from kvbridge.vllm.pull.orders import PullOrders
from kvbridge.vllm.rank_engines import RankEngines
from kvbridge.vllm.registration import register_caches
from kvbridge.vllm.side_channel import SideChannel
from kvbridge.vllm.stats import WithoutParams

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVBridgeConnector", "KVBridgeConnectorMetadata", "KVBridgeHandshake"]

log = logging.getLogger("kvbridge.vllm")


# --------------------------------------------------------------------------- wire values


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):
    """One worker's handshake payload, collected by vLLM and served by the scheduler."""

    rank: int
    compat_hash: str
    metadata: bytes  # kvbridge.handshake.encode_metadata(AgentMetadata)
    #: the hash's fields, so that a refused decode engine is told which differ
    compat_info: dict[str, str] = field(default_factory=dict)


@dataclass
class KVBridgeConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells every worker for one step: its mode's orders, and whether
    the step runs nothing (then a push-mode decode worker may wait, see ``idle_wait_us``)."""

    orders: Orders = field(default_factory=PullOrders)
    idle: bool = False


# --------------------------------------------------------------------------- helpers


def _incarnation(vllm_config: VllmConfig, engine_id: str) -> str:
    """One value per start of this engine, equal on every rank (derived from the config,
    which vLLM creates once and ships to every process)."""
    seed = f"{engine_id}|{getattr(vllm_config, 'instance_id', '')}|{shims.dp_index(vllm_config)}"
    return hashlib.sha256(seed.encode()).hexdigest()[:32]


def _route_logs() -> None:
    """Send kvbridge's log records where vLLM's go (vLLM configures only its own loggers).
    The timeline (:mod:`kvbridge.nixl.timeline`) logs only with ``KVBRIDGE_TIMELINE=1``."""
    logging.getLogger(TIMELINE_LOGGER).setLevel(
        logging.INFO if os.environ.get("KVBRIDGE_TIMELINE") == "1" else logging.WARNING)
    ours, theirs = logging.getLogger("kvbridge"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


# --------------------------------------------------------------------------- the connector


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbridge's vLLM KV connector (see the module docstring).

    Each method's docstring says who calls it, when, on which side (scheduler:
    the engine core process; worker: each TP worker process) and what it returns.
    """

    if shims.CacheHitSource is not None:
        _cache_hit_source = shims.CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        """vLLM builds one instance per process: ``role`` SCHEDULER in the engine core,
        WORKER in each TP worker, once the KV-cache configuration is known.

        Refuses, with a :class:`~kvbridge.vllm.config.ConfigError` naming the setting,
        configurations it cannot serve: unknown extra-config keys or bad values, a
        bad ``kv_role``, pipeline or context parallelism, KV-cache groups of a kind
        kvbridge does not move, push mode for hybrid models.
        """
        super().__init__(vllm_config, role, kv_cache_config)
        _route_logs()
        ktc = vllm_config.kv_transfer_config
        self.config: ConnectorConfig = parse_connector_config(ktc.kv_connector_extra_config)
        self.roles = check_engine_support(
            self.config, kv_role=ktc.kv_role, kv_cache_groups=shims.transfer_groups(kv_cache_config),
            **shims.parallel_sizes(vllm_config))
        try:
            self.groups: tuple[GroupFacts, ...] = (group_facts(kv_cache_config)
                                                   if kv_cache_config is not None else ())
            #: tokens per attention block (a hybrid model's may exceed cache_config.block_size)
            self.block_size = attention_block_size(self.groups, vllm_config.cache_config.block_size)
        except CacheShapeError as exc:
            raise ConfigError(str(exc)) from None
        hybrid = len(self.groups) > 1
        self.has_mamba = any(g.kind.value == "mamba" for g in self.groups)
        self.engine_id: str = ktc.engine_id
        self.incarnation = _incarnation(vllm_config, self.engine_id)
        self.port = self.config.port_for(shims.dp_index(vllm_config))
        self._sched: SchedulerMode | None = None
        self._side: SideChannel | None = None
        self._worker: RankEngines | None = None
        #: requests this engine (a consumer) got without transfer parameters (scheduler side)
        self._without_params = WithoutParams(self.roles.consumer)
        #: the mode's orders of a step with nothing to do (before any metadata is bound)
        self._no_orders = MODES[self.config.mode].no_orders
        if role == KVConnectorRole.SCHEDULER:
            self._sched, self._side = scheduler_half(
                engine_id=self.engine_id, block_size=self.block_size,
                tp_size=vllm_config.parallel_config.tensor_parallel_size, config=self.config,
                port=self.port, roles=self.roles,
                group_kinds=tuple(g.kind.value for g in self.groups) if hybrid else (),
                equal_tp_only=self._equal_tp_only(), drop_last_token=self.has_mamba)
        else:
            self._worker = worker_half(shims.tp_rank(), self.roles, self.config,
                                       single_group=shims.transfer_groups(kv_cache_config) <= 1)

    def _equal_tp_only(self) -> str | None:
        """Why this engine's Mamba state can only be read between equal TP sizes, or None."""
        types = {g.mamba_type for g in self.groups if g.kind.value == "mamba"}
        if "GDN_ATTN" in types:
            return ("gated delta-net state is moved whole, which needs equal TP sizes on both "
                    "engines; run both with the same tensor_parallel_size")
        if types and not shims.conv_state_dim_first():
            return ("the Mamba conv state is stored token-first (SD); splitting it between TP "
                    "sizes needs VLLM_SSM_CONV_STATE_LAYOUT=DS in both engines' environment")
        return None

    # ----- class-level hooks ---------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Called by vLLM (both sides) before the cache is allocated: the layout to
        allocate. Heads must be contiguous per block to split them between TP sizes
        (``LBHNC``/``HND``); None for MLA (one head)."""
        mc = vllm_config.model_config
        return shims.required_kvcache_layout(mc is not None and bool(mc.use_mla))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Called by vLLM >= 0.33 when the engine is configured with ``enable_sleep_mode``
        (vLLM refuses the configuration on False). Pull mode: yes, the workers drop and
        restore their NIXL registrations (:meth:`unregister_kv_caches`,
        :meth:`restore_kv_caches`). Push mode: no, prefill engines hold the decode
        engine's cache registration and would write into freed memory."""
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
        return parse_connector_config(extra).mode == "pull"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """Called by vLLM in the engine core to rebuild the stats a worker shipped as
        their ``data`` dict: a :class:`KVBridgeStats`."""
        return KVBridgeStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics:
        """Called once by vLLM's metrics logger (front end): the ``vllm:kvbridge_*``
        Prometheus metrics."""
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_finished_count(self) -> int | None:
        """Called by vLLM's output aggregator: None, every worker reports each request
        it took part in."""
        return None

    # ----- scheduler side --------------------------------------------------
    def _s(self) -> SchedulerMode:
        if self._sched is None:
            raise RuntimeError("scheduler-side method called on a worker-side KVBridgeConnector")
        return self._sched

    def on_new_request(self, request: Request) -> None:
        """Scheduler, when a request is added. On a consumer engine, a request without
        transfer parameters is counted (it computes its prompt here: see
        :class:`~kvbridge.vllm.stats.WithoutParams`). A decode request with kvbridge parameters
        is parsed now, and its handshake and lease renewals start with the next step. On
        a Mamba hybrid a prefill request drops its last prompt token: the state moved is
        the one before it, and the decode engine computes that token itself (a recurrent
        state cannot take the same token twice)."""
        self._without_params.arrived(request.request_id, request.kv_transfer_params)
        if self._s().on_new_request(request.request_id, request.kv_transfer_params,
                                    request.num_prompt_tokens):
            shims.drop_last_prompt_token(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Scheduler, each time it considers scheduling a waiting request. Returns
        (prompt tokens to load beyond ``num_computed_tokens``, load asynchronously?):
        every prompt token the prefill engine computed for a decode request with
        usable parameters, (0, False) otherwise. Push mode: a decode request loads its
        prompt asynchronously; a prefill request answers None ("ask again") until its
        decode engine's offer arrived."""
        return self._s().matched_tokens(request.request_id, request.kv_transfer_params,
                                        request.num_prompt_tokens, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Scheduler, after allocating a request's blocks (possibly twice per request).
        Orders the load into the new blocks once, or the release of the prefill
        blocks when nothing is to be loaded."""
        self._s().after_alloc(request.request_id, request.kv_transfer_params,
                              request.num_prompt_tokens,
                              shims.VllmAllocation(blocks, self._kv_cache_config), num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Scheduler, after a positive match: the KV-cache groups a load restores (all
        transfer groups)."""
        return shims.transfer_group_ids(self._kv_cache_config)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Scheduler, once per step after scheduling: this step's orders for every
        worker (loads, holds, releases, renewals; pushes and expectations); resets them."""
        orders = self._s().take_orders(shims.step_progress(scheduler_output))
        for ld in getattr(orders, "loads", ()):  # pull: this step orders these loads
            timeline_mark("load_ordered", ld.request_id)
        return KVBridgeConnectorMetadata(orders, idle=shims.step_is_idle(scheduler_output))

    def has_pending_push_work(self) -> bool:
        """Scheduler, each loop: keep stepping while push offers, writes or releases are
        pending (push mode)."""
        return self._sched is not None and self._sched.pending

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler, with the workers' merged results of a step: forgets the requests
        whose transfer finished."""
        done = set(getattr(connector_output, "finished_recving", None) or ())
        for rid in done:
            timeline_mark("load_seen", rid)
        done |= set(getattr(connector_output, "finished_sending", None) or ())
        if done:
            self._s().forget(list(done))

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, exactly once per finished request, before its blocks are freed
        (single-group vLLM). Returns (keep the blocks until a worker reports the request
        sent?, ``kv_transfer_params`` for the output): (True, decode parameters) for a
        completed prefill request to be decoded elsewhere."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """As :meth:`request_finished`, with one block list per KV-cache group. A push-mode
        prefill request keeps its blocks until its workers report the push released."""
        return self._s().finished(
            request.request_id, request.kv_transfer_params,
            completed=shims.request_completed(request),
            block_ids=shims.select_groups(self._kv_cache_config, block_ids),
            num_computed_tokens=request.num_computed_tokens,
            num_prompt_tokens=request.num_prompt_tokens)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Scheduler, once after the workers registered (and again after a sleep-mode
        wake-up), with each rank's :meth:`get_handshake_metadata`: serves them on the
        side channel."""
        payloads = {}
        for rank, m in metadata.items():
            if not isinstance(m, KVBridgeHandshake):
                raise ValueError(f"rank {rank} published {type(m).__name__}, not KVBridgeHandshake: "
                                 "every worker must run KVBridgeConnector")
            payloads[rank] = (m.compat_hash, m.metadata, m.compat_info)
        if self._side is None:
            raise RuntimeError("scheduler-side method called on a worker-side KVBridgeConnector")
        served = self._side.serve(payloads)
        if served is not None:
            self._s().set_served(*served)

    # ----- worker side -----------------------------------------------------
    def _w(self) -> RankEngines:
        if self._worker is None:
            raise RuntimeError("worker-side method called on a scheduler-side KVBridgeConnector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once after the KV cache is allocated (one tensor per attention
        layer): describes it and registers it with this rank's NIXL engines."""
        try:
            reg = register_caches(self._vllm_config, self._kv_cache_config, kv_caches, self.config,
                                  engine_id=self.engine_id,
                                  attention_backend=shims.attention_backend_name(self._vllm_config),
                                  conv_dim_first=self.has_mamba and shims.conv_state_dim_first())
        except CacheShapeError as exc:
            raise ConfigError(f"KVBridgeConnector cannot register this KV cache: {exc}") from None
        if self.has_mamba and reg.spec.mamba is not None:
            log.info("kvbridge: Mamba hybrid, conv state %s%s", reg.spec.mamba.conv_layout.value,
                     "" if shims.conv_state_dim_first() else
                     " (SD): transfers between equal TP sizes only; set "
                     "VLLM_SSM_CONV_STATE_LAYOUT=DS on both engines for heterogeneous TP")
        self._w().register(reg.spec, reg.regions, reg.engine_config, incarnation=self.incarnation,
                           address=(self.config.side_channel_host, self.port),
                           layer_names=reg.layer_names)

    def unregister_kv_caches(self) -> None:
        """Worker, vLLM >= 0.33 sleep mode, before the cache memory is freed (vLLM paused
        the engine first): deregisters the cache from NIXL and closes this rank's
        engines; held prefill requests are reported sent, started loads failed, and
        orders refused until :meth:`restore_kv_caches`. Idempotent."""
        self._w().suspend()

    def restore_kv_caches(self) -> None:
        """Worker, vLLM >= 0.33 sleep mode, after the cache memory is back at its
        addresses: registers it again under a new incarnation; vLLM then collects
        :meth:`get_handshake_metadata` again for the scheduler to serve, and peers
        handshake anew. Idempotent."""
        self._w().resume()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker, after :meth:`register_kv_caches` and :meth:`restore_kv_caches`: this
        rank's metadata for the scheduler to serve (prefill ranks), None on decode-only
        ranks."""
        hs = self._w().handshake()
        if hs is None:
            return None
        return KVBridgeHandshake(self._w().rank, *hs, compat_info=self._w().compat_info())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Worker, every step with this step's metadata bound (vLLM 0.32: after the
        forward pass unless the step loads synchronously): carries out the orders
        (holds, loads, releases, renewals, push expectations) without waiting."""
        self._w().start(self._orders())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, inside each attention layer: nothing to wait for (loads finish
        between steps, reported by :meth:`get_finished`)."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Worker, inside each attention layer once vLLM wrote its KV for this step: push
        mode (layer by layer) writes the layer into the decode engines now, on the
        engine's worker thread, so the copy overlaps the rest of the forward pass. Pull
        mode: nothing (the decode side reads the blocks)."""
        if self._worker is not None:
            self._worker.save_layer(layer_name, self._orders())

    def wait_for_save(self) -> None:
        """Worker, every step after the forward pass: push mode writes what the layers did
        not (the whole request when not layer by layer) and returns at once; the request's
        blocks stay allocated until the workers report the push released. Pull mode:
        nothing (blocks are held in place)."""
        if self._worker is not None:
            self._worker.finish_saves(self._orders())

    def _orders(self) -> Orders:
        """This step's orders, as bound by vLLM (none before the first step)."""
        meta = self._connector_metadata
        return meta.orders if isinstance(meta, KVBridgeConnectorMetadata) else self._no_orders

    def _results(self) -> TransferResults:
        """This step's results; in a step that runs nothing, a push-mode decode rank waits
        up to ``idle_wait_us`` for a request to land (vLLM steps again at once otherwise,
        spinning a core; see ``RankEngines.results``)."""
        meta = self._connector_metadata
        idle = isinstance(meta, KVBridgeConnectorMetadata) and meta.idle
        return self._w().results(self.config.idle_wait_us / 1e6 if idle else 0.0)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, every step (older vLLM): (finished sending, finished receiving) on this
        rank since the last call, None for an empty set."""
        r = self._results()
        return set(r.finished_sending) or None, set(r.finished_recving) or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Worker, every step (vLLM >= 0.11): finished sends and receives on this rank since
        the last call, and the failed receives (also in the finished ones)."""
        r = self._results()
        return shims.KVConnectorTransferResults(
            finished_sending=set(r.finished_sending), finished_recving=set(r.finished_recving),
            failed_recving=set(r.failed_recving))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, every step after the results: local blocks of failed loads, which vLLM
        recomputes or fails (``kv_load_failure_policy``)."""
        return self._w().take_invalid_blocks()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Worker, every step: this rank's transfer stats since the last call (None when
        nothing happened). Scheduler, every step (vLLM merges both): the requests a consumer
        engine got without transfer parameters since the last call."""
        if self._worker is None:  # scheduler side: requests that came without parameters
            counted = self._without_params.take()
            return None if counted is None else KVBridgeStats(data=counted)
        data = self._worker.take_stats()
        return None if data is None else KVBridgeStats(data=data)

    def shutdown(self) -> None:
        """Both sides, when the process shuts down: closes the engines and the side channel."""
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()
        if self._side is not None:
            self._side.close()
