"""Router configuration: which instances, which timeouts (a frozen dataclass).

Built from command-line flags or a JSON file (see :func:`load_config`); every
check raises :class:`ConfigError` saying what to change.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .pool import Placement
from .ring import PrefixKey

#: Values of ``prefix_placement``: which pools place requests by prompt prefix.
PREFIX_PLACEMENTS = ("off", "decode", "both")


class ConfigError(ValueError):
    """The router configuration is invalid; the message says what to change."""


@dataclass(frozen=True)
class RouterConfig:
    """Everything a router needs; several routers may share one (they keep no shared state).

    ``prefill`` and ``decode`` are base URLs of OpenAI-compatible servers
    (``http://host:port``, no path). Timeouts are in seconds and bound every
    upstream call: ``prefill_timeout_s`` the whole prefill request,
    ``decode_timeout_s`` the whole decode request (streams included),
    ``connect_timeout_s`` opening a connection, ``health_timeout_s`` one health
    probe. ``upstream_keepalive_s`` is how long an idle connection to an instance
    is kept for the next request: keep it below the instances' own keep-alive
    (vLLM's OpenAI server closes idle connections after 5 s,
    ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), or a request may go out on a connection
    the instance is closing at that moment and fail (a ``ReadError``).
    ``health_interval_s`` is the pause between probe rounds;
    ``unhealthy_after`` failed probes in a row take an instance out of rotation
    (a request that cannot connect takes it out at once).

    ``mode`` is the engines' kvbridge transfer mode: ``"pull"`` (prefill first, then
    decode with the prefill's answer) or ``"push"`` (both at once, see
    :mod:`kvbridge.router.push`). In push mode the decode engine needs each prefill
    engine's side channel: ``prefill_side_channels`` maps a prefill URL to
    ``"host:port"``; a prefill URL not listed uses its own host and port
    :data:`DEFAULT_SIDE_CHANNEL_PORT` (kvbridge's default ``side_channel_port``).

    ``prefix_placement`` ("off", "decode" or "both": decode and prefill) sends
    requests whose prompts start alike to the same instance, by consistent
    hashing of the first ``prefix_blocks`` blocks of ``prefix_block_tokens``
    tokens (text: ``prefix_chars_per_token`` characters a token), unless that
    instance has more than ``prefix_load_margin`` requests in flight beyond the
    least-loaded one (see :mod:`kvbridge.router.ring`).
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 60.0
    decode_timeout_s: float = 600.0
    upstream_keepalive_s: float = 2.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    unhealthy_after: int = 3
    max_connections: int = 1024
    max_body_bytes: int = 16 * 1024 * 1024
    mode: str = "pull"
    prefill_side_channels: Mapping[str, str] = field(default_factory=dict)
    prefix_placement: str = "off"
    prefix_block_tokens: int = 16
    prefix_blocks: int = 4
    prefix_chars_per_token: int = 4
    prefix_load_margin: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple(normalize_url(u, "--prefill") for u in self.prefill))
        object.__setattr__(self, "decode", tuple(normalize_url(u, "--decode") for u in self.decode))
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)} (the engines' kvbridge "
                              f"'mode'), got {self.mode!r}")
        if not isinstance(self.prefill_side_channels, Mapping):
            raise ConfigError("prefill_side_channels must map prefill URLs to 'host:port'")
        channels = {}
        for url, where in self.prefill_side_channels.items():
            u = normalize_url(url, "--prefill-side-channel")
            if u not in self.prefill:
                raise ConfigError(f"--prefill-side-channel names {u}, which is not a prefill "
                                  f"instance ({', '.join(self.prefill) or 'none'}); list it "
                                  "with --prefill too")
            host, port = parse_side_channel(where)
            channels[u] = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        object.__setattr__(self, "prefill_side_channels", channels)
        if not self.decode:
            raise ConfigError("at least one decode instance is needed: pass --decode URL")
        for urls, flag in ((self.prefill, "--prefill"), (self.decode, "--decode")):
            dupes = sorted({u for u in urls if urls.count(u) > 1})
            if dupes:
                raise ConfigError(f"{flag} lists {', '.join(dupes)} more than once; list each instance once")
        both = sorted(set(self.prefill) & set(self.decode))
        if both:
            raise ConfigError(f"{', '.join(both)} is both a prefill and a decode instance; "
                              "give each role its own server")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is out of range: use 0..65535")
        for f in ("connect_timeout_s", "prefill_timeout_s", "decode_timeout_s",
                  "upstream_keepalive_s", "health_interval_s", "health_timeout_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ConfigError(f"{f} must be a positive number of seconds, got {v!r}")
        for f in ("max_connections", "max_body_bytes", "unhealthy_after", "prefix_block_tokens",
                  "prefix_blocks", "prefix_chars_per_token"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{f} must be a positive integer, got {v!r}")
        if self.prefix_placement not in PREFIX_PLACEMENTS:
            raise ConfigError(f"prefix_placement must be one of {', '.join(PREFIX_PLACEMENTS)}, "
                              f"got {self.prefix_placement!r}")
        v = self.prefix_load_margin
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"prefix_load_margin must be a non-negative integer (requests in "
                              f"flight), got {v!r}")

    def placement(self, role: str) -> Placement | None:
        """Prefix-aware placement for the ``role`` pool; None where it places by load alone."""
        if self.prefix_placement == "off" or (role == "prefill" and self.prefix_placement != "both"):
            return None
        return Placement(PrefixKey(self.prefix_block_tokens, self.prefix_blocks,
                                   self.prefix_chars_per_token), self.prefix_load_margin)

    def side_channel(self, prefill_url: str) -> tuple[str, int]:
        """The side channel (host, port) of the prefill instance at ``prefill_url``, which a
        push-mode decode request names (configured, or the URL's host and port 5600)."""
        where = self.prefill_side_channels.get(prefill_url)
        if where is not None:
            return parse_side_channel(where)
        host = urlsplit(prefill_url).hostname or "127.0.0.1"
        return host, DEFAULT_SIDE_CHANNEL_PORT

    def with_overrides(self, **changes: Any) -> RouterConfig:
        """A copy with some fields changed (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


#: transfer modes of the engines (kvbridge's connector setting ``mode``)
MODES = ("pull", "push")
#: kvbridge's default ``side_channel_port`` on prefill engines
DEFAULT_SIDE_CHANNEL_PORT = 5600


def parse_side_channel(where: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for IPv6) as (host, port); raises ConfigError."""
    if not isinstance(where, str) or ":" not in where:
        raise ConfigError(f"side channel {where!r} must be 'host:port' (the prefill engine's "
                          "side_channel_host and side_channel_port), e.g. 10.0.0.5:5600")
    host, _, port_s = where.strip().rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_s)
    except ValueError:
        port = -1
    if not host or not 1 <= port <= 65535:
        raise ConfigError(f"side channel {where!r} must be 'host:port' with a port in 1..65535, "
                          "e.g. 10.0.0.5:5600")
    return host, port


