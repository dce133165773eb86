"""One engine's ranks in this process, over synthetic caches in host or GPU memory.

The building block of the multi-process harness (each harness process runs
one :class:`LocalRanks`) and of the in-process engine tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.handshake import MetadataServer, new_incarnation
from kvbridge.memory import kernel_spec
from kvbridge.nixl import DecodeEngine, EngineConfig, PrefillEngine
from kvbridge.topology import EngineSpec, kernel_block_ids

from .hybrid_cache import HybridCache
from .synthetic_cache import SyntheticCache


def cache_device(config: EngineConfig, rank: int) -> str:
    """Where a rank's synthetic cache lives: host memory for ``mem_type="DRAM"``; for
    ``"VRAM"`` the CUDA device ``rank % device count`` (one GPU: every rank on it)."""
    if config.mem_type != "VRAM":
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError("mem_type='VRAM' needs a CUDA device, and torch sees none here; "
                           "run with host memory (mem_type='DRAM', kvbridge demo --device cpu)")
    return f"cuda:{rank % torch.cuda.device_count()}"


@dataclass
class LocalRanks:
    """Some ranks of one engine: a synthetic cache and an engine per rank, and the metadata
    server of the first rank when it serves."""

    spec: EngineSpec
    caches: dict[int, SyntheticCache]
    engines: dict[int, PrefillEngine | DecodeEngine]
    server: MetadataServer | None = None

    @classmethod
    def start(cls, role: str, spec: EngineSpec, ranks: Iterable[int], num_blocks: int,
              config: EngineConfig, *, incarnation: str | None = None, serve: bool = True,
              host: str = "127.0.0.1", port: int = 0) -> LocalRanks:
        """Allocate ``num_blocks`` blocks per rank (kernel-split engines: their kernel blocks),
        build a prefill (``role="p"``) or decode (``"d"``) engine per rank and, with ``serve``,
        serve every rank's metadata on one server on ``host`` (``port`` 0: a free one)."""
        ranks = list(ranks)
        engine_cls = PrefillEngine if role == "p" else DecodeEngine
        n = spec.kernel_blocks_per_block
        kind = HybridCache if spec.mamba is not None else SyntheticCache
        caches = {r: kind.allocate(kernel_spec(spec), r, num_blocks * n, cache_device(config, r))
                  for r in ranks}
        if config.mem_type == "VRAM":  # this thread registers the caches with NIXL
            torch.cuda.set_device(cache_device(config, ranks[0]))
        inc = incarnation or new_incarnation()
        out = cls(spec, caches, {})
        try:
            for r in ranks:
                out.engines[r] = engine_cls(spec, r, caches[r].cache_regions(spec), config, incarnation=inc)
            if serve:
                out.server = out.engines[ranks[0]].serve(host=host, port=port)
                for r in ranks[1:]:
                    out.engines[r].serve(out.server)
        except BaseException:
            out.close()
            raise
        return out

    def fill(self, kv: np.ndarray, blocks: Iterable[int]) -> None:
        """Write a request's KV content (:func:`~.synthetic_cache.logical_kv`)
        into the logical ``blocks`` of every rank's cache."""
        ids = list(kernel_block_ids(list(blocks), self.spec.kernel_blocks_per_block))
        for c in self.caches.values():
            c.fill(kv, ids)

    def close(self) -> None:
        """Close every engine (the first one closes the server it created)."""
        for e in self.engines.values():
            e.close()
