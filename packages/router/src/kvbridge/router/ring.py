"""Prefix-aware placement: a consistent-hash ring of instances and the prompt key it hashes (pure).

Requests whose prompts start alike should meet the same engine, whose prefix
cache then holds their shared blocks: a decode engine reads only the blocks it
does not have (kvbridge's partial reads), a prefill engine computes only those.
The router hashes the *first blocks* of each prompt onto a ring of instances
(:class:`HashRing`, virtual nodes), so equal beginnings give equal owners, and
an instance that leaves hands on only its own share of the keys.

What is hashed (:class:`PrefixKey`), the router having no tokenizer:

* a completion whose prompt is token ids: the first ``blocks * block_tokens``
  ids, exactly what vLLM's block hashes start from;
* a completion whose prompt is text: its first
  ``blocks * block_tokens * chars_per_token`` characters (about four
  characters per token for English BPE tokenizers);
* a chat: the messages rendered as compact JSON with sorted keys (a
  deterministic text that starts alike when the conversations start alike:
  same system prompt, same first turns), cut the same way as text.

A prompt shorter than the window is hashed whole. Text cut at a character
count only approximates a token boundary: two prompts that share a long
beginning share the window (what matters), two that differ inside it go
wherever their hashes say (as without the option).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

#: Points per instance on the ring: with 160, each of 2..16 instances owns within
#: about 20% of its fair share of the keys (packages/router/tests/test_router_ring.py).
VNODES = 160


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring of node names (instance URLs) with ``vnodes`` points each.

    :meth:`walk` lists every node once, in ring order from a key's point: the
    first is the key's owner, the next ones its successors (where the key goes
    when the owner is down or too busy). Adding or removing a node moves only
    the keys whose owner it becomes or was."""

    def __init__(self, nodes: Iterable[str] = (), vnodes: int = VNODES) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be at least 1, got {vnodes}")
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._nodes: set[str] = set()
        for n in nodes:
            self.add(n)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def add(self, node: str) -> None:
        """Put ``node`` on the ring (once: adding it again changes nothing)."""
        if node in self._nodes:
            return
        self._nodes.add(node)
        for i in range(self.vnodes):
            p = _point(f"{node}#{i}".encode())
            at = bisect.bisect_left(self._points, p)
            self._points.insert(at, p)
            self._owners.insert(at, node)

    def remove(self, node: str) -> None:
        """Take ``node`` off the ring (a node not on it: nothing happens)."""
        if node not in self._nodes:
            return
        self._nodes.discard(node)
        keep = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != node]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def walk(self, key: bytes) -> Iterator[str]:
        """Every node once, clockwise from ``key``'s point (owner first)."""
        n = len(self._points)
        if not n:
            return
        start = bisect.bisect_right(self._points, _point(key))
        seen: set[str] = set()
        for k in range(n):
            node = self._owners[(start + k) % n]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self._nodes):
                    return

    def owner(self, key: bytes) -> str | None:
        """The node that owns ``key``; None on an empty ring."""
        return next(self.walk(key), None)


@dataclass(frozen=True)
class PrefixKey:
    """How a request's placement key is read from its prompt (see the module docstring).

    ``block_tokens`` is the engine's block size in tokens (vLLM's default: 16),
    ``blocks`` how many leading blocks the key covers, ``chars_per_token`` the
    characters counted as one token for text prompts and chats."""

    block_tokens: int = 16
    blocks: int = 4
    chars_per_token: int = 4

    def __post_init__(self) -> None:
        for f in ("block_tokens", "blocks", "chars_per_token"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")

    @property
    def tokens(self) -> int:
        return self.block_tokens * self.blocks

    @property
    def chars(self) -> int:
        return self.tokens * self.chars_per_token

    def of(self, body: Mapping[str, Any]) -> bytes:
        """The key of a checked completion or chat body (``prompt`` or ``messages``)."""
        if "messages" in body and "prompt" not in body:
            text = json.dumps(body["messages"], sort_keys=True, separators=(",", ":"),
                              ensure_ascii=False, default=str)
            return b"chat\0" + text[:self.chars].encode()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            ids = prompt[:self.tokens]
            return b"ids\0" + ",".join(str(int(t)) for t in ids).encode()
        return b"text\0" + str(prompt)[:self.chars].encode()
