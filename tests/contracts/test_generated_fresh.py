"""The committed generated code must equal what `make proto` produces from protos/ now."""

from __future__ import annotations

import filecmp
from pathlib import Path

from tools.gen_protos import DEFAULT_OUT, generate


def _tree(root: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    fresh = tmp_path / "proto"
    generate(fresh)
    committed, regenerated = _tree(DEFAULT_OUT), _tree(fresh)
    assert sorted(committed) == sorted(regenerated), "generated file set differs: run `make proto`"
    stale = [
        name for name, path in regenerated.items() if not filecmp.cmp(path, committed[name], shallow=False)
    ]
    assert not stale, f"stale generated files (run `make proto`): {stale}"


def test_freshness_check_detects_a_changed_proto(tmp_path: Path, monkeypatch) -> None:
    """The check above can fail: generating from an edited proto gives different code."""
    import tools.gen_protos as gen

    protos = tmp_path / "protos" / "pcpstack" / "v1"
    protos.mkdir(parents=True)
    for source in (gen.PROTO_ROOT / "pcpstack" / "v1").glob("*.proto"):
        text = source.read_text()
        if source.name == "common.proto":
            text = text.replace(
                # A field number far above any real one, so new fields never collide with it.
                "bool ignore_eos = 8;",
                "bool ignore_eos = 8;\n  // Added.\n  uint32 extra = 9999;",
            )
        (protos / source.name).write_text(text)
    monkeypatch.setattr(gen, "PROTO_ROOT", tmp_path / "protos")
    generate(tmp_path / "out")
    edited = (tmp_path / "out" / "common_pb2.py").read_bytes()
    assert edited != (DEFAULT_OUT / "common_pb2.py").read_bytes()
