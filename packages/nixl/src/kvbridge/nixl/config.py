"""The engine's knobs and compatibility hash.

The plain records it takes and reports (``TransferParams``, ``TransferRecord``,
``DecodeEvents``, ...) live in :mod:`kvbridge.topology` (no NIXL, no numpy), and
:mod:`kvbridge.nixl` re-exports them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from kvbridge.handshake import HandshakeError, compat_fields, compatibility_hash, normalize_key
from kvbridge.topology import EngineSpec, TopologyError, canonical_dtype

from .agent import AgentConfig

MODES = ("pull", "push")


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs (all times in seconds)."""

    agent: AgentConfig = field(default_factory=AgentConfig)
    #: ``pull``: decode ranks READ from prefill ranks; ``push``: prefill ranks WRITE into decode ranks
    mode: str = "pull"
    lease_s: float = 30.0
    renew_interval_s: float = 10.0
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 60.0
    allow_strided: bool = True
    mem_type: str = "DRAM"
    #: back host-memory (DRAM) caches with transparent huge pages before registering them
    #: (``kvbridge.memory.advise_huge_pages``): host READs pin pages as they copy, and on
    #: 4 KiB pages that costs about a third of the bandwidth; ignored for VRAM
    huge_pages: bool = True
    #: build and post READs on the worker thread, so load() and poll() never wait for NIXL
    #: (over UCX in host memory NIXL performs the copy inside the post call)
    post_in_background: bool = True
    #: with ``post_in_background``: after posting a request's READs the worker checks them
    #: until they complete, between its later jobs (it posts the next request's READs
    #: meanwhile), for at most this long (seconds; 0: only ``poll()`` checks them,
    #: so a READ that needs progress calls advances and is seen done once per ``poll()``)
    complete_in_background_s: float = 0.5
    #: model identity and attention backend for the handshake's compatibility hash
    model: str = "kvbridge-synthetic"
    attention_backend: str = "kvbridge"
    #: refuse peers whose compatibility hash differs (turn off only when you vouch for the pair)
    enforce_compat: bool = True
    #: the KV-cache dtype the engine was configured with, when the cache tensors' element
    #: type does not say it (vLLM stores FP8 caches as uint8 whatever the FP8 format); any
    #: spelling of kvbridge.topology's dtype table. None: the tensors' dtype. Peers must agree
    #: on it (it is hashed for the handshake)
    kv_cache_dtype: str | None = None
    #: only with ``AgentConfig(progress_thread=False)`` (by default NIXL's native progress
    #: thread moves transfers, connection set-up and notifications, and these three fields
    #: have no effect): how often the engine's worker then lets NIXL progress while the
    #: engine is busy (seconds; 0: only in poll() and while transfers run). Over UCX in host
    #: memory a peer's READ of this rank's blocks completes only while this side progresses
    progress_interval_s: float = 0.001
    #: the same while the engine is idle: no blocks held for a peer (prefill), no transfer
    #: awaited (decode); each wake-up costs CPU time and takes the GIL. 0 or a value not
    #: above ``progress_interval_s``: always ``progress_interval_s``
    idle_progress_interval_s: float = 0.02
    #: an engine also counts as busy for this long after its last ``poll()`` (seconds): a
    #: vLLM prefill worker learns of a finished request (and holds its blocks) only at its
    #: next step
    busy_after_poll_s: float = 5.0
    #: while the engine's worker thread has a job queued or running (a handshake, posting
    #: transfers, checking them), ``poll()`` first sleeps this long (seconds; 0: never), so
    #: that the worker can take the GIL: CPython gives it to a waiting thread only when the
    #: holder blocks, and a main thread that never blocks but often releases the GIL for an
    #: instant (vLLM's engine loop while requests wait for their KV) kept a decode worker
    #: from finishing its first handshake for 0.2-5.7 s (docs/benchmarks.md, first-request
    #: overhead), and from starting one for 135 ms while only a running job counted
    gil_handoff_s: float = 0.0002
    #: CPUs the engine's worker thread (handshakes, posting READs and WRITEs, which over
    #: UCX in host memory copy in the posting thread unless NIXL splits them over its UCX
    #: threads) runs on; None: the CPUs of the thread
    #: that built the engine. See :func:`all_cpus`
    worker_cpus: tuple[int, ...] | None = None
    #: at start, connect the agent once to a throwaway agent in this process and move a few
    #: bytes both ways (:mod:`kvbridge.nixl.warmup`), while the engine is built: the one-time
    #: connection costs (41-905 ms measured) then fall at engine start instead of on the first
    #: request. Host memory (DRAM) with NIXL's progress thread only; ignored otherwise
    warm_up: bool = True
    #: keep one :class:`TransferRecord` per finished transfer (drain with ``take_records()``);
    #: at most ``max_records`` are kept between drains
    record_transfers: bool = False
    max_records: int = 4096
    #: shared secret of the side channel (the same on both engines; None: no authentication).
    #: With it, handshakes are signed and checked both ways, and notifications carry a proof
    #: (see docs/handshake.md). 16..4096 bytes; a text key is UTF-8 encoded
    auth_key: str | bytes | None = field(default=None, repr=False)
    #: the block id that stands for "no block" in SLIDING and MAMBA groups' block lists (vLLM's
    #: null block is 0), on both engines; None: every id is a real block
    null_block_id: int | None = None
    #: pull mode, host memory: MiB of registered staging buffer on each decode rank (0: none).
    #: A READ whose pieces are scattered locally but adjacent on the prefill side (heads split
    #: between prefill ranks) is read into it in a few large descriptors and then copied into
    #: place (:mod:`kvbridge.nixl.staging`); READs that do not fit go directly into the cache.
    #: Off by default: on a two-core host the second copy cost what the merge saved
    #: (docs/benchmarks.md, "kvbridge demo")
    staging_mib: int = 0

    def __post_init__(self) -> None:
        if self.null_block_id is not None and (
                isinstance(self.null_block_id, bool) or not isinstance(self.null_block_id, int)
                or self.null_block_id < 0):
            raise ValueError(f"null_block_id must be None or a block id >= 0, got {self.null_block_id!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'pull' or 'push', got {self.mode!r}")
        if not 0 <= self.complete_in_background_s <= 60:
            raise ValueError(f"complete_in_background_s must be within [0, 60] seconds, got "
                             f"{self.complete_in_background_s!r}")
        for name in ("lease_s", "renew_interval_s", "handshake_timeout_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive seconds")
        normalize_key(self.auth_key)  # raises ValueError with advice
        if self.kv_cache_dtype is not None:
            try:
                object.__setattr__(self, "kv_cache_dtype", canonical_dtype(self.kv_cache_dtype))
            except TopologyError as exc:
                raise ValueError(f"kv_cache_dtype: {exc}") from None
        if self.worker_cpus is not None and (not self.worker_cpus or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in self.worker_cpus)):
            raise ValueError(f"worker_cpus must be None or a non-empty tuple of CPU numbers, got "
                             f"{self.worker_cpus!r}")
        for name in ("progress_interval_s", "idle_progress_interval_s"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be within [0, 1] seconds, got {getattr(self, name)!r}")
        if not 0 <= self.gil_handoff_s <= 0.01:
            raise ValueError(f"gil_handoff_s must be within [0, 0.01] seconds, got {self.gil_handoff_s!r}")
        if isinstance(self.staging_mib, bool) or not isinstance(self.staging_mib, int) or not (
                0 <= self.staging_mib <= 1 << 20):
            raise ValueError(f"staging_mib must be a whole number of MiB within [0, 1048576] (0: no "
                             f"staging), got {self.staging_mib!r}")
        if not 0 <= self.busy_after_poll_s <= 3600:
            raise ValueError(f"busy_after_poll_s must be within [0, 3600] seconds, got "
                             f"{self.busy_after_poll_s!r}")


def all_cpus() -> tuple[int, ...]:
    """Every CPU this machine has online (for ``EngineConfig.worker_cpus``: a worker
    thread free to run beside a process whose other threads are bound to one core)."""
    return tuple(range(os.cpu_count() or 1))


class HandshakeFailed(HandshakeError):
    """The peer's metadata does not describe what the request said (TP size, incarnation)."""


def _compat_inputs(spec: EngineSpec, config: EngineConfig) -> dict[str, str]:
    return dict(model=config.model, dtype=spec.dtype, cache_dtype=config.kv_cache_dtype or spec.dtype,
                layout="kvbridge-planned", attention_backend=config.attention_backend)


def engine_compat_hash(spec: EngineSpec, config: EngineConfig) -> str:
    """The handshake compatibility hash of an engine.

    Cache layouts are not hashed: kvbridge plans transfers between different
    layouts and the topology planner refuses pairs it cannot serve. The KV-cache
    dtype is the configured one (``EngineConfig.kv_cache_dtype``), so two FP8
    formats stored alike as bytes still differ.
    """
    return compatibility_hash(**_compat_inputs(spec, config))


def engine_compat_info(spec: EngineSpec, config: EngineConfig) -> dict[str, str]:
    """The inputs of :func:`engine_compat_hash`, served beside it so that a refused peer
    is told which of them differ."""
    return compat_fields(**_compat_inputs(spec, config))


def provisional_spec(spec: EngineSpec, engine_id: str, tp_size: int) -> EngineSpec:
    """A peer engine of the same model with another TP size (its TP-only facts are exact)."""
    return replace(spec, engine_id=engine_id, tp_size=tp_size, block_bytes=None)
