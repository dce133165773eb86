"""The connector's transfer statistics as plain data, in the shape of vLLM's
``KVConnectorStats.data``: list-valued keys hold one observation per transfer (or
handshake), int-valued keys count events over the interval.

Workers build one mapping per interval from their engines' counters and
transfer records (:func:`stats_delta`); vLLM merges the workers' mappings
(:func:`merge_stats`) and logs their summary (:func:`reduce_stats`). The vLLM
classes around this data live in :mod:`kvbridge.vllm.metrics`.

Pure logic: no vLLM, no I/O (besides a log line, :class:`WithoutParams`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvbridge.vllm.params import route

if TYPE_CHECKING:
    from kvbridge.nixl import Stats

log = logging.getLogger("kvbridge.vllm")

__all__ = ["COUNTS", "OBSERVATIONS", "WithoutParams", "empty_stats", "is_empty", "merge_stats",
           "reduce_stats", "stats_delta"]

#: list-valued keys: one observation per transfer (or handshake)
OBSERVATIONS = ("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors",
                "handshake_duration")
#: int-valued keys: counts over the interval
COUNTS = ("requests_done", "requests_failed", "failed_handshakes", "failed_transfers",
          "failed_posts", "failed_timeouts", "expired_leases", "released_requests",
          "ignored_notifications", "renewed_leases", "requests_without_params", "staged_reads",
          "late_transfers", "late_errors")


def empty_stats() -> dict[str, Any]:
    """The data of an interval in which nothing happened."""
    return {k: [] for k in OBSERVATIONS} | dict.fromkeys(COUNTS, 0)


def is_empty(data: Mapping[str, Any]) -> bool:
    """True when ``data`` holds no observation and every count is 0."""
    return not any(data.get(k) for k in OBSERVATIONS + COUNTS)


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


def reduce_stats(data: Mapping[str, Any]) -> dict[str, int | float]:
    """The interval summary vLLM logs (``KV Transfer metrics: ...``)."""
    d = data
    n = len(d.get("transfer_duration", []))
    secs = sum(d.get("transfer_duration", []))
    nbytes = sum(d.get("bytes_transferred", []))
    hs = d.get("handshake_duration", [])
    out: dict[str, int | float] = {
        "Transfers": n,
        "Avg xfer time (ms)": round(secs / n * 1e3, 3) if n else 0,
        "Avg MB per transfer": round(nbytes / n / 2**20, 3) if n else 0,
        "Throughput (GB/s)": round(nbytes / secs / 1e9, 3) if secs else 0,
        "Handshakes": len(hs),
        "Avg handshake (ms)": round(sum(hs) / len(hs) * 1e3, 2) if hs else 0,
    }
    for k in COUNTS:
        out[k.replace("_", " ").capitalize()] = int(d.get(k, 0))
    return out


def stats_delta(now: Stats, before: Stats) -> dict[str, int]:
    """Counter differences of one engine between two snapshots of its
    :class:`kvbridge.nixl.Stats`, in the keys of :data:`COUNTS`."""
    def diff(name: str) -> int:
        return int(getattr(now, name) - getattr(before, name))

    def fails(kind: str) -> int:
        return int(now.failures.get(kind, 0) - before.failures.get(kind, 0))

    return {
        "requests_done": diff("requests_done"),
        "requests_failed": diff("requests_failed"),
        "failed_handshakes": fails("handshake"),
        "failed_transfers": fails("transfer-error"),
        "failed_posts": fails("post-exception"),
        "failed_timeouts": fails("timeout"),
        "expired_leases": diff("leases_expired"),
        "released_requests": diff("requests_released"),
        "ignored_notifications": diff("notifications_unknown") + diff("notifications_bad_token")
        + diff("notifications_malformed") + diff("notifications_unauthenticated"),
        "renewed_leases": diff("leases_renewed"),
        "staged_reads": diff("staged_reads"),
        "late_transfers": diff("late_transfers"),
        "late_errors": diff("late_errors"),
    }


class WithoutParams:
    """Requests a consumer (decode) engine was given without transfer parameters: each one
    computes its whole prompt locally. A router that drops ``kv_transfer_params`` (or a
    client that bypasses the router) shows here, not as a failure.

    The scheduler half counts every new request (:meth:`arrived`) and vLLM takes the
    interval's count with the scheduler's stats (:meth:`take`), as
    ``requests_without_params`` (``vllm:kvbridge_num_requests_without_params_total``).
    The first such request is logged as a warning, the others at debug level.
    """

    def __init__(self, consumer: bool) -> None:
        self.consumer = consumer
        self.total = 0
        self._pending = 0

    def arrived(self, request_id: str, params: Mapping[str, Any] | None) -> bool:
        """Count ``request_id`` when this engine is a consumer and ``params`` ask for no
        transfer (absent, empty, or neither ``do_remote_prefill`` nor ``do_remote_decode``);
        True when it was counted."""
        if not self.consumer or route(params).transfer:
            return False
        self.total += 1
        self._pending += 1
        (log.warning if self.total == 1 else log.debug)(
            "request %s reached this decode (consumer) engine without kv_transfer_params: "
            "its prompt is computed here%s", request_id,
            " (counted in vllm:kvbridge_num_requests_without_params_total; a router that drops "
            "kv_transfer_params shows there)" if self.total == 1 else "")
        return True

    def take(self) -> dict[str, Any] | None:
        """The count since the last call, as stats data (None when it is 0)."""
        if not self._pending:
            return None
        n, self._pending = self._pending, 0
        return {"requests_without_params": n}
