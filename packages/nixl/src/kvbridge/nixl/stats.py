"""Transfer statistics: plain counters, mergeable across ranks with ``+``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class Stats:
    """Counters of one rank (or a merge of several, see :meth:`merge`)."""

    requests_done: int = 0
    requests_failed: int = 0
    transfers: int = 0
    bytes: int = 0
    descriptors: int = 0  # NIXL telemetry: descriptors after NIXL merged adjacent ones
    descriptors_posted: int = 0  # descriptors kvbridge handed to NIXL (index entries, before merging)
    staged_reads: int = 0  # READs landed in the staging buffer and copied into place
    staged_copy_us: int = 0  # time spent copying staged READs into place
    posts: int = 0  # requests whose transfers were built and posted
    prep_us: int = 0  # kvbridge time from block ids to transfers ready to post
    post_us: int = 0  # NIXL telemetry: time spent posting
    xfer_us: int = 0  # NIXL telemetry: time from post to completion
    handshakes: int = 0
    handshake_ms: float = 0.0
    notifications_sent: int = 0
    notifications_received: int = 0
    notifications_unknown: int = 0  # for requests not held (or already released)
    notifications_bad_token: int = 0
    notifications_malformed: int = 0
    notifications_duplicate: int = 0
    notifications_unassigned: int = 0  # DONE from a decode rank the plan does not assign to this rank
    notifications_unauthenticated: int = 0  # with an auth_key: no proof, or a wrong one
    leases_renewed: int = 0
    leases_expired: int = 0
    requests_released: int = 0
    stale_agents_dropped: int = 0
    late_transfers: int = 0  # given up in progress, then completed (bytes moved after the hand-back)
    late_errors: int = 0  # given up in progress, then ended in error (part of its bytes may have moved)
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, kind: str) -> None:
        self.requests_failed += 1
        self.failures[kind] = self.failures.get(kind, 0) + 1

    def __add__(self, other: Stats) -> Stats:
        if not isinstance(other, Stats):
            return NotImplemented
        out = Stats()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, dict):
                merged = dict(a)
                for k, v in b.items():
                    merged[k] = merged.get(k, 0) + v
                setattr(out, f.name, merged)
            else:
                setattr(out, f.name, a + b)
        return out

    @staticmethod
    def merge(parts: list[Stats]) -> Stats:
        out = Stats()
        for p in parts:
            out = out + p
        return out

    @property
    def gbps(self) -> float:
        """Bytes over summed NIXL transfer time (GB/s), 0 when unknown."""
        return self.bytes / (self.xfer_us * 1e3) if self.xfer_us else 0.0
