"""The one table of KV-cache element types kvbridge knows.

Every package names dtypes the same way: a short canonical name (``"bf16"``,
``"fp32"``, ``"fp8_e4m3"``, ...). :func:`canonical_dtype` folds the spellings
that engines and torch use (``"bfloat16"``, ``"torch.float16"``,
``"float8_e4m3fn"``, ``"fp8"``) onto it; :func:`dtype_size` gives its bytes.
"""

from __future__ import annotations

from .errors import TopologyError

#: canonical name -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

#: other spellings (torch names, vLLM's ``kv_cache_dtype`` values) -> canonical name
DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fnuz": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    "float8_e5m2fnuz": "fp8_e5m2",
}


def canonical_dtype(name: object) -> str:
    """kvbridge's name for a dtype spelling (``torch.bfloat16`` -> ``"bf16"``).

    Accepts a string or anything whose ``str()`` names a dtype (a torch dtype).
    Raises :class:`TopologyError` naming the supported types for anything else.
    """
    n = str(name).strip().lower().removeprefix("torch.")
    n = DTYPE_ALIASES.get(n, n)
    if n not in DTYPE_SIZES:
        raise TopologyError(
            f"unknown dtype {name!r}; use one of {sorted(DTYPE_SIZES)} "
            f"(or an alias: {sorted(DTYPE_ALIASES)})"
        )
    return n


def dtype_size(name: object) -> int:
    """Bytes per element of a dtype spelling such as ``"bf16"`` or ``"bfloat16"``."""
    return DTYPE_SIZES[canonical_dtype(name)]
