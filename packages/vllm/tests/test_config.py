"""Configuration parsing from kv_connector_extra_config and the environment."""

from __future__ import annotations

import pytest

from kvbridge.vllm.config import (
    CONFIG_KEYS,
    ConfigError,
    ConnectorConfig,
    EngineRoles,
    check_engine_support,
    parse_connector_config,
)


def test_defaults_without_extra_config_or_env() -> None:
    cfg = parse_connector_config(None, env={})
    assert cfg == ConnectorConfig(heartbeat_seconds=120.0 / 4)
    assert cfg.mode == "pull" and cfg.backends == ("UCX",) and cfg.enforce_compat is True


def test_unknown_key_names_every_valid_key() -> None:
    with pytest.raises(ConfigError) as e:
        parse_connector_config({"lease_secs": 5, "mode": "pull"}, env={})
    msg = str(e.value)
    assert "'lease_secs'" in msg
    for k in CONFIG_KEYS:
        assert k.key in msg


def test_extra_config_overrides_env_and_env_overrides_default() -> None:
    env = {"KVBRIDGE_LEASE_SECONDS": "40", "KVBRIDGE_MODE": "push", "KVBRIDGE_UCX_THREADS": "3"}
    cfg = parse_connector_config({"lease_seconds": 8}, env=env)
    assert cfg.lease_seconds == 8.0  # key wins over env
    assert cfg.mode == "push"  # env wins over default
    assert cfg.ucx_threads == 3
    assert cfg.heartbeat_seconds == 2.0  # lease / 4


def test_side_channel_falls_back_to_vllm_nixl_env_after_kvbridge_env() -> None:
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.7", "VLLM_NIXL_SIDE_CHANNEL_PORT": "6000"}
    cfg = parse_connector_config({}, env=env)
    assert (cfg.side_channel_host, cfg.side_channel_port) == ("10.0.0.7", 6000)
    env["KVBRIDGE_SIDE_CHANNEL_PORT"] = "7000"
    assert parse_connector_config({}, env=env).side_channel_port == 7000
    # An empty variable counts as unset.
    env["KVBRIDGE_SIDE_CHANNEL_HOST"] = "  "
    assert parse_connector_config({}, env=env).side_channel_host == "10.0.0.7"


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"mode": "pool"}, "'pull' or 'push'"),
        ({"backends": []}, "at least one backend"),
        ({"backends": 5}, "list of backend names"),
        ({"backends": ["UCX", "UCX"]}, "twice"),
        ({"ucx_threads": -1}, "[0, 64]"),
        ({"ucx_threads": 1.5}, "integer"),
        ({"ucx_threads": True}, "integer"),
        ({"lease_seconds": 0}, "positive"),
        ({"lease_seconds": float("inf")}, "positive finite"),
        ({"lease_seconds": "soon"}, "number of seconds"),
        ({"enforce_compat": "maybe"}, "boolean"),
        ({"side_channel_port": 70000}, "[1, 65535]"),
        ({"side_channel_host": "a b"}, "host name"),
        ({"lease_seconds": 10, "heartbeat_seconds": 10}, "shorter than lease_seconds"),
    ],
)
def test_bad_values_are_rejected_with_the_key_named(extra: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_connector_config(extra, env={})
    assert fragment in str(e.value)
    assert "kv_connector_extra_config" in str(e.value)


def test_backends_string_is_a_comma_list() -> None:
    assert parse_connector_config({"backends": "UCX"}, env={}).backends == ("UCX",)


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="KVBRIDGE_SIDE_CHANNEL_PORT"):
        parse_connector_config({}, env={"KVBRIDGE_SIDE_CHANNEL_PORT": "http"})


def test_env_strings_are_parsed_per_type() -> None:
    cfg = parse_connector_config(
        {}, env={"KVBRIDGE_BACKENDS": "UCX, POSIX", "KVBRIDGE_ENFORCE_COMPAT": "no",
                 "KVBRIDGE_HEARTBEAT_SECONDS": "2.5", "KVBRIDGE_HUGE_PAGES": "0",
                 "KVBRIDGE_STAGING_MIB": "64"},
    )
    assert cfg.staging_mib == 64 and parse_connector_config({}, env={}).staging_mib == 0
    with pytest.raises(ConfigError, match="KVBRIDGE_STAGING_MIB"):
        parse_connector_config({}, env={"KVBRIDGE_STAGING_MIB": "-1"})
    assert cfg.backends == ("UCX", "POSIX")
    assert cfg.enforce_compat is False
    assert cfg.huge_pages is False and parse_connector_config({}, env={}).huge_pages is True
    assert cfg.heartbeat_seconds == 2.5


