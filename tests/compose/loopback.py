"""The services of compose/docker-compose.yml as local processes, each on a loopback address of its own.

Compose gives every service a host named after it. Here each service gets its own 127.a.b.c address
instead (a, b random per run, so concurrent runs on a shared machine never meet) and its declared
`command` is rewritten: `0.0.0.0` (alone or in `0.0.0.0:port`) becomes the service's own address, a
service name given to --host or --advertise and every `name:port` become the mapped address, and a
bind-mounted container path becomes the file in compose/. The image's entry point `pcpstack` becomes
`python -m pcpstack.cli`.
"""

from __future__ import annotations

import random
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from pcpstack.cli.stack import LocalStack, StackOptions

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
# Options whose value is a bare host (elsewhere a service name is an identity, e.g. `serve registry`).
HOST_OPTIONS = ("--host", "--advertise")


def load_compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The compose file as plain data, YAML anchors and merge keys resolved."""
    return YAML(typ="safe", pure=True).load(path)


def loopback_hosts(names: list[str], rng: random.Random | None = None) -> dict[str, str]:
    """One 127.a.b.c address per service name, all in one random /24 of the loopback network."""
    rng = rng or random.Random()
    prefix = f"127.{rng.randint(1, 254)}.{rng.randint(0, 255)}"
    return {name: f"{prefix}.{index + 2}" for index, name in enumerate(names)}


def bind_mounts(service: dict[str, Any], compose_dir: Path = COMPOSE_DIR) -> dict[str, Path]:
    """Container path -> file on this machine, for the service's bind mounts (short or long syntax)."""
    mounts: dict[str, Path] = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, _, rest = volume.partition(":")
            target = rest.split(":", 1)[0]
        else:
            source, target = volume.get("source", ""), volume["target"]
        if source.startswith((".", "/")):
            mounts[target] = (compose_dir / source).resolve()
    return mounts


def environment(service: dict[str, Any]) -> dict[str, str]:
    """The service's `environment` (mapping or KEY=VALUE list) as a mapping of strings."""
    declared = service.get("environment", {})
    if isinstance(declared, list):
        declared = dict(item.partition("=")[::2] for item in declared)
    return {key: "" if value is None else str(value) for key, value in declared.items()}


def command(service: dict[str, Any]) -> list[str]:
    """The service's `command` as an argument list."""
    declared = service["command"]
    return shlex.split(declared) if isinstance(declared, str) else [str(arg) for arg in declared]


def option(argv: list[str], flag: str) -> str:
    """The value of the last `flag VALUE` in argv."""
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


@dataclass(frozen=True)
class LocalCommand:
    """One compose service as a local process: name, address, `pcpstack` arguments and environment."""

    name: str
    host: str
    args: list[str]
    env: dict[str, str]

    @property
    def address(self) -> str:
        """host:port the service listens on."""
        return f"{self.host}:{option(self.args, '--port')}"


def local_command(name: str, service: dict[str, Any], hosts: dict[str, str]) -> LocalCommand:
    """The service's command with hostnames mapped to loopback and mounted paths to compose/ files."""
    mounts = bind_mounts(service)
    argv = command(service)

    def rewrite(previous: str, arg: str) -> str:
        if arg == "0.0.0.0":
            return hosts[name]
        if previous in HOST_OPTIONS and arg in hosts:
            return hosts[arg]
        host, sep, port = arg.rpartition(":")
        if sep and host in hosts and port.isdigit():
            return f"{hosts[host]}:{port}"
        if sep and host == "0.0.0.0" and port.isdigit():  # a wildcard HOST:PORT, such as --metrics's
            return f"{hosts[name]}:{port}"
        for target, source in mounts.items():
            if arg == target or arg.startswith(target + "/"):
                return str(source) + arg[len(target) :]
        return arg

    args = [rewrite(previous, arg) for previous, arg in zip(["", *argv[:-1]], argv, strict=True)]
    return LocalCommand(name, hosts[name], args, environment(service))


class ComposeStack(LocalStack):
    """LocalStack's process handling (spawn, readiness through the registry, SIGTERM then SIGKILL) around
    the commands of a compose file instead of its own."""

    def __init__(self, commands: list[LocalCommand], log_dir: Path, ready_timeout_s: float) -> None:
        options = StackOptions(
            prefill_sets=1, decode=1, ready_timeout_s=ready_timeout_s, log_dir=str(log_dir)
        )
        super().__init__(options, progress=lambda message: None)
        self.commands = commands

    async def start(self) -> None:
        """Starts every command and waits for one ready PCP set, one decode worker and one KV store."""
        started = time.monotonic()
        by_name = {c.name: c for c in self.commands}
        self.registry_address = by_name["registry"].address
        self.registry_addresses = [self.registry_address]
        self.kvstore_address = by_name["kvstore"].address
        self.decode_addresses = [by_name["decode"].address]
        for c in self.commands:
            self.options.extra_env = c.env  # LocalStack gives every process the same extra_env
            verb, service, *args = c.args  # every compose command is `pcpstack serve SERVICE ...`
            assert verb == "serve", c.args
            self._spawn(c.name, c.address, service, args)
        await self._wait_ready(started)
