"""Side-channel authentication between real engines (NIXL/UCX in host memory, ZMQ on 127.0.0.1).

With an ``auth_key`` the handshake is signed both ways and every notification
carries a proof; a notification with the right token but without a valid proof
neither renews a lease nor releases a request.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import CFG, P, Pair

from kvbridge.handshake import normalize_key
from kvbridge.nixl import (
    EngineConfig,
    FailureKind,
    Kind,
    Notification,
    encode_notification,
    notification_key,
    parse_notification,
)
from kvbridge.tools.synthetic_cache import logical_kv

pytestmark = pytest.mark.timeout(120)

KEY = "0123456789abcdef-decode-and-prefill"
OTHER = "fedcba9876543210-somebody-else"
KEYED = replace(CFG, auth_key=KEY)


def mixed_pair(decode_cfg: EngineConfig, prefill_cfg: EngineConfig) -> Pair:
    pair = Pair(decode_cfg)
    pair.stop_prefill()
    pair.cfg = prefill_cfg
    pair.start_prefill()
    return pair


@pytest.fixture
def keyed():
    p = Pair(KEYED)
    yield p
    p.close()


def warm(pair: Pair) -> None:
    """One request end to end, so the decode rank knows the prefill agents."""
    pair.dec.load("warm", pair.hold("warm", [2], seed=9), ([3],))
    done, failed, _ = pair.run(lambda d, f, r: "warm" in d and len(r) == 2)
    assert not failed


def send(pair: Pair, rid: str, token: str, kind: Kind, key: bytes | None, *, proof: bytes | None = None):
    """What a peer that knows the prefill agents sends: a notification to each prefill rank."""
    peer = pair.dec.peers.get(P.engine_id)
    msg = encode_notification(Notification(kind, rid, 1, 0, token), key)
    if proof is not None:  # replace the proof, keep the rest
        parts = msg.split(b"|", 6)
        parts[5] = proof
        msg = b"|".join(parts)
    for q in sorted(peer.agents):
        pair.dec.agent.notify(peer.agents[q], msg)


def poll_prefill(pair: Pair, seconds: float = 0.3) -> list:
    out = []
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        for e in pair.pre:
            out += e.poll()
        time.sleep(0.01)
    return out


def test_keyed_engines_move_and_release(keyed):
    params = keyed.hold("a", [3, 1, 7])
    keyed.dec.load("a", params, ([9, 10, 2],))
    done, failed, released = keyed.run(lambda d, f, r: len(d) == 1 and len(r) == 2)
    assert done == ["a"] and not failed
    assert {(r.request_id, r.reason) for r in released} == {("a", "notified")}
    assert keyed.dc.verify(logical_kv(P, 1, 48), [9, 10, 2], 0, 48) == 0
    assert all(e.stats.notifications_unauthenticated == 0 for e in keyed.pre)
    assert keyed.prefill.server.authenticated


def test_forged_release_does_not_release_and_the_right_one_does(keyed):
    warm(keyed)
    params = keyed.hold("a", [1, 4])
    wrong = notification_key(normalize_key(OTHER))
    right = notification_key(normalize_key(KEY))
    send(keyed, "a", params.token, Kind.DONE, None)           # no proof at all (keyless form)
    send(keyed, "a", params.token, Kind.DONE, wrong)          # proof under another key
    send(keyed, "a", params.token, Kind.DONE, right, proof=b"0" * 32)  # made-up proof
    # a valid RENEW's proof pasted onto a DONE
    renew = encode_notification(Notification(Kind.RENEW, "a", 1, 0, params.token), right)
    send(keyed, "a", params.token, Kind.DONE, right, proof=renew.split(b"|", 6)[5])
    assert poll_prefill(keyed) == []
    for e in keyed.pre:
        assert e.held == 1 and e.stats.notifications_unauthenticated == 4
        assert e.stats.requests_released == 1  # the warm-up only
    send(keyed, "a", params.token, Kind.DONE, keyed.dec.notif_key)  # the decode engine's own
    _, _, released = keyed.run(lambda d, f, r: len(r) == 2)
    assert {(r.request_id, r.reason, r.block_ids) for r in released} == {("a", "notified", (1, 4))}


def test_forged_renewals_do_not_keep_a_lease_but_real_ones_do():
    pair = Pair(replace(KEYED, lease_s=0.4))
    try:
        warm(pair)
        forged = pair.hold("forged", [1])
        kept = pair.hold("kept", [5])
        wrong = notification_key(normalize_key(OTHER))
        expired: list = []
        t_end = time.monotonic() + 1.2  # three leases
        while time.monotonic() < t_end:
            send(pair, "forged", forged.token, Kind.RENEW, wrong)
            send(pair, "kept", kept.token, Kind.RENEW, pair.dec.notif_key)
            expired += poll_prefill(pair, 0.05)
        assert {(r.request_id, r.reason) for r in expired} == {("forged", "lease-expired")}
        assert len(expired) == 2
        for e in pair.pre:
            assert e.held == 1 and e.stats.notifications_unauthenticated > 0
        pair.dec.load("kept", kept, ([6],))
        done, failed, released = pair.run(lambda d, f, r: d and len(r) == 2)
        assert done == ["kept"] and not failed
        assert {r.reason for r in released} == {"notified"}
    finally:
        pair.close()


def test_notifications_without_a_key_stay_as_they_were(keyed):
    """A keyless engine sends the kvb1 form; a keyless prefill accepts either form."""
    plain = encode_notification(Notification(Kind.DONE, "r", 1, 0, "tok"))
    assert plain == b"kvb1|D|1|0|tok|r"
    pair = Pair()
    try:
        assert pair.dec.notif_key is None
        params = pair.hold("a", [1])
        pair.dec.load("a", params, ([2],))
        done, failed, _ = pair.run(lambda d, f, r: d and len(r) == 2)
        assert done == ["a"] and not failed and not pair.prefill.server.authenticated
    finally:
        pair.close()


@pytest.mark.parametrize("decode_key, prefill_key, says", [
    (OTHER, KEY, "does not match this server's key"),
    (None, KEY, "only answers authenticated requests"),
    (KEY, None, "answered without authentication"),
])
def test_mismatched_keys_fail_the_handshake_with_the_blocks(decode_key, prefill_key, says):
    pair = mixed_pair(replace(CFG, auth_key=decode_key), replace(CFG, auth_key=prefill_key))
    try:
        params = pair.hold("a", [1, 2])
        pair.dec.load("a", params, ([4, 5],))
        _, failed, released = pair.run(lambda d, f, r: len(f) == 1)
        (f,) = failed
        assert f.kind is FailureKind.HANDSHAKE and f.invalid_block_ids == (4, 5)
        assert says in f.message and "auth_key" in f.message
        assert pair.dec.resource_counts()["remote_agents"] == 0
        assert pair.dec.pending == 0
    finally:
        pair.close()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_untrusted_bytes_never_raise_with_a_key(raw):
    key = notification_key(normalize_key(KEY))
    for data in (raw, b"kva1|" + raw, b"kva1|D|1|0|tok|" + raw):
        out = parse_notification(data, key)
        assert out is None or (isinstance(out, Notification) and not out.authentic)


def test_proof_covers_every_field():
    key = notification_key(normalize_key(KEY))
    n = Notification(Kind.RENEW, "req|with|bars ü", 4, 3, "tok")
    raw = encode_notification(n, key)
    assert raw.startswith(b"kva1|R|4|3|tok|") and parse_notification(raw, key) == n
    assert parse_notification(raw) == n  # a keyless receiver reads it (and cannot check it)
    assert parse_notification(encode_notification(n), key) == replace(n, authentic=False)
    for a, b in ((b"|R|", b"|D|"), (b"|4|3|", b"|4|2|"), (b"|tok|", b"|tak|"), (b"bars", b"bare")):
        forged = parse_notification(raw.replace(a, b, 1), key)
        assert forged is not None and not forged.authentic, (a, b)


def test_engine_config_refuses_a_short_key():
    with pytest.raises(ValueError, match="auth_key must be 16"):
        EngineConfig(auth_key="secret")
    assert "auth_key" not in repr(EngineConfig(auth_key=KEY))  # never printed
    assert KEY not in repr(EngineConfig(auth_key=KEY))
