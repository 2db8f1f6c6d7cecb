"""Registry replicas on a real one-member etcd that serves clients over TLS and takes only clients with a
certificate from its CA (etcd's --client-cert-auth): a replica given the CA, a client certificate and its
key leads; one whose certificate comes from another CA, or that checks the members' certificates for a name
they do not carry, never reaches etcd and says why while it keeps running; TLS flags that cannot work are
refused at start-up (exit 2) naming the flag and the rule."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pcpstack.cli.certs import write_certs
from pcpstack.common.config import ConfigError
from pcpstack.common.errors import ServiceError
from pcpstack.common.ports import free_port
from pcpstack.registry import etcd_store
from pcpstack.registry.election import Election
from pcpstack.registry.etcd_local import EtcdCluster, ServerTls
from pcpstack.registry.etcd_store import RETIRE_GRACE_S, EtcdStore, load_tls
from pcpstack.registry.main import RegistryConfig
from tests.registry.support import until, wait_serving
from tests.registry.test_etcd_leader_cut import _kill, _leader_named_by, _leads, _replica

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA with certificates for etcd and for the registry (both naming localhost and 127.0.0.1), and in
    other/ a certificate from an unrelated CA."""
    out = tmp_path_factory.mktemp("etcd-certs")
    write_certs(out, names=["etcd", "registry"])
    write_certs(out / "other", names=["registry"])
    return out


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[EtcdCluster]:
    data_dir = tmp_path_factory.mktemp("etcd-tls")
    tls = ServerTls(ca=certs / "ca.pem", cert=certs / "etcd.pem", key=certs / "etcd-key.pem")
    with EtcdCluster(data_dir, members=1, tls=tls) as cluster:
        yield cluster
    shutil.rmtree(data_dir, ignore_errors=True)


def _tls_flags(folder: Path) -> list[str]:
    return [
        "--etcd-ca",
        str(folder / "ca.pem"),
        "--etcd-cert",
        str(folder / "registry.pem"),
        "--etcd-key",
        str(folder / "registry-key.pem"),
    ]


def test_a_replica_with_a_client_certificate_from_etcds_ca_leads_over_tls(etcd, certs, child_env, tmp_path):
    async def scenario():
        assert etcd.endpoints.startswith("https://")
        port = free_port()
        prefix = "/tls/registry/"
        # a name the member's certificate carries other than the endpoint's own
        flags = [*_tls_flags(certs), "--etcd-server-name", "localhost"]
        process = _replica(etcd.endpoints, prefix, port, child_env, tmp_path / "tls.log", *flags)
        ca, cert, key = (str(certs / name) for name in ("ca.pem", "registry.pem", "registry-key.pem"))
        tls = load_tls(etcd.endpoints, ca, cert, key)
        store = await EtcdStore.connect(etcd.endpoints, prefix, 2.0, tls)
        try:
            await wait_serving(f"127.0.0.1:{port}")
            await until(lambda: _leads(f"127.0.0.1:{port}"), timeout=30)
            leader = await store.client.get(store.key("leader"))
            assert leader is not None and leader.value == f"127.0.0.1:{port}".encode()
            # A watch (what a replica holding sessions streams commands from) runs over the TLS channel too.
            _, revision = await store.mailbox("")
            await store.post([("node-a", b"assign")])
            watch = store.watch_mailboxes(revision + 1)
            node_id, _, message = await asyncio.wait_for(anext(watch), 10)
            await watch.aclose()
            assert (node_id, message) == ("node-a", b"assign")
        finally:
            _kill([process])
            await store.close()

    asyncio.run(asyncio.wait_for(scenario(), 75))


