"""What --model may name: a Hugging Face repo id is served from the local cache (never downloaded), a
missing one is refused naming where it was looked for, and `local_models` lists what can be served."""

import json
from pathlib import Path

import pytest
import torch

from pcpstack.cli.main import main
from pcpstack.common.config import ConfigError, check_model_source
from pcpstack.common.models import ModelNotFound, cached_snapshot, local_models, resolve_model
from pcpstack.engine.engine import Engine
from pcpstack.engine.weights import load_model
from tests.engine.conftest import engine_logits, hf_logits
from tests.helpers import small_hf_llama


def cache_repo(cache: Path, repo_id: str, revision: str = "abc123", main: bool = True) -> Path:
    """A repo laid out as huggingface_hub caches it: snapshots/<revision>/ and refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    folder = repo / "snapshots" / revision
    folder.mkdir(parents=True)
    if main:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
    return folder


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_a_cached_repo_id_loads_the_snapshot_main_points_to(hf_cache):

    folder = cache_repo(hf_cache, "acme/tiny-llama")
    reference = small_hf_llama(folder)
    assert resolve_model("acme/tiny-llama") == folder
    loaded = load_model("acme/tiny-llama", device="cpu", dtype=torch.float32)
    ids = list(range(1, 30))
    torch.testing.assert_close(
        engine_logits(Engine(loaded, num_blocks=8), ids), hf_logits(reference, ids), atol=1e-5, rtol=0
    )
    check_model_source("--model", "acme/tiny-llama")  # the config check accepts it too


def test_a_repo_id_not_in_the_cache_is_refused_naming_where_it_looked(hf_cache):
    with pytest.raises(ConfigError) as refused:
        check_model_source("--model", "acme/absent")
    assert "acme/absent is not in the local Hugging Face cache" in str(refused.value)
    assert str(hf_cache / "models--acme--absent") in str(refused.value)
    assert "nothing is downloaded at run time" in str(refused.value)


def test_a_revision_is_chosen_with_an_at_sign_and_two_snapshots_need_one(hf_cache):
    first = cache_repo(hf_cache, "acme/two", "rev1", main=False)
    second = hf_cache / "models--acme--two" / "snapshots" / "rev2"
    second.mkdir()
    assert cached_snapshot("acme/two@rev2") == second
    assert cached_snapshot("acme/two@rev1") == first
    with pytest.raises(ModelNotFound, match=r"2 snapshots .* name one as acme/two@REVISION"):
        cached_snapshot("acme/two")


def test_local_models_lists_what_can_be_served_and_says_why_not(hf_cache):
    llama = cache_repo(hf_cache, "acme/llama")
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (llama / "model.safetensors").write_bytes(b"")
    bert = cache_repo(hf_cache, "acme/bert")
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    quantized = cache_repo(hf_cache, "acme/gguf")
    (quantized / "model.Q4_1.gguf").write_bytes(b"")
    models = {m.name: m for m in local_models()}
    assert models["tiny"].servable
    assert models["acme/llama"].servable and models["acme/llama"].detail == "llama"
    assert not models["acme/bert"].servable and "bert: not served" in models["acme/bert"].detail
    assert models[str(quantized / "model.Q4_1.gguf")].kind == "gguf"


def test_pcpstack_models_lists_a_cached_repo_as_servable(hf_cache, capsys):
    folder = cache_repo(hf_cache, "acme/llama")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"")
    assert main(["models", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert listed["acme/llama"]["servable"] and listed["tiny"]["servable"]
    assert main(["models"]) == 0
    assert f"Hugging Face cache: {hf_cache}" in capsys.readouterr().out
