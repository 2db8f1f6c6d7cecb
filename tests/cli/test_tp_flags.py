"""`--tp`, `--decode-tp`, `--dcp` and `--device` on `pcpstack up` and `generate --local`: a value the CLI
can judge alone is refused at once (exit 2, one line naming the flag, nothing started); a TP size only the
model can judge reaches the services, and their one-line refusal is what the user reads (exit 2, no
traceback)."""

from __future__ import annotations

import subprocess

import pytest

from pcpstack.cli import main as cli
from pcpstack.cli.launch import cli_command
from pcpstack.cli.stack import StackOptions


@pytest.mark.parametrize(
    "command, flags, named",
    [
        (["up"], ["--tp", "0"], "--tp=0: must be >= 1"),
        (["generate", "--local"], ["--decode-tp", "-1", "hi"], "--decode-tp=-1: must be >= 1"),
        (["up"], ["--device", "gpu"], "--device='gpu': must be one of cpu, cuda, npu"),
        (
            ["up"],
            ["--decode-tp", "4", "--dcp", "3"],
            "--dcp=3: with --decode-tp=4: DCP needs tp % dcp == 0 and tp >= dcp",
        ),
        (
            ["generate", "--local"],
            ["--dcp", "2", "hi"],
            "--dcp=2: with --decode-tp=1: DCP needs tp % dcp == 0 and tp >= dcp",
        ),
    ],
)
def test_a_bad_tp_or_device_flag_is_refused_before_anything_starts(
    command, flags, named, tmp_path, capsys
) -> None:
    logs = tmp_path / "logs"
    status = cli.main([*command, "--log-dir", str(logs), *flags])
    err = capsys.readouterr().err
    assert status == 2
    assert err == f"pcpstack {command[0]}: {named}\n"
    assert not logs.exists(), "no service should have been started"


def test_the_stack_shape_names_prefill_and_decode_tp_sizes() -> None:
    shape = StackOptions(tp=3, pcp=2, decode=2, decode_tp=3).shape()
    assert shape == "1 prefill set(s) of TP=3 x PCP=2 (6 rank(s) each) and 2 decode worker(s) of TP=3"
    assert StackOptions(decode_tp=9, dcp=3).shape().endswith("1 decode worker(s) of TP=9 x DCP=3")


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--tp", "--decode-tp"])
def test_up_reports_the_services_one_line_refusal_of_a_tp_the_model_cannot_split(
    flag: str, tmp_path, child_env
) -> None:
    # The tiny model has 4 attention heads: TP=3 cannot split them, and only the service knows the model.
    stack_flags = ["--model", "tiny", "--pcp", "1", "--gateway-port", "0", "--log-dir", str(tmp_path)]
    run = subprocess.run(
        cli_command("up", *stack_flags, flag, "3"),
        capture_output=True,
        text=True,
        env=child_env,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    service = "prefill" if flag == "--tp" else "decode"
    refusal = f"pcpstack up: {service}-0 refused to start: pcpstack serve {service}: config error:"
    assert last.startswith(refusal), run.stderr
    assert "tensor_parallel_size=3" in last
    assert "Traceback" not in run.stderr
