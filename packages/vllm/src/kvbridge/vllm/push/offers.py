"""Push mode: the decode scheduler's background thread that sends push offers.

A push offer is a round trip to the prefill engine's side channel; the
scheduler must not wait for it, so each offer runs as a job on one daemon
thread, in order.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

__all__ = ["OfferThread"]

log = logging.getLogger("kvbridge.vllm")


class OfferThread:
    """Runs jobs in order on one daemon thread, started with the first job."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvbridge-push-offers", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    @property
    def idle(self) -> bool:
        """No job waits to start."""
        return self._jobs.empty()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - the thread serves every later offer
                log.exception("kvbridge: a push offer job failed")

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=5)
            self._thread = None
