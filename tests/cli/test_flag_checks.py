"""`pcpstack status`, `generate --target` and `up` refuse a bad flag up front: each rule through the commands'
checks in this process, and per command one case through the real CLI (exit 2, one line naming the flag,
its value and the rule, and no service contacted). Valid combinations still pass the same checks."""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Iterator

import pytest

from pcpstack.cli import commands, status
from pcpstack.cli import main as cli
from pcpstack.cli.launch import cli_command

# Where the CLI would connect; a test fills in the address of a socket that counts the connections it gets.
PEER = "{peer}"


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A listening socket on 127.0.0.1 that nothing should connect to."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sock.setblocking(False)
        yield sock


def _was_contacted(sock: socket.socket) -> bool:
    try:
        sock.accept()[0].close()
    except BlockingIOError:
        return False
    return True


def _filled(flags: list[str]) -> list[str]:
    """flags with PEER as an address nothing is asked at (in-process checks connect to nothing)."""
    return [flag.replace(PEER, "127.0.0.1:1") for flag in flags]


def _refusal(child_env, sock: socket.socket, command: str, flags: list[str]) -> subprocess.CompletedProcess:
    peer = f"127.0.0.1:{sock.getsockname()[1]}"
    argv = [flag.replace(PEER, peer) for flag in flags]
    # A check that let the flag through would run on (a --watch loop, a long deadline): the timeout ends it.
    return subprocess.run(
        cli_command(command, *argv), capture_output=True, text=True, env=child_env, timeout=60
    )


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--registry", ""], "--registry=''"),
        (["--registry", " , "], "--registry=' , '"),
        (["--registry", PEER, "--watch", "nan"], "--watch=nan"),
        (["--registry", PEER, "--watch", "inf"], "--watch=inf"),
        (["--registry", PEER, "--watch", "-1"], "--watch=-1.0"),
        (["--registry", PEER, "--watch", "1e-6"], "--watch=1e-06"),
        (["--registry", PEER, "--timeout", "-1"], "--timeout=-1.0"),
        (["--registry", PEER, "--timeout", "nan"], "--timeout=nan"),
        (["--registry", PEER, "--timeout", "0"], "--timeout=0.0"),
        (["--registry", PEER, "--timeout", "inf"], "--timeout=inf"),
    ],
)
def test_status_refuses_a_bad_flag(flags, named) -> None:
    args = cli.build_parser(["status"]).parse_args(["status", *_filled(flags)])
    with pytest.raises(commands.UsageError) as refused:
        status.check_arguments(args)
    assert str(refused.value).startswith(f"{named}: ")


def test_status_refuses_a_bad_flag_in_one_line_before_asking_the_registry(child_env, listener) -> None:
    run = _refusal(child_env, listener, "status", ["--registry", PEER, "--watch", "nan"])
    assert run.returncode == 2
    assert run.stderr.startswith("pcpstack status: --watch=nan: ") and run.stderr.count("\n") == 1, run.stderr
    assert not _was_contacted(listener), "the registry should not have been asked"


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--timeout", "inf"], "--timeout=inf"),
        (["--timeout", "1e12"], "--timeout=1000000000000.0"),
        (["--timeout", "nan"], "--timeout=nan"),
        (["--pcp", "0", "--model", "/nonexist.gguf", "--tp", "3"], "--pcp=0"),
        (["--tp", "3"], "--tp=3"),
        (["--model", "/nonexist.gguf"], "--model='/nonexist.gguf'"),
        (["--log-dir", "/tmp/logs"], "--log-dir='/tmp/logs'"),
        (["--device", "cpu"], "--device='cpu'"),
        (["--decode-threads", "2"], "--decode-threads=2"),
        (["--prefill-chunk-tokens", "512"], "--prefill-chunk-tokens=512"),
        (["--no-prefix-cache"], "--no-prefix-cache=True"),
    ],
)
def test_generate_with_target_refuses_a_bad_or_stack_only_flag(flags, named) -> None:
    args = cli.build_parser(["generate"]).parse_args(["generate", "--target", "h:1", *flags, "hi"])
    with pytest.raises(commands.UsageError) as refused:
        commands.check_generate_arguments(args)
    assert str(refused.value).startswith(f"{named}: ")


def test_generate_refuses_a_bad_flag_in_one_line_before_contacting_the_worker(child_env, listener) -> None:
    run = _refusal(child_env, listener, "generate", ["--target", PEER, "--pcp", "3", "hi"])
    assert run.returncode == 2
    assert run.stderr.startswith("pcpstack generate: --pcp=3: ") and run.stderr.count("\n") == 1, run.stderr
    assert not _was_contacted(listener), "the decode worker should not have been contacted"


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--token-ids", "72,105", "this text"], "PROMPT='this text'"),
        (["--token-ids", "72,105", "--chat"], "--chat=True"),
        (["--token-ids", "72,105", "--chat", "--system", "be nice"], "--chat=True"),
    ],
)
def test_generate_refuses_a_prompt_or_chat_that_token_ids_would_drop(flags, named) -> None:
    args = cli.build_parser(["generate"]).parse_args(["generate", "--target", "h:1", *flags])
    with pytest.raises(commands.UsageError) as refused:
        commands.check_generate_arguments(args)
    assert str(refused.value).startswith(f"{named}: ")


