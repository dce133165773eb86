"""``kv_transfer_params``, both modes, both directions: the one module that names their keys.

vLLM hands each request's ``kv_transfer_params`` (a dict) to the connector and
returns what ``request_finished`` gives back as the output's parameters. The
keys are the ones vLLM's NixlConnector uses (so routers and vLLM's proxy
examples work unchanged), plus kvbridge's own, all prefixed ``kvbridge_``.
Unknown keys are ignored and a key whose value is null counts as absent.

Pull mode. A prefill request carries ``{"do_remote_decode": true}``. The prefill
engine's output (:func:`encode_remote_prefill`) carries what the decode engine
needs; a router passes that dict, unchanged, as the decode request's
parameters, parsed here once into a :class:`RemotePrefill`.

Push mode. The router gives one request to both engines with one transfer id,
and tells the decode engine where the prefill engine's side channel is::

    decode:  {"do_remote_prefill": true, "transfer_mode": "push",
              "kvbridge_transfer_id": ID, "remote_host": P_HOST, "remote_port": P_PORT}
    prefill: {"do_remote_decode": true, "transfer_mode": "push",
              "kvbridge_transfer_id": ID}

parsed into :class:`PushDecode` and :class:`PushPrefill`; the prefill output is
:func:`encode_pushed`.

Every request is first sorted by :func:`route` (which side, which mode); the
record of its side is then parsed with msgspec, whose constraints check the
values, and a refusal (:class:`ParamsError`) names the key and what it must be.

This module imports nothing from vLLM, torch or NIXL.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from kvbridge.topology import BlockIds

__all__ = [
    "PARAMS_VERSION",
    "TRANSFER_ID_KEY",
    "BlockIds",
    "ParamsError",
    "PushDecode",
    "PushPrefill",
    "RemotePrefill",
    "Route",
    "decode_push_decode",
    "decode_push_prefill",
    "decode_remote_prefill",
    "encode_pushed",
    "encode_remote_prefill",
    "is_prefill_request",
    "is_remote_prefill",
    "prefill_request_params",
    "route",
]

#: Version of kvbridge's additions; a decode side refuses a newer major version.
PARAMS_VERSION = 1
#: the key naming a push-mode transfer (the same on the decode and the prefill request)
TRANSFER_ID_KEY = "kvbridge_transfer_id"

_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_Size = Annotated[int, msgspec.Meta(ge=1)]
_Count = Annotated[int, msgspec.Meta(ge=0)]
_BlockId = Annotated[int, msgspec.Meta(ge=0)]
_TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]

#: what each key must hold, for refusals (``kv_transfer_params[key] must be ...``)
_EXPECTED = {
    "remote_engine_id": "a non-empty string",
    "remote_host": "a non-empty string",
    "remote_request_id": "a non-empty string",
    "remote_port": "an integer in [1, 65535]",
    "tp_size": "an integer >= 1",
    "dcp_size": "an integer >= 1",
    "pp_size": "an integer >= 1",
    "remote_num_tokens": "an integer >= 0",
    "remote_block_size": "an integer >= 1",
    "remote_blocks_expiry_time": "a number",
    "remote_block_ids": "a list of non-negative block ids per KV-cache group (one list per group)",
    "transfer_mode": "'pull' or 'push'",
    "kvbridge_token": "a string",
    "kvbridge_incarnation": "a string",
    "kvbridge_version": (f"an integer <= {PARAMS_VERSION} (the newest this kvbridge understands): "
                         "upgrade kvbridge on the decode side"),
    TRANSFER_ID_KEY: ("a string of 1..256 characters naming the transfer (the same on both "
                      "requests)"),
}


class ParamsError(ValueError):
    """kv_transfer_params are missing a field or hold an invalid value."""


class Route(msgspec.Struct, frozen=True):
    """Which part a request plays, read from its flags (before any other key is parsed).

    ``remote_prefill``: a decode request whose prompt KV comes from a prefill engine
    (``do_remote_prefill``); ``remote_decode``: a prefill request whose KV goes to a
    decode engine (``do_remote_decode``); ``push``: ``transfer_mode`` is ``"push"``.
    """

    remote_prefill: bool = False
    remote_decode: bool = False
    push: bool = False

    @property
    def decode(self) -> bool:
        """A decode request with a remote prefill."""
        return self.remote_prefill

    @property
    def prefill(self) -> bool:
        """A prefill request for a remote decode (and not itself a decode request)."""
        return self.remote_decode and not self.remote_prefill

    @property
    def transfer(self) -> bool:
        """Asks for a transfer of either direction."""
        return self.remote_prefill or self.remote_decode

    def transferred(self) -> Route:
        """This route once a decode request's transfer was ordered (or dropped): it is no
        longer a decode request with a remote prefill."""
        return msgspec.structs.replace(self, remote_prefill=False)


_PLAIN = Route()


def route(params: Mapping[str, Any] | None) -> Route:
    """The :class:`Route` of a request's ``kv_transfer_params`` (a plain request for None,
    an empty dict or anything that is not a dict). Flags count when truthy."""
    if not isinstance(params, Mapping) or not params:
        return _PLAIN
    return Route(remote_prefill=bool(params.get("do_remote_prefill")),
                 remote_decode=bool(params.get("do_remote_decode")),
                 push=params.get("transfer_mode") == "push")


class RemotePrefill(msgspec.Struct, frozen=True, kw_only=True):
    """One pull-mode decode request's source: where the prefill engine holds the prompt.

    Parsed once from the decode request's ``kv_transfer_params``
    (:func:`decode_remote_prefill`), or built by the prefill engine for its output
    (:func:`encode_remote_prefill`). ``block_ids`` are the prefill engine's blocks for
    all computed tokens, one tuple per KV-cache group; ``token`` and ``incarnation``
    are kvbridge's (empty in another connector's parameters). Each field carries its
    wire key (``msgspec.field(name=...)``).
    """

    block_ids: tuple[tuple[_BlockId, ...], ...] = msgspec.field(name="remote_block_ids")
    engine_id: _NonEmpty = msgspec.field(name="remote_engine_id")
    request_id: _NonEmpty = msgspec.field(name="remote_request_id")
    host: _NonEmpty = msgspec.field(name="remote_host")
    port: _Port = msgspec.field(name="remote_port")
    tp_size: _Size = 1
    dcp_size: _Size = 1
    pp_size: _Size = 1
    num_tokens: _Count | None = msgspec.field(default=None, name="remote_num_tokens")
    expiry_time: float | None = msgspec.field(default=None, name="remote_blocks_expiry_time")
    mode: Literal["pull", "push"] = msgspec.field(default="pull", name="transfer_mode")
    version: Annotated[int, msgspec.Meta(le=PARAMS_VERSION)] = msgspec.field(
        default=PARAMS_VERSION, name="kvbridge_version")
    token: str = msgspec.field(default="", name="kvbridge_token")
    incarnation: str = msgspec.field(default="", name="kvbridge_incarnation")
    block_size: _Size | None = msgspec.field(default=None, name="remote_block_size")

    @classmethod
    def of(cls, **fields: Any) -> RemotePrefill:
        """Build a record by field name, checked as a parsed one is."""
        return _checked(msgspec.to_builtins(cls(**fields)), cls)

    @property
    def from_kvbridge(self) -> bool:
        """True when a kvbridge prefill engine issued these parameters (they carry its token)."""
        return bool(self.token)


class PushDecode(msgspec.Struct, frozen=True, kw_only=True):
    """A push-mode decode request: its transfer id and the prefill engine's side channel."""

    transfer_id: _TransferId = msgspec.field(name=TRANSFER_ID_KEY)
    host: _NonEmpty = msgspec.field(name="remote_host")
    port: _Port = msgspec.field(name="remote_port")


