"""The device a thread works on: NIXL's UCX backend enables CUDA IPC for a thread's
connections only when that thread has the cache's GPU as its current device."""

from __future__ import annotations

import torch

from .regions import CacheRegions


def use_cache_device(regions: CacheRegions) -> None:
    """Make the calling thread's current CUDA device the one holding ``regions``; nothing
    for caches in host memory. Call it in every thread that talks to NIXL about them."""
    if regions.mem_type == "VRAM":
        torch.cuda.set_device(regions.device_id)
