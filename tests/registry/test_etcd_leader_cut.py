"""Registry replicas on a real one-member etcd when the path to etcd fails: a leader cut off from etcd (a TCP
proxy between them stops passing data) steps down within about its lease's TTL and the other replica leads
alone; an etcd name that does not resolve does not stop start-up, and a name that moves to a new address is
dialled there; a replica bound to a wildcard is refused without --advertise and writes the advertised
address as leader with it; etcd at an IPv6 address is reached."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pcpstack.common.channel import open_channel
from pcpstack.common.ports import free_port
from pcpstack.registry.election import LEADER_TTL_S
from pcpstack.registry.etcd_local import EtcdCluster
from pcpstack.registry.etcd_store import EtcdStore
from pcpstack.v1 import registry_pb2, registry_pb2_grpc
from tests.registry.support import until, wait_serving

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One etcd member shared by the module's tests (each keeps its state under its own prefix)."""
    data_dir = tmp_path_factory.mktemp("etcd")
    with EtcdCluster(data_dir, members=1) as cluster:
        yield cluster
    shutil.rmtree(data_dir, ignore_errors=True)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 75))


class _Proxy:
    """A TCP proxy from host:port to etcd's port on 127.0.0.1. `blackhole` stops it passing anything, as a
    partition does (connections stay open, new ones are accepted and hang); `close` refuses them."""

    def __init__(self, target_port: int, host: str = "127.0.0.1", port: int = 0) -> None:
        self._target_port = target_port
        self.host = host
        self.port = port or free_port()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._blackholed = False

    async def start(self) -> _Proxy:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        if self._blackholed:
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        self._writers.append(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if not self._blackholed:
                    writer.write(data)
                    await writer.drain()
        writer.close()

    def blackhole(self) -> None:
        self._blackholed = True

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()


def _replica(
    endpoints: str, prefix: str, port: int, env: dict[str, str], log: Path, *extra: str
) -> subprocess.Popen:
    command = [sys.executable, "-m", "pcpstack.cli", "serve", "registry", "--port", str(port)]
    flags = ["--lease", "2", "--restore-grace", "4", "--etcd", endpoints, "--etcd-prefix", prefix, *extra]
    return subprocess.Popen(
        [*command, *flags, "--log-level", "WARNING"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )


def _kill(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait()


async def _leader_named_by(address: str) -> str | None:
    """The leader address the replica at address answers ListSets with; None when it does not answer."""
    # a generous deadline: on a loaded machine a replica may take seconds to answer
    async with open_channel(address, default_deadline=5.0) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        try:
            return (await stub.ListSets(registry_pb2.ListSetsRequest())).leader_address
        except grpc.aio.AioRpcError:
            return None


async def _leads(address: str) -> bool:
    return await _leader_named_by(address) == address


def test_a_leader_cut_off_from_etcd_steps_down_within_about_a_ttl_and_the_other_replica_leads_alone(
    etcd, child_env, tmp_path
):
    """A reaches etcd only through a proxy, B directly. Once the proxy passes nothing, A stops answering as
    leader about a TTL after its last refresh (it cannot know whether its lease still lives), and B, elected
    once that lease has expired in etcd, is the only one that does."""

    async def scenario():
        etcd_port = int(etcd.endpoints.rpartition(":")[2])
        proxy = await _Proxy(etcd_port).start()
        ports = [free_port(), free_port()]
        a, b = (f"127.0.0.1:{port}" for port in ports)
        prefix = "/cut/registry/"
        processes = [
            _replica(f"http://127.0.0.1:{proxy.port}", prefix, ports[0], child_env, tmp_path / "a.log")
        ]
        try:
            await wait_serving(a)
            await until(lambda: _leads(a), timeout=30)
            processes.append(_replica(etcd.endpoints, prefix, ports[1], child_env, tmp_path / "b.log"))
            await wait_serving(b)

            async def b_follows_a() -> bool:
                return await _leader_named_by(b) == a

            await until(b_follows_a, timeout=30)

            proxy.blackhole()
            cut_at = time.monotonic()

            async def a_stepped_down() -> bool:
                return await _leader_named_by(a) != a

            # about a TTL; generous for a loaded machine, far below "never" (the old behaviour)
            await until(a_stepped_down, timeout=8 * LEADER_TTL_S)
            stepped_down_s = time.monotonic() - cut_at
            await until(lambda: _leads(b), timeout=30)
            # B leads alone: A, still cut off, does not claim it again
            for _ in range(10):
                assert await _leader_named_by(a) != a
                assert await _leads(b)
                await asyncio.sleep(0.2)
            assert stepped_down_s < 8 * LEADER_TTL_S
            assert "stepping down" in (tmp_path / "a.log").read_text(errors="replace")
        finally:
            _kill(processes)
            await proxy.close()

    _run(scenario())


def test_an_etcd_endpoint_that_does_not_resolve_is_skipped_at_start_up(etcd, child_env, tmp_path):
    """A name that does not resolve (a Pending etcd pod has no DNS record yet) next to a good endpoint: the
    replica starts and leads over the good one; with no endpoint resolving it keeps running and says why."""

    async def scenario():
        port = free_port()
        address = f"127.0.0.1:{port}"
        unresolvable = f"http://etcd-9.does-not-resolve.invalid:{free_port()}"
        log = tmp_path / "one.log"
        processes = [_replica(f"{unresolvable},{etcd.endpoints}", "/skip/registry/", port, child_env, log)]
        try:
            await until(lambda: _leads(address), timeout=30)
            assert "does not resolve" in log.read_text(errors="replace")
            alone_port = free_port()
            alone_log = tmp_path / "alone.log"
            processes.append(_replica(unresolvable, "/skip2/registry/", alone_port, child_env, alone_log))

            async def says_why() -> bool:
                assert processes[1].poll() is None, alone_log.read_text(errors="replace")
                return "no etcd endpoint resolves" in alone_log.read_text(errors="replace")

            await until(says_why, timeout=30)
            await asyncio.sleep(1.0)
            assert processes[1].poll() is None
        finally:
            _kill(processes)

    _run(scenario())


def test_an_etcd_name_that_moves_to_another_address_is_dialled_there(etcd, monkeypatch):
    """The name resolves to 127.0.0.2, where a proxy to etcd listens; that proxy goes and the name resolves
    to 127.0.0.3 (another proxy on the same port): requests fail for a while, then reach etcd there."""
    name = "etcd-0.moving.test"
    where = {"ip": "127.0.0.2"}
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        return real_getaddrinfo(where["ip"] if host == name else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "gethostbyname", lambda host: where["ip"] if host == name else host)

    async def scenario():
        etcd_port = int(etcd.endpoints.rpartition(":")[2])
        port = free_port()
        first = await _Proxy(etcd_port, "127.0.0.2", port).start()
        second = await _Proxy(etcd_port, "127.0.0.3", port).start()
        store = await EtcdStore.connect(f"http://{name}:{port}", "/moving/registry/", 2.0)
        try:
            await store.post([("n", b"before")])
            await first.close()
            where["ip"] = "127.0.0.3"

            async def reaches_etcd() -> bool:
                try:
                    await store.post([("n", b"after")])
                except Exception:
                    return False
                return True

            await until(reaches_etcd, timeout=30)
            messages, _ = await store.mailbox("n")
            assert [message for _, message in messages][-1] == b"after"
        finally:
            await store.close()
            await first.close()
            await second.close()

    _run(scenario())


def test_a_replica_reaches_etcd_at_an_ipv6_address(etcd, child_env, tmp_path):
    """--etcd http://[::1]:PORT (etcd behind a proxy on IPv6 loopback): the replica leads through it; a
    name that resolves to IPv6 only is dialled at that address."""

    async def scenario():
        etcd_port = int(etcd.endpoints.rpartition(":")[2])
        proxy = await _Proxy(etcd_port, "::1", free_port("::1")).start()
        port = free_port()
        log = tmp_path / "v6.log"
        process = _replica(f"http://[::1]:{proxy.port}", "/v6/registry/", port, child_env, log)
        store = await EtcdStore.connect(f"http://etcd-v6.test:{proxy.port}", "/v6/registry/", 2.0)
        try:
            await until(lambda: _leads(f"127.0.0.1:{port}"), timeout=30)
            assert store.client.addresses == [f"[::1]:{proxy.port}"]
            leader = await store.client.get(store.key("leader"))
            assert leader is not None and leader.value == f"127.0.0.1:{port}".encode()
        finally:
            _kill([process])
            await store.close()
            await proxy.close()

    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        return real_getaddrinfo("::1" if host == "etcd-v6.test" else host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket, "getaddrinfo", getaddrinfo)
        _run(scenario())


def test_a_replica_bound_to_a_wildcard_is_refused_without_advertise(child_env):
    command = [sys.executable, "-m", "pcpstack.cli", "serve", "registry", "--host", "0.0.0.0"]
    command += ["--port", str(free_port()), "--etcd", "http://127.0.0.1:2379"]
    done = subprocess.run(command, env=child_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "config error" in lines[0]
    assert "--host='0.0.0.0'" in lines[0] and "--advertise" in lines[0]


def test_a_replica_bound_to_a_wildcard_writes_its_advertised_address_as_leader(etcd, child_env, tmp_path):
    async def scenario():
        port = free_port()
        prefix = "/advertised/registry/"
        log = tmp_path / "wild.log"
        process = _replica(
            etcd.endpoints, prefix, port, child_env, log, "--host", "0.0.0.0", "--advertise", "127.0.0.1"
        )
        store = await EtcdStore.connect(etcd.endpoints, prefix, 2.0)
        try:
            await until(lambda: _leads(f"127.0.0.1:{port}"), timeout=30)
            leader = await store.client.get(store.key("leader"))
            assert leader is not None and leader.value == f"127.0.0.1:{port}".encode()
        finally:
            _kill([process])
            await store.close()

    _run(scenario())
