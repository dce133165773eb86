"""kvbridge-router: an OpenAI-compatible router for disaggregated prefill/decode serving.

Each request goes to a prefill instance with ``kv_transfer_params =
{"do_remote_decode": true}`` and one output token; the ``kv_transfer_params``
it returns go unchanged to a decode instance, whose answer (streamed or not)
goes back to the client. See docs/serving.md.

Public names: :class:`RouterConfig`, :class:`Router` (its ``.app`` is the ASGI
app), :func:`serve`, :func:`load_config`, :class:`ConfigError`.
"""

from .app import Router, serve
from .config import ConfigError, RouterConfig, load_config

__all__ = ["ConfigError", "Router", "RouterConfig", "load_config", "serve"]
