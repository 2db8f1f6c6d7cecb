"""`pcpstack bench prefill --tp`: a TP x PCP configuration runs as real rank processes (TP groups inside
PCP ranks) on the tiny model, its row lands in the JSON with its TP size, and the report renders it in the
TP table, ranks counted, while the TP=1 tables (PCP, peers, plots) stay as they were."""

from __future__ import annotations

import json
import subprocess

import pytest

from bench.report import write_report
from pcpstack.cli.launch import cli_command


@pytest.mark.slow
def test_a_tp2_pcp2_smoke_run_gives_a_row_that_the_report_puts_in_the_tp_table(tmp_path, child_env) -> None:
    flags = ["--tokens", "16", "--tp", "2", "--pcp", "2", "--model", "tiny", "--repeats", "1"]
    run = subprocess.run(
        cli_command("bench", "prefill", "--out", str(tmp_path), *flags),
        capture_output=True,
        text=True,
        env=child_env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "prefill.json").read_text())["results"]
    assert [(r["tokens"], r["tp"], r["pcp"]) for r in rows] == [(16, 2, 2)]
    assert rows[0]["ttft_s_median"] > 0
    report = tmp_path / "BENCHMARKS.md"
    write_report(tmp_path, report, tmp_path / "plots", tmp_path / "no-notes.md")
    text = report.read_text()
    tp_table = text.split("### Tensor parallelism inside PCP ranks", 1)[1]
    assert "| tokens | TP | PCP | ranks |" in tp_table
    assert "| 16 | 2 | 2 | 4 |" in tp_table
