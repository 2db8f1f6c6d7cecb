"""Generate the Python modules and typed stubs for protos/ into services/proto (or another folder).

protoc writes absolute imports for the proto package (`from pcpstack.v1 import common_pb2`); the import
root of this project is `services`, so those imports are rewritten to `services.proto.pcpstack.v1`.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
DEFAULT_OUT = ROOT / "services" / "proto"
_IMPORT_FROM = re.compile(r"^from pcpstack\.v1 import ", re.MULTILINE)
_INIT_DOC = '"""Generated from protos/ by tools/gen_protos.py; do not edit."""\n'
_DOTTED = re.compile(r"\bpcpstack\.v1\.(\w+_pb2(?:_grpc)?)\b")


def generate(out_dir: Path) -> list[Path]:
    """Regenerates every *_pb2.py, *_pb2.pyi and *_pb2_grpc.py(i) under out_dir; returns the files written."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        # The mypy plugins sit beside this interpreter, which need not be on PATH.
        f"--plugin=protoc-gen-mypy={Path(sys.executable).parent / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={Path(sys.executable).parent / 'protoc-gen-mypy_grpc'}",
        f"--mypy_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in sorted(out_dir.rglob("*.py*")):
        text = path.read_text()
        text = _IMPORT_FROM.sub("from services.proto.pcpstack.v1 import ", text)
        text = _DOTTED.sub(r"services.proto.pcpstack.v1.\1", text)
        path.write_text(text)
        written.append(path)
    for package in [out_dir, *(p for p in out_dir.rglob("*") if p.is_dir())]:
        (package / "__init__.py").write_text(_INIT_DOC)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ns = parser.parse_args()
    files = generate(ns.out)
    print(f"wrote {len(files)} files under {ns.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
