"""Connector configuration from vLLM's ``kv_connector_extra_config``.

Every setting has a key in ``kv_connector_extra_config``, an environment
variable used when the key is absent, and a default. Unknown keys are an error
that lists the valid ones: a typo must not silently fall back to a default.

This module imports nothing from vLLM, torch or NIXL (nor ZMQ: kvbridge.handshake, for the
key check, is imported only when an ``auth_key`` is given).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

__all__ = [
    "CONFIG_KEYS",
    "ConfigError",
    "ConfigKey",
    "ConnectorConfig",
    "EngineRoles",
    "check_engine_support",
    "parse_connector_config",
]

Mode = Literal["pull", "push"]


class ConfigError(ValueError):
    """A connector setting is unknown or has an invalid value."""


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector settings; the defaults here are the only declaration of them
    (see ``CONFIG_KEYS`` for each setting's key, environment variables and meaning).

    ``heartbeat_seconds=None`` means a quarter of ``lease_seconds``.
    """

    mode: Mode = "pull"
    push_layerwise: bool = True
    #: "all", "inherit" or CPU numbers (see CONFIG_KEYS)
    transfer_cpus: str | tuple[int, ...] = "all"
    backends: tuple[str, ...] = ("UCX",)
    ucx_threads: int = 1
    progress_thread: bool = True
    huge_pages: bool = True
    staging_mib: int = 0
    complete_in_background: bool = True
    gil_handoff_us: int = 200
    idle_wait_us: int = 1000
    warm_up: bool = True
    lease_seconds: float = 120.0
    heartbeat_seconds: float = None  # type: ignore[assignment]  # resolved to lease / 4
    handshake_timeout_seconds: float = 10.0
    transfer_timeout_seconds: float = 120.0
    enforce_compat: bool = True
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    #: shared secret of the side channel (the same on prefill and decode), never printed
    auth_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.heartbeat_seconds is None:
            object.__setattr__(self, "heartbeat_seconds", self.lease_seconds / 4)
        if self.heartbeat_seconds >= self.lease_seconds:
            raise ConfigError(
                f"heartbeat_seconds ({self.heartbeat_seconds:g}) must be shorter than "
                f"lease_seconds ({self.lease_seconds:g}), or the lease lapses between renewals; "
                "change them in kv_connector_extra_config "
                "(or KVBRIDGE_HEARTBEAT_SECONDS / KVBRIDGE_LEASE_SECONDS)"
            )

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


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(ConnectorConfig)}


@dataclass(frozen=True)
class ConfigKey:
    """One setting: its extra-config key, environment variables (first set wins) and a
    one-line description for error messages and docs; its default is the
    :class:`ConnectorConfig` field's."""

    key: str
    env: tuple[str, ...]
    help: str

    @property
    def default(self) -> Any:
        return _DEFAULTS[self.key]


CONFIG_KEYS: tuple[ConfigKey, ...] = (
    ConfigKey("mode", ("KVBRIDGE_MODE",),
              "'pull' (decode reads from prefill) or 'push' (prefill writes to decode)"),
    ConfigKey("push_layerwise", ("KVBRIDGE_PUSH_LAYERWISE",),
              "push mode: write each layer as soon as vLLM computed it, overlapping the rest of "
              "the prefill (false: write the whole request after the forward pass)"),
    ConfigKey("transfer_cpus", ("KVBRIDGE_TRANSFER_CPUS",),
              "CPUs of each worker's transfer thread (it posts READs/WRITEs; in host memory it "
              "copies): 'all' (any online CPU, not only the core vLLM binds the worker to), "
              "'inherit', or a list of CPU numbers (environment: comma-separated)"),
    ConfigKey("backends", ("KVBRIDGE_BACKENDS",),
              "NIXL backends, a list (environment: comma-separated)"),
    ConfigKey("ucx_threads", ("KVBRIDGE_UCX_THREADS",),
              "progress threads of the NIXL UCX backend (0 = none)"),
    ConfigKey("progress_thread", ("KVBRIDGE_PROGRESS_THREAD",),
              "run NIXL's native progress thread in every agent (it moves transfers and "
              "notifications without a Python thread; false: the engines' worker threads "
              "progress NIXL from Python)"),
    ConfigKey("huge_pages", ("KVBRIDGE_HUGE_PAGES",),
              "back host-memory KV caches with transparent huge pages before registering them "
              "(host READs run faster; no effect on GPU caches)"),
    ConfigKey("staging_mib", ("KVBRIDGE_STAGING_MIB",),
              "pull mode, host memory: MiB of staging buffer per decode rank; READs whose pieces "
              "are scattered here but adjacent on the prefill side (heads split between prefill "
              "ranks) land in it in a few large descriptors and are then copied into place; 0: "
              "none"),
    ConfigKey("complete_in_background", ("KVBRIDGE_COMPLETE_IN_BACKGROUND",),
              "decode: the worker thread that posts a request's READs checks them until they "
              "complete (else only the once-per-step poll does, and large host READs advance "
              "only then)"),
    ConfigKey("gil_handoff_us", ("KVBRIDGE_GIL_HANDOFF_US",),
              "while a rank's transfer thread has work (a handshake, posting, checking), each "
              "vLLM step pauses this many microseconds so that the thread gets Python's GIL "
              "(without it a busy engine loop kept first handshakes waiting for seconds); 0: "
              "never"),
    ConfigKey("idle_wait_us", ("KVBRIDGE_IDLE_WAIT_US",),
              "push mode: in a step that runs nothing while this decode rank awaits the "
              "prefill engine's writes, wait up to this many microseconds for a request to "
              "land before returning to vLLM (which would step again at once, spinning a "
              "core); it returns as soon as one has; pull mode and prefill ranks never wait; "
              "0: never wait"),
    ConfigKey("warm_up", ("KVBRIDGE_WARM_UP",),
              "at start, connect each rank's NIXL agent once to a throwaway agent and move a few "
              "bytes both ways, so that the first request does not pay the one-time connection "
              "set-up (host memory with the progress thread only)"),
    ConfigKey("lease_seconds", ("KVBRIDGE_LEASE_SECONDS",),
              "how long prefill holds a request's blocks for decode without renewal"),
    ConfigKey("heartbeat_seconds", ("KVBRIDGE_HEARTBEAT_SECONDS",),
              "lease renewal interval of waiting decode requests (default lease/4)"),
    ConfigKey("handshake_timeout_seconds", ("KVBRIDGE_HANDSHAKE_TIMEOUT_SECONDS",),
              "bound on one side-channel handshake"),
    ConfigKey("transfer_timeout_seconds", ("KVBRIDGE_TRANSFER_TIMEOUT_SECONDS",),
              "bound on one request's transfer before it is failed"),
    ConfigKey("enforce_compat", ("KVBRIDGE_ENFORCE_COMPAT",),
              "refuse peers whose compatibility hash differs"),
    ConfigKey("side_channel_host", ("KVBRIDGE_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_HOST"),
              "address the prefill side channel listens on and advertises"),
    ConfigKey("side_channel_port", ("KVBRIDGE_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT"),
              "side-channel port (plus the data-parallel index)"),
    ConfigKey("auth_key", ("KVBRIDGE_AUTH_KEY",),
              "shared secret (16+ bytes, the same on prefill and decode engines) that "
              "authenticates handshakes and notifications; unset: no authentication"),
)