def test_port_for_data_parallel_index() -> None:
    cfg = parse_connector_config({"side_channel_port": 65534}, env={})
    assert cfg.port_for(0) == 65534 and cfg.port_for(1) == 65535
    with pytest.raises(ConfigError, match="exceeds 65535"):
        cfg.port_for(2)
    with pytest.raises(ConfigError):
        cfg.port_for(-1)


def test_reads_os_environ_when_env_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_LEASE_SECONDS", "77")
    assert parse_connector_config({}).lease_seconds == 77.0


def test_defaults_are_declared_once_on_the_config() -> None:
    assert ConnectorConfig() == parse_connector_config(None, env={})
    assert ConnectorConfig(lease_seconds=8).heartbeat_seconds == 2.0  # lease / 4
    assert next(k for k in CONFIG_KEYS if k.key == "side_channel_port").default == 5600
    with pytest.raises(ConfigError, match="shorter than lease_seconds"):
        ConnectorConfig(lease_seconds=4, heartbeat_seconds=4)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_engine_roles_follow_kv_role(role: str) -> None:
    roles = check_engine_support(ConnectorConfig(), kv_role=role)
    assert roles == EngineRoles(producer=role != "kv_consumer", consumer=role != "kv_producer")


@pytest.mark.parametrize("setting", ["pipeline_parallel_size", "decode_context_parallel_size",
                                     "prefill_context_parallel_size"])
def test_pipeline_and_context_parallelism_are_refused_by_name(setting: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_engine_support(ConnectorConfig(), kv_role="kv_consumer", **{setting: 2})
    msg = str(e.value)
    assert f"{setting}=2" in msg and f"{setting}=1" in msg and "tensor_parallel_size" in msg


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"kv_role": "kv_sender"}, "kv_role must be"),
    ({"kv_role": None}, "kv_role must be"),
    ({"kv_role": "kv_both", "kv_cache_groups": 2, "config": ConnectorConfig(mode="push")},
     "2 KV-cache groups.*pull mode only"),
])
def test_other_unsupported_engines_are_refused(kw: dict, fragment: str) -> None:
    cfg = kw.pop("config", ConnectorConfig())
    with pytest.raises(ConfigError, match=fragment):
        check_engine_support(cfg, **kw)


def test_hybrid_models_are_served_in_pull_mode() -> None:
    roles = check_engine_support(ConnectorConfig(), kv_role="kv_both", kv_cache_groups=4)
    assert roles.producer and roles.consumer


def test_push_mode_is_served_layer_by_layer_unless_told_otherwise() -> None:
    roles = check_engine_support(ConnectorConfig(mode="push"), kv_role="kv_both")
    assert roles.producer and roles.consumer
    assert parse_connector_config({"mode": "push"}, env={}).push_layerwise is True
    cfg = parse_connector_config({"mode": "push"}, env={"KVBRIDGE_PUSH_LAYERWISE": "0"})
    assert cfg.push_layerwise is False
    with pytest.raises(ConfigError, match="push_layerwise'\\] must be a boolean"):
        parse_connector_config({"push_layerwise": "sometimes"}, env={})


def test_transfer_cpus_choose_where_the_transfer_thread_runs() -> None:
    import os

    from kvbridge.vllm.registration import engine_config

    def worker_cpus(extra, env=None):
        cfg = parse_connector_config(extra, env=env or {})
        return engine_config(cfg, mem_type="DRAM", model="m", attention_backend="b").worker_cpus

    assert worker_cpus({}) == tuple(range(os.cpu_count()))
    assert worker_cpus({"transfer_cpus": "inherit"}) is None
    assert worker_cpus({}, {"KVBRIDGE_TRANSFER_CPUS": "1,0"}) == (1, 0)
    assert worker_cpus({"transfer_cpus": [3]}) == (3,)
    for bad in ("some", [], [-1], "1,x"):
        with pytest.raises(ConfigError, match="transfer_cpus'\\] must be 'all', 'inherit'"):
            parse_connector_config({"transfer_cpus": bad}, env={})


KEY = "0123456789abcdef-shared-by-both"


