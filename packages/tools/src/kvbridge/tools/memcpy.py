"""The baseline every transfer figure is compared with: host memcpy on this machine."""

from __future__ import annotations

import time

import numpy as np


def memcpy_gbps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Single-thread host memcpy bandwidth (best of ``repeats`` copies of ``nbytes``)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9