_BY_KEY = {k.key: k for k in CONFIG_KEYS}


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


def _cpus(key: str, value: Any, env_var: str | None) -> str | tuple[int, ...]:
    if isinstance(value, str) and value.strip().lower() in ("all", "inherit"):
        return value.strip().lower()
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(items, (list, tuple)) and items:
        try:
            cpus = tuple(_int(key, v, env_var, lo=0, hi=1 << 16) for v in items)
        except ConfigError:
            cpus = ()
        if cpus:
            return cpus
    raise ConfigError(f"{_where(key, env_var)} must be 'all', 'inherit' or a list of CPU numbers, "
                      f"got {value!r}")


def _auth_key(key: str, value: Any, env_var: str | None) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{_where(key, env_var)} must be a string (the shared secret), got a "
                          f"{type(value).__name__}")
    from kvbridge.handshake import normalize_key  # imports ZMQ: only when a key is set

    try:
        normalize_key(value)
    except ValueError as exc:  # the message never contains the key
        raise ConfigError(f"{_where(key, env_var)}: {exc}") from None
    return value


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
    "push_layerwise": _bool,
    "transfer_cpus": _cpus,
    "huge_pages": _bool,
    "staging_mib": lambda k, v, e: _int(k, v, e, lo=0, hi=1 << 20),
    "complete_in_background": _bool,
    "warm_up": _bool,
    "gil_handoff_us": lambda k, v, e: _int(k, v, e, lo=0, hi=10_000),
    "idle_wait_us": lambda k, v, e: _int(k, v, e, lo=0, hi=100_000),
    "side_channel_host": _host,
    "side_channel_port": lambda k, v, e: _int(k, v, e, lo=1, hi=65535),
    "auth_key": _auth_key,
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

    return ConnectorConfig(**values)


# --------------------------------------------------------------------------- what vLLM runs


@dataclass(frozen=True)
class EngineRoles:
    """Which halves of the transfer one engine runs (from vLLM's ``kv_role``)."""

    producer: bool  # prefill: holds finished requests' blocks for decode engines
    consumer: bool  # decode: loads prompts' blocks from prefill engines


def check_engine_support(config: ConnectorConfig, *, kv_role: str | None, kv_cache_groups: int = 1,
                         pipeline_parallel_size: int = 1, decode_context_parallel_size: int = 1,
                         prefill_context_parallel_size: int = 1) -> EngineRoles:
    """Refuse, at connector start-up, a vLLM engine configuration the connector cannot serve.

    Raises :class:`ConfigError` naming the setting and what to change; returns the
    engine's roles otherwise. Pipeline parallelism and context parallelism (decode
    or prefill) split a request's KV cache between ranks in ways kvbridge's transfer
    plan does not describe: running with them would load wrong blocks. Models with
    several KV-cache groups (hybrid models) are moved in pull mode only.
    """
    if kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ConfigError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {kv_role!r}")
    for name, size in (("pipeline_parallel_size", pipeline_parallel_size),
                       ("decode_context_parallel_size", decode_context_parallel_size),
                       ("prefill_context_parallel_size", prefill_context_parallel_size)):
        if size != 1:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                f"KVBridgeConnector does not support {name}={size}: kvbridge transfers KV caches "
                f"split by tensor parallelism only. Run this engine with {name}=1 ({flag} 1) and "
                "use tensor_parallel_size to spread it over more devices"
            )
    if kv_cache_groups > 1 and config.mode == "push":
        raise ConfigError(
            f"this model has {kv_cache_groups} KV-cache groups (sliding-window, Mamba or mixed "
            "attention layers); KVBridgeConnector moves hybrid models in pull mode only: set "
            "kv_connector_extra_config['mode'] = 'pull' (the default) on both engines"
        )
    return EngineRoles(producer=kv_role in ("kv_producer", "kv_both"),
                       consumer=kv_role in ("kv_consumer", "kv_both"))