def test_auth_key_from_extra_config_or_env_and_never_printed() -> None:
    assert parse_connector_config({}, env={}).auth_key is None
    assert parse_connector_config({}, env={"KVBRIDGE_AUTH_KEY": KEY}).auth_key == KEY
    assert parse_connector_config({"auth_key": KEY}, env={"KVBRIDGE_AUTH_KEY": "x" * 20}).auth_key == KEY
    cfg = parse_connector_config({"auth_key": KEY}, env={})
    assert KEY not in repr(cfg)


@pytest.mark.parametrize("extra, env, where", [
    ({"auth_key": "too-short"}, {}, "kv_connector_extra_config['auth_key']"),
    ({}, {"KVBRIDGE_AUTH_KEY": "too-short"}, "KVBRIDGE_AUTH_KEY"),
    ({"auth_key": 1234567890123456789}, {}, "must be a string"),
])
def test_bad_auth_key_is_refused_without_echoing_it(extra: dict, env: dict, where: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_connector_config(extra, env=env)
    assert where in str(e.value) and "too-short" not in str(e.value)


def test_auth_key_reaches_the_engine_config() -> None:
    from kvbridge.vllm.registration import engine_config

    cfg = parse_connector_config({"auth_key": KEY}, env={})
    eng = engine_config(cfg, mem_type="DRAM", model="m", attention_backend="b")
    assert eng.auth_key == KEY
    assert engine_config(parse_connector_config({}, env={}), mem_type="DRAM", model="m",
                         attention_backend="b").auth_key is None


def test_complete_in_background_reaches_the_engine_config() -> None:
    from kvbridge.vllm.registration import engine_config

    on = engine_config(parse_connector_config({}, env={}), mem_type="DRAM", model="m",
                       attention_backend="b")
    assert on.complete_in_background_s > 0
    off_cfg = parse_connector_config({}, env={"KVBRIDGE_COMPLETE_IN_BACKGROUND": "false"})
    assert off_cfg.complete_in_background is False
    off = engine_config(off_cfg, mem_type="DRAM", model="m", attention_backend="b")
    assert off.complete_in_background_s == 0
    with pytest.raises(ConfigError, match="complete_in_background"):
        parse_connector_config({"complete_in_background": "sometimes"}, env={})


def test_warm_up_reaches_the_engine_config() -> None:
    from kvbridge.vllm.registration import engine_config

    on = engine_config(parse_connector_config({}, env={}), mem_type="DRAM", model="m",
                       attention_backend="b")
    assert on.warm_up is True
    off = engine_config(parse_connector_config({"warm_up": False}, env={}), mem_type="DRAM",
                        model="m", attention_backend="b")
    assert off.warm_up is False
    with pytest.raises(ConfigError, match="warm_up"):
        parse_connector_config({"warm_up": "maybe"}, env={})


def test_gil_handoff_reaches_the_engine_config_in_seconds() -> None:
    from kvbridge.vllm.registration import engine_config

    def built(extra, env=None):
        return engine_config(parse_connector_config(extra, env=env or {}), mem_type="DRAM", model="m",
                             attention_backend="b")

    assert built({}).gil_handoff_s == pytest.approx(200e-6)
    assert built({"gil_handoff_us": 0}).gil_handoff_s == 0
    assert built({}, env={"KVBRIDGE_GIL_HANDOFF_US": "500"}).gil_handoff_s == pytest.approx(500e-6)
    for bad in (-1, 20_000, "soon"):
        with pytest.raises(ConfigError, match="gil_handoff_us"):
            parse_connector_config({"gil_handoff_us": bad}, env={})


def test_idle_wait_key_env_and_bad_values() -> None:
    assert parse_connector_config({}, env={}).idle_wait_us == 1000
    assert parse_connector_config({"idle_wait_us": 0}, env={}).idle_wait_us == 0
    assert parse_connector_config({}, env={"KVBRIDGE_IDLE_WAIT_US": "250"}).idle_wait_us == 250
    for bad in (-1, 200_000, "later"):
        with pytest.raises(ConfigError, match="idle_wait_us"):
            parse_connector_config({"idle_wait_us": bad}, env={})


def test_a_step_is_idle_only_when_vllm_says_it_runs_no_tokens() -> None:
    from types import SimpleNamespace

    from kvbridge.vllm.shims import step_is_idle

    assert step_is_idle(SimpleNamespace(total_num_scheduled_tokens=0))
    assert not step_is_idle(SimpleNamespace(total_num_scheduled_tokens=7))
    assert not step_is_idle(SimpleNamespace())  # a vLLM that does not say: never wait
