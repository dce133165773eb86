"""``KVBridgeConnector``: kvbridge as an out-of-tree vLLM KV connector.

Load it with::

    kv_transfer_config={"kv_connector": "KVBridgeConnector",
                        "kv_connector_module_path": "kvbridge.vllm",
                        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                        "kv_connector_extra_config": {...}}   # see kvbridge.vllm.config

vLLM builds one connector per process and role. The scheduler-side instance
(engine core) keeps the bookkeeping of :class:`kvbridge.vllm.steps.SchedulerState`,
serves every rank's handshake metadata on the side channel, and hands each
step's orders to the workers. Each worker-side instance (one per TP rank)
describes its KV cache (:mod:`kvbridge.vllm.cachespec`), registers it with a
:class:`kvbridge.nixl.PrefillEngine` and/or :class:`kvbridge.nixl.DecodeEngine`,
carries out the orders, and reports finished and failed transfers.

This module imports vLLM; the rest of ``kvbridge.vllm`` does not.
"""

from __future__ import annotations

import copy
import hashlib
import logging
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
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbridge.handshake import MetadataServer, check_metadata, decode_metadata, encode_metadata
from kvbridge.memory import regions_from_kv_caches
from kvbridge.nixl import (
    AgentConfig,
    DecodeEngine,
    EngineConfig,
    PrefillEngine,
    Stats,
    TransferParams,
)
from kvbridge.vllm.aggregate import merge_stats
from kvbridge.vllm.cachespec import (
    LayerTensor,
    ModelFacts,
    dtype_name,
    engine_spec_for,
    layer_sort_key,
    model_identity,
)
from kvbridge.vllm.config import ConnectorConfig, parse_connector_config
from kvbridge.vllm.params import RemotePrefill
from kvbridge.vllm.steps import SchedulerState, StepOrders

try:  # vLLM >= 0.11
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVBridgeConnector", "KVBridgeConnectorMetadata", "KVBridgeHandshake", "KVBridgeStats"]

try:  # vLLM >= 0.11 labels where external cache hits come from
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]

log = logging.getLogger("kvbridge.vllm")


# --------------------------------------------------------------------------- wire values


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):
    """One worker's handshake payload, collected by vLLM and served by the scheduler."""

    rank: int
    compat_hash: str
    metadata: bytes  # kvbridge.handshake.encode_metadata(AgentMetadata)


@dataclass
class KVBridgeConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells every worker for one step."""

    orders: StepOrders = field(default_factory=StepOrders)


#: list-valued stats keys: one observation per transfer (or handshake)
_OBSERVATIONS = ("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors",
                 "handshake_duration")
#: int-valued stats keys: counts over the interval
_COUNTS = ("requests_done", "requests_failed", "failed_handshakes", "failed_transfers",
           "failed_posts", "failed_timeouts", "expired_leases", "released_requests",
           "ignored_notifications", "renewed_leases")


@dataclass
class KVBridgeStats(KVConnectorStats):
    """Transfer statistics of one interval, mergeable across workers (vLLM aggregates them)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: [] for k in _OBSERVATIONS} | dict.fromkeys(_COUNTS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is not None and other.data:
            self.data = merge_stats(self.data, other.data) or {}
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _OBSERVATIONS + _COUNTS)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        n = len(d.get("transfer_duration", []))
        secs = sum(d.get("transfer_duration", []))
        nbytes = sum(d.get("bytes_transferred", []))
        hs = d.get("handshake_duration", [])
        out: dict[str, int | float] = {
            "Transfers": n,
            "Avg xfer time (ms)": round(secs / n * 1e3, 3) if n else 0,
            "Avg MB per transfer": round(nbytes / n / 2**20, 3) if n else 0,
            "Throughput (GB/s)": round(nbytes / secs / 1e9, 3) if secs else 0,
            "Handshakes": len(hs),
            "Avg handshake (ms)": round(sum(hs) / len(hs) * 1e3, 2) if hs else 0,
        }
        for k in _COUNTS:
            out[k.replace("_", " ").capitalize()] = int(d.get(k, 0))
        return out


