"""`pcpstack serve registry`: run the registry in the foreground until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pcpstack.common.config import ConfigError, check_non_negative, check_positive, is_wildcard
from pcpstack.common.server import DEFAULT_MAX_MESSAGE_BYTES
from pcpstack.common.startup import (
    ListenConfig,
    Serving,
    add_process_arguments,
    config_from_args,
    run_service,
)
from pcpstack.registry.membership import Settings

if TYPE_CHECKING:
    from pcpstack.registry.etcd_auth import EtcdAuth
    from pcpstack.registry.etcd_store import EtcdTls

log = logging.getLogger(__name__)
DEFAULT_PORT = 7000
DEFAULT_ETCD_PREFIX = "/pcpstack/registry/"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The registry's command-line options."""
    add_process_arguments(parser)
    parser.add_argument(
        "--verify-peer-address",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="refuse a node that advertises a host other than the one it connects from, unless its TLS "
        "certificate names it (loopback peers may advertise any loopback address; default on)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument(
        "--advertise",
        default="",
        help="host the other registry replicas reach this one at, written as the leader's address with "
        "--etcd (default: --host; needed when --host is a wildcard)",
    )
    parser.add_argument(
        "--lease", type=float, default=3.0, help="seconds of silence after which a node is dead (default 3)"
    )
    parser.add_argument(
        "--assembly-timeout",
        type=float,
        default=60.0,
        help="seconds pooled nodes wait for a set to fill before they are told so (default 60)",
    )
    parser.add_argument(
        "--restore-grace",
        type=float,
        default=None,
        help="seconds after start during which nodes re-register with their assignments before new sets "
        "are formed (default: 2 x lease; 0 with --snapshot when no snapshot exists yet)",
    )
    parser.add_argument(
        "--snapshot", type=Path, default=None, help="file to keep a snapshot in, so a restart is faster"
    )
    parser.add_argument(
        "--etcd",
        default=None,
        metavar="http[s]://HOST:PORT[,...]",
        help="keep membership state (sets, generations, node records under leases) in this etcd cluster "
        "instead of in memory; registries started against one etcd elect a leader that assembles sets, "
        "and a restarted or newly elected one awaits the same sets (needs aetcd; docs/registry-on-etcd.md)",
    )
    parser.add_argument(
        "--etcd-ca",
        default="",
        metavar="FILE",
        help="PEM CA certificates the etcd members' certificates are checked against, with https:// --etcd "
        "endpoints (default: the system's roots)",
    )
    parser.add_argument(
        "--etcd-cert",
        default="",
        metavar="FILE",
        help="PEM client certificate this registry shows etcd (one started with --client-cert-auth needs "
        "it), with --etcd-key",
    )
    parser.add_argument("--etcd-key", default="", metavar="FILE", help="the --etcd-cert's PEM private key")
    parser.add_argument(
        "--etcd-server-name",
        default="",
        help="one name every etcd member's certificate carries, checked in each (default: each member is "
        "checked for its own endpoint's host, and reached one at a time)",
    )
    parser.add_argument(
        "--etcd-user",
        default="",
        help="the etcd user this registry authenticates as, where etcd has authentication on (with "
        "--etcd-password-file; a client certificate's name needs neither)",
    )
    parser.add_argument(
        "--etcd-password-file",
        default="",
        metavar="FILE",
        help="file holding the --etcd-user's password, one line (a Kubernetes Secret mounted as a file); "
        "read again before each sign-in to etcd, so a rotated password needs no restart",
    )
    parser.add_argument(
        "--etcd-prefix",
        default=DEFAULT_ETCD_PREFIX,
        help=f"key prefix of this registry's state in etcd (default {DEFAULT_ETCD_PREFIX})",
    )
    parser.add_argument(
        "--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, help="largest gRPC message"
    )


