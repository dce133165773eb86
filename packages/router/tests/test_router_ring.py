"""Prefix-aware placement: the hash ring, the prompt key, the pool's choice with load fallback."""

from __future__ import annotations

import collections

import pytest

from kvbridge.router import ConfigError, RouterConfig
from kvbridge.router.cli import build_parser, config_from_args
from kvbridge.router.pool import Placement, Pool
from kvbridge.router.ring import HashRing, PrefixKey

URLS = [f"http://10.0.0.{i}:8200" for i in range(5)]
KEYS = [f"prefix-{k}".encode() for k in range(4000)]


def owners(ring: HashRing) -> dict[bytes, str | None]:
    return {k: ring.owner(k) for k in KEYS}


def test_adding_a_node_moves_only_the_keys_it_takes():
    ring = HashRing(URLS[:4])
    before = owners(ring)
    ring.add(URLS[4])
    after = owners(ring)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(after[k] == URLS[4] for k in moved)
    assert 0.1 < len(moved) / len(KEYS) < 0.3  # about its fair fifth
    ring.add(URLS[4])  # again: nothing changes
    assert owners(ring) == after


def test_removing_a_node_moves_only_its_keys():
    ring = HashRing(URLS)
    before = owners(ring)
    ring.remove(URLS[2])
    after = owners(ring)
    for k in KEYS:
        if before[k] == URLS[2]:
            assert after[k] != URLS[2]
            # the key goes to the next node on the ring: the second in its walk before
            assert after[k] == list(HashRing(URLS).walk(k))[1]
        else:
            assert after[k] == before[k]
    ring.add(URLS[2])  # it comes back: every key goes home
    assert owners(ring) == before
    assert URLS[2] in ring and len(ring) == 5


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_keys_spread_evenly(n):
    ring = HashRing(f"http://host{i}:8000" for i in range(n))
    counts = collections.Counter(ring.owner(str(k).encode()) for k in range(20000))
    fair = 20000 / n
    assert len(counts) == n
    assert max(counts.values()) < 1.25 * fair and min(counts.values()) > 0.75 * fair, counts


def test_walk_lists_every_node_once_owner_first_and_is_stable():
    ring = HashRing(URLS)
    for k in KEYS[:50]:
        walk = list(ring.walk(k))
        assert sorted(walk) == sorted(URLS) and walk[0] == ring.owner(k)
        assert list(HashRing(reversed(URLS)).walk(k)) == walk  # insertion order does not matter
    assert HashRing().owner(b"x") is None and list(HashRing().walk(b"x")) == []
    with pytest.raises(ValueError, match="vnodes"):
        HashRing(URLS, vnodes=0)


def test_prefix_key_reads_the_first_blocks():
    key = PrefixKey(block_tokens=4, blocks=2, chars_per_token=3)  # 8 tokens, 24 characters
    ids = list(range(100, 120))
    assert key.of({"prompt": ids}) == key.of({"prompt": ids[:8] + [7, 7, 7]})
    assert key.of({"prompt": ids}) != key.of({"prompt": [1] + ids[1:]})
    assert key.of({"prompt": [ids]}) == key.of({"prompt": ids})  # a batch of one
    assert key.of({"prompt": ids[:3]}) == key.of({"prompt": ids[:3]})  # shorter: hashed whole
    text = "a" * 24
    assert key.of({"prompt": text + "x"}) == key.of({"prompt": text + "yz"})
    assert key.of({"prompt": text}) != key.of({"prompt": "b" + text[1:]})
    assert key.of({"prompt": [text + "x"]}) == key.of({"prompt": text})
    system = {"role": "system", "content": "s" * 40}
    assert (key.of({"messages": [system, {"role": "user", "content": "one"}]})
            == key.of({"messages": [system, {"role": "user", "content": "two"}]}))
    other = {"role": "system", "content": "t" * 40}
    assert key.of({"messages": [system]}) != key.of({"messages": [other]})
    # the same words as a chat and as a completion: different prompts for the engine
    assert key.of({"prompt": "hello"}) != key.of({"messages": "hello"})
    with pytest.raises(ValueError, match="blocks"):
        PrefixKey(blocks=0)


def placed_pool(n: int = 3, margin: int = 2) -> Pool:
    return Pool.of("decode", URLS[:n], placement=Placement(PrefixKey(), load_margin=margin))


