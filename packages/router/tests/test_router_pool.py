"""Instance choice and health bookkeeping (pure logic) and the configuration checks."""

from __future__ import annotations

import json

import pytest

from kvbridge.router import ConfigError, RouterConfig, load_config
from kvbridge.router.pool import Pool


def test_choose_prefers_fewest_in_flight_and_skips_unhealthy_and_excluded():
    seen = []
    pool = Pool.of("prefill", ["http://a:1", "http://b:1", "http://c:1"], seen.append)
    a, b, c = pool.instances
    with pool.using(a), pool.using(a), pool.using(b):
        assert pool.choose() is c
        assert pool.choose(exclude=[c]) is b
        pool.mark_failed(c, "refused")
        assert pool.choose() is b
        assert pool.choose(exclude=[b]) is a
        assert pool.choose(exclude=[a, b]) is None
    assert [i.in_flight for i in pool.instances] == [0, 0, 0]
    assert c.last_error == "refused" and not c.healthy
    assert pool.mark_probe(c, True) and c.healthy and c.failures == 0
    assert not pool.mark_probe(c, True)  # no change
    assert seen  # every change was reported


def test_probes_take_an_instance_out_only_after_failures_in_a_row():
    pool = Pool.of("decode", ["http://a:1", "http://b:1"], unhealthy_after=3)
    a, b = pool.instances
    assert not pool.mark_probe(a, False, "slow") and not pool.mark_probe(a, False, "slow")
    assert a.healthy and a.failures == 2
    assert not pool.mark_probe(a, True) and a.failures == 0  # an answer resets the count
    for _ in range(2):
        pool.mark_probe(a, False, "slow")
    assert pool.mark_probe(a, False, "/health gave no answer") and not a.healthy
    assert pool.describe_down() == "http://a:1: /health gave no answer"
    pool.mark_failed(b, "refused")  # a request that cannot connect: out at once
    assert not b.healthy and pool.choose() is None
    # the last resort: instances out of rotation, least loaded first, still honouring exclude
    with pool.using(a):
        assert pool.choose(any_health=True) is b
    assert pool.choose(exclude=[a, b], any_health=True) is None
    assert pool.mark_ok(a) and a.healthy and a.failures == 0
    assert pool.choose() is a


def test_ties_go_round_robin():
    pool = Pool.of("decode", ["http://a:1", "http://b:1", "http://c:1"])
    picks = [pool.choose().url for _ in range(6)]
    assert picks == ["http://a:1", "http://b:1", "http://c:1"] * 2


def test_in_flight_is_released_on_exceptions():
    pool = Pool.of("decode", ["http://a:1"])
    with pytest.raises(RuntimeError), pool.using(pool.instances[0]):
        raise RuntimeError("boom")
    assert pool.instances[0].in_flight == 0


@pytest.mark.parametrize("kw,msg", [
    ({"prefill": (), "decode": ()}, "at least one decode"),
    ({"prefill": ("http://a:1",), "decode": ("http://a:1",)}, "both a prefill and a decode"),
    ({"prefill": ("a:1", "http://a:1/"), "decode": ("b:2",)}, "more than once"),
    ({"decode": ("http://b",)}, "needs a host and a port"),
    ({"decode": ("ftp://b:1",)}, "http:// or https://"),
    ({"decode": ("http://b:1/v1",)}, "without a path"),
    ({"decode": ("b:1",), "prefill_timeout_s": 0}, "positive number"),
    ({"decode": ("b:1",), "port": 70000}, "out of range"),
    ({"decode": ("b:1",), "max_connections": 0}, "positive integer"),
])
def test_config_errors_say_what_to_change(kw, msg):
    kw.setdefault("prefill", ())
    with pytest.raises(ConfigError, match=msg):
        RouterConfig(**kw)


def test_config_file(tmp_path):
    f = tmp_path / "router.json"
    f.write_text(json.dumps({"prefill": ["10.0.0.5:8100"], "decode": ["http://10.0.0.6:8200/"],
                             "port": 9000, "prefill_timeout_s": 5}))
    cfg = load_config(f)
    assert cfg.prefill == ("http://10.0.0.5:8100",) and cfg.decode == ("http://10.0.0.6:8200",)
    assert cfg.port == 9000 and cfg.prefill_timeout_s == 5
    f.write_text(json.dumps({"decode": ["b:1"], "prefil": ["a:1"]}))
    with pytest.raises(ConfigError, match="unknown key.*prefil"):
        load_config(f)
    f.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(f)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.json")