class PushPrefill(msgspec.Struct, frozen=True, kw_only=True):
    """A push-mode prefill request: its transfer id."""

    transfer_id: _TransferId = msgspec.field(name=TRANSFER_ID_KEY)


_T = TypeVar("_T", bound=msgspec.Struct)
_PATH = re.compile(r"at `\$\.([A-Za-z_0-9]+)")
_REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
             "remote_port")


def _present(params: Mapping[str, Any]) -> dict[str, Any]:
    """The keys whose value is not null."""
    return {k: v for k, v in params.items() if v is not None}


def _checked(values: dict[str, Any], cls: type[_T]) -> _T:
    """``values`` as a ``cls``; a refusal names the key and what it must hold."""
    try:
        return msgspec.convert(values, cls)
    except msgspec.ValidationError as exc:
        m = _PATH.search(str(exc))
        key = m.group(1) if m else ""
        if key in _EXPECTED:
            raise ParamsError(f"kv_transfer_params[{key!r}] must be {_EXPECTED[key]}, got "
                              f"{values.get(key)!r}") from None
        raise ParamsError(f"kv_transfer_params are invalid: {exc}") from None


def _groups(v: Any) -> Any:
    """``remote_block_ids`` as one list per group: older vLLM (one group) sends a flat list."""
    if isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool)
                                            for x in v):
        return [list(v)] if v else []
    return v


