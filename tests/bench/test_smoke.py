"""Every benchmark runs end to end at tiny sizes, so none can rot; full runs are by hand (see README)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SMOKE = {
    "engine": ["--model", "tiny", "--threads", "1", "--repeats", "1", "--decode-steps", "2"],
    "registry": ["--nodes", "20", "--duration", "1", "--lease", "1"],
    "kv": ["--bytes", "1MiB", "--repeats", "1"],
    "prefill": ["--tokens", "64", "--pcp", "1,2", "--model", "tiny", "--repeats", "1"],
    "e2e": [
        "--model",
        "tiny",
        "--concurrency",
        "1,2",
        "--prompt-tokens",
        "16",
        "--max-tokens",
        "4",
        "--overhead-tokens",
        "64",
        "--repeats",
        "1",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("area", sorted(SMOKE))
def test_benchmark_smoke_run_writes_json(area, tmp_path, child_env) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", area, "--json", "--out", str(tmp_path), *SMOKE[area]],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads((tmp_path / f"{area}.json").read_text())
    assert saved == json.loads(run.stdout)
    assert saved  # each bench reports something
