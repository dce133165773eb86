"""``kv_transfer_params`` in vLLM's conventions, as typed values.

A prefill request carries ``{"do_remote_decode": True}``. The prefill engine's
output carries what the decode engine needs; a router passes that dict, unchanged,
as the decode request's ``kv_transfer_params``. The keys are the ones vLLM's
NixlConnector uses (so routers and vLLM's proxy examples work unchanged), plus
kvbridge's own keys, all prefixed ``kvbridge_``.

This module imports nothing from vLLM; it imports :mod:`kvbridge.nixl` (for its
``TransferParams``) when the first parameters are parsed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from kvbridge.nixl import TransferParams

__all__ = [
    "PARAMS_VERSION",
    "ParamsError",
    "RemotePrefill",
    "decode_remote_prefill",
    "encode_remote_prefill",
    "is_prefill_request",
    "is_remote_prefill",
    "prefill_request_params",
    "transfer_block_ids",
]

#: Version of kvbridge's additions; a decode side refuses a newer major version.
PARAMS_VERSION = 1

_REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
             "remote_port")


class ParamsError(ValueError):
    """kv_transfer_params are missing a field or hold an invalid value."""


@dataclass(frozen=True)
class RemotePrefill:
    """One decode request's source, parsed once from its ``kv_transfer_params``.

    ``transfer`` is the transfer engine's record (:class:`kvbridge.nixl.TransferParams`:
    prefill engine id, side-channel address, TP size, the block ids (flat for one
    KV-cache group, per group for hybrid models), token, incarnation, prefill
    request id), built once here and handed to
    :meth:`kvbridge.nixl.DecodeEngine.load` as is. The other fields are what
    vLLM's wire format adds: ``block_ids`` per KV-cache group, the prompt tokens
    the prefill engine computed, its mode, pipeline/context-parallel sizes, block
    size and lease expiry. Build one with :meth:`of`.
    """

    transfer: TransferParams
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int | None = None
    mode: Literal["pull", "push"] = "pull"
    dcp_size: int = 1
    pp_size: int = 1
    block_size: int | None = None
    expiry_time: float | None = None

    @classmethod
    def of(cls, *, engine_id: str, host: str, port: int, request_id: str,
           block_ids: tuple[tuple[int, ...], ...], tp_size: int = 1, token: str = "",
           incarnation: str = "", **wire: Any) -> RemotePrefill:
        """Validate the prefill engine's fields, build its :class:`TransferParams` and
        the record (``wire``: the other fields of :class:`RemotePrefill`)."""
        _check_str("remote_engine_id", engine_id)
        _check_str("remote_host", host)
        _check_str("remote_request_id", request_id)
        _check_int("remote_port", port, lo=1, hi=65535)
        _check_int("tp_size", tp_size, lo=1)
        if not isinstance(token, str):
            raise ParamsError(f"kvbridge_token must be a string, got {token!r}")
        if not isinstance(incarnation, str):
            raise ParamsError(f"kvbridge_incarnation must be a string, got {incarnation!r}")
        # the transfer engine's record; kvbridge.nixl imports torch and NIXL, so it is
        # imported when the first request is parsed, not when this module is
        from kvbridge.nixl import TransferParams

        transfer = TransferParams(engine_id=engine_id, host=host, port=port, tp_size=tp_size,
                                  block_ids=transfer_block_ids(block_ids), token=token,
                                  incarnation=incarnation, request_id=request_id)
        return cls(transfer, tuple(tuple(g) for g in block_ids), **wire)

    def __post_init__(self) -> None:
        _check_int("dcp_size", self.dcp_size, lo=1)
        _check_int("pp_size", self.pp_size, lo=1)
        if self.num_tokens is not None:
            _check_int("remote_num_tokens", self.num_tokens, lo=0)
        if self.block_size is not None:
            _check_int("remote_block_size", self.block_size, lo=1)
        if self.mode not in ("pull", "push"):
            raise ParamsError(f"transfer_mode must be 'pull' or 'push', got {self.mode!r}")
        if tuple(self.transfer.block_ids) != transfer_block_ids(self.block_ids):
            raise ParamsError("RemotePrefill.transfer.block_ids must be block_ids as the engine "
                              "takes them; build the record with RemotePrefill.of")

    @property
    def from_kvbridge(self) -> bool:
        """True when a kvbridge prefill engine issued these parameters (they carry its token)."""
        return bool(self.transfer.token)


def transfer_block_ids(groups: Sequence[Sequence[int]]
                       ) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
    """Per-group block ids as the transfer engine takes them: the flat list of a
    single-group engine (as before hybrid models), one tuple per group otherwise."""
    if len(groups) <= 1:
        return tuple(groups[0]) if groups else ()
    return tuple(tuple(g) for g in groups)


def _check_str(name: str, v: Any) -> None:
    if not isinstance(v, str) or not v:
        raise ParamsError(f"kv_transfer_params[{name!r}] must be a non-empty string, got {v!r}")


def _check_int(name: str, v: Any, *, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ParamsError(f"kv_transfer_params[{name!r}] must be an integer {bound}, got {v!r}")


def prefill_request_params() -> dict[str, Any]:
    """Parameters for a request that prefill should compute and hand to decode."""
    return {"do_remote_decode": True}


def is_prefill_request(params: Mapping[str, Any] | None) -> bool:
    """True for a request that prefill computes and keeps for a remote decode."""
    return bool(params) and bool(params.get("do_remote_decode")) and not params.get(
        "do_remote_prefill"
    )


def is_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """True for a decode request whose prompt KV is to be pulled from prefill."""
    return bool(params) and bool(params.get("do_remote_prefill"))


def encode_remote_prefill(rp: RemotePrefill) -> dict[str, Any]:
    """The prefill output's ``kv_transfer_params`` for ``rp``, in vLLM's keys."""
    t = rp.transfer
    out: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(g) for g in rp.block_ids],
        "remote_engine_id": t.engine_id,
        "remote_request_id": t.request_id,
        "remote_host": t.host,
        "remote_port": t.port,
        "tp_size": t.tp_size,
        "dcp_size": rp.dcp_size,
        "pp_size": rp.pp_size,
        "remote_num_tokens": rp.num_tokens,
        "remote_blocks_expiry_time": rp.expiry_time,
        "transfer_mode": rp.mode,
        "kvbridge_version": PARAMS_VERSION,
        "kvbridge_token": t.token,
        "kvbridge_incarnation": t.incarnation,
    }
    if rp.block_size is not None:
        out["remote_block_size"] = rp.block_size
    return out


def _block_ids(v: Any) -> tuple[tuple[int, ...], ...]:
    """Accept per-group lists (vLLM >= 0.11) and a flat list (older vLLM: one group)."""
    if not isinstance(v, (list, tuple)):
        raise ParamsError(f"kv_transfer_params['remote_block_ids'] must be a list, got {v!r}")
    groups: Sequence[Any]
    if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        groups = [v] if v else []
    else:
        groups = v
    out = []
    for g in groups:
        if not isinstance(g, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in g
        ):
            raise ParamsError(
                "kv_transfer_params['remote_block_ids'] must be a list of non-negative block "
                f"ids per KV-cache group, got {v!r}"
            )
        out.append(tuple(g))
    return tuple(out)


def decode_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """Parse a decode request's ``kv_transfer_params``; raise :class:`ParamsError`
    naming the problem. Unknown keys are ignored (routers may add their own)."""
    if not isinstance(params, Mapping):
        raise ParamsError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    if not params.get("do_remote_prefill"):
        raise ParamsError("kv_transfer_params has no do_remote_prefill=true: not a decode request")
    missing = [k for k in _REQUIRED if params.get(k) is None]
    if missing:
        raise ParamsError(
            f"kv_transfer_params lacks {', '.join(missing)}; pass the prefill output's "
            "kv_transfer_params to the decode request unchanged"
        )
    version = params.get("kvbridge_version", PARAMS_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version > PARAMS_VERSION:
        raise ParamsError(
            f"kv_transfer_params['kvbridge_version'] is {version!r}; this kvbridge understands "
            f"up to {PARAMS_VERSION}: upgrade kvbridge on the decode side"
        )

    def opt(key: str, default: Any) -> Any:
        v = params.get(key)
        return default if v is None else v

    return RemotePrefill.of(
        engine_id=params["remote_engine_id"],
        host=params["remote_host"],
        port=params["remote_port"],
        request_id=params["remote_request_id"],
        block_ids=_block_ids(params["remote_block_ids"]),
        tp_size=opt("tp_size", 1),
        num_tokens=params.get("remote_num_tokens"),
        mode=opt("transfer_mode", "pull"),
        token=opt("kvbridge_token", ""),
        dcp_size=opt("dcp_size", 1),
        pp_size=opt("pp_size", 1),
        block_size=params.get("remote_block_size"),
        expiry_time=params.get("remote_blocks_expiry_time"),
        incarnation=opt("kvbridge_incarnation", ""),
    )
