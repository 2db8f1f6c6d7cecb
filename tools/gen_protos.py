"""Generate the Python modules and typed stubs for protos/ into services/v1, imported as `pcpstack.v1`.

protoc writes `protos/pcpstack/v1/x.proto` as `pcpstack/v1/x_pb2.py` with absolute imports
(`from pcpstack.v1 import common_pb2`). The installed package maps `pcpstack` to `services/`, so the
generated folder `pcpstack/v1` is placed at `services/v1` exactly as protoc wrote it: no rewriting.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
DEFAULT_OUT = ROOT / "services" / "v1"
PROTO_PACKAGE = Path("pcpstack") / "v1"
_INIT_DOC = '"""Generated from protos/ by tools/gen_protos.py; do not edit."""\n'


def generate(out_dir: Path) -> list[Path]:
    """Regenerates every *_pb2.py, *_pb2.pyi and *_pb2_grpc.py(i) into out_dir; returns the files written."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as scratch:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={scratch}",
            # The mypy plugins sit beside this interpreter, which need not be on PATH.
            f"--plugin=protoc-gen-mypy={Path(sys.executable).parent / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={Path(sys.executable).parent / 'protoc-gen-mypy_grpc'}",
            f"--mypy_out={scratch}",
            f"--grpc_python_out={scratch}",
            f"--mypy_grpc_out={scratch}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        shutil.copytree(Path(scratch) / PROTO_PACKAGE, out_dir)
    (out_dir / "__init__.py").write_text(_INIT_DOC)
    return sorted(out_dir.rglob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ns = parser.parse_args()
    files = generate(ns.out)
    print(f"wrote {len(files)} files under {ns.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
