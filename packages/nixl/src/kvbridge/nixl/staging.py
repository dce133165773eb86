"""Staged READs: read a request's scattered pieces into one staging run, then copy them into place.

When prefill ranks split a decode block's heads between them (TP 2 -> 1 with
HND blocks, for instance), each prefill rank's share of a decode block is a
piece that lies between the other ranks' pieces: locally no two pieces of one
READ are adjacent, so NIXL cannot merge them and every piece is its own
operation (in host memory one CMA copy of 16 KiB or so, whose cost per call
dominates). On the prefill side the same pieces are usually adjacent, since a
request's blocks mostly run consecutively. A staged READ lands the pieces in
consecutive slots of a registered staging buffer instead, so that NIXL merges
them into a few large descriptors; when the READ completes, one vectorised
copy per local region moves every piece to its place, before the request is
reported done.

Used in pull mode with host-memory (DRAM) caches, for READs whose pieces all
have one size, when merging on the remote side cuts the descriptors by
:data:`MIN_GAIN` or more, and while the staging buffer has room (otherwise
the READ goes directly into the cache, as without staging). Size it with
``EngineConfig.staging_mib``.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kvbridge.memory import advise_huge_pages

from .agent import NixlAgent, PreparedList

#: stage a READ only when merging on the remote side needs at least this many times fewer
#: descriptors than reading into place (each staged byte is copied twice)
MIN_GAIN = 2

_HUGE = 2 << 20  # the staging buffer's alignment: a transparent huge page


def desc_addresses(rows: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(addresses, lengths)`` (int64) of descriptors ``idx`` of a strided ``N x 5`` row table
    (columns: address, length, device, stride, count; descriptor ``start(row) + b`` is at
    ``address + b * stride``)."""
    counts = rows[:, 4].astype(np.int64)
    starts = np.cumsum(counts) - counts
    i = np.asarray(idx, dtype=np.int64)
    r = np.searchsorted(starts, i, side="right") - 1
    if i.size and (r.min() < 0 or (i - starts[r] >= counts[r]).any()):
        raise ValueError("descriptor index outside the prepared list")
    addr = rows[r, 0].astype(np.int64) + (i - starts[r]) * rows[r, 3].astype(np.int64)
    return addr, rows[r, 1].astype(np.int64)


def runs(addr: np.ndarray, length: np.ndarray) -> int:
    """How many descriptors remain when each one that starts where the previous one ends is
    merged into it (NIXL's merge of consecutive descriptors)."""
    if addr.size == 0:
        return 0
    return 1 + int(np.count_nonzero(addr[1:] != addr[:-1] + length[:-1]))


def worth_staging(local_rows: np.ndarray, remote_rows: np.ndarray) -> bool:
    """Whether a rank pair's descriptor rows have locally scattered pieces that lie back to back
    remotely (consecutive blocks), the case a staging buffer serves."""
    if local_rows.shape != remote_rows.shape or not len(local_rows):
        return False
    scattered = local_rows[:, 3] > local_rows[:, 1]
    adjacent = remote_rows[:, 3] == remote_rows[:, 1]
    return bool((scattered & adjacent).any())


@dataclass(eq=False)
class Staged:
    """One READ staged at ``offset`` (bytes into the buffer): ``n`` pieces of ``piece`` bytes,
    piece ``k`` bound for element ``elements[k]`` of local region ``regions[k]`` (elements of
    ``piece`` bytes counted from the region's start). Its copy into place is claimed once
    (:meth:`StagingArea.claim`): by the copy thread or by the caller's ``poll()``."""

    offset: int
    piece: int
    n: int
    regions: np.ndarray
    elements: np.ndarray
    claimed: bool = False
    copy_us: int = 0  # how long the copy into place took
    #: the copy thread's copy (None: not handed to it)
    future: Future | None = field(default=None, repr=False)

    @property
    def slots(self) -> np.ndarray:
        """The staging slots (``piece``-byte descriptors of the buffer's list) it reads into."""
        first = self.offset // self.piece
        return np.arange(first, first + self.n, dtype=np.int32)