def test_a_stack_only_flag_with_target_is_refused_as_local_only() -> None:
    args = cli.build_parser(["generate"]).parse_args(["generate", "--target", "h:1", "--pcp", "4", "hi"])
    with pytest.raises(commands.UsageError, match=r"--pcp=4: applies to --local only"):
        commands.check_generate_arguments(args)


@pytest.mark.parametrize(
    "flags",
    [
        ["--target", "h:1", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--seed", "3", "hi"],
        ["--target", "h:1", "--json", "--max-tokens", "8", "--stop", ".", "--ignore-eos", "hi"],
        ["--target", "h:1", "--chat", "--system", "be brief", "--timeout", str(commands.MAX_SECONDS), "hi"],
        ["--target", "h:1", "--token-ids", "1,2,3", "--timeout", "0.5"],
        ["--local", "--pcp", "1", "--tp", "2", "--model", "tiny", "--no-prefix-cache", "hi"],
    ],
)
def test_generate_accepts_a_valid_combination(flags) -> None:
    args = cli.build_parser(["generate"]).parse_args(["generate", *flags])
    commands.check_generate_arguments(args)


@pytest.mark.parametrize(
    "flags, watch",
    [
        ([], 0.0),
        (["--watch", "0"], 0.0),
        (["--watch", "2.5", "--timeout", "1"], 2.5),
        (["--registry", "a:1, b:2", "--json", "--watch", str(commands.MAX_SECONDS)], commands.MAX_SECONDS),
    ],
)
def test_status_accepts_a_valid_combination(flags, watch) -> None:
    args = cli.build_parser(["status"]).parse_args(["status", *flags])
    status.check_arguments(args)
    assert args.watch == watch


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--host", "no such host"], "--host='no such host': must be an address of this machine"),
        (["--log-dir", "/etc/hostname"], "--log-dir='/etc/hostname': must be a folder"),
        (["--log-dir", "/etc/hostname/logs"], "--log-dir='/etc/hostname/logs': cannot be made"),
    ],
)
def test_up_refuses_a_host_or_log_dir_it_could_not_use(flags, named) -> None:
    args = cli.build_parser(["up"]).parse_args(["up", "--model", "tiny", *flags])
    with pytest.raises(commands.UsageError, match=re.escape(named)):
        commands.check_stack_arguments(args)


@pytest.mark.parametrize(
    "flags, env, named",
    [
        (["--log-dir", "/etc/hostname"], {}, "--log-dir='/etc/hostname': must be a folder"),
        ([], {"PCPSTACK_TLS_CA": "/no/such/ca.pem"}, "PCPSTACK_TLS_CA='/no/such/ca.pem'"),
        ([], {"PCPSTACK_TOKEN": "short"}, "PCPSTACK_TOKEN: a token must be"),
        # Each used to be refused by a service after the registry and KV store had started, or not at all.
        (["--pcp", "5000"], {}, "--pcp=5000: must be at most 4096"),
        (["--decode", "100000"], {}, "--decode=100000: must be at most 64"),
    ],
)
def test_up_refuses_a_host_log_dir_or_tls_setting_before_starting_anything(
    child_env, flags, env, named
) -> None:
    # Each used to end in a traceback, some after the registry, store and workers had been started.
    run = subprocess.run(
        cli_command("up", "--model", "tiny", "--gateway-port", "0", *flags),
        capture_output=True,
        text=True,
        env={**child_env, **env},
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.startswith(f"pcpstack up: {named}") and run.stderr.count("\n") == 1, run.stderr
    assert "ready" not in run.stdout and "registry" not in run.stdout, run.stdout


def test_a_bad_token_in_the_environment_is_one_line_for_status_too(child_env, listener) -> None:
    run = subprocess.run(
        cli_command("status", "--registry", f"127.0.0.1:{listener.getsockname()[1]}"),
        capture_output=True,
        text=True,
        env={**child_env, "PCPSTACK_TOKEN": "short"},
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.startswith("pcpstack status: PCPSTACK_TOKEN:") and run.stderr.count("\n") == 1, (
        run.stderr
    )


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--max-tokens", "4294967296", "hi"], "--max-tokens=4294967296: must be in 1..4294967295"),
        (["--top-k", "4294967296", "hi"], "--top-k=4294967296: must be in 0..4294967295"),
        (["--token-ids", "1,4294967296"], "--token-ids='1,4294967296': 4294967296 is out of range"),
    ],
)
def test_generate_refuses_a_value_past_the_uint32_field_that_carries_it(flags, named) -> None:
    args = cli.build_parser(["generate"]).parse_args(["generate", "--target", "h:1", *flags])
    with pytest.raises(commands.UsageError, match=re.escape(named)):
        commands.check_generate_arguments(args)


