"""Prefix-aware placement through ``kvbridge router --prefix-placement decode`` with real vLLM.

1 prefill (TP 1, prefix caching off) + 2 decode servers (TP 1, prefix caching
on), the tiny Llama of served.py. Two prompt prefixes are picked so that the
router's hash ring gives them different decode servers (the test builds the
same ring from the servers' URLs). Three prompts of each prefix go through the
router one at a time; each request is attributed to the decode server whose
finished-request counter rose. Checks:

* every request of a prefix lands on that prefix's decode server (and both
  servers serve, so the placement is no pin to one);
* the later requests of a prefix hit the decode server's prefix cache and pull
  fewer KV bytes than the first (kvbridge reads only the blocks after the
  cached ones), and KV moved for every request;
* the outputs equal a decode server's own run of the same prompts (sent
  straight to the *other* decode server, whose cache never held that prefix,
  so it computes the whole prompt itself; both run the same model and flags).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from served import (
    Served,
    completion_body,
    engine,
    http_json,
    router,
    served_model,
    stop_all,
    text_prompts,
    wait_ready,
)

from kvbridge.router import RouterConfig
from kvbridge.router.pool import Pool

MAX_TOKENS = 12
PREFIX_WORDS = 100
DONE = "vllm:request_success_total"
HITS = "vllm:prefix_cache_hits_total"
BYTES = "vllm:kvbridge_bytes_transferred_sum"
XFERS = "vllm:kvbridge_xfer_time_seconds_count"
FLAGS = ("--prefix-placement", "decode")


class Engines:
    def __init__(self, prefill: Served, decode: list[Served], router: Served) -> None:
        self.prefill, self.decode, self.router = prefill, decode, router


@pytest.fixture(scope="module")
def engines(e2e_workdir: Path) -> Iterator[Engines]:
    model = served_model(kv_heads=2)
    workdir = e2e_workdir / "served-prefix"
    p0 = engine("prefill0", model, "prefill", workdir)
    decode = [engine(f"decode{i}", model, "decode", workdir, prefix_caching=True) for i in range(2)]
    r: Served | None = None
    try:
        for s in (p0, *decode):
            s.start()
        wait_ready([p0, *decode], 900)
        r = router([p0], decode, workdir, name="router-prefix", extra_args=FLAGS).start()
        wait_ready([r], 120)
        yield Engines(p0, decode, r)
    finally:
        stop_all([p0, *decode, *([r] if r else [])])


def prefixes_on_each_decode(decode: list[Served]) -> dict[str, str]:
    """{decode name: a prompt prefix the router's ring gives to it}, from the router's own code."""
    cfg = RouterConfig(prefill=(), decode=tuple(d.url for d in decode), prefix_placement="decode")
    pool = Pool.of("decode", cfg.decode, placement=cfg.placement("decode"))
    names = {d.url: d.name for d in decode}
    found: dict[str, str] = {}
    for seed in range(100):
        prefix = text_prompts((PREFIX_WORDS,), seed=1000 + seed)[0]
        owner = names[pool.ring_order(pool.prefix_key({"prompt": prefix}))[0].url]
        found.setdefault(owner, prefix)
        if len(found) == len(decode):
            return found
    raise AssertionError(f"no prefix for every decode server in 100 tries: {found}")


def counted(decode: list[Served], before: dict[str, dict[str, float]],
            timeout_s: float = 60) -> tuple[str, dict[str, dict[str, float]]]:
    """(the decode server that finished one more request and counted its pull, every server's
    metrics then)."""
    end = time.monotonic() + timeout_s
    while True:
        now = {d.name: d.metrics() for d in decode}
        rose = [n for n in now if now[n].get(DONE, 0) > before[n].get(DONE, 0)
                and now[n].get(XFERS, 0) > before[n].get(XFERS, 0)]
        if rose or time.monotonic() > end:
            assert len(rose) == 1, f"expected one decode server to finish the request, got {rose}"
            return rose[0], now
        time.sleep(0.3)


def test_requests_sharing_a_prefix_land_on_one_decode_server_and_match_its_own_run(engines: Engines):
    decode = engines.decode
    prefixes = prefixes_on_each_decode(decode)
    suffixes = text_prompts((20,) * 6, seed=77)
    # A A B B A B: two requests of a prefix in a row, which least-loaded round robin over two
    # idle servers never sends to the same one
    a, b = sorted(prefixes)
    order = [(a, 0), (a, 1), (b, 0), (b, 1), (a, 2), (b, 2)]
    plan = [(owner, prefixes[owner] + " " + suffixes[3 * (owner == b) + j]) for owner, j in order]
    served_by: dict[str, list[str]] = {d.name: [] for d in decode}
    routed: dict[str, str] = {}
    pulled: dict[str, list[float]] = {d.name: [] for d in decode}
    hits: dict[str, list[float]] = {d.name: [] for d in decode}
    before = {d.name: d.metrics() for d in decode}
    for owner, prompt in plan:
        out = http_json(engines.router.url + "/v1/completions", completion_body(prompt, MAX_TOKENS))
        routed[prompt] = out["choices"][0]["text"]
        name, now = counted(decode, before)
        assert name == owner, f"a request of {owner}'s prefix went to {name}"
        served_by[name].append(prompt)
        pulled[name].append(now[name].get(BYTES, 0) - before[name].get(BYTES, 0))
        hits[name].append(now[name].get(HITS, 0) - before[name].get(HITS, 0))
        before = now
    assert all(len(v) == 3 for v in served_by.values()), served_by
    for name in served_by:
        first, *later = pulled[name]
        assert first > 0 and all(0 < b < first for b in later), (name, pulled[name])
        assert hits[name][0] == 0 and all(h > 0 for h in hits[name][1:]), (name, hits[name])
    # each decode server's own run: the other server (a cold cache for that prefix) computes it
    for name, prompts in served_by.items():
        other = next(d for d in decode if d.name != name)
        for p in prompts:
            own = http_json(other.url + "/v1/completions", completion_body(p, MAX_TOKENS))
            assert own["choices"][0]["text"] == routed[p], f"{name}: routed output differs"
    assert len(set(routed.values())) == len(routed)  # different prompts, different outputs
