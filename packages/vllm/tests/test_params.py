"""kv_transfer_params encode/decode in vLLM's conventions."""

from __future__ import annotations

import json

import pytest

from kvbridge.vllm.params import (
    PARAMS_VERSION,
    ParamsError,
    RemotePrefill,
    decode_remote_prefill,
    encode_remote_prefill,
    is_prefill_request,
    is_remote_prefill,
    prefill_request_params,
)

# What vLLM 0.32's NixlConnector returned from a prefill run on this machine.
NIXL_OUTPUT = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "04a5d41e-1374-4074-8e42-40594f671866", "remote_request_id": "0-b1611e00",
    "remote_host": "127.0.0.1", "remote_port": 44967, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
    "remote_num_tokens": 70, "remote_blocks_expiry_time": None, "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0,
}


def _rp(**kw: object) -> RemotePrefill:
    base: dict = dict(engine_id="P0", host="10.1.2.3", port=5600, request_id="req-7",
                      block_ids=((4, 5, 9),), tp_size=2, num_tokens=70, token="t0k")
    base.update(kw)
    return RemotePrefill.of(**base)


def test_prefill_request_and_predicates() -> None:
    p = prefill_request_params()
    assert p == {"do_remote_decode": True}
    assert is_prefill_request(p) and not is_remote_prefill(p)
    out = encode_remote_prefill(_rp())
    assert is_remote_prefill(out) and not is_prefill_request(out)
    assert not is_prefill_request(None) and not is_remote_prefill({})


def test_encode_uses_vllm_keys_and_survives_json_round_trip() -> None:
    rp = _rp(block_ids=((1, 2), (7,)), block_size=16, expiry_time=12.5)
    out = encode_remote_prefill(rp)
    for key in ("do_remote_prefill", "remote_block_ids", "remote_engine_id", "remote_request_id",
                "remote_host", "remote_port", "tp_size", "remote_num_tokens", "transfer_mode"):
        assert key in out
    assert out["remote_block_ids"] == [[1, 2], [7]]
    assert out["kvbridge_version"] == PARAMS_VERSION
    # A router serialises the dict to JSON and back; the value must survive.
    assert decode_remote_prefill(json.loads(json.dumps(out))) == rp


def test_decodes_vllm_nixl_connector_output() -> None:
    rp = decode_remote_prefill(NIXL_OUTPUT)
    t = rp
    assert t.engine_id == NIXL_OUTPUT["remote_engine_id"]
    assert rp.block_ids == ((1, 2, 3),)
    assert (t.host, t.port, t.tp_size, rp.num_tokens) == ("127.0.0.1", 44967, 1, 70)
    assert t.token == "" and rp.mode == "pull" and rp.expiry_time is None


def test_flat_block_id_list_is_one_group() -> None:
    params = dict(NIXL_OUTPUT, remote_block_ids=[3, 4])
    assert decode_remote_prefill(params).block_ids == ((3, 4),)
    assert decode_remote_prefill(dict(NIXL_OUTPUT, remote_block_ids=[])).block_ids == ()


def test_missing_fields_are_named() -> None:
    params = dict(NIXL_OUTPUT)
    del params["remote_host"]
    del params["remote_port"]
    with pytest.raises(ParamsError, match="remote_host, remote_port"):
        decode_remote_prefill(params)
    with pytest.raises(ParamsError, match="do_remote_prefill"):
        decode_remote_prefill({"do_remote_decode": True})
    with pytest.raises(ParamsError, match="dict"):
        decode_remote_prefill([("do_remote_prefill", True)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"remote_port": 0}, "remote_port"),
        ({"remote_port": "5600"}, "remote_port"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": True}, "tp_size"),
        ({"remote_block_ids": [[1, -2]]}, "non-negative"),
        ({"remote_block_ids": [[1], 2]}, "per KV-cache group"),
        ({"remote_block_ids": "1,2"}, "must be a list"),
        ({"remote_engine_id": ""}, "remote_engine_id"),
        ({"transfer_mode": "teleport"}, "transfer_mode"),
        ({"kvbridge_token": 5}, "kvbridge_token"),
        ({"kvbridge_version": PARAMS_VERSION + 1}, "upgrade kvbridge"),
        ({"remote_num_tokens": -1}, "remote_num_tokens"),
    ],
)
def test_invalid_values_are_rejected(change: dict, fragment: str) -> None:
    with pytest.raises(ParamsError, match=fragment):
        decode_remote_prefill(dict(NIXL_OUTPUT, **change))


def test_unknown_router_keys_are_ignored() -> None:
    params = dict(encode_remote_prefill(_rp()), router_hint="x", _remote_blocks_processed=True)
    assert decode_remote_prefill(params) == _rp()


def test_the_transfer_engines_record_takes_block_ids_per_group() -> None:
    from kvbridge.nixl import TransferParams
    from kvbridge.vllm.pull.worker import transfer_params

    rp = decode_remote_prefill(encode_remote_prefill(_rp(block_ids=((4, 5, 9), (1, 2, 3)),
                                                         incarnation="inc")))
    # a hybrid model's groups travel to the engine per group, in vLLM's group order
    assert transfer_params(rp) == TransferParams(engine_id="P0", host="10.1.2.3", port=5600,
                                                 tp_size=2, block_ids=((4, 5, 9), (1, 2, 3)),
                                                 token="t0k", incarnation="inc", request_id="req-7")
    assert rp.block_ids == ((4, 5, 9), (1, 2, 3)) and rp.from_kvbridge
    # one group (and vLLM's flat single-group form) is one group for the engine too
    one = decode_remote_prefill(dict(encode_remote_prefill(_rp(block_ids=((4, 5, 9),))),
                                     remote_block_ids=[4, 5, 9]))
    assert transfer_params(one).block_ids == ((4, 5, 9),) and one.block_ids == ((4, 5, 9),)


def test_the_parameters_are_records_built_not_patched() -> None:
    # a bad record built by field name is refused as a parsed one would be
    with pytest.raises(ParamsError, match="remote_port"):
        _rp(port=0)
    params = encode_remote_prefill(_rp())
    before = dict(params)
    decode_remote_prefill(params)
    assert params == before


def test_vllm_router_prefill_request_is_a_prefill_request() -> None:
    """vllm-router 0.1.17 sends the decode keys with null values on the prefill request."""
    from kvbridge.vllm.params import route

    sent = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert is_prefill_request(sent) and not is_remote_prefill(sent)
    assert route(sent).transfer and not route(sent).push
    # a decode request whose optional keys are null parses as if they were absent
    params = dict(encode_remote_prefill(_rp()), tp_size=None, remote_num_tokens=None,
                  kvbridge_token=None, transfer_mode=None)
    rp = decode_remote_prefill(params)
    assert rp.tp_size == 1 and rp.num_tokens is None and rp.token == "" and rp.mode == "pull"
    # a null required key is missing, and named
    with pytest.raises(ParamsError, match="lacks remote_host"):
        decode_remote_prefill(dict(encode_remote_prefill(_rp()), remote_host=None))
