"""Seeded damage to real msgpack encodings (what a broken or hostile peer sends).

Each ``undecodable_*`` function returns bytes no decoder of the side channel can
turn into a message, whatever the message was: the test then knows the one right
answer (``bad-request`` from a server, ``MalformedReply`` from a client).
:func:`flip` damages anywhere and may or may not leave a decodable message.
"""

from __future__ import annotations

import random
import sys

#: byte sequences that are not UTF-8: a lone continuation byte, bytes UTF-8 never uses,
#: an overlong encoding, a UTF-16 surrogate, a sequence cut short, a code point above U+10FFFF
BAD_UTF8 = (b"\x80", b"\xff", b"\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\xf4\x90\x80\x80")


def str_spans(data: bytes, texts: list[str]) -> list[tuple[int, int]]:
    """(start, end) of every payload of the msgpack strings ``texts`` in ``data`` (found by
    their header and bytes, as the encoder wrote them)."""
    spans = []
    for text in texts:
        raw = text.encode()
        n = len(raw)
        header = bytes([0xA0 | n]) if n < 32 else (b"\xd9" + bytes([n]) if n < 256 else None)
        if header is None:
            continue
        start = data.find(header + raw)
        while start >= 0:
            spans.append((start + len(header), start + len(header) + n))
            start = data.find(header + raw, start + 1)
    return spans


def undecodable_utf8(data: bytes, texts: list[str], rng: random.Random) -> bytes:
    """One string of ``texts`` (a key, a tag or a value) with bytes that are not UTF-8
    written into it, keeping its length."""
    spans = str_spans(data, texts)
    start, end = rng.choice(spans)
    bad = rng.choice([b for b in BAD_UTF8 if len(b) <= end - start])
    at = rng.randrange(start, end - len(bad) + 1)
    return data[:at] + bad + data[at + len(bad):]


def nested(depth: int, rng: random.Random) -> bytes:
    """One msgpack value nested ``depth`` levels deep (arrays, maps or both)."""
    kind = rng.choice(["array", "map", "mixed"])
    if kind == "array":
        return b"\x91" * depth + b"\xc0"
    if kind == "map":
        return b"\x81\xa1k" * depth + b"\xc0"
    return (b"\x91\x81\xa1k" * (depth // 2)) + b"\xc0"


def undecodable_nesting(data: bytes, rng: random.Random, max_bytes: int = 60_000) -> bytes:
    """A map message with one more key (first or last) whose value is nested deeper than
    the interpreter's recursion limit, or a whole message that is."""
    low = sys.getrecursionlimit() + 1_000
    depth = rng.randrange(low, max(low + 1, max_bytes // 4))
    deep = nested(depth, rng)
    where = rng.choice(["first", "last", "alone"])
    if data[0] & 0xF0 == 0x80:  # fixmap
        n, rest = data[0] & 0x0F, data[1:]
    else:
        assert data[0] == 0xDE, "a msgpack map"  # map 16
        n, rest = int.from_bytes(data[1:3], "big"), data[3:]
    if where == "alone":
        return deep
    header = b"\xde" + (n + 1).to_bytes(2, "big")
    extra = b"\xa5extra" + deep
    return header + (extra + rest if where == "first" else rest + extra)


def undecodable_truncation(data: bytes, rng: random.Random) -> bytes:
    """A strict prefix of the message (every one is incomplete msgpack)."""
    return data[:rng.randrange(len(data))]


def undecodable_length(data: bytes, texts: list[str], rng: random.Random) -> bytes:
    """A string, or the whole map, declaring far more bytes or entries than follow."""
    if rng.random() < 0.25:  # the map header itself: 4 billion entries
        return b"\xdf" + rng.choice([b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff"]) + data[1:]
    start, end = rng.choice(str_spans(data, texts))
    header_at = start - (1 if data[start - 1] & 0xE0 == 0xA0 else 2)
    huge = rng.choice([b"\xdb\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff", b"\xda\xff\xff",
                       b"\xc6\xff\xff\xff\xff"])  # str 32, str 16, bin 32
    return data[:header_at] + huge + data[start:]


def undecodable(data: bytes, texts: list[str], rng: random.Random) -> tuple[str, bytes]:
    """One of the damages above, chosen by ``rng``: (its name, the damaged bytes)."""
    name = rng.choice(["utf8", "nesting", "truncation", "length"])
    if name == "utf8":
        return name, undecodable_utf8(data, texts, rng)
    if name == "nesting":
        return name, undecodable_nesting(data, rng)
    if name == "truncation":
        return name, undecodable_truncation(data, rng)
    return name, undecodable_length(data, texts, rng)


def flip(data: bytes, rng: random.Random) -> bytes:
    """1-4 bytes replaced or bit-flipped anywhere (may still decode, to anything)."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(out))
        out[i] = rng.randrange(256) if rng.random() < 0.5 else out[i] ^ (1 << rng.randrange(8))
    return bytes(out)