def test_pool_sends_a_key_to_its_ring_instance_and_falls_back_on_load():
    pool = placed_pool(margin=2)
    key = pool.prefix_key({"prompt": "the shared system prompt " * 20})
    assert key is not None
    first = pool.choose(key=key)
    assert all(pool.choose(key=key) is first for _ in range(5))
    walk = pool.ring_order(key)
    assert walk[0] is first and len(walk) == 3
    second = walk[1]
    # busier than the least loaded by the margin: still chosen
    first.in_flight = 2
    assert pool.choose(key=key) is first
    # by more than the margin: the next instance on the ring that is within it
    first.in_flight = 3
    assert pool.choose(key=key) is second
    second.in_flight = 3
    third = walk[2]
    assert pool.choose(key=key) is third
    first.in_flight = second.in_flight = 0
    # excluded (a failed try) or out of rotation: the next one on the ring
    assert pool.choose(exclude=[first], key=key) is second
    pool.mark_failed(first, "refused")
    assert pool.choose(key=key) is second
    assert pool.choose(any_health=True, key=key) is first  # the last resort keeps ring order
    assert pool.choose(exclude=pool.instances, key=key) is None
    # without a key: least loaded, as without placement
    third.in_flight = 1
    assert pool.choose() is second


def test_an_instance_out_of_rotation_remaps_only_its_share():
    pool = placed_pool(n=4, margin=100)
    keys = [pool.prefix_key({"prompt": f"prefix {k} " * 30}) for k in range(400)]
    before = {k: pool.choose(key=k) for k in keys}
    down = pool.instances[1]
    pool.mark_failed(down, "refused")
    after = {k: pool.choose(key=k) for k in keys}
    moved = [k for k in keys if before[k] is not after[k]]
    assert moved and all(before[k] is down for k in moved)
    assert all(after[k] is not down for k in keys)
    pool.mark_ok(down)
    assert {k: pool.choose(key=k) for k in keys} == before


def test_pool_without_placement_ignores_keys():
    pool = Pool.of("decode", URLS[:2])
    assert pool.prefix_key({"prompt": "x"}) is None and pool.ring_order(b"k") == []
    assert [pool.choose(key=b"k").url for _ in range(4)] == [URLS[0], URLS[1]] * 2


def test_placement_config_and_flags():
    cfg = RouterConfig(prefill=("p:1",), decode=("d:1", "d:2"))
    assert cfg.prefix_placement == "off" and cfg.placement("decode") is None
    cfg = cfg.with_overrides(prefix_placement="decode", prefix_blocks=2, prefix_load_margin=0)
    placement = cfg.placement("decode")
    assert placement is not None and placement.key.tokens == 32 and placement.load_margin == 0
    assert cfg.placement("prefill") is None
    assert cfg.with_overrides(prefix_placement="both").placement("prefill") == placement
    for bad, msg in (({"prefix_placement": "yes"}, "one of off, decode, both"),
                     ({"prefix_block_tokens": 0}, "prefix_block_tokens must be a positive"),
                     ({"prefix_load_margin": -1}, "non-negative")):
        with pytest.raises(ConfigError, match=msg):
            RouterConfig(prefill=(), decode=("d:1",), **bad)
    args = build_parser().parse_args(["--decode", "d:1", "--prefix-placement", "both",
                                      "--prefix-block-tokens", "32", "--prefix-blocks", "3",
                                      "--prefix-load-margin", "5"])
    cfg = config_from_args(args)
    assert (cfg.prefix_placement, cfg.prefix_block_tokens, cfg.prefix_blocks,
            cfg.prefix_load_margin) == ("both", 32, 3, 5)


def test_requests_sharing_a_prefix_meet_on_one_decode_and_one_prefill(make_cluster):
    c = make_cluster(2, 3, prefix_placement="both", prefix_block_tokens=4, prefix_blocks=4)
    prefixes = [f"system prompt number {n} says: " + "w " * 40 for n in range(12)]
    with c.client() as http:
        for round_ in range(2):
            for n, p in enumerate(prefixes):
                r = http.post("/v1/completions", json={"prompt": p + f"question {n}.{round_}",
                                                       "max_tokens": 2})
                assert r.status_code == 200, r.text
    for role in (c.prefill, c.decode):
        by_prefix: dict[int, set[str]] = collections.defaultdict(set)
        for f in role:
            for seen in f.generation_requests():
                n = next(i for i, p in enumerate(prefixes) if seen.body["prompt"].startswith(p))
                by_prefix[n].add(f.name)
        assert len(by_prefix) == len(prefixes)
        assert all(len(names) == 1 for names in by_prefix.values()), by_prefix
    # twelve prefixes on three decode instances: more than one serves (a spread, not a pin)
    assert sum(1 for f in c.decode if f.generation_requests()) > 1
