"""Plain records of the transfer engine, typed without importing it (standard library only).

The transfer engine (:mod:`kvbridge.nixl`) imports NIXL, numpy and torch; the
records it takes and reports live here, so that a caller (the vLLM adapter's
scheduler side, a router, a test) can build and type them without those
imports. :mod:`kvbridge.nixl` re-exports every one of them (the same objects).

Block ids are always per KV-cache group (:data:`BlockIds`): one tuple of ids per
group, in the order of ``EngineSpec.groups``; an engine that declares no groups
has exactly one group, so its ids are ``(ids,)``.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["BlockIds", "DecodeEvents", "Failed", "FailureKind", "Released", "TransferParams",
           "TransferRecord", "per_group_block_ids"]

#: Block ids of one request: one tuple per KV-cache group, in the order of
#: ``EngineSpec.groups`` (an engine without declared groups has one group: ``(ids,)``).
BlockIds = tuple[tuple[int, ...], ...]


def _group(ids: object, what: str, index: int) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(
            f"{what}: group {index} must be a tuple of block ids, got {ids!r}; pass one tuple "
            "per KV-cache group, e.g. ((3, 4, 5),) for an engine with one group"
        )
    if type(ids) in (tuple, list) and set(map(type, ids)) <= {int} and (not ids or min(ids) >= 0):
        return tuple(ids)  # the common case: Python ints (a tuple is returned as is)
    out = []
    for b in ids:
        try:
            if isinstance(b, bool):
                raise TypeError
            v = operator.index(b)
        except TypeError:
            raise ValueError(f"{what}: group {index} holds {b!r}, which is not a block id "
                             "(a non-negative integer)") from None
        if v < 0:
            raise ValueError(f"{what}: group {index} holds the negative block id {v}")
        out.append(v)
    return tuple(out)


def per_group_block_ids(ids: object, what: str = "block_ids") -> BlockIds:
    """``ids`` checked to be :data:`BlockIds` (one sequence of non-negative ints per
    KV-cache group), as tuples of ``int``. Raises ``ValueError`` saying what to pass,
    in particular for a flat list of ids (single-group engines take ``(ids,)``)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"{what} must be one tuple of block ids per KV-cache group, got {ids!r}")
    groups = tuple(ids)
    if not groups:
        raise ValueError(f"{what} names no KV-cache group: pass one tuple of block ids per group "
                         "(an engine without declared groups has one: ((),) for no blocks)")
    if any(isinstance(g, int) or _is_scalar(g) for g in groups):
        shown = repr(tuple(groups)) if len(groups) <= 3 else f"({', '.join(map(str, groups[:3]))}, ...)"
        raise ValueError(
            f"{what} is a flat list of block ids; pass one tuple per KV-cache group, in the "
            f"order of EngineSpec.groups: ({shown},) for an engine with one group"
        )
    return tuple(_group(g, what, i) for i, g in enumerate(groups))


def _is_scalar(x: object) -> bool:
    """An integer of another type (numpy's): it has ``__index__`` and is not iterable."""
    return hasattr(x, "__index__") and not isinstance(x, Iterable)


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
            hi is not None and value > hi):
        span = f">= {lo}" if hi is None else f"within {lo}..{hi}"
        raise ValueError(f"TransferParams.{name} must be an integer {span}, got {value!r}")


@dataclass(frozen=True)
class TransferParams:
    """One request as a peer engine holds it: where that engine is, its blocks, the token.

    Pull mode: what a prefill engine hands out for a request (``PrefillEngine.hold``),
    passed through the router to the decode engine's ``DecodeEngine.load``.
    ``request_id`` is the id the prefill engine holds the request under; the decode
    side names it in its notifications. Empty means the decode side uses the same id
    as the prefill side.

    Push mode: where a prefill engine writes a request (``PrefillEngine.push``):
    the decode engine's address, TP size, blocks and the token it expects, and
    ``computed_tokens``, the tokens the decode engine already holds (a prefix hit:
    ``block_ids`` start after them). ``request_id`` is the decode engine's id of the
    request, named in the WRITTEN notifications (empty: the prefill side's id).

    ``block_ids``: :data:`BlockIds`, one tuple per KV-cache group of the engine that
    holds the blocks, in the order of its ``EngineSpec.groups`` (``(ids,)`` for an
    engine with one group); given as lists, they are stored as tuples. Raises
    ``ValueError`` for a field of the wrong type or range.
    """

    engine_id: str
    host: str
    port: int
    tp_size: int
    block_ids: BlockIds
    token: str
    incarnation: str = ""
    request_id: str = ""
    computed_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(f"TransferParams.engine_id must be a non-empty string, got "
                             f"{self.engine_id!r}")
        for name in ("host", "token", "incarnation", "request_id"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"TransferParams.{name} must be a string, got {getattr(self, name)!r}")
        _check_int("port", self.port, 0, 65535)
        _check_int("tp_size", self.tp_size, 1)
        _check_int("computed_tokens", self.computed_tokens, 0)
        object.__setattr__(self, "block_ids", per_group_block_ids(self.block_ids, "TransferParams.block_ids"))


@dataclass(frozen=True)
class TransferRecord:
    """One finished transfer (NIXL telemetry), for callers that keep per-transfer figures."""

    op: str  # "READ" or "WRITE"
    peer_engine: str
    bytes: int
    descriptors: int
    post_us: int
    xfer_us: int


@dataclass(frozen=True)
class Released:
    """A request whose blocks the prefill engine may free now (``block_ids``: every
    group's ids in one tuple)."""

    request_id: str
    block_ids: tuple[int, ...]
    reason: str  # "notified", "lease-expired", "written" or "push-failed"


class FailureKind(str, enum.Enum):
    """Why a decode rank gave a request up."""

    HANDSHAKE = "handshake"
    TRANSFER = "transfer-error"
    POST = "post-exception"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class Failed:
    """A request that will not complete: its local blocks hold garbage and must be recomputed
    (``invalid_block_ids``: every group's ids in one tuple)."""

    request_id: str
    kind: FailureKind
    invalid_block_ids: tuple[int, ...]
    message: str


@dataclass(frozen=True)
class DecodeEvents:
    """What ``DecodeEngine.poll`` reports: requests done, requests failed."""

    done: list[str]
    failed: list[Failed]