def _stats_delta(now: Stats, before: Stats) -> dict[str, int]:
    """Counter differences of one engine between two snapshots, in KVBridgeStats keys."""
    def diff(name: str) -> int:
        return int(getattr(now, name) - getattr(before, name))

    def fails(kind: str) -> int:
        return int(now.failures.get(kind, 0) - before.failures.get(kind, 0))

    return {
        "requests_done": diff("requests_done"),
        "requests_failed": diff("requests_failed"),
        "failed_handshakes": fails("handshake"),
        "failed_transfers": fails("transfer-error"),
        "failed_posts": fails("post-exception"),
        "failed_timeouts": fails("timeout"),
        "expired_leases": diff("leases_expired"),
        "released_requests": diff("requests_released"),
        "ignored_notifications": diff("notifications_unknown") + diff("notifications_bad_token")
        + diff("notifications_malformed"),
        "renewed_leases": diff("leases_renewed"),
    }


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """Prometheus metrics ``vllm:kvbridge_*`` (per engine)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def hist(name: str, doc: str, buckets: list[float]) -> dict:
            return create_metric_per_engine(
                self._histogram_cls(name=name, documentation=doc, buckets=buckets,
                                    labelnames=labelnames), per_engine_labelvalues)

        def counter(name: str, doc: str) -> dict:
            return create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)

        secs = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
        self._hist = {
            "transfer_duration": hist("vllm:kvbridge_xfer_time_seconds",
                                      "Duration of kvbridge KV transfers (NIXL telemetry).", secs),
            "post_duration": hist("vllm:kvbridge_post_time_seconds",
                                  "Time NIXL spent posting kvbridge KV transfers.", secs),
            "bytes_transferred": hist("vllm:kvbridge_bytes_transferred",
                                      "Bytes per kvbridge KV transfer.",
                                      [float(2 ** (10 + i)) for i in range(1, 25, 2)]),
            "num_descriptors": hist("vllm:kvbridge_num_descriptors",
                                    "NIXL descriptors per kvbridge KV transfer (after merging).",
                                    [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536]),
            "handshake_duration": hist("vllm:kvbridge_handshake_seconds",
                                       "Side-channel handshake + agent load + list preparation.",
                                       secs),
        }
        self._counters = {
            "failed": counter("vllm:kvbridge_num_failed_transfers",
                              "Requests whose KV transfer failed (handshake, transfer error, "
                              "post exception or timeout)."),
            "failed_handshakes": counter("vllm:kvbridge_num_failed_handshakes",
                                         "Requests failed because the handshake failed."),
            "expired_leases": counter("vllm:kvbridge_num_expired_leases",
                                      "Prefill requests whose blocks were freed at lease expiry."),
            "ignored_notifications": counter("vllm:kvbridge_num_ignored_notifications",
                                             "Notifications ignored: unknown request, wrong "
                                             "token or malformed."),
            "requests_done": counter("vllm:kvbridge_num_requests_done",
                                     "Decode-side requests whose KV arrived (per worker)."),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for key, metric in self._hist.items():
            for v in d.get(key, ()):
                metric[engine_idx].observe(v)
        failed = sum(int(d.get(k, 0)) for k in ("failed_handshakes", "failed_transfers",
                                                 "failed_posts", "failed_timeouts"))
        if failed:
            self._counters["failed"][engine_idx].inc(failed)
        for key in ("failed_handshakes", "expired_leases", "ignored_notifications", "requests_done"):
            if d.get(key):
                self._counters[key][engine_idx].inc(int(d[key]))


# --------------------------------------------------------------------------- helpers


def _incarnation(vllm_config: VllmConfig, engine_id: str) -> str:
    """One value per start of this engine, equal on every rank (derived from the config,
    which vLLM creates once and ships to every process)."""
    seed = f"{engine_id}|{getattr(vllm_config, 'instance_id', '')}|{_dp_index(vllm_config)}"
    return hashlib.sha256(seed.encode()).hexdigest()[:32]


def _route_logs() -> None:
    """Send kvbridge's log records where vLLM's go (vLLM configures only its own loggers)."""
    ours, theirs = logging.getLogger("kvbridge"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def _dp_index(vllm_config: VllmConfig) -> int:
    pc = vllm_config.parallel_config
    return int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)


def _transfer_params(rp: RemotePrefill) -> TransferParams:
    return TransferParams(rp.engine_id, rp.host, rp.port, rp.tp_size,
                          rp.block_ids[0] if rp.block_ids else (), rp.token, rp.incarnation,
                          rp.request_id)


def _transfer_groups(kv_cache_config: KVCacheConfig | None) -> int:
    if kv_cache_config is None:
        return 1
    groups = getattr(kv_cache_config, "transfer_groups", None)
    if groups is None:
        groups = getattr(kv_cache_config, "kv_cache_groups", ())
    return len(groups)


def _select_groups(kv_cache_config: KVCacheConfig | None, block_ids: Any) -> tuple:
    """Per-group block id lists of the transfer groups (vLLM >= 0.32 may exclude some)."""
    sel = getattr(kv_cache_config, "select_transfer_block_ids", None)
    if sel is not None and block_ids:
        block_ids = sel(tuple(block_ids))
    return tuple(block_ids)


# --------------------------------------------------------------------------- the connector


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbridge's vLLM KV connector (see the module docstring)."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _route_logs()
        ktc = vllm_config.kv_transfer_config
        self.config: ConnectorConfig = parse_connector_config(ktc.kv_connector_extra_config)
        if ktc.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {ktc.kv_role!r}")
        self.producer = ktc.kv_role in ("kv_producer", "kv_both")
        self.consumer = ktc.kv_role in ("kv_consumer", "kv_both")
        if self.config.mode != "pull":
            raise ValueError(
                "KVBridgeConnector supports mode 'pull' (decode reads from prefill) with vLLM; "
                "'push' is available in kvbridge.nixl for other engines. Set "
                "kv_connector_extra_config['mode'] = 'pull'"
            )
        n_groups = _transfer_groups(kv_cache_config)
        if n_groups > 1:
            raise ValueError(
                f"this model has {n_groups} KV-cache groups (sliding-window, Mamba or mixed "
                "attention layers); KVBridgeConnector transfers models whose attention layers "
                "share one group. Use a model with uniform full attention, or vLLM's NixlConnector"
            )
        self.engine_id: str = ktc.engine_id
        self.incarnation = _incarnation(vllm_config, self.engine_id)
        self.port = self.config.port_for(_dp_index(vllm_config))
        self._sched: _Scheduler | None = None
        self._worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _Scheduler(self)
        else:
            self._worker = _Worker(self)

    # ----- class-level hooks ---------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Heads must be contiguous per block to split them between TP sizes (HND)."""
        mc = vllm_config.model_config
        if mc is not None and mc.use_mla:
            return None
        try:
            from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: F401 - vLLM >= 0.32

            return "LBHNC"
        except ImportError:  # pragma: no cover - older vLLM
            return "HND"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVBridgeStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_finished_count(self) -> int | None:
        return None  # every worker reports each request it took part in

    # ----- scheduler side --------------------------------------------------
    def _s(self) -> _Scheduler:
        if self._sched is None:
            raise RuntimeError("scheduler-side method called on a worker-side KVBridgeConnector")
        return self._sched

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._s().state.matched_tokens(
            request.request_id, request.kv_transfer_params, request.num_prompt_tokens,
            num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self._s().state.on_new_request(request.request_id, request.kv_transfer_params,
                                       request.num_prompt_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._s().after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        ids = getattr(self._kv_cache_config, "transfer_group_ids", None)
        return tuple(ids) if ids is not None else (0,)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVBridgeConnectorMetadata(self._s().state.take_orders())

    def update_connector_output(self, connector_output: Any) -> None:
        done = set(getattr(connector_output, "finished_recving", None) or ())
        done |= set(getattr(connector_output, "finished_sending", None) or ())
        if done:
            self._s().state.forget(list(done))

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._s().serve(metadata)

    # ----- worker side -----------------------------------------------------
    def _w(self) -> _Worker:
        if self._worker is None:
            raise RuntimeError("worker-side method called on a scheduler-side KVBridgeConnector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._w().handshake()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVBridgeConnectorMetadata):
            self._w().start(meta.orders)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish between steps; nothing to wait for inside a layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # pull mode: the decode side reads the blocks; nothing to save per layer

    def wait_for_save(self) -> None:
        return  # pull mode holds blocks in place (no host staging on registrable memory)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _failed = self._w().results()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        sending, recving, failed = self._w().results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().take_invalid_blocks()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        return self._worker.take_stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()


# --------------------------------------------------------------------------- scheduler process


class _Scheduler:
    """The engine core's half: bookkeeping (SchedulerState) and the side-channel server."""

    def __init__(self, conn: KVBridgeConnector) -> None:
        vc = conn._vllm_config
        self.conn = conn
        self.server: MetadataServer | None = None
        self.state = SchedulerState(
            engine_id=conn.engine_id, block_size=vc.cache_config.block_size,
            tp_size=vc.parallel_config.tensor_parallel_size,
            address=(conn.config.side_channel_host, conn.port),
            producer=conn.producer, consumer=conn.consumer,
            heartbeat_s=conn.config.heartbeat_seconds, mode=conn.config.mode,
        )

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        kvc = self.conn._kv_cache_config
        if num_external_tokens > 0:
            if hasattr(blocks, "get_unhashed_block_ids_all_groups"):
                unhashed = blocks.get_unhashed_block_ids_all_groups()
            else:  # pragma: no cover - older vLLM
                unhashed = [blocks.get_unhashed_block_ids()]
            unhashed = _select_groups(kvc, unhashed)
            first = blocks.blocks[0] if getattr(blocks, "blocks", None) else ()
            computed = sum(1 for b in first if b.block_hash is not None and not b.is_null)
        else:
            unhashed, computed = (), 0
        self.state.after_alloc(request.request_id, params, request.num_prompt_tokens, unhashed,
                               computed, num_external_tokens)

    def finished(self, request: Request, block_ids: tuple) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        completed = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                       RequestStatus.FINISHED_STOPPED)
        return self.state.finished(
            request.request_id, request.kv_transfer_params, completed=completed,
            block_ids=_select_groups(self.conn._kv_cache_config, block_ids),
            num_computed_tokens=request.num_computed_tokens,
            num_prompt_tokens=request.num_prompt_tokens)

    def serve(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Serve every rank's metadata on the side channel (prefill side, pull mode)."""
        payloads = {}
        for rank, m in metadata.items():
            if not isinstance(m, KVBridgeHandshake):
                raise ValueError(f"rank {rank} published {type(m).__name__}, not KVBridgeHandshake: "
                                 "every worker must run KVBridgeConnector")
            payloads[rank] = m
        if not payloads:
            return
        hashes = {p.compat_hash for p in payloads.values()}
        if len(hashes) != 1:
            raise ValueError(f"the ranks of engine {self.conn.engine_id!r} disagree on the "
                             f"compatibility hash ({sorted(hashes)}); they must run the same model")
        mds = {rank: check_metadata(decode_metadata(p.metadata)) for rank, p in payloads.items()}
        incarnations = {md.incarnation for md in mds.values()}
        if len(incarnations) != 1:
            raise ValueError(f"the ranks of engine {self.conn.engine_id!r} report different "
                             f"incarnations {sorted(incarnations)}")
        if self.server is None:
            self.server = MetadataServer(mds, compat_hash=hashes.pop(),
                                         host=self.conn.config.side_channel_host, port=self.conn.port)
        else:
            for rank, md in mds.items():
                self.server.set_metadata(rank, md)
        self.state.set_incarnation(incarnations.pop())
        log.info("kvbridge: serving %d rank(s) of engine %s on %s:%d", len(mds),
                 self.conn.engine_id, self.server.host, self.server.port)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


# --------------------------------------------------------------------------- worker processes


class _Worker:
    """One TP rank's half: the transfer engines and their reports."""

    def __init__(self, conn: KVBridgeConnector) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.conn = conn
        self.rank = get_tensor_model_parallel_rank()
        self.prefill: PrefillEngine | None = None
        self.decode: DecodeEngine | None = None
        self._held: set[str] = set()
        self._free_now: set[str] = set()  # holds that failed: report them sent so vLLM frees them
        self._failed_now: dict[str, tuple[int, ...]] = {}  # loads refused before starting
        self._invalid: set[int] = set()
        self._single_group = _transfer_groups(conn._kv_cache_config) <= 1
        self._stats_base: dict[str, Stats] = {}
        self._pending_stats = KVBridgeStats()

    # ----- registration ----------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        vc = self.conn._vllm_config
        mc, pc = vc.model_config, vc.parallel_config
        names = sorted(kv_caches, key=layer_sort_key)
        kvc = self.conn._kv_cache_config
        facts = ModelFacts(
            engine_id=self.conn.engine_id, tp_size=pc.tensor_parallel_size,
            num_kv_heads=1 if mc.use_mla else mc.get_total_num_kv_heads(),
            head_dim=mc.get_head_size(), block_size=vc.cache_config.block_size,
            num_blocks=int(kvc.num_blocks) if kvc is not None else next(iter(kv_caches.values())).shape[0],
            use_mla=bool(mc.use_mla),
        )
        layers = [LayerTensor(n, tuple(kv_caches[n].shape), tuple(kv_caches[n].stride()),
                              dtype_name(kv_caches[n].dtype)) for n in names]
        spec = engine_spec_for(facts, layers)
        regions = regions_from_kv_caches({n: kv_caches[n] for n in names}, spec)
        hf = mc.hf_config
        identity = model_identity(
            getattr(hf, "architectures", None), hidden_size=getattr(hf, "hidden_size", 0),
            num_layers=spec.num_layers, num_heads=getattr(hf, "num_attention_heads", 0),
            num_kv_heads=facts.num_kv_heads, head_dim=facts.head_dim,
            vocab_size=mc.get_vocab_size())
        cfg = self.conn.config
        ecfg = EngineConfig(
            agent=AgentConfig(backends=cfg.backends, num_threads=cfg.ucx_threads,
                              progress_thread=cfg.progress_thread),
            mode=cfg.mode, lease_s=cfg.lease_seconds, renew_interval_s=cfg.heartbeat_seconds,
            handshake_timeout_s=cfg.handshake_timeout_seconds,
            transfer_timeout_s=cfg.transfer_timeout_seconds, mem_type=regions.mem_type,
            model=identity, attention_backend=_backend_name(vc), enforce_compat=cfg.enforce_compat,
            record_transfers=True, huge_pages=cfg.huge_pages,
        )
        inc = self.conn.incarnation
        if self.conn.producer:
            self.prefill = PrefillEngine(spec, self.rank, regions, ecfg, incarnation=inc)
            self.prefill.advertise(cfg.side_channel_host, self.conn.port)
        if self.conn.consumer:
            self.decode = DecodeEngine(spec, self.rank, regions, ecfg, incarnation=inc)
        log.info("kvbridge: rank %d registered %d layers (%s %s, %d blocks of %d tokens, %s)",
                 self.rank, spec.num_layers, spec.layout.value, spec.head_order.value,
                 regions.num_blocks, spec.block_size, regions.mem_type)

    def handshake(self) -> KVBridgeHandshake | None:
        eng = self.prefill  # pull mode: decode engines fetch the prefill ranks' metadata
        if eng is None:
            return None
        return KVBridgeHandshake(self.rank, eng.compat_hash, encode_metadata(eng.metadata()))

    # ----- per step --------------------------------------------------------
    def start(self, orders: StepOrders) -> None:
        if orders.empty:
            return
        for h in orders.holds:
            if self.prefill is None:
                self._free_now.add(h.request_id)
                continue
            try:
                self.prefill.hold(h.request_id, h.block_ids, h.token)
                self._held.add(h.request_id)
            except ValueError as exc:
                log.error("kvbridge: cannot hold request %s (%s); freeing its blocks", h.request_id, exc)
                self._free_now.add(h.request_id)
        dec = self.decode
        for ld in orders.loads:
            if dec is None:
                self._failed_now[ld.request_id] = ld.local_block_ids
                continue
            try:
                dec.load(ld.request_id, _transfer_params(ld.source), ld.local_block_ids,
                         ld.computed_tokens)
            except ValueError as exc:
                log.error("kvbridge: cannot load request %s: %s", ld.request_id, exc)
                self._failed_now[ld.request_id] = ld.local_block_ids
        if dec is not None:
            for verb, call, targets in (("release", dec.release, orders.releases),
                                        ("renew", dec.renew, orders.renewals)):
                for rp in targets:
                    try:
                        call(_transfer_params(rp))
                    except ValueError as exc:
                        log.warning("kvbridge: cannot %s request %s at %s: %s", verb, rp.request_id,
                                    rp.engine_id, exc)

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) on this worker since the
        last call; a failed receive is also in finished receiving."""
        sending, recving, failed = set(self._free_now), set(self._failed_now), set(self._failed_now)
        for blocks in self._failed_now.values():
            self._invalid.update(blocks)
        self._free_now.clear()
        self._failed_now.clear()
        if self.prefill is not None:
            for r in self.prefill.poll():
                if r.request_id in self._held:
                    self._held.discard(r.request_id)
                    sending.add(r.request_id)
        if self.decode is not None:
            ev = self.decode.poll()
            recving.update(ev.done)
            for f in ev.failed:
                log.warning("kvbridge: request %s failed (%s): %s; its %d local blocks must be "
                            "recomputed", f.request_id, f.kind.value, f.message, len(f.invalid_block_ids))
                recving.add(f.request_id)
                failed.add(f.request_id)
                self._invalid.update(f.invalid_block_ids)
        return sending, recving, failed

    def take_invalid_blocks(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        # vLLM maps block ids back to requests only for single-group models; failed_recving
        # carries the failure in every case
        return out if self._single_group else set()

    def take_stats(self) -> KVBridgeStats | None:
        st = KVBridgeStats()
        for name, eng in (("prefill", self.prefill), ("decode", self.decode)):
            if eng is None:
                continue
            now = copy.deepcopy(eng.stats)
            before = self._stats_base.get(name, Stats())
            self._stats_base[name] = now
            for k, v in _stats_delta(now, before).items():
                st.data[k] += v
            hs = now.handshakes - before.handshakes
            if hs > 0:
                avg = (now.handshake_ms - before.handshake_ms) / hs / 1e3
                st.data["handshake_duration"].extend([avg] * hs)
            for rec in eng.take_records():
                st.data["transfer_duration"].append(rec.xfer_us / 1e6)
                st.data["post_duration"].append(rec.post_us / 1e6)
                st.data["bytes_transferred"].append(rec.bytes)
                st.data["num_descriptors"].append(rec.descriptors)
        return None if st.is_empty() else st

    def close(self) -> None:
        for eng in (self.decode, self.prefill):
            if eng is not None:
                eng.close()
        self.decode = self.prefill = None


def _backend_name(vllm_config: VllmConfig) -> str:
    """The attention backend's name (part of the compatibility hash: caches of different
    backends can order bytes differently inside a block)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        names = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})
        return ",".join(names) or "unknown"
    except Exception:  # pragma: no cover - older vLLM
        return "unknown"