def test_a_replica_etcd_does_not_trust_or_that_does_not_trust_etcd_keeps_running_and_says_why(
    etcd, certs, child_env, tmp_path
):
    """One shows a certificate from another CA (etcd refuses it); one checks the members' certificates for
    a name they do not carry (it refuses etcd). Neither leads; both keep serving and log the failure."""

    async def scenario():
        ports = [free_port(), free_port()]
        logs = [tmp_path / "stranger.log", tmp_path / "wrong-name.log"]
        foreign = _tls_flags(certs / "other")
        foreign[1] = str(certs / "ca.pem")  # it trusts etcd; etcd does not trust its certificate
        processes = [
            _replica(etcd.endpoints, "/stranger/registry/", ports[0], child_env, logs[0], *foreign),
            _replica(
                etcd.endpoints,
                "/wrong-name/registry/",
                ports[1],
                child_env,
                logs[1],
                *_tls_flags(certs),
                "--etcd-server-name",
                "etcd.elsewhere.example",
            ),
        ]
        why = ("SSLV3_ALERT_BAD_CERTIFICATE", "Hostname Verification Check failed")
        try:
            for log, reason in zip(logs, why, strict=True):

                async def says_why(log: Path = log, reason: str = reason) -> bool:
                    text = log.read_text(errors="replace")
                    return "etcd unreachable" in text and reason in text

                await until(says_why, timeout=30)
            await asyncio.sleep(2.0)  # an election would have finished by now
            for port, process, log in zip(ports, processes, logs, strict=True):
                assert process.poll() is None, log.read_text(errors="replace")
                assert await _leader_named_by(f"127.0.0.1:{port}") != f"127.0.0.1:{port}"
                # retried five times a second, said once (each distinct error once every 30 s)
                assert log.read_text(errors="replace").count("etcd unreachable") == 1
        finally:
            _kill(processes)

    asyncio.run(asyncio.wait_for(scenario(), 75))


def test_a_client_certificate_rotated_on_disk_is_dialled_with_without_a_restart(
    etcd, certs, tmp_path, monkeypatch, caplog
):
    """The client's certificate files replaced where the flags point (as the kubelet updates a Secret
    volume: a new folder, a link swapped): the next requests go over a channel with the new ones. From one
    etcd refuses (another CA's; an expired one is refused the same way) to one it takes; then a pair whose
    key belongs to another certificate, which is logged and not used."""
    monkeypatch.setattr(etcd_store, "TLS_CHECK_S", 0.0)
    monkeypatch.setattr(etcd_store, "RETIRE_GRACE_S", 0.5)

    def mount(source: Path, version: str, key_from: Path | None = None) -> None:
        """source's files (the key from key_from) in a new folder, `..data` swapped to it: a Secret volume."""
        folder = tmp_path / version
        folder.mkdir()
        shutil.copy(certs / "ca.pem", folder / "ca.pem")
        shutil.copy(source / "registry.pem", folder / "registry.pem")
        shutil.copy((key_from or source) / "registry-key.pem", folder / "registry-key.pem")
        for name in ("ca.pem", "registry.pem", "registry-key.pem"):
            if not (tmp_path / name).is_symlink():
                (tmp_path / name).symlink_to(Path("..data") / name)
        (tmp_path / "..data.new").symlink_to(version)
        os.replace(tmp_path / "..data.new", tmp_path / "..data")

    async def scenario():
        mount(certs / "other", "v1")
        tls = load_tls(
            etcd.endpoints, *(str(tmp_path / name) for name in ("ca.pem", "registry.pem", "registry-key.pem"))
        )
        store = await EtcdStore.connect(etcd.endpoints, "/rotated/", 2.0, tls)
        try:
            with pytest.raises(ServiceError):
                await store.post([("n", b"refused")])
            mount(certs, "v2")
            await until(lambda: _posts(store, b"taken"), timeout=15)
            messages, _ = await store.mailbox("n")
            assert [message for _, message in messages] == [b"taken"]
            # a certificate with another one's key: not used, said why; the channel in use goes on
            mount(certs, "v3", key_from=certs / "other")
            with caplog.at_level("WARNING", logger="pcpstack.registry.etcd_store"):
                await store.post([("n", b"still")])
            assert "cannot be used yet" in caplog.text and "is not the key of" in caplog.text
        finally:
            await store.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def _posts(store: EtcdStore, message: bytes) -> bool:
    try:
        await store.post([("n", message)])
    except ServiceError:
        return False
    return True


