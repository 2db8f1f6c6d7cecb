"""Registry replicas on a real one-member etcd with authentication on (users, a role with read and write on
one prefix, simple tokens that lapse after two idle seconds): a replica given a user and its password file
leads; one with a wrong password keeps running, never leads, says why, and does not ask etcd again on every
request; a token etcd stopped taking is replaced, for one-shot requests and for watches; a password rotated
in etcd and in its file is taken without a restart; flags that cannot work are refused naming the flag."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import aetcd.rpc
import pytest

from pcpstack.common.config import ConfigError
from pcpstack.common.errors import ServiceError
from pcpstack.common.ports import free_port
from pcpstack.registry import etcd_auth
from pcpstack.registry.etcd_auth import EtcdAuth
from pcpstack.registry.etcd_local import EtcdCluster
from pcpstack.registry.etcd_store import EtcdStore
from pcpstack.registry.main import RegistryConfig
from tests.registry.support import until
from tests.registry.test_etcd_leader_cut import _kill, _leader_named_by, _leads, _replica

pytestmark = pytest.mark.timeout(90)

TOKEN_TTL_S = 2
PASSWORD = "s3cret-pw"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """etcd with authentication on: root, and the user `registry` with read and write under /auth/."""
    data_dir = tmp_path_factory.mktemp("etcd-auth")
    with EtcdCluster(data_dir, members=1, flags=[f"--auth-token-ttl={TOKEN_TTL_S}"]) as cluster:
        cluster.etcdctl("user", "add", "root", "--new-user-password=root-pw")
        cluster.etcdctl("user", "grant-role", "root", "root")
        cluster.etcdctl("role", "add", "registry")
        cluster.etcdctl("role", "grant-permission", "registry", "--prefix=true", "readwrite", "/auth/")
        cluster.etcdctl("user", "add", "registry", f"--new-user-password={PASSWORD}")
        cluster.etcdctl("user", "grant-role", "registry", "registry")
        cluster.etcdctl("auth", "enable")
        yield cluster
    shutil.rmtree(data_dir, ignore_errors=True)


def _password_file(folder: Path, password: str) -> Path:
    path = folder / "etcd-password"
    path.write_text(password + "\n")  # as `echo` writes it
    return path


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 75))


def test_a_replica_with_a_user_and_password_leads_and_a_wrong_password_never_does(etcd, child_env, tmp_path):
    async def scenario():
        good_port, bad_port = free_port(), free_port()
        good_log, bad_log = tmp_path / "good.log", tmp_path / "bad.log"
        (tmp_path / "good").mkdir()
        (tmp_path / "bad").mkdir()
        good, bad = _password_file(tmp_path / "good", PASSWORD), _password_file(tmp_path / "bad", "wrong")
        auth = ["--etcd-user", "registry", "--etcd-password-file"]
        processes = [
            _replica(etcd.endpoints, "/auth/one/", good_port, child_env, good_log, *auth, str(good)),
            _replica(etcd.endpoints, "/auth/two/", bad_port, child_env, bad_log, *auth, str(bad)),
        ]
        try:
            await until(lambda: _leads(f"127.0.0.1:{good_port}"), timeout=30)

            async def says_why() -> bool:
                assert processes[1].poll() is None, bad_log.read_text(errors="replace")
                return "invalid user ID or password" in bad_log.read_text(errors="replace")

            await until(says_why, timeout=30)
            # past a token's life: the leader still leads (its token is in use), the other still does not
            await asyncio.sleep(TOKEN_TTL_S + 1)
            assert await _leads(f"127.0.0.1:{good_port}")
            assert await _leader_named_by(f"127.0.0.1:{bad_port}") in ("", None)
            assert processes[1].poll() is None
        finally:
            _kill(processes)

    _run(scenario())


def test_a_lapsed_token_is_replaced_for_requests_and_for_watches(etcd):
    async def scenario():
        store = await EtcdStore.connect(
            etcd.endpoints, "/auth/lapse/", 2.0, auth=EtcdAuth("registry", PASSWORD)
        )
        tokens = store.client._tokens
        try:
            await store.post([("n", b"first")])
            first = await tokens.token()
            await asyncio.sleep(TOKEN_TTL_S + 1.5)  # unused this long, etcd forgets the token
            await store.post([("n", b"second")])  # refused once for the token, sent again with a new one
            assert await tokens.token() != first
            messages, _ = await store.mailbox("n")
            assert [message for _, message in messages] == [b"first", b"second"]

            async def first_event():
                async for _, _, message in store.watch_mailboxes(1):
                    return message

            assert await asyncio.wait_for(first_event(), 10) == b"first"
            # the watch stream keeps the token it opened with: once that lapses, a new watch is refused
            # (etcd answers "permission denied"); the stream is opened again with a new token and the
            # next watch works
            await asyncio.sleep(TOKEN_TTL_S + 1.5)
            attempts = 0
            while True:
                attempts += 1
                try:
                    assert await asyncio.wait_for(first_event(), 10) == b"first"
                    break
                except ServiceError as exc:
                    assert "permission denied" in str(exc) and attempts < 3
        finally:
            await store.close()

    _run(scenario())


def test_a_refused_password_is_not_sent_again_on_every_request(etcd, monkeypatch):
    sent = _count_authenticates(monkeypatch)

    async def scenario():
        store = await EtcdStore.connect(
            etcd.endpoints, "/auth/wrong/", 2.0, auth=EtcdAuth("registry", "wrong")
        )
        try:
            for _ in range(5):
                with pytest.raises(ServiceError, match="invalid user ID or password"):
                    await store.post([("n", b"x")])
            assert sent == ["registry"]
            monkeypatch.setattr(etcd_auth, "AUTH_RETRY_S", 0.0)
            with pytest.raises(ServiceError, match="invalid user ID or password"):
                await store.post([("n", b"x")])
            assert sent == ["registry", "registry"]
        finally:
            await store.close()

    _run(scenario())


def test_tasks_waiting_for_a_token_from_an_etcd_that_does_not_answer_fail_together(monkeypatch):
    """Eight requests at once, etcd silent (it accepts connections and says nothing): one Authenticate
    times out and the seven tasks queued behind it fail with its error, rather than each waiting out an
    Authenticate of its own one after another."""
    sent = _count_authenticates(monkeypatch)
    monkeypatch.setattr(etcd_auth, "AUTH_TIMEOUT_S", 0.5)

    async def scenario():
        async def silent(reader, writer):
            await asyncio.sleep(60)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        store = await EtcdStore.connect(
            f"http://127.0.0.1:{port}", "/auth/silent/", 2.0, auth=EtcdAuth("u", "p")
        )
        try:
            outcomes = await asyncio.gather(
                *(store.post([("n", b"x")]) for _ in range(8)), return_exceptions=True
            )
            assert all(isinstance(outcome, ServiceError) for outcome in outcomes), outcomes
            assert sent == ["u"]
        finally:
            await store.close()
            server.close()

    _run(scenario())


def test_a_password_changed_in_etcd_and_in_its_file_is_taken_without_a_restart(etcd, tmp_path, monkeypatch):
    """A rotation as an operator does it: the user's password changed in etcd (every token stops working),
    then the Secret the password file comes from. Requests fail while the file holds the old password and
    work again once it holds the new one, with the same client."""
    root = "--user=root:root-pw"
    etcd.etcdctl(root, "user", "add", "rotating", "--new-user-password=first-pw")
    etcd.etcdctl(root, "user", "grant-role", "rotating", "registry")
    path = _password_file(tmp_path, "first-pw")
    monkeypatch.setattr(etcd_auth, "AUTH_RETRY_S", 0.0)

    async def scenario():
        store = await EtcdStore.connect(
            etcd.endpoints, "/auth/rotate/", 2.0, auth=etcd_auth.load_auth("rotating", str(path))
        )
        try:
            await store.post([("n", b"before")])
            etcd.etcdctl(root, "user", "passwd", "rotating", "--interactive=false", stdin="second-pw\n")
            with pytest.raises(ServiceError, match="invalid user ID or password"):
                await store.post([("n", b"between")])
            path.write_text("not a password\nin two lines\n")  # a file half written: the old one is kept
            with pytest.raises(ServiceError, match="invalid user ID or password"):
                await store.post([("n", b"between")])
            _password_file(tmp_path, "second-pw")
            await store.post([("n", b"after")])
            messages, _ = await store.mailbox("n")
            assert [message for _, message in messages] == [b"before", b"after"]
        finally:
            await store.close()

    _run(scenario())


def _count_authenticates(monkeypatch) -> list[str]:
    """The user names of the Authenticate calls the client sends from now on, in order."""
    sent = []
    real_stub = aetcd.rpc.AuthStub

    class CountingStub:
        def __init__(self, channel) -> None:
            self._stub = real_stub(channel)

        async def Authenticate(self, request, **kwargs):
            sent.append(request.name)
            return await self._stub.Authenticate(request, **kwargs)

    monkeypatch.setattr(etcd_auth.aetcd.rpc, "AuthStub", CountingStub)
    return sent


def test_authentication_flags_that_cannot_work_are_refused_naming_the_flag(tmp_path):
    good = _password_file(tmp_path, PASSWORD)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    two_lines = tmp_path / "two"
    two_lines.write_text("a\nb\n")
    etcd = "http://127.0.0.1:2379"
    cases = [
        ({"etcd_user": "registry"}, "--etcd-user", "--etcd-password-file"),
        ({"etcd_password_file": str(good)}, "--etcd-password-file", "--etcd-user"),
        (
            {"etcd_user": "registry", "etcd_password_file": str(tmp_path / "absent")},
            "--etcd-password-file",
            "readable",
        ),
        ({"etcd_user": "registry", "etcd_password_file": str(empty)}, "--etcd-password-file", "empty"),
        ({"etcd_user": "registry", "etcd_password_file": str(two_lines)}, "--etcd-password-file", "one line"),
    ]
    for flags, named, rule in cases:
        with pytest.raises(ConfigError) as refused:
            RegistryConfig(etcd=etcd, **flags)
        assert named in str(refused.value) and rule in str(refused.value), flags
    with pytest.raises(ConfigError, match=r"--etcd-user.*needs --etcd"):
        RegistryConfig(etcd_user="registry", etcd_password_file=str(good))
    config = RegistryConfig(etcd=etcd, etcd_user="registry", etcd_password_file=str(good))
    auth = config.etcd_auth()
    assert auth == EtcdAuth("registry", PASSWORD, str(good)) and PASSWORD not in repr(auth)
