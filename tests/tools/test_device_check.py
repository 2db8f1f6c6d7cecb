"""tools/device_check.sh, the operator's one command for the device-parametrised exactness tests: on a machine
without an accelerator it says so and exits 0 at once; where the hardware is present but torch cannot use it
(a CPU build of torch, as here behind a stand-in nvidia-smi, since no GPU can run here) it refuses with exit
status 1 and says what to fix, rather than skipping every test and reporting success."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "device_check.sh"

# On an accelerator machine the script runs the device tests themselves (minutes): that is its own job there.
pytestmark = pytest.mark.skipif(
    any(shutil.which(tool) for tool in ("nvidia-smi", "npu-smi"))
    or bool(glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/davinci[0-9]*")),
    reason="an accelerator is present: run tools/device_check.sh itself",
)


def run_script(path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)


def test_without_an_accelerator_the_device_check_says_so_and_exits_0() -> None:
    run = run_script(os.environ["PATH"])
    assert run.returncode == 0, run.stderr
    assert "no accelerator on this machine" in run.stdout


def test_gpu_hardware_that_torch_cannot_use_fails_the_device_check_naming_the_cause(tmp_path) -> None:
    probe = tmp_path / "nvidia-smi"
    probe.write_text("#!/bin/sh\nexit 0\n")
    probe.chmod(0o755)
    run = run_script(f"{tmp_path}:{os.environ['PATH']}")
    assert run.returncode == 1
    assert "torch in .venv sees 0 cuda devices" in run.stderr