def _refusal(certs: Path, **flags: str) -> ConfigError:
    with pytest.raises(ConfigError) as refused:
        RegistryConfig(**{"etcd": "https://127.0.0.1:2379", **flags})
    return refused.value


def test_tls_flags_that_cannot_work_are_refused_naming_the_flag(certs, tmp_path) -> None:
    ca, cert, key = (str(certs / name) for name in ("ca.pem", "registry.pem", "registry-key.pem"))
    other_key = str(certs / "other" / "registry-key.pem")
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not a certificate\n")
    cases = {
        "--etcd-ca": dict(etcd="http://127.0.0.1:2379", etcd_ca=ca),  # TLS files on a plain endpoint
        "--etcd-server-name": dict(etcd="http://127.0.0.1:2379", etcd_server_name="etcd"),
        "--etcd-cert": dict(etcd_cert=cert),  # a certificate without its key
        "--etcd-key": dict(etcd_key=key),  # a key without its certificate
        "--etcd": dict(etcd="http://127.0.0.1:2379,https://127.0.0.2:2379"),  # a mix of schemes
    }
    for flag, given in cases.items():
        assert flag in _refusal(certs, **given).keys, given
    mismatched = _refusal(certs, etcd_cert=cert, etcd_key=other_key)  # another certificate's key
    assert mismatched.keys == ("--etcd-key",) and "is not the key of" in str(mismatched)
    # Members on several hosts: each checked for its own name, or all for the one given.
    several = "https://etcd-0.etcd:2379,https://etcd-1.etcd:2379"
    own = RegistryConfig(etcd=several, etcd_ca=ca).etcd_tls()
    named = RegistryConfig(etcd=several, etcd_ca=ca, etcd_server_name="etcd").etcd_tls()
    assert own is not None and own.server_name == "" and named is not None and named.server_name == "etcd"
    unreadable = _refusal(certs, etcd_ca=str(tmp_path / "missing.pem"))
    assert unreadable.keys == ("--etcd-ca",) and "cannot be read" in str(unreadable)
    garbled = _refusal(certs, etcd_ca=str(not_pem))
    assert garbled.keys == ("--etcd-ca",) and "PEM" in str(garbled)
    with pytest.raises(ConfigError) as without_etcd:
        RegistryConfig(etcd_key=key)
    assert without_etcd.value.keys == ("--etcd-key",) and "needs --etcd" in str(without_etcd.value)
    # What the flags accept: a CA alone (a server-only TLS etcd), or all three.
    assert RegistryConfig(etcd="https://127.0.0.1:2379", etcd_ca=ca).etcd_tls() is not None
    full = RegistryConfig(etcd="https://localhost:2379", etcd_ca=ca, etcd_cert=cert, etcd_key=key).etcd_tls()
    assert full is not None and full.server_name == "" and full.cert and full.key
    assert "PRIVATE KEY" not in repr(full)  # a traceback or log line showing the settings
    with pytest.raises(ValueError, match="TLS needs https://"):  # what the code takes, as the flags do
        asyncio.run(EtcdStore.connect("http://127.0.0.1:2379", "/refused/", 2.0, full))


