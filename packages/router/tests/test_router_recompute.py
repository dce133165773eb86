"""Silent recompute, made loud: prefill answers without usable kv_transfer_params and decode
requests sent without them are counted (Prometheus) and logged."""

from __future__ import annotations

import logging

import pytest
from router_fakes import wait_until

from kvbridge.router.recompute import unusable

NIXL_LIKE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
             "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.1", "remote_port": 5600,
             "remote_request_id": "r"}


@pytest.mark.parametrize("params, fragment", [
    (None, "no kv_transfer_params"),
    ({}, "not parameters"),
    ([1], "not parameters"),
    ({"do_remote_prefill": False, "remote_host": "h"}, "do_remote_prefill"),
    # the shape a third-party router sends *to* prefill, echoed back
    ({"do_remote_prefill": True, "remote_engine_id": None, "remote_block_ids": None,
      "remote_host": None, "remote_port": None},
     "null for remote_engine_id, remote_block_ids, remote_host, remote_port"),
])
def test_unusable_params_say_why(params, fragment) -> None:
    why = unusable(params)
    assert why is not None and fragment in why


def test_usable_params() -> None:
    assert unusable(NIXL_LIKE) is None
    assert unusable(dict(NIXL_LIKE, router_hint=None)) is None  # others' keys are theirs


def test_prefill_answers_without_params_are_counted_per_instance_and_logged(make_cluster, caplog):
    c = make_cluster(2, 1)
    c.prefill[0].mode = "no_params"
    p0, p1 = c.upstream_urls["p0"], c.upstream_urls["p1"]
    with caplog.at_level(logging.WARNING, logger="kvbridge.router"), c.client() as http:
        texts = [http.post("/v1/completions", json={"prompt": f"q{i}"}).json()["choices"][0]["text"]
                 for i in range(4)]
    assert texts == [f"q{i}|p1" for i in range(4)]  # retried on p1: nothing recomputed
    n0 = c.metric("kvbridge_router_prefill_without_params_total", instance=p0)
    assert n0 >= 1 and n0 == len([s for s in c.prefill[0].generation_requests()])
    assert c.metric("kvbridge_router_prefill_without_params_total", instance=p1) == 0
    assert c.metric("kvbridge_router_decode_without_params_total") == 0
    logged = [r.getMessage() for r in caplog.records if p0 in r.getMessage()]
    assert logged and all("no kv_transfer_params" in m for m in logged)
    wait_until(lambda: c.in_flight() == [0, 0, 0], "in-flight back to zero")


def test_decode_requests_sent_without_params_are_counted_and_logged(make_cluster, caplog):
    c = make_cluster(2, 1)
    for p in c.prefill:
        p.mode = "no_params"
    with caplog.at_level(logging.WARNING, logger="kvbridge.router"), c.client() as http:
        texts = [http.post("/v1/completions", json={"prompt": f"q{i}"}).json()["choices"][0]["text"]
                 for i in range(3)]
    assert texts == [f"q{i}|local" for i in range(3)]  # the decode instance computed them
    assert c.metric("kvbridge_router_decode_without_params_total") == 3
    assert sum(c.metric("kvbridge_router_prefill_without_params_total", instance=c.upstream_urls[n])
               for n in ("p0", "p1")) == 6
    assert sum("computes the prompt itself" in r.getMessage() for r in caplog.records) == 3
    # the decode requests really went out without parameters
    assert all("kv_transfer_params" not in s.body for s in c.decode[0].generation_requests())
    wait_until(lambda: c.in_flight() == [0, 0, 0], "in-flight back to zero")
