"""The gateway's flags: an API key from a file, CORS origins, the tokenizer it finds by itself, and the
refusals that name the flag."""

from __future__ import annotations

import argparse

import pytest

from pcpstack.common.config import DEFAULT_MODEL_NAME, ConfigError
from pcpstack.gateway.main import GatewayConfig, add_arguments

DECODE = ["--decode", "127.0.0.1:50051"]


def _config(*args: str) -> GatewayConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return GatewayConfig.from_args(parser.parse_args([*DECODE, *args]))


def test_the_api_key_is_read_from_its_file_without_the_newline(tmp_path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-local-123\n")
    assert _config("--api-key-file", str(key_file)).key() == "sk-local-123"
    assert _config("--api-key", "direct").key() == "direct"
    assert _config().key() == ""


@pytest.mark.parametrize("content", [None, "  \n"])
def test_a_missing_or_empty_api_key_file_is_refused_naming_the_flag(tmp_path, content: str | None) -> None:
    key_file = tmp_path / "key"
    if content is not None:
        key_file.write_text(content)
    with pytest.raises(ConfigError) as caught:
        _config("--api-key-file", str(key_file))
    assert "--api-key-file" in str(caught.value)


def test_allowed_origins_may_be_repeated_or_comma_separated() -> None:
    config = _config("--allowed-origins", "http://a.example,http://b.example", "--allowed-origins", "*")
    assert config.allowed_origins == ("http://a.example", "http://b.example", "*")


def test_the_tokenizer_follows_the_model_name_when_the_gateway_can_find_it() -> None:
    assert _config("--model-name", "tiny").tokenizer_source() == "tiny"
    assert _config("--model-name", DEFAULT_MODEL_NAME).tokenizer_source() == ""  # the embedded model
    assert _config("--model-name", "my-model").tokenizer_source() is None
    assert _config("--model-name", "my-model", "--tokenizer", "tiny").tokenizer_source() == "tiny"


def test_a_tokenizer_that_is_no_model_is_refused_naming_the_flag(tmp_path) -> None:
    with pytest.raises(ConfigError) as caught:
        _config("--tokenizer", str(tmp_path / "nothing.txt"))
    assert "--tokenizer" in str(caught.value)
