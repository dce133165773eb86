"""vLLM's Mamba-type layers of the running engine as kvbridge geometry.

A hybrid model's Mamba state is sharded over TP ranks by SSM head, its ``B``/``C``
channels by group, and vLLM *replicates* a single group on every rank when the TP
size exceeds it. One rank's state shapes cannot tell a replicated group from groups
that shard (one group per rank either way), and model configurations name the group
count differently per family (``mamba_n_groups``, ``n_groups``, ``mamba_ngroups``,
...). So kvbridge reads the geometry vLLM itself computed for the running engine:
the Mamba layer objects it registered in the static forward context
(``compilation_config.static_forward_context``, what vLLM's
``get_layers_from_vllm_config`` reads), by attribute, importing nothing from vLLM.

:func:`layer_geometry` turns one layer into a :class:`MambaLayerGeometry` (plain
values); :func:`mamba_spec_from_layers` (pure) checks the layers against the
KV-cache spec's state shapes and gives the model's unsharded
:class:`kvbridge.topology.MambaSpec`.

vLLM 0.32 attributes read (``MambaMixer2``): ``num_heads``, ``head_dim``,
``ssm_state_size``, ``n_groups`` (groups allocated over all ranks, replication
included), ``norm.n_groups`` (the checkpoint's groups: vLLM builds the gated norm with
them), ``conv_kernel_size``, ``tp_size``, ``num_spec``. Gated delta-net
(``GatedDeltaNetAttention``): ``num_v_heads``, ``head_v_dim``, ``num_k_heads``,
``head_k_dim``, ``conv_kernel_size``, ``tp_size``, ``num_spec``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.topology import ConvLayout, MambaSpec, dtype_size
from kvbridge.vllm.cachespec import CacheShapeError

__all__ = ["MambaLayerGeometry", "layer_geometry", "mamba_layer_geometry", "mamba_spec_from_layers"]


@dataclass(frozen=True)
class MambaLayerGeometry:
    """One Mamba-type layer as vLLM built it for this engine (whole-model sizes).

    Gated delta-net maps onto the same pieces: value heads and their dim as the SSM
    heads and head dim, key heads as the ``B``/``C`` groups and the key head dim as the
    state size (its SSM state is ``[value heads, value dim, key dim]`` per rank).
    """

    mamba_type: str  # vLLM's backend name: "MAMBA2" or "GDN_ATTN"
    tp_size: int
    heads: int
    head_dim: int
    state_size: int
    #: the checkpoint's B/C groups
    n_groups: int
    #: groups vLLM allocates over all ranks: ``n_groups``, or the TP size when it
    #: replicates a single group on every rank
    allocated_groups: int
    conv_kernel: int
    #: speculative tokens: the conv state keeps ``conv_kernel - 1 + spec_tokens`` columns
    spec_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("tp_size", "heads", "head_dim", "state_size", "n_groups", "allocated_groups",
                     "conv_kernel"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise CacheShapeError(f"Mamba layer geometry: {name} must be a positive integer, "
                                      f"got {v!r}")
        if self.heads % self.tp_size or self.allocated_groups % self.tp_size:
            raise CacheShapeError(
                f"Mamba layer geometry: {self.heads} heads and {self.allocated_groups} groups do "
                f"not split over TP {self.tp_size}")
        if self.allocated_groups not in (self.n_groups, self.tp_size) or (
                self.allocated_groups != self.n_groups and self.n_groups != 1):
            raise CacheShapeError(
                f"Mamba layer geometry: {self.allocated_groups} groups allocated over TP "
                f"{self.tp_size} for a model of {self.n_groups}; vLLM replicates only a single "
                "group")

    @property
    def replicated(self) -> bool:
        """Whether every rank holds a copy of the model's single group."""
        return self.allocated_groups != self.n_groups

    @property
    def conv_columns(self) -> int:
        return self.conv_kernel - 1 + self.spec_tokens

    @property
    def conv_dim_per_rank(self) -> int:
        return (self.heads * self.head_dim + 2 * self.allocated_groups * self.state_size) // self.tp_size

    def state_shapes(self, *, dim_first: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One rank's (conv, SSM) state shapes as vLLM's KV-cache spec holds them."""
        conv = ((self.conv_dim_per_rank, self.conv_columns) if dim_first
                else (self.conv_columns, self.conv_dim_per_rank))
        return conv, (self.heads // self.tp_size, self.head_dim, self.state_size)


def _int(layer: Any, name: str, default: int | None = None) -> int | None:
    v = getattr(layer, name, default)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _backend(layer: Any) -> str:
    try:
        t = layer.mamba_type
    except Exception:  # noqa: BLE001 - a layer without a backend is not a Mamba layer
        return ""
    return str(getattr(t, "name", t))


def layer_geometry(layer: Any) -> MambaLayerGeometry | None:
    """The geometry of one vLLM layer object; None for a layer that is not a Mamba-2 or
    gated delta-net layer, or that lacks an attribute kvbridge reads (then the caller
    falls back to the KV-cache spec's shapes)."""
    kind = _backend(layer)
    if kind == "MAMBA2":
        norm_groups = _int(getattr(layer, "norm", None), "n_groups")
        vals = {"heads": _int(layer, "num_heads"), "head_dim": _int(layer, "head_dim"),
                "state_size": _int(layer, "ssm_state_size"), "allocated_groups": _int(layer, "n_groups"),
                "n_groups": norm_groups if norm_groups is not None else _int(layer, "n_groups")}
    elif kind == "GDN_ATTN":
        vals = {"heads": _int(layer, "num_v_heads"), "head_dim": _int(layer, "head_v_dim"),
                "state_size": _int(layer, "head_k_dim"), "n_groups": _int(layer, "num_k_heads"),
                "allocated_groups": _int(layer, "num_k_heads")}
    else:
        return None
    vals |= {"tp_size": _int(layer, "tp_size"), "conv_kernel": _int(layer, "conv_kernel_size"),
             "spec_tokens": _int(layer, "num_spec", 0)}
    if any(v is None for v in vals.values()):
        return None
    return MambaLayerGeometry(mamba_type=kind, **vals)  # type: ignore[arg-type]


def mamba_layer_geometry(vllm_config: Any, names: Sequence[str]) -> dict[str, MambaLayerGeometry]:
    """The geometry of the named layers vLLM registered in its static forward context
    (the layers of this worker's model); layers it lacks, or cannot describe, are left out."""
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)
    if not isinstance(ctx, Mapping):
        return {}
    out = {}
    for n in names:
        layer = ctx.get(n)
        geo = layer_geometry(layer) if layer is not None else None
        if geo is not None:
            out[n] = geo
    return out


def mamba_spec_from_layers(layers: Mapping[str, MambaLayerGeometry], *, tp_size: int,
                           state_shapes: Sequence[Sequence[int]], state_dtypes: Sequence[str],
                           mamba_type: str, dim_first: bool) -> MambaSpec:
    """The model's unsharded :class:`MambaSpec` from vLLM's layers, checked against the
    KV-cache spec's per-rank ``state_shapes`` (conv, SSM) and ``state_dtypes``.

    Raises :class:`CacheShapeError` when the layers differ from each other, from the
    engine's TP size, from the KV-cache spec's backend, or from the state shapes vLLM
    allocated (a layer kind or version whose state kvbridge would misdescribe)."""
    if not layers:
        raise CacheShapeError("no Mamba layer geometry to describe")
    kinds = sorted({g for g in layers.values()}, key=repr)
    if len(kinds) > 1:
        first = next(iter(layers))
        other = next(n for n, g in layers.items() if g != layers[first])
        raise CacheShapeError(
            f"Mamba layers {first!r} and {other!r} have different geometries "
            f"({layers[first]} vs {layers[other]}); KVBridgeConnector moves one Mamba state "
            "shape per engine")
    geo = kinds[0]
    if geo.tp_size != tp_size:
        raise CacheShapeError(f"vLLM's Mamba layers are split over TP {geo.tp_size}, the engine "
                              f"runs TP {tp_size}")
    if geo.mamba_type != mamba_type:
        raise CacheShapeError(f"vLLM's Mamba layers are {geo.mamba_type} layers but their KV-cache "
                              f"group holds {mamba_type} state")
    want = tuple(tuple(int(x) for x in s) for s in state_shapes)
    got = geo.state_shapes(dim_first=dim_first)
    if want != got:
        raise CacheShapeError(
            f"vLLM's Mamba layers ({geo.heads} heads of {geo.head_dim}, {geo.n_groups} groups "
            f"({geo.allocated_groups} allocated) of state {geo.state_size}, conv kernel "
            f"{geo.conv_kernel}, TP {geo.tp_size}) make per-rank states {got}, but the KV-cache "
            f"spec holds {want}; this vLLM version lays Mamba state out in a way kvbridge does not "
            "describe: serve the model without a KV connector or with vLLM's NixlConnector")
    if len(state_dtypes) != 2:
        raise CacheShapeError(f"Mamba state dtypes {list(state_dtypes)}: expected conv and SSM")
    return MambaSpec(
        ssm_heads=geo.heads, ssm_head_dim=geo.head_dim, state_size=geo.state_size,
        n_groups=geo.n_groups, conv_width=geo.conv_columns,
        conv_dtype_size=dtype_size(state_dtypes[0]), ssm_dtype_size=dtype_size(state_dtypes[1]),
        conv_layout=ConvLayout.DIM_FIRST if dim_first else ConvLayout.TOKEN_FIRST)
