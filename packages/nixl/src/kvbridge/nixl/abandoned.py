"""Transfers given up before they ended: kept until they end, late ones counted.

A request can be given up (failed, timed out) while its READs or WRITEs are still in
progress. NIXL cannot stop such a transfer: releasing its handle cancels nothing that is
under way (UCX frees the request and the operation goes on), and in NIXL 1.5.1 dropping
the peer closes its endpoints in flush mode, which lets them finish too. Over TCP a READ
from a peer that was stopped (SIGSTOP, a hung host) completes when the peer runs again,
into memory the request no longer owns.

So :class:`Abandoned` keeps each transfer that was in progress when it was given up,
unreleased, and checks it on every ``poll()`` until it ends; then it releases it. One
that *completed* after it was given up wrote into memory already handed back: it is
counted (``Stats.late_transfers``) and logged as an error, so that operators see it; one
that ended in error may have moved part of its bytes, and is counted apart
(``Stats.late_errors``, logged as a warning). A transfer that had not been posted, or had
ended, is released at once; one whose release NIXL refuses is retried on every poll.
Transfers to a peer that is dropped are released with the peer's agent
(:meth:`~kvbridge.nixl.agent.NixlAgent.remove_remote`); whether they still land is then
unknown, and they are not counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from .agent import NixlAgent, NixlError, Transfer
from .stats import Stats

log = logging.getLogger("kvbridge.nixl")


@dataclass(eq=False)
class _Kept:
    transfer: Transfer
    given_up_at: float  # monotonic
    in_progress: bool  # False: ended, but NIXL refused to release it (retried)


class Abandoned:
    """The transfers one rank gave up, until each has ended and been released."""

    def __init__(self, agent: NixlAgent, stats: Stats) -> None:
        self._agent = agent
        self._stats = stats
        self._kept: list[_Kept] = []

    def __len__(self) -> int:
        return len(self._kept)

    def _state(self, x: Transfer) -> str:
        try:
            return self._agent.state(x)
        except NixlError:  # the agent is closed: nothing can progress any more
            return "CLOSED"

    def drop(self, transfers: Iterable[Transfer]) -> None:
        """Give ``transfers`` up: release those not in progress now, keep the others."""
        now = time.monotonic()
        for x in list(transfers):
            if x.released:
                continue
            if self._state(x) == "PROC":
                self._kept.append(_Kept(x, now, True))
            elif not self._agent.release_transfer(x):
                log.warning("NIXL refused to release an active %s to %s; retrying later", x.op, x.peer)
                self._kept.append(_Kept(x, now, False))

    def sweep(self) -> None:
        """Release the kept transfers that have ended (count those that completed or failed late)."""
        if not self._kept:
            return
        keep = []
        for k in self._kept:
            x = k.transfer
            if x.released:  # released with its peer
                continue
            if k.in_progress:
                st = self._state(x)
                if st == "PROC":
                    keep.append(k)
                    continue
                k.in_progress = False
                if st == "DONE":
                    self._stats.late_transfers += 1
                    log.error("a %s with %s completed %.1f s after its request was given up: "
                              "its bytes moved after the request's blocks were handed back (NIXL "
                              "cannot cancel a transfer in progress)", x.op, x.peer,
                              time.monotonic() - k.given_up_at)
                elif st == "ERR":
                    self._stats.late_errors += 1
                    log.warning("a %s with %s ended in error %.1f s after its request was given "
                                "up: part of its bytes may have moved after the request's blocks "
                                "were handed back", x.op, x.peer, time.monotonic() - k.given_up_at)
            if not self._agent.release_transfer(x):
                keep.append(k)
        self._kept = keep
