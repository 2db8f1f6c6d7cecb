"""The CLI's flags as a new user meets them: every default in the help, `--version`, one default registry
port, and `generate`/`up` refusing a bad flag at once (exit 2, one line naming the flag, nothing started)."""

from __future__ import annotations

import argparse
import importlib.metadata
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from bench import __main__ as bench_main
from pcpstack.cli import main as cli
from pcpstack.cli.launch import cli_command
from pcpstack.registry.main import DEFAULT_PORT as REGISTRY_PORT

ROOT = Path(__file__).resolve().parents[2]


def subcommand_parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(`pcpstack serve decode`, its parser) for every leaf command, service modules imported."""
    for service in cli.SERVICES:
        yield from _leaves("pcpstack", cli.build_parser(["serve", service]), only=f"serve {service}")
    yield from _leaves("pcpstack", cli.build_parser(["certs", "config"]), skip=("serve", "bench"))
    for area in (*bench_main.AREAS, "report"):  # `pcpstack bench AREA` is `python -m bench AREA`
        yield from _leaves("pcpstack bench", bench_main.build_parser([area]), only=f"bench {area}")


def _leaves(prefix: str, parser: argparse.ArgumentParser, only: str = "", skip: tuple[str, ...] = ()):
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield prefix, parser
        return
    for name, child in subparsers[0].choices.items():
        path = f"{prefix} {name}"
        if name in skip or (only and not f"{only} ".startswith(f"{path.removeprefix('pcpstack ')} ")):
            continue
        yield from _leaves(path, child, only)


def test_the_walk_finds_every_service_and_command() -> None:
    names = {name for name, _ in subcommand_parsers()}
    assert {f"pcpstack serve {s}" for s in cli.SERVICES} | {
        "pcpstack up",
        "pcpstack generate",
        "pcpstack status",
        "pcpstack certs",
        "pcpstack config check",
    } <= names


@pytest.mark.parametrize("command, parser", list(subcommand_parsers()), ids=lambda v: str(v)[:40])
def test_every_option_with_a_default_says_it_in_its_help(command: str, parser: argparse.ArgumentParser):
    missing = []
    for action in parser._actions:
        if not cli.has_default(action):
            continue
        # What `--help` prints for this option (the help line wrapped, whitespace joined).
        shown = " ".join(parser._get_formatter()._format_action(action).split())
        if "default" not in shown.lower():
            missing.append(action.option_strings[0])
    assert missing == [], f"{command}: options whose help does not give their default: {missing}"


@pytest.mark.parametrize("command, parser", list(subcommand_parsers()), ids=lambda v: str(v)[:40])
def test_a_flag_without_a_value_shows_no_default(command: str, parser: argparse.ArgumentParser):
    shown = {
        action.option_strings[0]: " ".join(parser._get_formatter()._format_action(action).split())
        for action in parser._actions
        if action.option_strings
        and action.nargs == 0
        and not isinstance(action, argparse.BooleanOptionalAction)
    }
    assert {flag: line for flag, line in shown.items() if "(default: " in line} == {}


def test_version_prints_the_installed_version(child_env) -> None:
    run = subprocess.run(cli_command("--version"), capture_output=True, text=True, env=child_env, timeout=60)
    assert run.returncode == 0
    assert run.stdout.strip() == f"pcpstack {importlib.metadata.version('pcpstack')}"


def test_compose_and_status_use_the_registrys_default_port() -> None:
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    registry = compose["services"]["registry"]
    command = registry["command"]
    assert command[command.index("--port") + 1] == str(REGISTRY_PORT)
    assert registry["ports"] == [f"{REGISTRY_PORT}:{REGISTRY_PORT}"]
    status = cli.build_parser(["status"]).parse_args(["status"])
    assert status.registry == f"127.0.0.1:{REGISTRY_PORT}"


def test_up_defaults_to_the_gateway_port_8000_on_loopback() -> None:
    args = cli.build_parser(["up"]).parse_args(["up"])
    assert (args.host, args.gateway_port) == ("127.0.0.1", 8000)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--temperature", "-1", "hi"], "--temperature=-1.0"),
        (["--token-ids", "5,-3"], "--token-ids='5,-3'"),
        (["--token-ids", "5,x"], "--token-ids='5,x'"),
        (["--top-p", "1.5", "hi"], "--top-p=1.5"),
        (["--top-k", "-1", "hi"], "--top-k=-1"),
        (["--max-tokens", "0", "hi"], "--max-tokens=0"),
        (["--seed", "-4", "hi"], "--seed=-4"),
        (["--pcp", "0", "hi"], "--pcp=0"),
    ],
)
def test_generate_refuses_a_bad_flag_before_starting_a_stack(tmp_path, child_env, flags, named) -> None:
    logs = tmp_path / "logs"
    run = subprocess.run(
        cli_command("generate", "--local", "--log-dir", str(logs), *flags),
        capture_output=True,
        text=True,
        env=child_env,
        timeout=120,
    )
    assert run.returncode == 2
    assert run.stderr.startswith(f"pcpstack generate: {named}: ") and run.stderr.count("\n") == 1, run.stderr
    assert not logs.exists(), "no service should have been started"


def test_generate_checks_its_flags_without_importing_torch(child_env) -> None:
    """A bad flag is refused in well under a second: the checks need no torch (~2 s to import here)."""
    script = (
        "import sys\n"
        "from pcpstack.cli import commands, main\n"
        "args = main.build_parser(['generate']).parse_args(['generate', '--local', '--top-p', '1.5', 'hi'])\n"
        "try:\n"
        "    commands.check_generate_arguments(args)\n"
        "except commands.UsageError as refusal:\n"
        "    print(refusal, 'torch' in sys.modules)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=child_env, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert "--top-p=1.5" in run.stdout and run.stdout.rstrip().endswith(" False"), run.stdout


def test_up_refuses_at_once_a_gateway_port_in_use(tmp_path, child_env) -> None:
    logs = tmp_path / "logs"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            cli_command("up", "--gateway-port", str(port), "--log-dir", str(logs)),
            capture_output=True,
            text=True,
            env=child_env,
            timeout=120,
        )
    assert run.returncode == 1
    assert f"--gateway-port {port} on 127.0.0.1 is in use" in run.stderr and "Traceback" not in run.stderr
    assert not list(logs.glob("*.log")), "no service should have been started"