@dataclass(frozen=True, kw_only=True)
class RegistryConfig(ListenConfig):
    """The registry process's configuration, validated when built; errors name the flag."""

    port: int = DEFAULT_PORT
    lease: float = 3.0
    assembly_timeout: float = 60.0
    # None: 2 x lease.
    restore_grace: float | None = None
    snapshot: Path | None = None
    etcd: str | None = None
    etcd_prefix: str = DEFAULT_ETCD_PREFIX
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    etcd_server_name: str = ""
    etcd_user: str = ""
    etcd_password_file: str = ""
    verify_peer_address: bool = True
    advertise: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("--lease", self.lease)
        check_positive("--assembly-timeout", self.assembly_timeout)
        if self.restore_grace is not None:
            check_non_negative("--restore-grace", self.restore_grace)
        if self.snapshot is not None:
            self._check_snapshot(self.snapshot)
        if self.etcd is not None:
            self._check_etcd(self.etcd)
        else:
            for flag, value in self._etcd_tls_flags().items():
                if value:
                    raise ConfigError.broken(flag, value, "is TLS to etcd: it needs --etcd")
            for flag, value in (
                ("--etcd-user", self.etcd_user),
                ("--etcd-password-file", self.etcd_password_file),
            ):
                if value:
                    raise ConfigError.broken(flag, value, "is authentication to etcd: it needs --etcd")
            if self.advertise:
                rule = "is where the other registry replicas reach this one while it leads: it needs --etcd"
                raise ConfigError.broken("--advertise", self.advertise, rule)
            if self.etcd_prefix != DEFAULT_ETCD_PREFIX:
                raise ConfigError.broken(
                    "--etcd-prefix", self.etcd_prefix, "is where in etcd: it needs --etcd"
                )
        if is_wildcard(self.advertise):
            raise ConfigError.broken(
                "--advertise", self.advertise, "must be an address others can dial, not a wildcard"
            )
        if not self.etcd_prefix.startswith("/"):
            raise ConfigError.broken("--etcd-prefix", self.etcd_prefix, "must start with /")

    @staticmethod
    def _check_snapshot(path: Path) -> None:
        # checked now: a path the registry cannot write would only show as warnings once it serves
        if path.is_dir():
            rule = "must be a file, not a folder"
        elif not path.parent.is_dir():
            rule = "must be a file in an existing folder"
        elif not os.access(path.parent, os.W_OK | os.X_OK):
            rule = "must be in a folder this process can write"
        else:
            return
        raise ConfigError.broken("--snapshot", str(path), rule)

    def _check_etcd(self, urls: str) -> None:
        if self.snapshot is not None:
            rule = "with --etcd the state is kept in etcd; give one of the two"
            raise ConfigError.broken("--snapshot", str(self.snapshot), rule)
        try:
            from pcpstack.registry.etcd_store import parse_endpoints
        except ImportError as exc:
            rule = f"needs the aetcd package (pip install 'pcpstack[etcd]'): {exc}"
            raise ConfigError.broken("--etcd", urls, rule) from None
        parse_endpoints(urls)
        self.etcd_tls()  # its files are read and checked now
        self.etcd_auth()
        if is_wildcard(self.host) and not self.advertise:
            # the leader's address is written for the other replicas to dial: a wildcard is no address
            raise ConfigError(
                f"--host={self.host!r} with --etcd: the leader's address must be one other replicas can "
                "dial; give --advertise HOST",
                ("--host", "--advertise"),
                "--etcd with a wildcard --host needs --advertise",
            )

    def _etcd_tls_flags(self) -> dict[str, str]:
        return {
            "--etcd-ca": self.etcd_ca,
            "--etcd-cert": self.etcd_cert,
            "--etcd-key": self.etcd_key,
            "--etcd-server-name": self.etcd_server_name,
        }

    def etcd_tls(self) -> EtcdTls | None:
        """TLS to etcd as the flags give it (None: plain http, or no --etcd), its files read."""
        if self.etcd is None:
            return None
        from pcpstack.registry.etcd_store import load_tls

        return load_tls(self.etcd, self.etcd_ca, self.etcd_cert, self.etcd_key, self.etcd_server_name)

    def etcd_auth(self) -> EtcdAuth | None:
        """The etcd user and password as the flags give them (None: none, or no --etcd), the file read."""
        if self.etcd is None:
            return None
        from pcpstack.registry.etcd_auth import load_auth

        return load_auth(self.etcd_user, self.etcd_password_file)

    @property
    def advertised_host(self) -> str:
        """The host other replicas reach this one at."""
        return self.advertise or self.host

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RegistryConfig:
        """The config the flags describe."""
        return config_from_args(cls, args)

    def settings(self) -> Settings:
        """The registry core's timing."""
        grace = 2 * self.lease if self.restore_grace is None else self.restore_grace
        return Settings(
            lease_s=self.lease,
            assembly_timeout_s=self.assembly_timeout,
            restore_grace_s=grace,
            restore_grace_given=self.restore_grace is not None,
        )


async def start(config: RegistryConfig) -> Serving:
    """Starts the registry; draining stops its clock and then its server."""
    from pcpstack.registry.server import start_registry

    settings = config.settings()
    registry = await start_registry(
        settings,
        config.server_options(),
        config.snapshot,
        config.verify_peer_address,
        config.etcd,
        config.etcd_prefix,
        advertised_host=config.advertised_host,
        etcd_tls=config.etcd_tls(),
        etcd_auth=config.etcd_auth(),
    )
    log.info("registry serving", extra={"address": registry.address, "lease_s": settings.lease_s})
    return Serving.grpc(registry.running, registry.stop)


def run(args: argparse.Namespace) -> int:
    """Serves until signalled; returns the exit status."""
    return run_service("registry", args, RegistryConfig.from_args, start)
