"""The baselines transfer figures are compared with: host memcpy on this machine, or a
copy within one GPU for caches in GPU memory."""

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


def device_copy_gbps(nbytes: int = 256 << 20, repeats: int = 5, device: str = "cuda:0") -> float:
    """Copy bandwidth within one CUDA device (best of ``repeats`` copies of ``nbytes``; bytes
    counted once, as :func:`memcpy_gbps` counts them)."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9
