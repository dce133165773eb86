"""Connector configuration from vLLM's ``kv_connector_extra_config``.

Every setting has a key in ``kv_connector_extra_config``, an environment
variable used when the key is absent, and a default. Unknown keys are an error
that lists the valid ones: a typo must not silently fall back to a default.

This module imports nothing from vLLM, torch or NIXL.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = [
    "CONFIG_KEYS",
    "ConfigError",
    "ConfigKey",
    "ConnectorConfig",
    "parse_connector_config",
]

Mode = Literal["pull", "push"]


class ConfigError(ValueError):
    """A connector setting is unknown or has an invalid value."""


@dataclass(frozen=True)
class ConfigKey:
    """One setting: its extra-config key, environment variables (first set wins),
    default, and a one-line description for error messages and docs."""

    key: str
    env: tuple[str, ...]
    default: Any
    help: str


CONFIG_KEYS: tuple[ConfigKey, ...] = (
    ConfigKey("mode", ("KVBRIDGE_MODE",), "pull",
              "'pull' (decode reads from prefill) or 'push' (prefill writes to decode)"),
    ConfigKey("backends", ("KVBRIDGE_BACKENDS",), ("UCX",),
              "NIXL backends, a list (environment: comma-separated)"),
    ConfigKey("ucx_threads", ("KVBRIDGE_UCX_THREADS",), 1,
              "progress threads of the NIXL UCX backend (0 = none)"),
    ConfigKey("progress_thread", ("KVBRIDGE_PROGRESS_THREAD",), False,
              "run NIXL's progress thread in every agent (spins a core while idle; the connector "
              "polls NIXL every engine step instead)"),
    ConfigKey("huge_pages", ("KVBRIDGE_HUGE_PAGES",), True,
              "back host-memory KV caches with transparent huge pages before registering them "
              "(host READs run faster; no effect on GPU caches)"),
    ConfigKey("lease_seconds", ("KVBRIDGE_LEASE_SECONDS",), 120.0,
              "how long prefill holds a request's blocks for decode without renewal"),
    ConfigKey("heartbeat_seconds", ("KVBRIDGE_HEARTBEAT_SECONDS",), None,
              "lease renewal interval of waiting decode requests (default lease/4)"),
    ConfigKey("handshake_timeout_seconds", ("KVBRIDGE_HANDSHAKE_TIMEOUT_SECONDS",), 10.0,
              "bound on one side-channel handshake"),
    ConfigKey("transfer_timeout_seconds", ("KVBRIDGE_TRANSFER_TIMEOUT_SECONDS",), 120.0,
              "bound on one request's transfer before it is failed"),
    ConfigKey("enforce_compat", ("KVBRIDGE_ENFORCE_COMPAT",), True,
              "refuse peers whose compatibility hash differs"),
    ConfigKey("side_channel_host", ("KVBRIDGE_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_HOST"),
              "127.0.0.1", "address the prefill side channel listens on and advertises"),
    ConfigKey("side_channel_port", ("KVBRIDGE_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT"),
              5600, "side-channel port (plus the data-parallel index)"),
)

_BY_KEY = {k.key: k for k in CONFIG_KEYS}


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector settings (see ``CONFIG_KEYS`` for meanings)."""

    mode: Mode = "pull"
    backends: tuple[str, ...] = ("UCX",)
    ucx_threads: int = 1
    progress_thread: bool = False
    huge_pages: bool = True
    lease_seconds: float = 120.0
    heartbeat_seconds: float = 30.0
    handshake_timeout_seconds: float = 10.0
    transfer_timeout_seconds: float = 120.0
    enforce_compat: bool = True
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600

    def port_for(self, data_parallel_index: int) -> int:
        """The side-channel port of one data-parallel replica."""
        if data_parallel_index < 0:
            raise ConfigError(f"data_parallel_index must be >= 0, got {data_parallel_index}")
        port = self.side_channel_port + data_parallel_index
        if port > 65535:
            raise ConfigError(
                f"side_channel_port {self.side_channel_port} + data-parallel index "
                f"{data_parallel_index} exceeds 65535; choose a lower side_channel_port"
            )
        return port

    def to_extra_config(self) -> dict[str, Any]:
        """The ``kv_connector_extra_config`` dict that parses back to this config."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["backends"] = list(self.backends)
        return out


# --------------------------------------------------------------------------- parsing


def _where(key: str, env_var: str | None) -> str:
    return f"environment variable {env_var}" if env_var else f"kv_connector_extra_config[{key!r}]"


def _bool(key: str, value: Any, env_var: str | None) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{_where(key, env_var)} must be a boolean (true/false), got {value!r}")


def _int(key: str, value: Any, env_var: str | None, *, lo: int, hi: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{_where(key, env_var)} must be an integer, got {value!r}")
    if isinstance(value, str):
        try:
            value = int(value.strip(), 10)
        except ValueError:
            raise ConfigError(f"{_where(key, env_var)} must be an integer, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise ConfigError(f"{_where(key, env_var)} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{_where(key, env_var)} must be in [{lo}, {hi}], got {value}")
    return value


def _seconds(key: str, value: Any, env_var: str | None) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{_where(key, env_var)} must be a number of seconds, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ConfigError(
                f"{_where(key, env_var)} must be a number of seconds, got {value!r}"
            ) from None
    if not isinstance(value, (int, float)):
        raise ConfigError(f"{_where(key, env_var)} must be a number of seconds, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{_where(key, env_var)} must be a positive finite number, got {value!r}")
    return value


def _mode(key: str, value: Any, env_var: str | None) -> Mode:
    v = value.strip().lower() if isinstance(value, str) else value
    if v not in ("pull", "push"):
        raise ConfigError(f"{_where(key, env_var)} must be 'pull' or 'push', got {value!r}")
    return v  # type: ignore[return-value]


def _backends(key: str, value: Any, env_var: str | None) -> tuple[str, ...]:
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(
            f"{_where(key, env_var)} must be a list of backend names such as ['UCX'], got {value!r}"
        )
    if not items or not all(isinstance(v, str) and v.strip() for v in items):
        raise ConfigError(
            f"{_where(key, env_var)} must name at least one backend (e.g. 'UCX'), got {value!r}"
        )
    names = tuple(v.strip() for v in items)
    if len(set(names)) != len(names):
        raise ConfigError(f"{_where(key, env_var)} lists a backend twice: {value!r}")
    return names


def _host(key: str, value: Any, env_var: str | None) -> str:
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value.strip()):
        raise ConfigError(f"{_where(key, env_var)} must be a host name or address, got {value!r}")
    return value.strip()


_PARSERS: dict[str, Callable[[str, Any, str | None], Any]] = {
    "mode": _mode,
    "backends": _backends,
    "ucx_threads": lambda k, v, e: _int(k, v, e, lo=0, hi=64),
    "lease_seconds": _seconds,
    "heartbeat_seconds": _seconds,
    "handshake_timeout_seconds": _seconds,
    "transfer_timeout_seconds": _seconds,
    "enforce_compat": _bool,
    "progress_thread": _bool,
    "huge_pages": _bool,
    "side_channel_host": _host,
    "side_channel_port": lambda k, v, e: _int(k, v, e, lo=1, hi=65535),
}


def parse_connector_config(
    extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> ConnectorConfig:
    """Build a :class:`ConnectorConfig` from ``kv_connector_extra_config``.

    Precedence per setting: the extra-config key, then the first environment
    variable of ``CONFIG_KEYS`` that is set (``env`` defaults to ``os.environ``),
    then the default. Raises :class:`ConfigError` for unknown keys or bad values.
    """
    if env is None:
        import os

        env = os.environ
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k not in _BY_KEY)
    if unknown:
        valid = ", ".join(k.key for k in CONFIG_KEYS)
        raise ConfigError(
            f"unknown kv_connector_extra_config key(s) {', '.join(map(repr, unknown))} for "
            f"KVBridgeConnector; valid keys: {valid}"
        )
    values: dict[str, Any] = {}
    for spec in CONFIG_KEYS:
        if spec.key in extra:
            raw, env_var = extra[spec.key], None
        else:
            env_var = next((e for e in spec.env if env.get(e, "").strip() != ""), None)
            if env_var is None:
                continue
            raw = env[env_var]
        values[spec.key] = _PARSERS[spec.key](spec.key, raw, env_var)

    lease = values.get("lease_seconds", _BY_KEY["lease_seconds"].default)
    heartbeat = values.get("heartbeat_seconds", lease / 4)
    if heartbeat >= lease:
        raise ConfigError(
            f"heartbeat_seconds ({heartbeat:g}) must be shorter than lease_seconds ({lease:g}), "
            "or the lease lapses between renewals; change them in kv_connector_extra_config "
            "(or KVBRIDGE_HEARTBEAT_SECONDS / KVBRIDGE_LEASE_SECONDS)"
        )
    values["heartbeat_seconds"] = heartbeat
    return ConnectorConfig(**values)
