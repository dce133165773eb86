"""An optional event log of each push, for measuring the overlap from the engines' own clocks.

Off by default. With the ``kvbridge.timeline`` logger at INFO (the vLLM connector
sets it so when the environment has ``KVBRIDGE_TIMELINE=1``), the push mode logs
one line per event, with the wall-clock time (``time.time()``, comparable between
the engines of one host)::

    kvbridge-timeline <event> <request id> t=<seconds> [key=value ...]

Prefill side: ``saved`` (a layer was handed over for writing, in vLLM's
``save_kv_layer``), ``posted`` and ``written`` (a WRITE's post and the moment the
posting thread saw it complete, with its layers), ``forward_end`` (the forward
pass ended: ``wait_for_save``), ``notified`` (the WRITTEN notifications of a
layered push were sent). Decode side: ``arrived`` (a WRITTEN notification was
applied). Request ids are the decode engine's where the push names them.
``bench/bench_push.py`` reads these lines.
"""

from __future__ import annotations

import logging
import time

LOGGER = "kvbridge.timeline"
log = logging.getLogger(LOGGER)


def enabled() -> bool:
    return log.isEnabledFor(logging.INFO)


def mark(event: str, request_id: str, **fields: object) -> None:
    """Log one event now (nothing when the timeline is off)."""
    if log.isEnabledFor(logging.INFO):
        extra = "".join(f" {k}={v}" for k, v in fields.items())
        log.info("kvbridge-timeline %s %s t=%.6f%s", event, request_id, time.time(), extra)