def normalize_url(url: str, flag: str = "instance") -> str:
    """``http://host:port`` without a trailing slash; raises ConfigError for anything else."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"{flag}: empty instance URL; pass e.g. http://10.0.0.5:8100")
    u = url.strip().rstrip("/")
    if "://" not in u:
        u = "http://" + u
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{flag}: {url!r} must be an http:// or https:// URL")
    try:
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"{flag}: {url!r} has an invalid port ({e})") from None
    if not parts.hostname or port is None:
        raise ConfigError(f"{flag}: {url!r} needs a host and a port, e.g. http://10.0.0.5:8100")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{flag}: {url!r} must be a base URL without a path (the router adds /v1/...)")
    return f"{parts.scheme}://{parts.netloc}"


_FIELDS = {f.name for f in fields(RouterConfig)}


def config_from_mapping(data: Mapping[str, Any], where: str = "config") -> RouterConfig:
    """A RouterConfig from a mapping with the dataclass's field names."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: the top level must be a JSON object")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(_FIELDS))}")
    kw = dict(data)
    for role in ("prefill", "decode"):
        v = kw.get(role, ())
        if isinstance(v, str) or not isinstance(v, Sequence):
            raise ConfigError(f"{where}: {role} must be a list of URLs")
        kw[role] = tuple(v)
    try:
        return RouterConfig(**kw)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_config(path: str | Path) -> RouterConfig:
    """Read a JSON config file, e.g. ``{"prefill": ["http://p0:8100"], "decode": [...], "port": 8000}``."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {p} is not valid JSON: {e}") from None
    return config_from_mapping(data, str(p))
