"""Progress bars on stderr for ``kvbridge demo`` and ``kvbridge bench --scale`` (tqdm).

On a terminal a bar shows at once and is redrawn five times a second; into a file or a
pipe it shows only once a phase has run longer than ``DELAY_S`` (a short run prints
nothing there, a long one says what it is waiting for), redrawn every 5 s. Stdout (the
figures) is never touched.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from tqdm import tqdm

#: into a file or pipe, a phase shorter than this prints no progress
DELAY_S = 2.0


def progress(label: str, total: int | None = None, *, unit: str = "it",
             stream: TextIO | None = None) -> tqdm:
    """A bar for ``total`` items (``None``: a phase of unknown length, elapsed time only);
    advance it with ``bar.update(n)``, end it with ``close()`` or a ``with`` block."""
    stream = sys.stderr if stream is None else stream
    tty = bool(getattr(stream, "isatty", lambda: False)())
    fmt = "{desc}: {elapsed}" if total is None else None
    # miniters=0: every update may redraw (a ticker's update(0) too), at most once per mininterval
    return tqdm(total=total, desc=label, unit=unit, file=stream, bar_format=fmt, miniters=0,
                delay=0.0 if tty else DELAY_S, mininterval=0.2 if tty else 5.0, leave=True)


@contextmanager
def ticker(label: str, *, stream: TextIO | None = None) -> Iterator[tqdm]:
    """Elapsed time of a phase that blocks and cannot report progress itself (starting engine
    processes), redrawn by a background thread until the ``with`` block ends."""
    bar = progress(label, stream=stream)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(bar.mininterval):
            bar.update(0)

    thread = threading.Thread(target=tick, name="kvbridge-progress", daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()
        bar.close()