class StagingArea:
    """A registered host buffer that staged READs land in, and the copy that puts them in place.

    ``regions``: ``(base address, bytes)`` of each local cache region (the order of the
    engine's ``RegionGeometry``). Allocation is first fit over byte ranges and thread-safe
    (the worker plans READs, the caller's ``poll()`` frees them). A completed READ's copy
    into place runs on the area's copy thread when the worker saw the completion first
    (:meth:`copy_soon`), else in ``poll()`` (:meth:`claim`, then :meth:`scatter`).
    """

    def __init__(self, nbytes: int, regions: list[tuple[int, int]], huge_pages: bool = True) -> None:
        if nbytes <= 0:
            raise ValueError(f"a staging area needs a positive size, got {nbytes} bytes")
        # 2 MiB-aligned, and faulted in by the first READs that use it (made during a
        # handshake, so making it must cost next to nothing: touching 128 MiB of 4 KiB pages
        # took 110-470 ms on a busy two-core host)
        self._map = mmap.mmap(-1, nbytes + _HUGE)
        raw = np.frombuffer(self._map, dtype=np.uint8)
        skip = -raw.ctypes.data % _HUGE
        self.buffer = raw[skip:skip + nbytes]
        self.addr = self.buffer.ctypes.data
        self.nbytes = nbytes
        if huge_pages:
            advise_huge_pages([(self.addr, nbytes)], collapse=False)
        self._regions = [(int(a), int(n)) for a, n in regions]
        bases = np.array([a for a, _ in self._regions], dtype=np.int64)
        self._order = np.argsort(bases, kind="stable")  # regions by address
        self._bases = bases[self._order]
        self._ends = self._bases + np.array([n for _, n in self._regions], dtype=np.int64)[self._order]
        self._views: dict[tuple[int, int], np.ndarray] = {}
        self._lists: dict[int, PreparedList] = {}
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (start, end)
        self._used: dict[int, int] = {}  # offset -> end
        self._lock = threading.Lock()
        self._copier: ThreadPoolExecutor | None = None

    # ----- registration and lists ---------------------------------------------
    def descs(self) -> list[tuple[int, int, int]]:
        """What to register with the agent (host memory, device 0)."""
        return [(self.addr, self.nbytes, 0)]

    def slot_list(self, agent: NixlAgent, piece: int) -> PreparedList:
        """The buffer as a local prepared list of ``piece``-byte slots (prepared once per size)."""
        lst = self._lists.get(piece)
        if lst is None or lst.released:
            rows = np.array([[self.addr, piece, 0, piece, self.nbytes // piece]], dtype=np.uint64)
            lst = self._lists[piece] = agent.prepare(None, rows, "DRAM")
        return lst

    @property
    def lists(self) -> int:
        """Live prepared lists over the buffer (one per piece size used)."""
        return sum(not lst.released for lst in self._lists.values())

    @property
    def bytes_in_use(self) -> int:
        with self._lock:
            return sum(end - start for start, end in self._used.items())

    # ----- planning (worker thread) ---------------------------------------------
    def plan(self, local_rows: np.ndarray, remote_rows: np.ndarray, li: np.ndarray,
             ri: np.ndarray) -> Staged | None:
        """Stage the READ of local descriptors ``li`` from remote ``ri`` if it pays and fits;
        None: read into place."""
        if li.size < MIN_GAIN:
            return None
        laddr, llen = desc_addresses(local_rows, li)
        piece = int(llen[0])
        if piece <= 0 or (llen != piece).any():
            return None
        raddr, rlen = desc_addresses(remote_rows, ri)
        if runs(laddr, llen) < MIN_GAIN * runs(raddr, rlen):
            return None
        k = np.searchsorted(self._bases, laddr, side="right") - 1
        if (k < 0).any() or (laddr + piece > self._ends[k]).any():
            return None  # not inside a registered region (cannot happen for prepared lists)
        off = laddr - self._bases[k]
        if (off % piece).any():
            return None  # pieces not aligned to their size within the region: no vectorised copy
        start = self._alloc(int(li.size) * piece, piece)
        if start is None:
            return None
        return Staged(start, piece, int(li.size), self._order[k], off // piece)

    def _alloc(self, size: int, align: int) -> int | None:
        with self._lock:
            for k, (lo, hi) in enumerate(self._free):
                start = -(-lo // align) * align
                if start + size > hi:
                    continue
                parts = [(a, b) for a, b in ((lo, start), (start + size, hi)) if b > a]
                self._free[k:k + 1] = parts
                self._used[start] = start + size
                return start
            return None

    # ----- completion ------------------------------------------------------------------
    def claim(self, st: Staged) -> bool:
        """Take the copy of ``st`` (True once; the READ must be complete)."""
        with self._lock:
            if st.claimed:
                return False
            st.claimed = True
            return True

    def copy_soon(self, st: Staged) -> None:
        """Hand the copy of a completed READ to the copy thread, unless it was claimed already
        (claimed and handed over at once: a claimed copy has its ``future`` or is the
        claimer's own)."""
        with self._lock:
            if st.claimed:
                return
            st.claimed = True
            if self._copier is None:
                self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-staging")
            st.future = self._copier.submit(self.scatter, st)

    def scatter(self, st: Staged) -> None:
        """Copy a completed staged READ's pieces to their places in the cache: one copy per run
        of pieces bound for one region, a strided one where their elements are evenly spaced."""
        t0 = time.perf_counter()
        src = self.buffer[st.offset:st.offset + st.n * st.piece].view(np.dtype((np.void, st.piece)))
        cuts = np.flatnonzero(np.diff(st.regions)) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), st.n], strict=True):
            dst, el = self._view(int(st.regions[a]), st.piece), st.elements[a:b]
            step = int(el[1] - el[0]) if b - a > 1 else 1
            if step > 0 and (b - a == 1 or (np.diff(el) == step).all()):
                dst[int(el[0]):int(el[-1]) + 1:step] = src[a:b]
            else:
                dst[el] = src[a:b]
        st.copy_us = int((time.perf_counter() - t0) * 1e6)

    def _view(self, region: int, piece: int) -> np.ndarray:
        v = self._views.get((region, piece))
        if v is None:
            base, size = self._regions[region]
            raw = (ctypes.c_uint8 * size).from_address(base)
            v = self._views[(region, piece)] = np.frombuffer(raw, dtype=np.dtype((np.void, piece)),
                                                             count=size // piece)
        return v

    def free(self, st: Staged) -> None:
        """Give a staged READ's bytes back (only once no transfer can write them any more)."""
        with self._lock:
            end = self._used.pop(st.offset, None)
            if end is None:
                return
            self._free.append((st.offset, end))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for lo, hi in self._free:
                if merged and merged[-1][1] == lo:
                    merged[-1] = (merged[-1][0], hi)
                else:
                    merged.append((lo, hi))
            self._free = merged

    def close(self) -> None:
        """Finish the copy thread's work (the agent releases the prepared lists when it closes;
        the buffer is unmapped with the object)."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        self._lists.clear()
