"""Settings that once were accepted and then ignored are refused, naming the key or variable, the value and
the rule: num_kv_heads in an engine_config (the model decides it), master_port on a decode instance (its
ranks pick a free port), and PCPSTACK_LOG_FORMAT, PCPSTACK_CPU_KERNELS, PCPSTACK_DENSE_MATMUL or
PCPSTACK_COPY_CRC values no code reads."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest

from pcpstack.cli.launch import cli_command
from pcpstack.common import logs
from pcpstack.common.config import (
    COPY_CRC_ENV,
    CPU_KERNELS_CHOICES,
    CPU_KERNELS_ENV,
    DENSE_MATMUL_ENV,
    ConfigError,
    EngineConfig,
    env_choice,
    load_configs,
    parse_overrides,
    role_config,
)
from tests.common.test_startup import REGISTRY, refusal

DECODE = "motor_engine_decode_config"
PREFILL = "motor_engine_prefill_config"


def _config_check(child_env: dict[str, str], tmp_path: Path, document: dict, *sets: str, role: str = ""):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(document))
    args = [arg for value in sets for arg in ("--set", value)] + (["--role", role] if role else [])
    return subprocess.run(
        cli_command("config", "check", str(path), *args),
        capture_output=True,
        text=True,
        env=child_env,
        timeout=60,
    )


# --- num_kv_heads: the model's, not the config's -----------------------------------------------------


@pytest.mark.parametrize("key", ["num_kv_heads", "num-kv-heads"])
def test_num_kv_heads_in_an_engine_config_is_an_unknown_key(key: str) -> None:
    with pytest.raises(ConfigError, match="the model's own config decides its K/V heads") as info:
        EngineConfig.from_mapping({key: 4}, role="prefill")
    assert f"unknown engine_config key {key!r}" in str(info.value)


def test_config_check_refuses_a_num_kv_heads_override_with_one_line(child_env, tmp_path: Path) -> None:
    document = {PREFILL: {"engine_config": {"nnodes": 1}}}
    run = _config_check(child_env, tmp_path, document, "num_kv_heads=-5")
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert "unknown override key 'num_kv_heads'" in line
    assert "the model's own config decides its K/V heads" in line


def test_the_models_kv_heads_still_drive_the_dcp_gqa_rule_and_survive_overrides() -> None:
    config = EngineConfig.from_mapping(
        {"tensor_parallel_size": 8, "decode_context_parallel_size": 2}, role="decode"
    ).with_model_shape(4)
    assert config.with_overrides({"model": "tiny"}).num_kv_heads == 4
    with pytest.raises(ConfigError, match="num_kv_heads=4"):
        config.with_overrides({"decode_context_parallel_size": 4})  # 8 // 4 = 2 < 4


# --- master_port: a prefill set's, never a decode worker's ---------------------------------------------


@pytest.mark.parametrize("key", ["master-port", "master_port"])
@pytest.mark.parametrize("port", [7001, 7100])
def test_a_decode_config_naming_a_master_port_is_refused(key: str, port: int) -> None:
    with pytest.raises(ConfigError, match=f"master_port={port} on a decode instance") as info:
        load_configs({DECODE: {"engine_config": {key: port}}})
    assert info.value.keys == ("master_port",)


def test_a_master_port_override_is_refused_for_decode_and_kept_for_prefill() -> None:
    overrides = parse_overrides(["master-port=7100"])
    assert load_configs({PREFILL: {"engine_config": {}}}, overrides)["prefill"].master_port == 7100
    with pytest.raises(ConfigError, match="master_port=7100 on a decode instance"):
        load_configs({DECODE: {"engine_config": {}}}, overrides)


def test_a_decode_config_without_a_master_port_resolves_and_round_trips() -> None:
    config = load_configs({DECODE: {"engine_config": {"block_size": 64}}}, {"nnodes": 1})["decode"]
    assert config.block_size == 64
    assert EngineConfig.from_proto(config.to_proto(), role="decode") == config
    with pytest.raises(ConfigError, match="on a decode instance"):
        EngineConfig(role="decode", master_port=7100)


def test_config_check_refuses_a_decode_master_port_with_one_line(child_env, tmp_path: Path) -> None:
    run = _config_check(child_env, tmp_path, {DECODE: {"engine_config": {"master-port": 7100}}})
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert "master_port=7100 on a decode instance" in line


def test_config_check_shows_a_master_port_for_prefill_only(child_env, tmp_path: Path) -> None:
    document = {DECODE: {"engine_config": {}}, PREFILL: {"engine_config": {"master-port": 7100}}}
    run = _config_check(child_env, tmp_path, document)
    assert run.returncode == 0, run.stderr
    resolved = json.loads(run.stdout)
    assert "master_port" not in resolved["decode"] and resolved["prefill"]["master_port"] == 7100


def test_a_services_overrides_go_to_its_own_section_of_a_file_with_both(tmp_path: Path) -> None:
    # A prefill node's --set master-port is not the decode section's business (which would refuse it).
    path = tmp_path / "both.json"
    path.write_text(json.dumps({DECODE: {"engine_config": {}}, PREFILL: {"engine_config": {}}}))
    assert role_config("prefill", str(path), {"master-port": 29500}).master_port == 29500
    with pytest.raises(ConfigError, match="master_port=29500 on a decode instance"):
        role_config("decode", str(path), {"master-port": 29500})


def test_config_check_role_applies_the_overrides_as_that_roles_service_would(child_env, tmp_path) -> None:
    document = {DECODE: {"engine_config": {}}, PREFILL: {"engine_config": {}}}
    every_section = _config_check(child_env, tmp_path, document, "master-port=7100")
    assert every_section.returncode == 2 and "master_port=7100 on a decode instance" in every_section.stderr
    run = _config_check(child_env, tmp_path, document, "master-port=7100", role="prefill")
    assert run.returncode == 0, run.stderr
    resolved = json.loads(run.stdout)
    assert list(resolved) == ["prefill"] and resolved["prefill"]["master_port"] == 7100
    missing = _config_check(child_env, tmp_path, {PREFILL: {"engine_config": {}}}, role="decode")
    assert missing.returncode == 2 and "has no motor_engine_decode_config section" in missing.stderr


def test_serve_decode_refuses_a_master_port_override(child_env) -> None:
    line = refusal(child_env, "decode", "--registry", REGISTRY, "--set", "master-port=7100")
    assert "master_port=7100 on a decode instance" in line


# --- environment switches ---------------------------------------------------------------------------


def test_env_choice_names_the_variable_the_value_and_every_allowed_value(monkeypatch) -> None:
    monkeypatch.setenv("PCPSTACK_TEST_SWITCH", "Maybe")
    with pytest.raises(ConfigError) as info:
        env_choice("PCPSTACK_TEST_SWITCH", {"": "default", "on": "always"})
    assert str(info.value) == ("PCPSTACK_TEST_SWITCH='Maybe': must be one of: unset (default), on (always)")
    monkeypatch.setenv("PCPSTACK_TEST_SWITCH", " ON ")
    assert env_choice("PCPSTACK_TEST_SWITCH", {"": "default", "on": "always"}) == "on"
    monkeypatch.delenv("PCPSTACK_TEST_SWITCH")
    assert env_choice("PCPSTACK_TEST_SWITCH", {"": "default", "on": "always"}) == ""


@pytest.mark.parametrize(("value", "chosen"), [("json", "json"), ("Console", "console"), ("", "json")])
def test_a_known_log_format_is_used(monkeypatch, value: str, chosen: str) -> None:
    monkeypatch.setenv(logs.LOG_FORMAT_ENV, value)
    assert logs.log_format(io.StringIO()) == chosen  # not a terminal: json when unset


def test_an_unknown_log_format_is_refused_not_replaced_by_the_default(monkeypatch) -> None:
    monkeypatch.setenv(logs.LOG_FORMAT_ENV, "text")
    with pytest.raises(ConfigError, match="PCPSTACK_LOG_FORMAT='text': must be one of: unset"):
        logs.log_format(io.StringIO())


@pytest.mark.parametrize("service", ["kvstore", "registry"])
def test_a_service_refuses_an_unknown_log_format_with_one_line(child_env, service: str) -> None:
    line = refusal(child_env, service, "--port", "0", env={logs.LOG_FORMAT_ENV: "text"})
    assert "PCPSTACK_LOG_FORMAT='text'" in line and "json" in line and "console" in line


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_an_unknown_cpu_kernels_value_is_refused(monkeypatch, value: str) -> None:
    monkeypatch.setenv(CPU_KERNELS_ENV, value)
    with pytest.raises(ConfigError, match=f"PCPSTACK_CPU_KERNELS='{value}': must be one of: unset"):
        env_choice(CPU_KERNELS_ENV, CPU_KERNELS_CHOICES)


@pytest.mark.parametrize("service", ["decode", "prefill"])
@pytest.mark.parametrize(
    ("variable", "value", "takes"),
    [(CPU_KERNELS_ENV, "yes", ("unset", "0", "1")), (DENSE_MATMUL_ENV, "mkl", ("unset", "torch", "onednn"))],
)
def test_a_model_node_refuses_an_unknown_engine_setting_before_any_rank_starts(
    child_env, service: str, variable: str, value: str, takes: tuple[str, ...]
) -> None:
    """Read by the engine in every rank process: a bad value must stop the node before any starts."""
    line = refusal(child_env, service, "--registry", REGISTRY, env={variable: value})
    assert f"{variable}='{value}'" in line
    assert all(f"{choice} (" in line for choice in takes)


@pytest.mark.parametrize("service", ["decode", "prefill", "kvstore"])
def test_every_service_that_copies_kv_refuses_an_unknown_copy_crc_value_at_start_up(
    child_env, service: str
) -> None:
    """Read at the first KV copy, in a rank process or a request: a bad value must stop the start."""
    args = () if service == "kvstore" else ("--registry", REGISTRY)
    line = refusal(child_env, service, *args, env={COPY_CRC_ENV: "on"})
    assert "PCPSTACK_COPY_CRC='on'" in line
    assert all(f"{value} (" in line for value in ("unset", "0", "1"))


@pytest.mark.parametrize("service", ["decode", "prefill", "kvstore"])
def test_a_service_that_requires_the_fused_copy_where_it_cannot_be_built_refuses_to_start(
    child_env, tmp_path: Path, service: str
) -> None:
    env = {COPY_CRC_ENV: "1", "CC": str(tmp_path / "no-such-cc"), "PCPSTACK_KERNEL_CACHE": str(tmp_path)}
    node = ("--registry", REGISTRY, "--model", "tiny")
    line = refusal(child_env, service, "--port", "0", *(() if service == "kvstore" else node), env=env)
    assert "PCPSTACK_COPY_CRC='1': requires the fused copy, which is unavailable: building" in line
    assert "no-such-cc" in line
