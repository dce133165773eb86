"""KV-cache groups: which layers share one block table, and how a transfer pairs their blocks.

vLLM's hybrid KV-cache manager gives every *group* of layers its own block
table: full-attention layers, sliding-window layers (blocks outside the window
are replaced by a null block) and Mamba layers (only the last block of a
request holds the state). An engine that declares no groups has one FULL group
of every layer (every engine before groups existed).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import TopologyError


class GroupKind(str, enum.Enum):
    """How a group's blocks pair up between the two engines."""

    #: every block of the prompt (from the decode side's computed tokens on)
    FULL = "full"
    #: as FULL, but a pair in which either block id is the null block moves nothing
    SLIDING = "sliding"
    #: the last non-null block of each side: the state after the whole prompt
    MAMBA = "mamba"


@dataclass(frozen=True)
class CacheGroup:
    """One KV-cache group of an engine.

    ``layers`` are layer indices as the cache's regions number them: the position
    of the layer in the engine's KV-cache mapping (vLLM: the sorted layer names),
    counting attention and Mamba layers alike. ``block_size`` is the group's tokens
    per block, ``sliding_window`` the window in tokens (SLIDING groups only).
    """

    kind: GroupKind
    layers: tuple[int, ...]
    block_size: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", GroupKind(self.kind))
        except ValueError:
            raise TopologyError(
                f"CacheGroup.kind must be one of {[k.value for k in GroupKind]}, got {self.kind!r}"
            ) from None
        layers = tuple(self.layers)
        if not layers or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers):
            raise TopologyError(
                f"CacheGroup.layers must be a non-empty tuple of layer indices >= 0, got {self.layers!r}"
            )
        if len(set(layers)) != len(layers):
            raise TopologyError(f"CacheGroup.layers lists a layer twice: {layers}")
        object.__setattr__(self, "layers", layers)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise TopologyError(f"CacheGroup.block_size must be a positive integer, got {self.block_size!r}")
        if self.kind is GroupKind.SLIDING:
            w = self.sliding_window
            if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
                raise TopologyError(
                    f"a SLIDING CacheGroup needs sliding_window > 0 tokens, got {self.sliding_window!r}"
                )
        elif self.sliding_window is not None:
            raise TopologyError(
                f"only SLIDING groups have a sliding_window; a {self.kind.value} group got "
                f"{self.sliding_window!r}"
            )


def check_groups(groups: tuple[CacheGroup, ...], *, has_mamba: bool, what: str) -> None:
    """Raise TopologyError when ``groups`` cannot describe one engine's cache."""
    seen: dict[int, int] = {}
    for i, g in enumerate(groups):
        if not isinstance(g, CacheGroup):
            raise TopologyError(f"{what}: groups[{i}] must be a CacheGroup, got {type(g).__name__}")
        if g.kind is GroupKind.MAMBA and not has_mamba:
            raise TopologyError(
                f"{what}: group {i} is a Mamba group but the engine has no Mamba spec; describe "
                "the Mamba state (EngineSpec.mamba) or drop the group"
            )
        for layer in g.layers:
            if layer in seen:
                raise TopologyError(f"{what}: layer {layer} is in groups {seen[layer]} and {i}; "
                                    "every layer belongs to one group")
            seen[layer] = i


def check_same_groups(local: tuple[CacheGroup, ...], remote: tuple[CacheGroup, ...],
                      num_layers: int, where: str) -> None:
    """Raise TopologyError naming the first group index and field that differ.

    An empty tuple stands for one FULL group of every layer ``0 .. num_layers - 1``.
    """
    a, b = effective_groups(local, num_layers), effective_groups(remote, num_layers)
    if len(a) != len(b):
        raise TopologyError(
            f"{where}: KV-cache group count differs ({len(a)} vs {len(b)}); both engines must "
            "serve the same model with the same KV-cache grouping"
        )
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for field in ("kind", "layers", "sliding_window"):
            u, v = getattr(x, field), getattr(y, field)
            if u != v:
                show = (lambda z: z.value) if field == "kind" else (lambda z: z)
                raise TopologyError(
                    f"{where}: KV-cache group {i} differs in {field} ({show(u)} vs {show(v)}); "
                    "both engines must serve the same model with the same KV-cache grouping"
                )


def effective_groups(groups: tuple[CacheGroup, ...], num_layers: int,
                     block_size: int = 1) -> tuple[CacheGroup, ...]:
    """``groups``, or one FULL group of every layer when there are none."""
    if groups:
        return tuple(groups)
    return (CacheGroup(GroupKind.FULL, tuple(range(num_layers)), block_size),)
