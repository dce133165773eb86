"""Progress on stderr for ``kvbridge demo`` and ``kvbridge bench --scale``: plain text, ``\\r`` updates.

Shown when stderr is a terminal, or once a phase has run longer than ``after_s``
(2 s): a short run prints nothing, a long one says what it is waiting for
(redrawn five times a second on a terminal, every 5 s into a file or pipe).
Stdout (the figures) is never touched.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    """``label [#####.....] count/total elapsed``; call it with how many items finished.

    With ``total=0`` there is no bar, only the elapsed time (a phase of unknown length).
    Usable as a context manager; :meth:`close` ends the line if anything was shown.
    """

    def __init__(self, label: str, total: int = 0, *, after_s: float = 2.0, every_s: float | None = None,
                 stream: TextIO | None = None) -> None:
        self.label, self.total, self.after = label, total, after_s
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        # a log file gets an update every few seconds, a terminal five a second
        self.every = every_s if every_s is not None else (0.2 if self.tty else 5.0)
        self.start = time.monotonic()
        self.count = 0
        self.shown = False
        self._last = 0.0
        self._lock = threading.Lock()

    def __call__(self, n: int = 1) -> None:
        with self._lock:
            self.count += n
            self._draw(final=False)

    def _draw(self, final: bool) -> None:
        now = time.monotonic()
        elapsed = now - self.start
        if not (self.tty or elapsed >= self.after):
            return
        if not final and now - self._last < self.every:
            return
        self._last = now
        if self.total:
            width = 30
            filled = min(width, int(width * self.count / self.total))
            bar = f" [{'#' * filled}{'.' * (width - filled)}] {self.count}/{self.total}"
        else:
            bar = ""
        self.stream.write(f"\r{self.label}{bar} {elapsed:.1f} s")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        with self._lock:
            if self.shown:
                self._draw(final=True)
                self.stream.write("\n")
                self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Ticker(Progress):
    """A :class:`Progress` redrawn by a background thread: for a phase that blocks (starting
    processes) and cannot report progress itself."""

    def __init__(self, label: str, **kw) -> None:
        super().__init__(label, **kw)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbridge-progress", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            with self._lock:
                self._draw(final=False)

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        super().close()
