"""Fixtures of the kvbridge-handshake tests."""

from __future__ import annotations

import threading
import time

import pytest


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Every test must leave the thread count where it found it."""
    before = threading.active_count()
    yield
    deadline = time.monotonic() + 3.0
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before, [t.name for t in threading.enumerate()]
