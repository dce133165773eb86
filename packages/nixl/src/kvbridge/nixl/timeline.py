"""An optional event log of each push and pull, for measuring from the engines' own clocks.

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

Pull mode, decode side: ``load_ordered`` (the scheduler ordered a load: its step's orders),
``load_start`` (the worker took the order), ``read_posted`` (the request's READs
were posted, with the posts' wall time ``post_ms``, the posting thread's CPU time
``post_cpu_ms``, in host memory UCX copies in that thread, and ``runnable_ms``, the
time it was ready to run but waited for a CPU), ``read_checked`` (the posting thread
saw them complete), ``load_reported`` (the worker reported the request done to vLLM)
and ``load_seen`` (the scheduler got that report). ``bench/bench_vllm.py`` reads them
(``bench/load_phases.py``).
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