def decode_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """Parse a pull-mode decode request's ``kv_transfer_params``; raise :class:`ParamsError`
    naming the problem. Unknown keys are ignored (routers may add their own)."""
    if not isinstance(params, Mapping):
        raise ParamsError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    if not params.get("do_remote_prefill"):
        raise ParamsError("kv_transfer_params has no do_remote_prefill=true: not a decode request")
    values = _present(params)
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise ParamsError(
            f"kv_transfer_params lacks {', '.join(missing)}; pass the prefill output's "
            "kv_transfer_params to the decode request unchanged"
        )
    values["remote_block_ids"] = _groups(values["remote_block_ids"])
    return _checked(values, RemotePrefill)


def encode_remote_prefill(rp: RemotePrefill) -> dict[str, Any]:
    """The pull-mode prefill output's ``kv_transfer_params`` for ``rp``, in vLLM's keys
    (``remote_block_size`` only when known)."""
    out: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False}
    out.update(msgspec.to_builtins(rp))
    out["remote_block_ids"] = [list(g) for g in rp.block_ids]
    if rp.block_size is None:
        del out["remote_block_size"]
    return out


def decode_push_decode(params: Mapping[str, Any]) -> PushDecode:
    """Parse a push-mode decode request's transfer id and prefill side channel."""
    values = _present(params)
    if TRANSFER_ID_KEY not in values:
        raise ParamsError(f"kv_transfer_params[{TRANSFER_ID_KEY!r}] must be "
                          f"{_EXPECTED[TRANSFER_ID_KEY]}, got None")
    for key, what in (("remote_host", "host"), ("remote_port", "port (1..65535)")):
        if key not in values:
            raise ParamsError(f"push kv_transfer_params need {key}: the prefill engine's "
                              f"side-channel {what}")
    return _checked(values, PushDecode)


def decode_push_prefill(params: Mapping[str, Any]) -> PushPrefill:
    """Parse a push-mode prefill request's transfer id."""
    values = _present(params)
    if TRANSFER_ID_KEY not in values:
        raise ParamsError(f"kv_transfer_params[{TRANSFER_ID_KEY!r}] must be "
                          f"{_EXPECTED[TRANSFER_ID_KEY]}, got None")
    return _checked(values, PushPrefill)


def encode_pushed() -> dict[str, Any]:
    """The push-mode prefill output's ``kv_transfer_params`` (its blocks were pushed)."""
    return {"transfer_mode": "push", "kvbridge_pushed": True}


def prefill_request_params() -> dict[str, Any]:
    """Parameters for a request that prefill should compute and hand to decode."""
    return {"do_remote_decode": True}


def is_prefill_request(params: Mapping[str, Any] | None) -> bool:
    """True for a request that prefill computes and keeps for a remote decode."""
    return route(params).prefill


def is_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """True for a decode request whose prompt KV is to be pulled from prefill."""
    return route(params).decode
