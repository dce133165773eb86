"""Pure bookkeeping of requests, without NIXL: the prefill ledger and the decode tracker.

Both take the current time as an argument (seconds, any monotonic origin), so
they are deterministic and unit-testable.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from kvbridge.topology import Failed, FailureKind, Released

from .messages import Kind, Notification
from .stats import Stats

# ---------------------------------------------------------------------------
# prefill side


@dataclass
class HeldRequest:
    request_id: str
    block_ids: tuple[int, ...]
    token: str
    deadline: float
    decode_tp: int | None = None
    consumers: frozenset[int] = frozenset()
    notified_by: set[int] = field(default_factory=set)


class PrefillLedger:
    """Requests a prefill rank holds until every assigned decode rank has notified.

    ``consumers_for(decode_tp)`` names the decode ranks of a decode engine with
    that TP size that notify this prefill rank per request (the plan's
    ``ProducerRankPlan.consumer_ranks``); it raises ``ValueError`` (or returns
    nothing) for a TP size this rank cannot serve. A DONE notification counts
    only when it comes from one of those ranks, each (request, decode rank)
    once; DONE from any other decode rank is ignored and counted in
    ``stats.notifications_unassigned``.
    """

    def __init__(self, consumers_for: Callable[[int], Collection[int]], lease_s: float,
                 stats: Stats | None = None):
        if lease_s <= 0:
            raise ValueError(f"lease must be positive seconds, got {lease_s!r}")
        self._consumers_for = consumers_for
        self._consumers_cache: dict[int, frozenset[int]] = {}
        self.lease_s = lease_s
        self.stats = stats if stats is not None else Stats()
        self._held: dict[str, HeldRequest] = {}
        self._released: list[Released] = []

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def hold(self, request_id: str, block_ids: Iterable[int], token: str, now: float) -> None:
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already held; request ids must be unique")
        self._held[request_id] = HeldRequest(request_id, tuple(int(b) for b in block_ids), token,
                                             now + self.lease_s)

    def _consumers(self, decode_tp: int) -> frozenset[int]:
        """The decode ranks that notify this rank when the decode TP is ``decode_tp`` (cached)."""
        if decode_tp not in self._consumers_cache:
            try:
                got = self._consumers_for(decode_tp)
            except ValueError:
                got = ()
            if isinstance(got, int) or not isinstance(got, Iterable):
                raise TypeError(
                    f"consumers_for({decode_tp}) must return the decode ranks (a collection of ints), "
                    f"got {got!r}"
                )
            self._consumers_cache[decode_tp] = frozenset(int(r) for r in got)
        return self._consumers_cache[decode_tp]

    def on_notification(self, n: Notification | None, now: float) -> str:
        """Apply one notification; returns what happened (for logs and tests)."""
        self.stats.notifications_received += 1
        if n is None:
            self.stats.notifications_malformed += 1
            return "malformed"
        if not n.authentic:  # checked first: nothing unproven touches a held request
            self.stats.notifications_unauthenticated += 1
            return "unauthenticated"
        req = self._held.get(n.request_id)
        if req is None:
            self.stats.notifications_unknown += 1
            return "unknown"
        if n.token != req.token:
            self.stats.notifications_bad_token += 1
            return "bad-token"
        if n.kind is Kind.RENEW:
            req.deadline = max(req.deadline, now + self.lease_s)
            self.stats.leases_renewed += 1
            return "renewed"
        if n.kind is not Kind.DONE:
            self.stats.notifications_malformed += 1
            return "malformed"
        if req.decode_tp is not None and n.decode_tp != req.decode_tp:
            self.stats.notifications_malformed += 1
            return "bad-decode-tp"
        consumers = self._consumers(n.decode_tp)
        if not consumers:
            self.stats.notifications_malformed += 1
            return "bad-decode-tp"
        if n.decode_rank not in consumers:  # the plan does not send this decode rank here
            self.stats.notifications_unassigned += 1
            return "unassigned"
        if req.decode_tp is None:  # the first accepted DONE fixes the decode TP
            req.decode_tp, req.consumers = n.decode_tp, consumers
        if n.decode_rank in req.notified_by:
            self.stats.notifications_duplicate += 1
            return "duplicate"
        req.notified_by.add(n.decode_rank)
        if req.notified_by >= req.consumers:
            self._release(req, "notified")
            return "released"
        return "counted"

    def _release(self, req: HeldRequest, reason: str) -> None:
        del self._held[req.request_id]
        self._released.append(Released(req.request_id, req.block_ids, reason))
        self.stats.requests_released += 1
        if reason == "lease-expired":
            self.stats.leases_expired += 1

    def expire(self, now: float) -> list[str]:
        """Release every request whose lease has lapsed; returns their ids."""
        lapsed = [r for r in self._held.values() if r.deadline <= now]
        for r in lapsed:
            self._release(r, "lease-expired")
        return [r.request_id for r in lapsed]

    def take_released(self) -> list[Released]:
        out, self._released = self._released, []
        return out


# ---------------------------------------------------------------------------
# decode side


class State(str, enum.Enum):
    WAITING = "waiting-handshake"
    READY = "ready"
    POSTED = "posted"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Tracked:
    request_id: str
    engine: str
    local_block_ids: tuple[int, ...]
    deadline: float
    state: State = State.WAITING
    outstanding: set[object] = field(default_factory=set)


class DecodeTracker:
    """Per-request state machine of a decode rank.

    waiting-handshake -> ready -> posted -> done, and any non-final state ->
    failed (with the request's local blocks reported invalid).
    """

    def __init__(self, stats: Stats | None = None):
        self.stats = stats if stats is not None else Stats()
        self._reqs: dict[str, Tracked] = {}
        self._done: list[str] = []
        self._failed: list[Failed] = []

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reqs

    def get(self, request_id: str) -> Tracked | None:
        return self._reqs.get(request_id)

    def add(self, request_id: str, engine: str, local_block_ids: Iterable[int], deadline: float,
            ready: bool) -> Tracked:
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} is already loading; request ids must be unique")
        t = Tracked(request_id, engine, tuple(int(b) for b in local_block_ids), deadline,
                    State.READY if ready else State.WAITING)
        self._reqs[request_id] = t
        return t

    def waiting_on(self, engine: str) -> list[Tracked]:
        return [t for t in self._reqs.values() if t.engine == engine and t.state is State.WAITING]

    def handshake_done(self, engine: str) -> list[Tracked]:
        out = self.waiting_on(engine)
        for t in out:
            t.state = State.READY
        return out

    def handshake_failed(self, engine: str, message: str) -> list[Failed]:
        return [self.fail(t.request_id, FailureKind.HANDSHAKE, message) for t in self.waiting_on(engine)]

    def posted(self, request_id: str, parts: Iterable[object]) -> None:
        t = self._reqs[request_id]
        if t.state is not State.READY:
            raise ValueError(f"request {request_id!r} is {t.state.value}, not ready to post")
        t.outstanding = set(parts)
        t.state = State.POSTED
        if not t.outstanding:
            self._finish(t)

    def part_done(self, request_id: str, part: object) -> bool:
        """Mark one transfer of a request complete; True when the request is done."""
        t = self._reqs.get(request_id)
        if t is None or t.state is not State.POSTED:
            return False
        t.outstanding.discard(part)
        if not t.outstanding:
            self._finish(t)
            return True
        return False

    def _finish(self, t: Tracked) -> None:
        del self._reqs[t.request_id]
        t.state = State.DONE
        self._done.append(t.request_id)
        self.stats.requests_done += 1

    def fail(self, request_id: str, kind: FailureKind, message: str) -> Failed:
        t = self._reqs.pop(request_id)
        t.state = State.FAILED
        f = Failed(request_id, kind, t.local_block_ids, message)
        self._failed.append(f)
        self.stats.fail(kind.value)
        return f

    def overdue(self, now: float) -> list[Tracked]:
        return [t for t in self._reqs.values() if t.deadline <= now]

    def take_done(self) -> list[str]:
        out, self._done = self._done, []
        return out

    def take_failed(self) -> list[Failed]:
        out, self._failed = self._failed, []
        return out
