"""Which pairs of engines a transfer can serve.

:func:`check_compatible` raises :class:`TopologyError` naming what to change for
any pair that cannot be planned: a different model, dtype or Mamba state, block
sizes that do not divide, packed caches paired with anything but the same packed
cache.
"""

from __future__ import annotations

from .dtypes import canonical_dtype
from .errors import TopologyError
from .groups import check_same_groups
from .spec import EngineSpec


def check_compatible(local: EngineSpec, remote: EngineSpec) -> None:
    """Raise TopologyError for any pair of engines a transfer cannot serve."""
    where = f"local engine {local.engine_id!r} vs remote engine {remote.engine_id!r}"
    if local.engine_id == remote.engine_id:
        raise TopologyError(f"{where}: both sides have the same engine id; give each engine its own id")
    for name, hint in (
        ("num_kv_heads", "both engines must serve the same model"),
        ("head_dim", "both engines must serve the same model"),
        ("num_layers", "both engines must serve the same model"),
        ("use_mla", "both engines must use the same attention (MLA or not)"),
    ):
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            raise TopologyError(f"{where}: {name} differs ({a} vs {b}); {hint}")
    if local.dtype_size != remote.dtype_size or canonical_dtype(local.dtype) != canonical_dtype(remote.dtype):
        raise TopologyError(
            f"{where}: KV cache dtype differs ({local.dtype} vs {remote.dtype}); "
            "run both engines with the same kv-cache dtype"
        )
    _check_packed(local, remote, where)
    check_same_groups(local.groups, remote.groups, local.num_layers, where)
    if _mamba_shape(local) != _mamba_shape(remote):
        raise TopologyError(
            f"{where}: Mamba state differs ({local.mamba} vs {remote.mamba}); "
            "both engines must serve the same hybrid model"
        )
    for what, a, b in (
        ("block sizes", local.block_size, remote.block_size),
        ("kernel block sizes", local.kernel_block_size, remote.kernel_block_size),
    ):
        if max(a, b) % min(a, b):
            raise TopologyError(
                f"{where}: {what} {a} and {b} tokens do not divide; "
                "the larger block size must be a multiple of the smaller"
            )
    if local.block_size != remote.block_size and local.mamba is not None:
        raise TopologyError(
            f"{where}: hybrid Mamba models need equal block sizes on both sides "
            f"({local.block_size} vs {remote.block_size}); set the same block size"
        )
    if local.cross_layer != remote.cross_layer and local.block_size != remote.block_size:
        raise TopologyError(
            f"{where}: a cross-layer cache on one side only cannot be combined with a block-size "
            "mismatch; use equal block sizes"
        )


def _check_packed(local: EngineSpec, remote: EngineSpec, where: str) -> None:
    """Packed caches pair only with packed caches of the same head order and kernel block size.

    Inside a packed head slice the order of K and V over the tokens is backend-specific
    (K rows then V rows, or K|V per token), so kvbridge never cuts a slice along tokens and
    never rearranges one: reads take whole head slices of whole physical blocks.
    """
    if not (local.is_packed or remote.is_packed):
        return
    if local.layout is not remote.layout:
        raise TopologyError(
            f"{where}: cache layouts {local.layout.value} and {remote.layout.value} cannot be "
            "paired: a packed cache keeps K and V of each head together in a backend-specific "
            "order, so it cannot be split into K and V elements; both engines must use the same "
            "vLLM-style packed cache (layout packed)"
        )
    if local.head_order is not remote.head_order:
        raise TopologyError(
            f"{where}: packed caches with different head orders ({local.head_order.value} vs "
            f"{remote.head_order.value}) would need the tokens inside each head slice rearranged, "
            "whose order is backend-specific; use the same head order (HND) on both engines"
        )
    if local.kernel_block_size != remote.kernel_block_size:
        raise TopologyError(
            f"{where}: packed caches need equal kernel (physical) block sizes, got "
            f"{local.kernel_block_size} and {remote.kernel_block_size} tokens; kvbridge cannot "
            "regroup tokens inside a packed head slice (their order is backend-specific), so use "
            "the same (kernel) block size on both engines"
        )


def _mamba_shape(spec: EngineSpec) -> tuple[int, ...] | None:
    m = spec.mamba
    if m is None:
        return None
    return (m.ssm_heads, m.ssm_head_dim, m.state_size, m.n_groups, m.conv_width,
            m.conv_dtype_size, m.ssm_dtype_size)
