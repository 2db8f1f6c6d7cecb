"""Configuration: seed-style JSON in, typed config out, and every configuration rule (docs/architecture.md)
enforced both ways."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from pcpstack.cli import main as cli
from pcpstack.cli.launch import cli_command
from pcpstack.common.config import (
    ConfigError,
    EngineConfig,
    check_address,
    check_addresses,
    check_host_id,
    check_model_source,
    check_port,
    check_positive,
    load_config_file,
    load_configs,
    parse_overrides,
)
from pcpstack.common.errors import FailedPrecondition

SEED = {
    "motor_engine_prefill_config": {
        "engine_type": "vllm",
        "engine_config": {
            "model": "/mnt/weight/your_model",
            "tensor_parallel_size": 1,
            "data_parallel_size": 2,
            "prefill-context-parallel-size": 2,
            "cp-kv-cache-interleave-size": 128,
            "nnodes": 2,
            "master-port": 7001,
        },
    }
}


# Seed 000's own example, verbatim: one PCP rank's 16 TP ranks on each of 2 nodes.
SEED_000_EXAMPLE = """{
  "motor_engine_prefill_config": {
    "engine_type": "vllm",
    "engine_config": {
      "model": "/mnt/weight/your_model",
      "tensor_parallel_size": 16,
      "data_parallel_size": 1,
      "prefill-context-parallel-size": 2,
      "cp-kv-cache-interleave-size": 128,
      "nnodes": 2,
      "master-port": 7001
    }
  }
}"""


def prefill(**values) -> EngineConfig:
    return EngineConfig.from_mapping(values, role="prefill")


def refused(role: str = "prefill", **values) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_mapping(values, role=role)
    return info.value


def test_seed_document_resolves_hyphen_and_underscore_keys() -> None:
    config = load_configs(SEED)["prefill"]
    assert config.prefill_context_parallel_size == 2
    assert config.master_port == 7001
    assert config.data_parallel_size == 2 and config.nnodes == 2
    assert config.block_size == 128  # taken from the interleave size
    assert config.nodes_required == 4 and config.pcp_ranks_per_node == 1 and config.world_size == 2


def test_rule_pcp_and_dcp_not_both_above_one() -> None:
    assert prefill(prefill_context_parallel_size=2, decode_context_parallel_size=1)
    error = refused(prefill_context_parallel_size=2, decode_context_parallel_size=2, tensor_parallel_size=2)
    assert "prefill_context_parallel_size=2" in str(error) and "decode_context_parallel_size=2" in str(error)
    assert error.rule == "PCP and DCP cannot both be > 1"


def test_rule_decode_instance_requires_pcp_one() -> None:
    assert EngineConfig.from_mapping({"prefill_context_parallel_size": 1}, role="decode")
    error = refused(role="decode", prefill_context_parallel_size=2)
    assert "decode" in str(error) and "prefill_context_parallel_size=2" in str(error)


def test_rule_interleave_size_equals_block_size() -> None:
    assert prefill(block_size=64, cp_kv_cache_interleave_size=64)
    error = refused(block_size=64, cp_kv_cache_interleave_size=128)
    assert "cp_kv_cache_interleave_size=128" in str(error) and "block_size=64" in str(error)


def test_rule_dcp_divides_tp_and_tp_at_least_dcp() -> None:
    assert prefill(tensor_parallel_size=4, decode_context_parallel_size=2)
    assert "tp % dcp == 0" in refused(tensor_parallel_size=3, decode_context_parallel_size=2).rule
    assert "tp >= dcp" in refused(tensor_parallel_size=1, decode_context_parallel_size=2).rule


def test_rule_dcp_for_gqa_models_uses_tp_per_kv_head() -> None:
    assert prefill(tensor_parallel_size=8, decode_context_parallel_size=2).with_model_shape(num_kv_heads=4)
    with pytest.raises(ConfigError) as info:
        prefill(tensor_parallel_size=8, decode_context_parallel_size=2).with_model_shape(num_kv_heads=8)
    assert "num_kv_heads=8" in str(info.value) and "(tp // num_kv_heads)=1" in str(info.value)
    base = prefill(tensor_parallel_size=8, decode_context_parallel_size=4)
    with pytest.raises(ConfigError, match="num_kv_heads=4"):
        base.with_model_shape(num_kv_heads=4)  # 8 // 4 = 2 < 4


def test_rule_pcp_divisible_by_nnodes() -> None:
    assert prefill(prefill_context_parallel_size=4, nnodes=2).pcp_ranks_per_node == 2
    error = refused(prefill_context_parallel_size=3, nnodes=2)
    assert "prefill_context_parallel_size=3" in str(error) and "nnodes=2" in str(error)
    assert error.rule == "pcp % nnodes == 0"


def test_world_size_is_tp_times_pcp() -> None:
    assert prefill(tensor_parallel_size=2, prefill_context_parallel_size=3).world_size == 6


def test_rule_layerwise_transfer_refused_with_pcp() -> None:
    assert prefill(kv_transfer_mode="layerwise", prefill_context_parallel_size=1)
    error = refused(kv_transfer_mode="layerwise", prefill_context_parallel_size=2)
    assert "layerwise" in str(error) and "prefill_context_parallel_size=2" in str(error)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"nnodes": 0}, "nnodes=0 must be an integer >= 1"),
        ({"tensor_parallel_size": "two"}, "tensor_parallel_size='two' must be of type int"),
        ({"pipeline_parallel_size": 2}, "unknown engine_config key 'pipeline_parallel_size'"),
        ({"master_port": 70000}, "master_port=70000"),
        ({"kv_transfer_mode": "magic"}, "kv_transfer_mode='magic'"),
        (
            {"prefill_context_parallel_size": 2**32 - 1},
            "prefill_context_parallel_size=4294967295 must be at most",
        ),
        (
            {"prefill_context_parallel_size": 512, "tensor_parallel_size": 16},
            "= 8192 ranks: a set has at most",
        ),
    ],
)
def test_malformed_values_are_refused_with_the_key_named(values: dict, needle: str) -> None:
    assert needle in str(refused(**values))


def test_overrides_apply_on_top_and_are_validated() -> None:
    configs = load_configs(SEED, parse_overrides(["nnodes=1", "prefill-context-parallel-size=4"]))
    assert configs["prefill"].nnodes == 1 and configs["prefill"].pcp_size == 4
    with pytest.raises(ConfigError, match="nnodes=3"):
        load_configs(SEED, parse_overrides(["nnodes=3"]))


def test_proto_round_trip_keeps_every_value() -> None:
    config = prefill(prefill_context_parallel_size=4, nnodes=2, block_size=64, master_port=7100)
    assert EngineConfig.from_proto(config.to_proto(), role="prefill") == config


def test_a_transfer_mode_this_version_does_not_know_is_refused_not_served_as_another() -> None:
    message = prefill().to_proto()
    message.kv_transfer_mode = 77
    with pytest.raises(ConfigError, match="kv_transfer_mode=77 is not a known KvTransferMode"):
        EngineConfig.from_proto(message, role="prefill")


def test_config_check_cli_prints_resolution_and_exits_2_on_violation(tmp_path, child_env) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(SEED))
    run = subprocess.run(
        cli_command("config", "check", str(good)),
        capture_output=True,
        text=True,
        env=child_env,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["prefill"]["nodes_required"] == 4
    bad = tmp_path / "bad.json"
    seed = json.loads(json.dumps(SEED))
    seed["motor_engine_prefill_config"]["engine_config"]["nnodes"] = 3
    bad.write_text(json.dumps(seed))
    run = subprocess.run(
        cli_command("config", "check", str(bad)),
        capture_output=True,
        text=True,
        env=child_env,
        timeout=60,
    )
    assert run.returncode == 2
    assert "nnodes=3" in run.stderr and "prefill_context_parallel_size=2" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_config_check_accepts_seed_000s_example_and_prints_its_world_size_tp_times_pcp(
    tmp_path, capsys
) -> None:
    example = tmp_path / "seed-000.json"
    example.write_text(SEED_000_EXAMPLE)
    assert cli.main(["config", "check", str(example)]) == 0
    resolved = json.loads(capsys.readouterr().out)["prefill"]
    assert resolved["tensor_parallel_size"] == 16 and resolved["prefill_context_parallel_size"] == 2
    assert resolved["world_size"] == 32
    assert resolved["nodes_required"] == 2 and resolved["pcp_ranks_per_node"] == 1


def test_an_engine_config_is_validated_when_built() -> None:
    with pytest.raises(ConfigError, match="nnodes=0 must be an integer >= 1"):
        EngineConfig(nnodes=0)


def test_config_error_is_a_failed_precondition_naming_key_value_and_rule() -> None:
    error = ConfigError.broken("--port", -1, "must be a TCP port in 0..65535")
    assert isinstance(error, FailedPrecondition) and error.code == "FAILED_PRECONDITION"
    assert str(error) == "--port=-1: must be a TCP port in 0..65535"
    assert error.keys == ("--port",)


@pytest.mark.parametrize(
    ("check", "value", "rule"),
    [
        (check_port, -1, "TCP port in 0..65535"),
        (check_port, 65536, "TCP port in 0..65535"),
        (check_port, True, "TCP port in 0..65535"),
        (check_positive, 0, "must be > 0"),
        (check_positive, float("nan"), "must be > 0"),
        (check_address, "no-port", "HOST:PORT"),
        (check_address, "host:0", "HOST:PORT"),
        (check_addresses, "a:7000,host:0", "address 'host:0' must be HOST:PORT"),
        (check_addresses, "a:7000,,b:7000", "address '' must be HOST:PORT"),
        (check_model_source, "/nowhere/model.gguf", "does not exist"),
        (check_model_source, "/nowhere/model.bin", "a .gguf file, a model folder or a Hugging Face repo id"),
    ],
)
def test_shared_rules_refuse_naming_the_key_and_value(check, value, rule: str) -> None:
    with pytest.raises(ConfigError, match=rule) as info:
        check("--key", value)
    assert str(info.value).startswith(f"--key={value!r}")


def test_shared_rules_accept_valid_values(tmp_path) -> None:
    check_port("--port", 0)
    check_positive("--lease", 0.5)
    check_address("--registry", "10.0.0.1:7000")
    check_address("--kvstore", "")  # optional unless required
    check_addresses("--registry", "10.0.0.1:7000, 10.0.0.2:7000")  # registry replicas
    check_model_source("--model", "")
    check_model_source("--model", "tiny")
    (tmp_path / "config.json").write_text("{}")
    check_model_source("--model", str(tmp_path))  # a model folder: its config.json is what makes it one


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        # A misspelt engine_config: every setting in it would silently stay at its default.
        ({"engine_confg": {"prefill-context-parallel-size": 4}}, "unknown keys ['engine_confg']"),
        ({"engine_config": {}, "extra": 1}, "unknown keys ['extra']"),
        ({"engine_type": 5, "engine_config": {}}, "engine_type=5 must be a string"),
    ],
)
def test_a_section_holds_only_its_known_keys(section: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)) as refused:
        load_configs({"motor_engine_prefill_config": section})
    assert refused.value.keys[0] == "motor_engine_prefill_config"


def test_a_config_file_that_cannot_be_read_or_parsed_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config_file(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="must hold valid JSON"):
        load_config_file(broken)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="nests too deeply"):
        load_config_file(deep)
    twice = tmp_path / "twice.json"
    section = '{"engine_config": {"master_port": 7100, "master_port": 7200}}'
    twice.write_text('{"motor_engine_prefill_config": ' + section + "}")
    with pytest.raises(ConfigError, match="gives 'master_port' twice in one object"):
        load_config_file(twice)


def test_config_check_refuses_a_tp_the_named_model_cannot_split_and_notes_a_model_it_cannot_see(
    tmp_path, capsys
) -> None:
    """With the model on this machine, config check applies the TP rule to its heads (tiny has 4 query and 2
    K/V heads); a model path it cannot see is noted on stderr and left to the node's start-up check."""
    config = tmp_path / "tp3.json"
    config.write_text(json.dumps({"motor_engine_prefill_config": {"engine_config": {"model": "tiny"}}}))
    assert cli.main(["config", "check", str(config), "--set", "tensor_parallel_size=3"]) == 2
    assert "tensor_parallel_size=3 must divide the model's num_attention_heads=4" in capsys.readouterr().err
    assert cli.main(["config", "check", str(config), "--set", "tensor_parallel_size=2"]) == 0
    example = tmp_path / "seed-000.json"
    example.write_text(SEED_000_EXAMPLE)
    assert cli.main(["config", "check", str(example)]) == 0
    assert "'/mnt/weight/your_model' is not on this machine" in capsys.readouterr().err


