"""What installing pcpstack puts on the path: one import package, `pcpstack`, and nothing of the checkout's.

The wheel is built from this checkout without build isolation (no network needed) and read as a zip; the
imports run in a fresh interpreter whose working directory is outside the checkout, so only what the
install provides can be imported.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(ROOT),
            "-w",
            str(out),
        ],
        check=True,
        cwd=out,
        timeout=300,
    )
    (wheel,) = out.glob("pcpstack-*.whl")
    return zipfile.ZipFile(wheel).namelist()


def test_the_wheel_holds_only_the_pcpstack_package(wheel_names: list[str]) -> None:
    top_level = {name.split("/")[0] for name in wheel_names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"pcpstack"}


def test_every_source_folder_is_a_package_in_the_wheel(wheel_names: list[str]) -> None:
    """pyproject lists the packages by hand (package-dir mapping); a new folder must be listed too."""
    folders = {p.parent for p in (ROOT / "services").rglob("*.py") if "__pycache__" not in p.parts}
    for folder in folders:
        assert (folder / "__init__.py").is_file(), f"{folder} is not a regular package"
        package = "/".join(("pcpstack", *folder.relative_to(ROOT / "services").parts))
        assert f"{package}/__init__.py" in wheel_names, f"{package} is missing from the wheel"
    assert "pcpstack/engine/cpu_kernels.c" in wheel_names


def test_outside_the_checkout_pcpstack_imports_and_services_does_not(tmp_path: Path) -> None:
    def imports(module: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", f"import {module}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )

    good = imports("pcpstack.registry, pcpstack.v1, pcpstack.cli.main")
    assert good.returncode == 0, good.stderr
    for generic in ("services", "bench"):
        refused = imports(generic)
        assert refused.returncode != 0 and f"No module named '{generic}'" in refused.stderr
