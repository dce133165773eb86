"""kvbridge development tools: ``kvbridge demo``, ``kvbridge bench`` and what they run on.

Outside the runtime: no kvbridge runtime package imports this one, and installing
kvbridge-nixl (or kvbridge-vllm) does not install it. By concept:

* :mod:`~kvbridge.tools.synthetic_cache` and :mod:`~kvbridge.tools.hybrid_cache`: host-memory
  caches filled with verifiable content (attention; attention + Mamba-2 pages);
* :mod:`~kvbridge.tools.local_ranks`: some ranks of one engine in this process, each with
  its synthetic cache;
* :mod:`~kvbridge.tools.harness`: a prefill and a decode engine in real processes
  (:mod:`~kvbridge.tools.engine_process`: the loop each of those processes runs;
  :mod:`~kvbridge.tools.process_start`: how they start);
* :mod:`~kvbridge.tools.demo` and :mod:`~kvbridge.tools.bench`: the ``kvbridge demo`` and
  ``kvbridge bench`` commands; :mod:`~kvbridge.tools.scale`: ``kvbridge bench --scale``
  (:mod:`~kvbridge.tools.chart`: its matplotlib chart); :mod:`~kvbridge.tools.bare_nixl`: the
  bench's bare-NIXL reference; :mod:`~kvbridge.tools.memcpy`: the host memcpy baseline both
  commands report; :mod:`~kvbridge.tools.progress_bars`: their tqdm progress bars on stderr;
* :mod:`~kvbridge.tools.ports`: free ports below the ephemeral range, for test and benchmark
  engines' side channels.
"""
