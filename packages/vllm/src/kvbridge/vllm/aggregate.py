"""Merging the workers' per-step connector reports for the scheduler.

Every TP worker reports, each step, the request ids whose send or receive
finished *on that worker*, the ids whose receive failed, local block ids that
failed to load, and transfer stats. A request is finished for the scheduler
once every expected worker has reported it; the expected count can change at
run time (a worker announces the new count, e.g. after a handshake revealed how
many ranks take part). Failed receives stay pending until the request is
finished receiving, then are reported as failed once.

Pure logic: no vLLM, no I/O. Stats are plain mappings in the shape of vLLM's
``KVConnectorStats.data``: lists of observations are concatenated, numbers are
added.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MergedReport", "OutputAggregator", "WorkerReport", "merge_stats"]


@dataclass(frozen=True)
class WorkerReport:
    """One worker's connector output for one step."""

    rank: int
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
    stats: Mapping[str, Any] | None = None
    #: A new expected worker count announced by this worker (None: no change).
    expected_count: int | None = None

    @classmethod
    def of(cls, rank: int, *, sending: Iterable[str] = (), recving: Iterable[str] = (),
           failed: Iterable[str] = (), invalid: Iterable[int] = (),
           stats: Mapping[str, Any] | None = None,
           expected_count: int | None = None) -> WorkerReport:
        return cls(rank, frozenset(sending), frozenset(recving), frozenset(failed),
                   frozenset(invalid), stats, expected_count)


@dataclass(frozen=True)
class MergedReport:
    """What the scheduler sees for one step."""

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    #: Subset of ``finished_recving`` whose receive failed on some worker.
    failed_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
    stats: Mapping[str, Any] | None = None
    expected_count: int = 1


def merge_stats(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Merge two stats mappings: lists concatenate, numbers add, keys union.

    Raises TypeError when the same key holds a list on one side and a number
    (or anything else) on the other.
    """
    if a is None and b is None:
        return None
    out: dict[str, Any] = {k: (list(v) if isinstance(v, (list, tuple)) else v)
                           for k, v in (a or {}).items()}
    for k, v in (b or {}).items():
        if k not in out:
            out[k] = list(v) if isinstance(v, (list, tuple)) else v
            continue
        cur = out[k]
        if isinstance(cur, list) and isinstance(v, (list, tuple)):
            cur.extend(v)
        elif (isinstance(cur, (int, float)) and isinstance(v, (int, float))
              and not isinstance(cur, bool) and not isinstance(v, bool)):
            out[k] = cur + v
        else:
            raise TypeError(
                f"cannot merge stats key {k!r}: {type(cur).__name__} and {type(v).__name__}"
            )
    return out


@dataclass
class _Pending:
    ranks: set[int] = field(default_factory=set)


class OutputAggregator:
    """Counts per-request reports across workers; see the module docstring.

    ``remember`` bounds how many already-finished ids are remembered so that a
    late duplicate report for one of them is ignored instead of opening a new
    entry that would never finish.
    """

    def __init__(self, expected_count: int, *, remember: int = 65536) -> None:
        self._expected = self._check_count(expected_count)
        self._send: dict[str, _Pending] = {}
        self._recv: dict[str, _Pending] = {}
        self._failed: set[str] = set()
        self._done_send: OrderedDict[str, None] = OrderedDict()
        self._done_recv: OrderedDict[str, None] = OrderedDict()
        self._remember = remember

    @staticmethod
    def _check_count(n: int) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"expected worker count must be an integer >= 1, got {n!r}")
        return n

    @property
    def expected_count(self) -> int:
        return self._expected

    def set_expected_count(self, n: int) -> None:
        """Change how many workers must report a request. Requests already
        reported by at least ``n`` workers finish on the next :meth:`merge`."""
        self._expected = self._check_count(n)

    def pending(self) -> tuple[frozenset[str], frozenset[str]]:
        """(sending, receiving) ids reported by some but not yet all workers."""
        return frozenset(self._send), frozenset(self._recv)

    def forget(self, req_id: str) -> None:
        """Drop all state of a request (e.g. aborted)."""
        self._send.pop(req_id, None)
        self._recv.pop(req_id, None)
        self._failed.discard(req_id)

    def _count(self, table: dict[str, _Pending], done: OrderedDict[str, None],
               rank: int, ids: Iterable[str]) -> None:
        for rid in ids:
            if rid in done:
                continue  # late duplicate of a request already finished
            table.setdefault(rid, _Pending()).ranks.add(rank)

    def _harvest(self, table: dict[str, _Pending], done: OrderedDict[str, None]) -> set[str]:
        finished = {rid for rid, p in table.items() if len(p.ranks) >= self._expected}
        for rid in finished:
            del table[rid]
            done[rid] = None
        while len(done) > self._remember:
            done.popitem(last=False)
        return finished

    def merge(self, reports: Sequence[WorkerReport]) -> MergedReport:
        """Fold one step's reports (one per worker, any order) into the state."""
        seen_ranks: set[int] = set()
        stats: dict[str, Any] | None = None
        invalid: set[int] = set()
        for r in reports:
            if r.rank in seen_ranks:
                raise ValueError(f"two reports from worker rank {r.rank} in one step")
            seen_ranks.add(r.rank)
            if r.expected_count is not None:
                self.set_expected_count(r.expected_count)
            self._count(self._send, self._done_send, r.rank, r.finished_sending)
            # A failed receive also counts as this worker being done receiving.
            self._count(self._recv, self._done_recv, r.rank, r.finished_recving | r.failed_recving)
            self._failed |= {rid for rid in r.failed_recving if rid not in self._done_recv}
            invalid |= r.invalid_block_ids
            if r.stats:
                stats = merge_stats(stats, r.stats)
        sent = self._harvest(self._send, self._done_send)
        received = self._harvest(self._recv, self._done_recv)
        failed = self._failed & received
        self._failed -= failed
        return MergedReport(
            finished_sending=frozenset(sent),
            finished_recving=frozenset(received),
            failed_recving=frozenset(failed),
            invalid_block_ids=frozenset(invalid),
            stats=stats,
            expected_count=self._expected,
        )