def test_config_check_applies_the_dcp_gqa_rule_to_the_named_models_kv_heads(tmp_path, capsys) -> None:
    """tiny has 2 K/V heads: a decode TP of 2 leaves one rank per head, none to split its tokens over DCP=2;
    TP=4 leaves two."""

    def check(tp: int) -> int:
        config = tmp_path / f"tp{tp}.json"
        section = {"model": "tiny", "tensor_parallel_size": tp, "decode_context_parallel_size": 2}
        config.write_text(json.dumps({"motor_engine_decode_config": {"engine_config": section}}))
        return cli.main(["config", "check", str(config)])

    assert check(2) == 2
    assert "(tp // num_kv_heads)=1 must be >= dcp and divisible by dcp" in capsys.readouterr().err
    assert check(4) == 0


@pytest.mark.parametrize("value", ["", "node-a", "ip-10-0-0-7.ec2.internal"])
def test_a_host_id_of_printable_characters_is_accepted(value: str) -> None:
    check_host_id("--host-id", value)


@pytest.mark.parametrize("value", ["node a", "tab\there", "x" * 254, "bell\x07"])
def test_a_host_id_with_spaces_or_too_long_is_refused_naming_the_flag(value: str) -> None:
    with pytest.raises(ConfigError, match=r"--host-id=.*at most 253 printable characters without spaces"):
        check_host_id("--host-id", value)