def test_a_registry_started_with_half_a_client_certificate_exits_2_naming_both_flags(certs, child_env):
    command = [sys.executable, "-m", "pcpstack.cli", "serve", "registry", "--port", str(free_port())]
    command += ["--etcd", "https://127.0.0.1:2379", "--etcd-cert", str(certs / "registry.pem")]
    done = subprocess.run(command, env=child_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "config error" in lines[0]
    assert "--etcd-cert" in lines[0] and "--etcd-key" in lines[0]


HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


@pytest.fixture(scope="module")
def member_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a client certificate for the registry, and one certificate per member naming only the member's
    own loopback address."""
    folder = tmp_path_factory.mktemp("member-certs")
    write_certs(folder, names=["registry"])
    for i, host in enumerate(HOSTS):
        write_certs(folder, names=[f"etcd-{i}"], dns=[], ips=[host])
    return folder


@pytest.fixture(scope="module")
def members(tmp_path_factory: pytest.TempPathFactory, member_certs: Path) -> Iterator[EtcdCluster]:
    """Three members on three loopback addresses, each serving with its own certificate."""
    tls = [
        ServerTls(
            ca=member_certs / "ca.pem",
            cert=member_certs / f"etcd-{i}.pem",
            key=member_certs / f"etcd-{i}-key.pem",
        )
        for i in range(len(HOSTS))
    ]
    data_dir = tmp_path_factory.mktemp("etcd-members")
    with EtcdCluster(data_dir, members=len(HOSTS), tls=tls, hosts=HOSTS) as cluster:
        yield cluster
    shutil.rmtree(data_dir, ignore_errors=True)


def test_a_member_that_hangs_is_left_for_the_next_without_ending_the_tasks_that_had_calls_on_it(
    members, member_certs
) -> None:
    """Member 0 stopped (SIGSTOP: its connections stay open, calls hang until their deadline) while an
    election leads and eight tasks read etcd in a loop: the client dials the next member on a new channel,
    and the old one is closed only after its calls had time to end, so every task lives on (closing it at
    once ended them all, cancelled, the election with them), and the election leads again."""
    ca, cert, key = (str(member_certs / name) for name in ("ca.pem", "registry.pem", "registry-key.pem"))

    async def scenario() -> tuple[int, bool, str, int]:
        store = await EtcdStore.connect(
            members.endpoints, "/hang/registry/", 3.0, load_tls(members.endpoints, ca, cert, key)
        )
        election = Election(store, "127.0.0.1:9", _nothing, lambda: None)
        campaign = asyncio.create_task(election.run())
        failed = [0]

        async def read() -> None:
            while True:
                try:
                    await store.node_records()
                except ServiceError:
                    failed[0] += 1
                    await asyncio.sleep(0.05)

        readers = [asyncio.create_task(read()) for _ in range(8)]
        try:
            await until(lambda: _true(election.leading), timeout=30)
            first = store.client.server_name
            os.kill(members.pids[0], signal.SIGSTOP)
            try:
                await until(lambda: _true(store.client.server_name != first), timeout=30)
                await asyncio.sleep(RETIRE_GRACE_S + 1)  # the old channel is closed by now
            finally:
                os.kill(members.pids[0], signal.SIGCONT)
            await until(lambda: _true(election.leading), timeout=30)
            ended = sum(task.done() for task in [*readers, campaign])
            return ended, election.leading, store.client.server_name, failed[0]
        finally:
            for task in [*readers, campaign]:
                task.cancel()
            await asyncio.gather(*readers, campaign, return_exceptions=True)
            await store.close()

    ended, leading, now, failed = asyncio.run(asyncio.wait_for(scenario(), 85))
    assert (ended, leading) == (0, True)
    assert now != "127.0.0.1" and failed > 0  # it moved on, after calls on member 0 failed


async def _nothing() -> None:
    pass


async def _true(value: bool) -> bool:
    return value


def test_members_whose_certificates_name_only_themselves_are_dialled_one_at_a_time(
    members, member_certs, child_env, tmp_path
) -> None:
    """The registry process against the three members, checking each for its own name: it leads through the
    first, and when that member is killed dials the next and leads on (one channel over all three with one
    name could not pass the second)."""

    async def scenario() -> None:
        port = free_port()
        address = f"127.0.0.1:{port}"
        log = tmp_path / "members.log"
        process = _replica(
            members.endpoints, "/members/registry/", port, child_env, log, *_tls_flags(member_certs)
        )
        try:
            await until(lambda: _leads(address), timeout=30)
            members.kill_member(0)

            async def moved_on() -> bool:
                return "dialling the next" in log.read_text(errors="replace") and await _leads(address)

            await until(moved_on, timeout=60)
        finally:
            _kill([process])

    asyncio.run(asyncio.wait_for(scenario(), 85))