@pytest.mark.parametrize(
    "target, rule",
    [
        ("", "must be a decode worker HOST:PORT"),
        ("foo", "must be HOST:PORT"),
        ("127.0.0.1:0", "port in 1..65535"),
        ("127.0.0.1:65536", "port in 1..65535"),
        ("[::1]", "must be HOST:PORT"),
    ],
)
def test_generate_refuses_a_target_that_is_no_host_and_port(target, rule) -> None:
    # An empty --target used to start a whole local stack, as if --local had been given.
    args = cli.build_parser(["generate"]).parse_args(["generate", "--target", target, "hi"])
    with pytest.raises(
        commands.UsageError, match=re.escape(f"--target={target!r}: ") + ".*" + re.escape(rule)
    ):
        commands.check_generate_arguments(args)


@pytest.mark.parametrize("target", ["h:1", "127.0.0.1:65535", "[::1]:7000", "decode-0.example:50051"])
def test_generate_accepts_a_host_and_port_target(target) -> None:
    args = cli.build_parser(["generate"]).parse_args(
        ["generate", "--target", target, "--max-tokens", "4294967295", "--top-k", "4294967295", "hi"]
    )
    commands.check_generate_arguments(args)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--gateway", "foo"], "--gateway='foo': must be an http:// or https:// URL"),
        (["--gateway", "ftp://x"], "--gateway='ftp://x': must be an http:// or https:// URL"),
        (["--gateway", "http://127.0.0.1:70000"], "--gateway='http://127.0.0.1:70000': must have a port"),
        (["--gateway", "http://127.0.0.1:0"], "--gateway='http://127.0.0.1:0': must have a port"),
        (["--gateway", "http://:8000"], "--gateway='http://:8000': must name a host"),
        (["--gateway", "http://[::1"], "--gateway='http://[::1': must be a URL"),
        (["--gateway", "http://h:8000/v1"], "--gateway='http://h:8000/v1': must be the base URL"),
        (["--gateway", "", "--api-key", "secret"], "--gateway='': skips the gateway, so --api-key"),
    ],
)
def test_status_refuses_a_gateway_it_could_not_ask(flags, named) -> None:
    args = cli.build_parser(["status"]).parse_args(["status", *flags])
    with pytest.raises(commands.UsageError, match=re.escape(named)) as refused:
        status.check_arguments(args)
    assert "secret" not in str(refused.value), "the API key must stay out of the message"


@pytest.mark.parametrize(
    "flags",
    [
        ["--gateway", ""],
        ["--gateway", "https://gateway.example", "--api-key", "k"],
        ["--gateway", "http://[::1]:8000/"],
        ["--gateway", "https://proxy.example:8443/pcpstack"],
    ],
)
def test_status_accepts_a_gateway_url_or_none(flags) -> None:
    args = cli.build_parser(["status"]).parse_args(["status", *flags])
    status.check_arguments(args)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--pcp", "5000"], "--pcp=5000: must be at most 4096"),
        (["--tp", "5000"], "--tp=5000: must be at most 4096"),
        (["--decode-tp", "5000"], "--decode-tp=5000: must be at most 4096"),
        (
            ["--pcp", "100", "--tp", "50"],
            "--pcp=100: with --tp=50: a set's PCP x TP ranks must be at most 4096",
        ),
        (["--decode", "100000"], "--decode=100000: must be at most 64"),
        (["--prefill-sets", "65"], "--prefill-sets=65: must be at most 64"),
        (["--registry-replicas", "65"], "--registry-replicas=65: must be at most 64"),
        (["--pcp", "64", "--tp", "4"], "--pcp=64: a local stack would run 256 prefill rank(s)"),
        (["--decode", "64", "--decode-tp", "4"], "--decode=64: a local stack would run 2 prefill rank(s)"),
    ],
)
def test_up_refuses_sizes_past_the_engine_or_one_machine(flags, named) -> None:
    args = cli.build_parser(["up"]).parse_args(["up", "--model", "tiny", *flags])
    with pytest.raises(commands.UsageError, match=re.escape(named)):
        commands.check_stack_arguments(args)


def test_up_accepts_the_largest_local_stack() -> None:
    flags = ["--prefill-sets", "64", "--pcp", "2", "--decode", "64", "--registry-replicas", "64"]
    args = cli.build_parser(["up"]).parse_args(["up", "--model", "tiny", *flags])
    commands.check_stack_arguments(args)
