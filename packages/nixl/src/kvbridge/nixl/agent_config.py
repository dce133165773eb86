"""How one rank's NIXL agent is built: :class:`AgentConfig`, and :func:`build_agent`, which
makes NIXL's Python agent (``nixl._api.nixl_agent``) on a native agent configured in full
(NIXL's wrapper fixes the progress thread's delay at 0, a spinning core)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AgentConfig:
    """How to build one rank's NIXL agent.

    ``backends`` are NIXL plugin names (UCX by default); ``num_threads`` is the
    UCX worker thread count (0 lets NIXL pick); ``telemetry`` enables per
    transfer timing (``get_xfer_telemetry``).

    ``progress_thread`` starts NIXL's own (native) progress thread, which moves
    transfers, connection set-up and notifications without any Python thread;
    ``progress_delay_us`` is how long it sleeps between polls when nothing
    happens (NIXL's ``pthrDelay``; the UCX backend waits on its workers' event
    descriptors with that timeout, rounded up to whole milliseconds: 1..1000
    all mean 1 ms, and 0 spins a core). NIXL's Python wrapper always uses 0, so
    :class:`NixlAgent` builds the native agent configuration itself. With the
    thread off, the owner must let NIXL progress (the engines' worker and
    ``poll()`` then do it).

    ``split_batch_size`` is the UCX backend's: a transfer of at least this many
    descriptors (after merging) is split over the ``num_threads`` UCX threads,
    each copying its share (in host memory a transfer below it is copied by the
    posting thread, inside its post; NIXL's own default is 1024).
    It is passed only with two threads or more (with one, a split leaves one chunk
    and only moves the copy from the posting thread to UCX's). Defaults, by
    measurement on the 2-core VM (docs/benchmarks.md, ``kvbridge bench``): 2
    threads and a split from 16 descriptors (a contiguous request's 32 merged
    2 MiB descriptors are copied by two threads at once).

    ``backend_params`` are extra init parameters per backend, as
    ``(backend, key, value)`` triples (e.g. ``("UCX", "split_batch_size",
    "256")`` or ``("UCX", "engine_config", "MAX_RMA_RAILS=1")``); they are
    passed to NIXL as they are, except that a UCX ``engine_config`` is appended
    to the settings of :data:`GPU_UCX_SETTINGS` on GPU memory (a later setting
    of the same name wins).
    """

    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 2
    split_batch_size: int = 16
    telemetry: bool = True
    progress_thread: bool = True
    progress_delay_us: int = 1000
    backend_params: tuple[tuple[str, str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("AgentConfig.backends is empty; name at least one NIXL backend, e.g. UCX")
        if not isinstance(self.num_threads, int) or self.num_threads < 0:
            raise ValueError(f"AgentConfig.num_threads must be an integer >= 0, got {self.num_threads!r}")
        if isinstance(self.split_batch_size, bool) or not isinstance(self.split_batch_size, int) \
                or self.split_batch_size < 1:
            raise ValueError(f"AgentConfig.split_batch_size must be an integer >= 1, got {self.split_batch_size!r}")
        if (isinstance(self.progress_delay_us, bool) or not isinstance(self.progress_delay_us, int)
                or not 0 <= self.progress_delay_us <= 1_000_000):
            raise ValueError(f"AgentConfig.progress_delay_us must be an integer within [0, 1000000] "
                             f"microseconds, got {self.progress_delay_us!r}")
        for triple in self.backend_params:
            if len(triple) != 3 or not all(isinstance(x, str) for x in triple):
                raise ValueError(f"AgentConfig.backend_params holds (backend, key, value) string triples, "
                                 f"got {triple!r}")
            if triple[0] not in self.backends:
                raise ValueError(f"AgentConfig.backend_params names backend {triple[0]!r}, which is not "
                                 f"in backends {self.backends}")

    def init_params(self, backend: str, mem_type: str = "DRAM") -> dict[str, str]:
        """The init parameters NIXL gets for ``backend`` on an agent registering ``mem_type``
        memory (thread count and UCX batch split; on GPU memory, UCX's
        :data:`GPU_UCX_SETTINGS`; then ``backend_params``, which override them)."""
        params: dict[str, str] = {}
        if self.num_threads > 0 and backend in ("UCX", "OBJ", "LIBFABRIC"):
            params["num_threads"] = str(self.num_threads)
        if self.num_threads > 1 and backend == "UCX":
            params["split_batch_size"] = str(self.split_batch_size)
        if backend == "UCX" and mem_type == "VRAM":
            params["engine_config"] = ",".join(f"{k}={v}" for k, v in GPU_UCX_SETTINGS)
        for name, key, value in self.backend_params:
            if name == backend:
                params[key] = (f"{params[key]},{value}" if key == "engine_config" and params.get(key)
                               else value)
        return params


#: UCX settings (names without the ``UCX_`` prefix) that agents on GPU memory get through the
#: UCX backend's ``engine_config``; a ``UCX_*`` environment variable of the same name still
#: wins. UCX leaves CUDA IPC reads off by default on some platforms (its "auto"); then a pull
#: READ of GPU memory fell back to software emulation over TCP: 0.5 GB/s on an H100, against
#: 2.9 GB/s through CUDA IPC in the same run (docs/benchmarks.md).
GPU_UCX_SETTINGS: tuple[tuple[str, str], ...] = (("CUDA_IPC_ENABLE_GET_ZCOPY", "y"),)


def build_agent(name: str, config: AgentConfig, mem_type: str = "DRAM") -> object:
    """A ``nixl._api.nixl_agent`` whose native agent is built from our full configuration.

    The wrapper's constructor hard-codes the progress thread's delay to 0 (a
    spinning core), so the wrapper is set up on a native agent with neither
    backends nor threads, and that agent is then replaced by one built from a
    ``nixlAgentConfig`` with our delay; the backends are created through the
    wrapper (``create_backend``), which records their memory types and options
    as usual. Everything else (registration, lists, handles) is the wrapper's.
    """
    from nixl import _bindings
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    wrapper = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[],
                                                 capture_telemetry=config.telemetry))
    native = _bindings.nixlAgentConfig()
    native.useProgThread = config.progress_thread
    native.useListenThread = False
    native.syncMode = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value  # as the wrapper, without listener
    native.pthrDelay = config.progress_delay_us
    native.captureTelemetry = config.telemetry
    wrapper.agent = _bindings.nixlAgent(name, native)
    wrapper.plugin_list = wrapper.agent.getAvailPlugins()
    for backend in config.backends:
        if backend in wrapper.plugin_list:
            wrapper.create_backend(backend, config.init_params(backend, mem_type))
    return wrapper
