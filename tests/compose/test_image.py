"""The image the compose file and the Kubernetes manifests name (Dockerfile) installs what their commands
need. There is no docker engine here: the Dockerfile's own dependency command runs in the checkout."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from tests.compose.loopback import ROOT


def _image_requirements() -> list[str]:
    """What the Dockerfile's `pip install ... $(python -c "...")` installs besides torch."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    (program,) = re.findall(r'\$\(python -c "(.*?)"\)', dockerfile, re.DOTALL)
    program = program.replace("\\\n", "")  # Docker joins a line ending in a backslash with the next
    listed = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return listed.stdout.split()


def test_the_image_can_run_the_registry_on_etcd_as_the_kubernetes_manifests_do() -> None:
    registry = (ROOT / "deploy" / "k8s" / "base" / "registry.yaml").read_text()
    assert "--etcd" in registry  # the manifests' registries keep their state in etcd
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = _image_requirements()
    assert set(project["dependencies"]) <= set(installed)
    assert set(project["optional-dependencies"]["etcd"]) <= set(installed)  # aetcd: `serve registry --etcd`
