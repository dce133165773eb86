"""Push mode served: real vLLM OpenAI servers behind ``kvbridge router --mode push``.

1 prefill + 1 decode (TP 1), both with kvbridge's ``mode: push`` and layer-by-layer
writes (``push_layerwise``, the default), the decode engine with
``kv_load_failure_policy: recompute`` and a 30 s ``transfer_timeout_seconds``. The
router sends each request to both at once with one transfer id and names the prefill
engine's side channel (``--prefill-side-channel``) on the decode request.

* Completions and chat, streamed and not, equal the decode server's own run (no
  ``kv_transfer_params``, prefix caching off), and KV moved: the decode engine counts
  one arrival per routed request, the prefill engine (the writer) the bytes, no
  failure on either side, no push that did not happen.
* A prefill server that stops answering (its API server frozen with SIGSTOP, its
  engine alive: the decode engine's offer is accepted, the writes never come): the
  decode request does not hang; after ``transfer_timeout_seconds`` its load fails and
  it is recomputed (the policy), text unchanged, the failure counted.
  The router cancels its prefill request to the frozen server after the answer.
* A killed prefill server (SIGKILL): the decode engine's offer fails at once (counted
  as a failed handshake, as pull mode counts one) and it recomputes; the router takes
  the instance out and later requests prefill locally.

The router's health probes are off (``--health-interval 3600``) so that requests,
not a probe's timing, find the stopped and the dead instance.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from served import (
    SERVED_PUSH_CONNECTOR,
    Served,
    engine,
    http_text,
    push_router_args,
    router,
    stop_all,
    text_prompts,
    wait_ready,
)
from test_served_router import (
    CHAT,
    chat,
    completion,
    local_chat,
    local_texts,
    openai_client,
    router_errors,
    served_tiny,  # noqa: F401 - the session's tiny model (a fixture)
)

pytestmark = pytest.mark.timeout(1800)

LENGTHS = (70, 129)
TRANSFER_TIMEOUT_S = 30
PUSH_CONNECTOR = replace(SERVED_PUSH_CONNECTOR, extra_config={
    **SERVED_PUSH_CONNECTOR.extra_config, "transfer_timeout_seconds": TRANSFER_TIMEOUT_S})
DONE = "vllm:kvbridge_num_requests_done_total"
BYTES_SUM = "vllm:kvbridge_bytes_transferred_sum"
FAILED = "vllm:kvbridge_num_failed_transfers_total"
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers, K and V, KV heads, head size, float32
BLOCK = 32


class Pair:
    def __init__(self, prefill: Served, decode: Served, router_: Served) -> None:
        self.prefill, self.decode, self.router = prefill, decode, router_
        self.prompts = text_prompts(LENGTHS, seed=4321)
        self.local: list[str] = []
        self.local_chat: list[str] = []


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def failures_since(server: Served, before: dict[str, float], expected: int) -> float:
    """New failed transfers on ``server``, once they reached ``expected`` or 30 s passed
    (an engine's stats reach /metrics with its next step's output)."""
    end = time.monotonic() + 30
    while (n := delta(before, server.metrics(), FAILED)) < expected and time.monotonic() < end:
        time.sleep(0.5)
    return n


def prefill_in_flight(r: Served) -> int:
    return json.loads(http_text(r.url + "/health"))["prefill"][0]["in_flight"]


@pytest.fixture(scope="module")
def pair(e2e_workdir: Path, served_tiny: Path) -> Iterator[Pair]:  # noqa: F811
    workdir = e2e_workdir / "served-push"
    p = engine("prefill-push", served_tiny, "prefill", workdir, connector=PUSH_CONNECTOR)
    d = engine("decode-push", served_tiny, "decode", workdir, connector=PUSH_CONNECTOR)
    servers = [p, d]
    try:
        p.start()
        d.start()
        wait_ready([p, d], 900)
        r = router([p], [d], workdir, name="router-push",
                   extra_args=[*push_router_args([p]), "--health-interval", "3600"])
        servers.append(r.start())
        wait_ready([r], 120)
        pair = Pair(p, d, r)
        pair.local = local_texts(d, pair.prompts)
        pair.local_chat = local_chat(d)
        yield pair
    finally:
        stop_all(servers)


def test_push_through_the_router_equals_the_decode_servers_own_run(pair: Pair):
    client = openai_client(pair.router.url)
    before = {s.name: s.metrics() for s in (pair.prefill, pair.decode)}
    n = 0
    for i, prompt in enumerate(pair.prompts):
        for stream in (False, True):
            assert completion(client, prompt, stream=stream)[0] == pair.local[i], (i, stream)
            n += 1
    for j, msgs in enumerate(CHAT):
        for stream in (False, True):
            assert chat(client, msgs, stream=stream) == pair.local_chat[j], (j, stream)
            n += 1
    pm, dm = pair.prefill.metrics(), pair.decode.metrics()
    # every routed request's KV arrived by WRITE: one arrival per request on the decode
    # engine (TP 1), the bytes on the prefill engine, which wrote them
    assert delta(before[pair.decode.name], dm, DONE) >= n, (before, dm)
    min_bytes = 2 * sum((n_words - 1) // BLOCK * BLOCK for n_words in LENGTHS) * BYTES_PER_TOKEN
    assert delta(before[pair.prefill.name], pm, BYTES_SUM) >= min_bytes
    for s, m in ((pair.prefill, pm), (pair.decode, dm)):
        assert delta(before[s.name], m, FAILED) == 0, s.name
    for kind in ("push_failed", "prefill_failed", "prefill_timeout", "prefill_unreachable",
                 "local_prefill"):
        assert router_errors(pair.router, kind) == 0, kind


def test_a_prefill_that_stops_answering_does_not_hang_the_decode(pair: Pair):
    client = openai_client(pair.router.url)
    assert pair.prefill.proc is not None
    before = pair.decode.metrics()
    os.kill(pair.prefill.proc.pid, signal.SIGSTOP)  # the API server only; its engine runs on
    t0 = time.monotonic()
    # the decode engine's offer is accepted, no prefill request reaches the engine, so no
    # write ever comes: the load fails after transfer_timeout_seconds and is recomputed
    assert completion(client, pair.prompts[0], stream=True)[0] == pair.local[0]
    waited = time.monotonic() - t0
    assert failures_since(pair.decode, before, 1) == 1
    # and the router gives up the prefill request it still had on the frozen server
    # (PREFILL_GRACE_S after the decode answer), without counting that as a failure
    end = time.monotonic() + 60
    while prefill_in_flight(pair.router) and time.monotonic() < end:
        time.sleep(0.5)
    assert prefill_in_flight(pair.router) == 0
    assert router_errors(pair.router, "prefill_unreachable") == 0
    print(f"\nstopped prefill: answered (recomputed) after {waited:.1f} s")


def test_a_killed_prefill_is_recomputed_then_skipped(pair: Pair):
    client = openai_client(pair.router.url)
    pair.prefill.kill(sig=signal.SIGKILL, grace_s=30)  # stopped or not, the group dies
    before = pair.decode.metrics()
    t0 = time.monotonic()
    # the router still has it in rotation: the prefill request cannot connect, the decode
    # engine's offer fails at once and it recomputes
    assert completion(client, pair.prompts[1], stream=False)[0] == pair.local[1]
    print(f"\nkilled prefill: answered (recomputed) after {time.monotonic() - t0:.1f} s")
    assert failures_since(pair.decode, before, 1) == 1  # the offer failed: counted
    assert router_errors(pair.router, "prefill_unreachable") == 1
    # now out of rotation: the decode server prefills locally, no transfer attempted
    before = pair.decode.metrics()
    assert completion(client, pair.prompts[0], stream=True)[0] == pair.local[0]
    assert router_errors(pair.router, "local_prefill") == 1
    assert delta(before, pair.decode.metrics(), FAILED) == 0
    assert router_errors(pair.router, "prefill_unreachable") == 1
