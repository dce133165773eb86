"""Back host-memory KV regions with transparent huge pages (Linux).

Over UCX in host memory a READ is a cross-process copy (CMA) that pins the
source and destination pages as it goes. On 4 KiB pages that pinning is a large
part of the cost: measured on a 2-core host, a 64 MiB READ between torch
tensors ran at 6.5-8 GB/s on 4 KiB pages and 10.7-11.3 GB/s after both sides
were collapsed to 2 MiB pages (numpy, which advises huge pages itself for large
arrays, reached 10-12 GB/s without help).

:func:`advise_huge_pages` marks the 2 MiB-aligned inside of each range with
``MADV_HUGEPAGE`` (future faults get huge pages) and, where the kernel has it
(Linux 6.1+), collapses the pages already there with ``MADV_COLLAPSE``. It is
best effort: nothing here raises for what the kernel refuses; the result says
what was done. Call it on host memory only, before registering it with NIXL
(registration may pin pages, and pinned pages cannot be collapsed).

The head and tail of a range rarely sit on 2 MiB boundaries (torch and glibc
place a large tensor a few KiB past a page boundary), so the huge pages inside
leave up to 2 MiB at each end on 4 KiB pages: an eighth of a 16 MiB layer
tensor. Where the 2 MiB page around such an edge lies wholly in anonymous
private writable memory of this process (the neighbouring tensor, usually: large
allocations are mapped next to each other), that whole page is advised and
collapsed too; the memory around the range keeps its contents, and pages a
registration has pinned are left as they are (the kernel refuses to collapse
them; the result counts the refusal).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25

_THP = "/sys/kernel/mm/transparent_hugepage"


@dataclass(frozen=True)
class HugePageResult:
    """What :func:`advise_huge_pages` did.

    ``page_size``: the huge page size in bytes (0 when this host has none);
    ``advised_bytes``: bytes marked ``MADV_HUGEPAGE``; ``collapsed_bytes``: bytes
    collapsed to huge pages now; ``skipped``: why nothing was attempted (None when
    something was); ``errors``: what the kernel refused, one line per kind.
    """

    page_size: int
    advised_bytes: int = 0
    collapsed_bytes: int = 0
    skipped: str | None = None
    errors: tuple[str, ...] = ()


def huge_page_size() -> int:
    """The transparent huge page size of this host in bytes, 0 when there is none
    (not Linux, no THP support, or THP switched off with ``never``)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        with open(f"{_THP}/enabled") as f:
            if "[never]" in f.read():
                return 0
        with open(f"{_THP}/hpage_pmd_size") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def _aligned(addr: int, size: int, page: int) -> tuple[int, int]:
    """The ``page``-aligned inside of ``[addr, addr + size)`` as (start, length); length 0 if none."""
    start = -(-addr // page) * page
    end = (addr + size) // page * page
    return start, max(0, end - start)


def anonymous_spans(maps_text: str | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` spans of this process's anonymous private writable memory, adjacent
    mappings merged, from ``/proc/self/maps`` (or ``maps_text``); empty when unreadable."""
    if maps_text is None:
        try:
            with open("/proc/self/maps") as f:
                maps_text = f.read()
        except OSError:
            return []
    spans: list[tuple[int, int]] = []
    for line in maps_text.splitlines():
        parts = line.split()
        if len(parts) < 5 or len(parts) > 6 or not parts[1].startswith("rw") or parts[1][3:4] != "p":
            continue
        if parts[4] != "0" or (len(parts) == 6 and parts[5] != "[heap]"):
            continue  # file-backed, or a special mapping ([stack], [vvar], ...)
        a, _, b = parts[0].partition("-")
        lo, hi = int(a, 16), int(b, 16)
        if spans and spans[-1][1] == lo:
            spans[-1] = (spans[-1][0], hi)
        else:
            spans.append((lo, hi))
    return spans


def _covering(addr: int, size: int, page: int, anon: list[tuple[int, int]]) -> tuple[int, int]:
    """Like :func:`_aligned`, but also the partial huge pages at the head and tail of
    ``[addr, addr + size)`` that lie wholly inside one of the ``anon`` spans."""
    start, length = _aligned(addr, size, page)
    end = start + length if length else start

    def inside(lo: int) -> bool:
        return any(s <= lo and lo + page <= e for s, e in anon)

    head = addr // page * page
    if size > 0 and head < addr and inside(head):
        start = head
    tail = -(-(addr + size) // page) * page
    if size > 0 and tail > addr + size and inside(tail - page):
        end = tail
    end = max(end, start)
    return start, end - start


def advise_huge_pages(ranges: Iterable[tuple[int, int]], *, collapse: bool = True,
                      page_size: int | None = None, edges: bool = True) -> HugePageResult:
    """Ask the kernel to back the host memory ``ranges`` ((address, bytes) pairs) with
    huge pages; with ``collapse``, also collapse the pages already faulted in.

    Only the part of each range that covers whole huge pages is advised (a range
    shorter than a huge page is left alone). The ranges must be anonymous host
    memory owned by this process (torch or numpy CPU tensors); device memory is
    not for this function. ``page_size`` overrides the detected huge page size
    (tests). With ``edges`` (the default) the partial huge pages at each range's
    head and tail are included where they lie wholly in anonymous memory of this
    process (see the module notes); without it only whole pages inside a range.
    """
    page = huge_page_size() if page_size is None else page_size
    spans = []
    for addr, size in ranges:
        addr, size = int(addr), int(size)
        if addr <= 0 or size < 0:
            raise ValueError(f"bad memory range (address {addr:#x}, {size} bytes): pass the "
                             f"(address, size) of host tensors")
        spans.append((addr, size))
    if page <= 0:
        return HugePageResult(0, skipped="this host has no transparent huge pages")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError) as exc:
        return HugePageResult(page, skipped=f"madvise is not available: {exc}")
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    advised = collapsed = 0
    errors: dict[str, int] = {}

    def refused(what: str) -> None:
        err = ctypes.get_errno()
        key = f"{what}: {errno.errorcode.get(err, err)} ({os.strerror(err)})"
        errors[key] = errors.get(key, 0) + 1

    anon = anonymous_spans() if edges else []
    todo: list[tuple[int, int]] = []  # the inside of each range, then each edge page once
    edge_pages: set[int] = set()
    for addr, size in spans:
        start, length = _aligned(addr, size, page)
        if length:
            todo.append((start, length))
        if anon:
            lo, n = _covering(addr, size, page, anon)
            for p in (lo, lo + n - page):
                if n and not start <= p < start + length:
                    edge_pages.add(p)
    todo.extend((p, page) for p in sorted(edge_pages) if not any(s <= p < s + n for s, n in todo))
    for start, length in todo:
        if madvise(start, length, MADV_HUGEPAGE) != 0:
            refused("MADV_HUGEPAGE")
            continue
        advised += length
        if collapse:
            if madvise(start, length, MADV_COLLAPSE) == 0:
                collapsed += length
            else:
                refused("MADV_COLLAPSE")
    return HugePageResult(page, advised, collapsed, None,
                          tuple(f"{k} x{n}" for k, n in sorted(errors.items())))


def huge_page_bytes(ranges: Iterable[tuple[int, int]]) -> int:
    """Bytes of the ``ranges`` ((address, bytes) pairs) of this process that sit on
    anonymous huge pages now, from ``/proc/self/smaps`` (0 where it cannot be read).

    A mapping that only partly overlaps a range counts at most the overlap.
    """
    spans = [(int(a), int(a) + int(n)) for a, n in ranges]
    if not spans:
        return 0
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return 0
    total = 0
    lo = hi = 0
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            a, _, b = head.partition("-")
            try:
                lo, hi = int(a, 16), int(b, 16)
            except ValueError:
                lo = hi = 0
        elif line.startswith("AnonHugePages:"):
            kib = int(line.split()[1])
            if not kib:
                continue
            overlap = sum(max(0, min(hi, e) - max(lo, s)) for s, e in spans)
            total += min(kib * 1024, overlap)
    return total
