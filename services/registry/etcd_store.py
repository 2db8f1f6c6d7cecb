"""The registry's membership state kept in etcd (`pcpstack serve registry --etcd URL[,URL...]`).

This is a store under the membership core, not a second registry: `Membership` still decides everything
(assembly, fencing, re-forming); this module persists what it decides and gives it back after a restart.
- Sets and the generation counter are the core's snapshot (`Membership.snapshot()`), one key per set plus
  one generation key. Every write is a transaction that compares the generation key's mod revision with the
  one this registry last read or wrote, so a registry whose view is stale (another registry wrote in the
  meantime) cannot commit: its sets are refused before any node hears of them, and two registries can never
  hand out overlapping sets.
- A restart reads the snapshot back, so the same set ids and generations are awaited from their members.
- Every live node has a record under the registry's node lease (TTL: the registry lease rounded up to whole
  seconds; one lease for all records, so refreshing it costs one request whatever the number of nodes). A
  node the core declares dead has its record deleted, and a registry that dies stops refreshing, so its
  records expire with the lease.

Client: `aetcd` (PyPI, 1.0.0, 2026), the maintained asyncio fork of python-etcd3. It depends only on grpcio
and protobuf with ranges that accept the versions pinned here (grpcio 1.85, protobuf 7) and installs without
conflicts; its generated etcd v3 stubs load under protobuf 7. Several endpoints are dialled as one gRPC
channel over their addresses (pick-first), so one etcd member going down moves the channel to another. The
names are resolved here, not by gRPC (its dns: target takes one name), when the client connects and again
whenever a request finds no address answering, so an etcd pod that moved to a new IP is dialled there; a
name that does not resolve yet is skipped until it does. Over TLS with each member checked for its own name
(no --etcd-server-name), the channel spans one member's addresses, and the next member is dialled after
ROTATE_AFTER requests in a row found it not answering. A channel is replaced, never closed under its
callers: the old one is closed RETIRE_GRACE_S later, and a call that still ends cancelled by that close is
Unavailable to its caller, as any other failed request (the task awaiting it lives on). With a user and
password (etcd_auth), every request carries a token, asked for again whenever etcd stops taking it. TLS
files are looked at again every TLS_CHECK_S before a request: a certificate rotated on disk is dialled with
on a new channel, without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc

from pcpstack.common.config import ConfigError
from pcpstack.common.errors import Unavailable
from pcpstack.common.logs import ThrottledWarning
from pcpstack.registry.etcd_auth import EtcdAuth, Tokens
from pcpstack.registry.membership import SNAPSHOT_VERSION

log = logging.getLogger(__name__)
T = TypeVar("T")

# etcd refuses leases shorter than about 1.5 election timeouts (1.5 s with its defaults)
MIN_LEASE_TTL_S = 2
REQUEST_TIMEOUT_S = 5.0
# etcd's --max-txn-ops default: the most operations one transaction may carry
MAX_TXN_OPS = 128
# seconds: how long one name's lookup may take; how often names are looked up again while etcd is unreachable
RESOLVE_TIMEOUT_S = 2.0
RESOLVE_EVERY_S = 2.0
# Requests in a row that find a member not answering before the next member is dialled (one member at a time)
ROTATE_AFTER = 3
# Seconds between two looks at the TLS files' stamps (a rotated certificate is dialled with within this)
TLS_CHECK_S = 10.0
# Seconds a replaced channel stays open for the calls other tasks still have on it (each ends within its
# REQUEST_TIMEOUT_S; a watch has no deadline and ends with the channel, Unavailable to its reader)
RETIRE_GRACE_S = REQUEST_TIMEOUT_S + 1.0


class Superseded(Unavailable):
    """Another registry wrote the membership in etcd since this one last read it: this registry's view is
    stale and it may not form or change sets (nodes retry against another replica)."""


@dataclass(frozen=True)
class Endpoint:
    """One etcd member's client URL, parsed; secure: https (TLS)."""

    host: str
    port: int
    secure: bool = False

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        return f"{host}:{self.port}"


def parse_endpoints(urls: str) -> list[Endpoint]:
    """Endpoints from "http://HOST:PORT[,http://HOST:PORT...]" or the same with https:// (TLS; all of one
    scheme; an IPv6 HOST in brackets, http://[::1]:2379); raises ConfigError naming the bad one."""
    endpoints = []
    for url in (part.strip() for part in urls.split(",")):
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        scheme_ok = parts.scheme in ("http", "https")
        if not scheme_ok or not parts.hostname or port is None or parts.path not in ("", "/"):
            rule = f"every endpoint must be http://HOST:PORT or https://HOST:PORT; {url!r} is not"
            raise ConfigError.broken("--etcd", urls, rule)
        endpoints.append(Endpoint(parts.hostname, port, parts.scheme == "https"))
    if len({endpoint.secure for endpoint in endpoints}) > 1:
        rule = "the endpoints are one channel: all http:// or all https://, not a mix"
        raise ConfigError.broken("--etcd", urls, rule)
    return endpoints


@dataclass(frozen=True)
class EtcdTls:
    """TLS to etcd (https:// endpoints), as read from the flags' files: the CA the members' certificates
    come from (empty: the system's roots), this registry's client certificate and key (empty: none; an etcd
    started with --client-cert-auth needs them), and the name checked in every member's certificate (empty:
    each member's own endpoint host)."""

    server_name: str = ""
    ca: bytes = b""
    cert: bytes = b""
    key: bytes = field(default=b"", repr=False)
    # the files ca, cert and key were read from ("" for none): read again when they change (_TlsFiles)
    files: tuple[str, str, str] = ("", "", "")

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials gRPC dials with."""
        return grpc.ssl_channel_credentials(self.ca or None, self.key or None, self.cert or None)


def load_tls(urls: str, ca: str = "", cert: str = "", key: str = "", server_name: str = "") -> EtcdTls | None:
    """The TLS the flags describe for the endpoints urls (None: plain http), its files read and checked now
    (a file gRPC would only reject at the first handshake shows as etcd never answering); raises ConfigError
    naming the flag and the rule."""
    endpoints = parse_endpoints(urls)
    given = {"--etcd-ca": ca, "--etcd-cert": cert, "--etcd-key": key, "--etcd-server-name": server_name}
    if not endpoints[0].secure:
        for flag, value in given.items():
            if value:
                raise ConfigError.broken(flag, value, "needs https:// --etcd endpoints (TLS)")
        return None
    if bool(cert) != bool(key):
        raise ConfigError(
            f"--etcd-cert={cert!r} --etcd-key={key!r}: a client certificate and its key are given together",
            ("--etcd-cert", "--etcd-key"),
            "--etcd-cert and --etcd-key are given together",
        )
    return _read_tls(server_name, ca, cert, key)


def _read_tls(server_name: str, ca: str, cert: str, key: str) -> EtcdTls:
    """TLS from the files ca, cert and key, read and checked now; ConfigError naming the flag and the rule."""
    tls = EtcdTls(
        server_name=server_name,
        ca=_read_file("--etcd-ca", ca),
        cert=_read_file("--etcd-cert", cert),
        key=_read_file("--etcd-key", key),
        files=(ca, cert, key),
    )
    _check_pem(tls, ca, cert, key)
    return tls


def _file_stamps(paths: tuple[str, ...]) -> tuple:
    """What tells that the files changed: each one's inode, modification time and size (None: missing). A
    Kubernetes Secret volume swaps a symbolic link to a new folder, which gives the same paths new inodes."""
    stamps = []
    for path in paths:
        try:
            stat = os.stat(path) if path else None
        except OSError:
            stat = None
        stamps.append(None if stat is None else (stat.st_ino, stat.st_mtime_ns, stat.st_size))
    return tuple(stamps)


class _TlsFiles:
    """Watches the files of the TLS to etcd: `changed()`, called before requests, looks at them at most every
    TLS_CHECK_S and returns the TLS they hold once that differs from what the channel dials with, checked as
    at start-up (a pair that does not match yet, mid-rotation, is logged and looked at again when the files
    change next)."""

    def __init__(self, tls: EtcdTls) -> None:
        self._tls = tls
        self._stamps = _file_stamps(tls.files)
        self._checked_at = time.monotonic()
        self._warnings = ThrottledWarning(log, interval_s=60.0)

    def changed(self) -> EtcdTls | None:
        if not any(self._tls.files) or time.monotonic() - self._checked_at < TLS_CHECK_S:
            return None
        self._checked_at = time.monotonic()
        stamps = _file_stamps(self._tls.files)
        if stamps == self._stamps:
            return None
        self._stamps = stamps
        try:
            tls = _read_tls(self._tls.server_name, *self._tls.files)
        except ConfigError as exc:
            self._warnings.warning("unusable", "etcd TLS files changed but cannot be used yet: %s", exc)
            return None
        if (tls.ca, tls.cert, tls.key) == (self._tls.ca, self._tls.cert, self._tls.key):
            return None
        self._tls = tls
        return tls


def _read_file(flag: str, path: str) -> bytes:
    if not path:
        return b""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError.broken(flag, path, f"cannot be read: {exc.strerror or exc}") from None


def _check_pem(tls: EtcdTls, ca: str, cert: str, key: str) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    if tls.ca:
        try:
            x509.load_pem_x509_certificates(tls.ca)
        except ValueError:
            raise ConfigError.broken("--etcd-ca", ca, "must hold PEM certificates") from None
    if not tls.cert:
        return
    try:
        chain = x509.load_pem_x509_certificates(tls.cert)
    except ValueError:
        raise ConfigError.broken("--etcd-cert", cert, "must hold a PEM certificate") from None
    try:
        private = serialization.load_pem_private_key(tls.key, password=None)
    except (ValueError, TypeError):
        raise ConfigError.broken("--etcd-key", key, "must hold an unencrypted PEM private key") from None
    if private.public_key() != chain[0].public_key():
        rule = f"is not the key of --etcd-cert={cert!r}: a certificate and its key belong together"
        raise ConfigError.broken("--etcd-key", key, rule)


async def _resolve(endpoints: list[Endpoint]) -> list[str]:
    """The endpoints' addresses as the names resolve now, as one gRPC target's list: "ip:port" for IPv4,
    "[ip]:port" for IPv6; IPv4 only where any name has an IPv4 address (one target takes one family). A
    name that does not resolve (a Pending etcd pod has no DNS record yet) is skipped with a warning."""
    loop = asyncio.get_running_loop()
    found: dict[int, list[str]] = {socket.AF_INET: [], socket.AF_INET6: []}
    for endpoint in endpoints:
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM),
                RESOLVE_TIMEOUT_S,
            )
        except (OSError, TimeoutError) as exc:
            log.warning(
                "etcd endpoint does not resolve; skipped", extra={"host": endpoint.host, "error": str(exc)}
            )
            continue
        for family, _, _, _, address in infos:
            if family == socket.AF_INET:
                found[family].append(f"{address[0]}:{endpoint.port}")
            elif family == socket.AF_INET6:
                found[family].append(f"[{address[0]}]:{endpoint.port}")
    return list(dict.fromkeys(found[socket.AF_INET] or found[socket.AF_INET6]))


class WatchRefused(aetcd.exceptions.ClientError):
    """etcd canceled a watch (as it is created or later) with its reason: permission denied (which is also
    what a watch sent with a token etcd no longer takes gets), or the watch stream was overloaded."""


class _Watcher(aetcd.watcher.Watcher):
    """aetcd's watcher, except that a watch etcd cancels ends with WatchRefused: aetcd counts a create
    answered `created` and `canceled` at once as a watch, which then waits forever for events."""

    async def _handle_response(self, response) -> None:
        if not response.canceled:
            return await super()._handle_response(response)
        refused = WatchRefused(f"etcd canceled the watch: {response.cancel_reason or 'no reason given'}")
        async with self._lock:
            if response.created and self._new_callback is not None:
                self._new_callback.error = refused
                self._new_callback_ready.notify_all()
                return
            callback = self._callbacks.pop(response.watch_id, None)
        if callback is not None:
            await self._process_callback(callback, refused)


class _Client(aetcd.Client):
    """aetcd's client, its one channel dialled over every endpoint's addresses (gRPC's ipv4: and ipv6:
    schemes list several) as they resolve when it connects; `reresolve` dials anew when they have changed.
    With tls the channel is a TLS one (aetcd dials plain text only), every member's certificate checked for
    tls.server_name (the channel's addresses are IPs, which no certificate needs to name). With tls and no
    such name, on several hosts, each member is checked for its own endpoint's name, as etcd's own client
    does: the channel then reaches one member at a time, and `reresolve` moves it on to the next."""

    def __init__(
        self, endpoints: list[Endpoint], tls: EtcdTls | None = None, auth: EtcdAuth | None = None
    ) -> None:
        super().__init__(timeout=REQUEST_TIMEOUT_S)
        secure = endpoints[0].secure
        # every channel's requests carry the token of auth's user (etcd_auth)
        self._tokens = Tokens(auth, lambda: self.channel) if auth is not None else None
        if auth is not None and not secure:
            log.warning("the etcd password goes over plain http: https:// endpoints keep it private")
        if tls is not None and not secure:
            raise ValueError("TLS settings for http:// etcd endpoints: TLS needs https:// ones")
        self._endpoints = endpoints
        # https:// without settings: the system's roots, each member's own name
        self._tls = EtcdTls() if secure and tls is None else tls
        self._tls_files = _TlsFiles(self._tls) if self._tls is not None else None
        self._one_member = (
            self._tls is not None
            and not self._tls.server_name
            and len({endpoint.host for endpoint in endpoints}) > 1
        )
        self._member = 0  # the endpoint dialled, when one member at a time is
        self._failures = 0  # requests in a row that found no member answering
        self._retiring: set[asyncio.Task] = set()  # closing replaced channels once their calls had time
        self.addresses: list[str] = []
        self._resolved_at = -math.inf

    @property
    def server_name(self) -> str:
        """The name the TLS channel checks in the certificate of the member it reaches ("": plain text)."""
        if self._tls is None:
            return ""
        return self._tls.server_name or self._endpoints[self._member].host

    async def connect(self) -> None:
        """Connects (aetcd calls this before every request); with no address yet, resolves the names first
        (at most every RESOLVE_EVERY_S) and raises ConnectionFailedError while none resolves. TLS files that
        changed on disk (a rotated certificate) are dialled with on a new channel."""
        self._reload_tls()
        if self._connected.is_set():
            return
        if not self.addresses:
            if time.monotonic() - self._resolved_at >= RESOLVE_EVERY_S:
                await self._retarget()
            if not self.addresses:
                names = ", ".join(str(endpoint) for endpoint in self._endpoints)
                raise aetcd.exceptions.ConnectionFailedError(f"no etcd endpoint resolves ({names}); retrying")
        if not self._connected.is_set():
            self._open_channel()

    def _open_channel(self) -> None:
        """What aetcd's connect sets up (the channel, its service stubs, the watcher), over TLS where
        configured (aetcd dials plain text only). Nothing here awaits, so no other task sees it half done;
        the connection and any handshake happen at the first request, whose failure reads as etcd not
        answering (ConnectionFailedError). With a user and password, each request carries the token etcd
        hands out for them (etcd_auth.Tokens; aetcd asks for one only when it connects)."""
        target = f"{self._host}:{self._port}"
        options = list(self._options.items())
        interceptors = self._tokens.interceptors() if self._tokens is not None else None
        if self._tls is None:
            self.channel = grpc.aio.insecure_channel(target, options, interceptors=interceptors)
        else:
            options.append(("grpc.ssl_target_name_override", self.server_name))
            credentials = self._tls.credentials()
            self.channel = grpc.aio.secure_channel(target, credentials, options, interceptors=interceptors)
        self.kvstub = aetcd.rpc.KVStub(self.channel)
        self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
        self.leasestub = aetcd.rpc.LeaseStub(self.channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
        self._watcher = _Watcher(
            aetcd.rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()

    def _reload_tls(self) -> None:
        tls = self._tls_files.changed() if self._tls_files is not None else None
        if tls is None:
            return
        self._tls = tls
        log.info("etcd TLS files changed: new requests go over a channel that uses them")
        if self._connected.is_set():
            self._replace_channel()

    async def watch_refused(self) -> None:
        """After etcd refused a watch: the watch stream is opened again (the next watch's stream carries the
        token then held, a stream keeps the one it opened with), and with a user and password the token is
        asked for anew (a refusal for a stale token reads as permission denied)."""
        old, self._watcher = (
            self._watcher,
            _Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata),
        )
        if self._tokens is not None:
            self._tokens.forget()
        if old is not None:
            with contextlib.suppress(Exception):
                await old.shutdown()

    def failed(self) -> None:
        """A request found no member answering (EtcdStore.unreachable)."""
        self._failures += 1

    def answered(self) -> None:
        """A request was answered."""
        self._failures = 0

    async def reresolve(self) -> None:
        """After a request found no address answering: resolves the names again (at most every
        RESOLVE_EVERY_S) and, if their addresses changed, dials them on a new channel. When one member at a
        time is dialled, the next member's once ROTATE_AFTER requests in a row found this one not answering
        (a single slow answer, or etcd's own UNAVAILABLE while it elects a leader, moves nothing)."""
        if time.monotonic() - self._resolved_at < RESOLVE_EVERY_S:
            return
        before = (self.addresses, self._member)
        await self._retarget(advance=self._one_member and self._failures >= ROTATE_AFTER)
        if self.addresses and (self.addresses, self._member) != before and self._connected.is_set():
            if self._one_member:
                log.warning(
                    "etcd member not answering; dialling the next", extra={"member": self.server_name}
                )
            else:
                log.warning("etcd endpoints resolve to new addresses", extra={"addresses": self.addresses})
            self._failures = 0
            self._replace_channel()

    def _replace_channel(self) -> None:
        """Dials the current addresses on a new channel; the old one is closed RETIRE_GRACE_S later. Closing
        it now would cancel every call other tasks have on it (a channel's close cancels its calls), and with
        them those tasks."""
        old = (self.channel, self._watcher)
        self._open_channel()
        if old[0] is not None:
            retiring = asyncio.create_task(self._retire(*old), name="etcd-channel-retire")
            self._retiring.add(retiring)
            retiring.add_done_callback(self._retiring.discard)

    @staticmethod
    async def _retire(channel: grpc.aio.Channel, watcher) -> None:
        try:
            await asyncio.sleep(RETIRE_GRACE_S)
        finally:  # cancelled (the client closes): at once
            with contextlib.suppress(Exception):
                if watcher is not None:
                    await watcher.shutdown()
                await channel.close()

    async def close(self) -> None:
        """Closes the channel and any still being retired."""
        retiring = list(self._retiring)
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        await super().close()

    async def _retarget(self, advance: bool = False) -> None:
        """Resolves the names of every endpoint, or when one member at a time is dialled, of the current
        member's (advance: the next one's), moving on past members whose names do not resolve."""
        self._resolved_at = time.monotonic()
        if not self._one_member:
            addresses = await _resolve(self._endpoints)
        else:
            addresses, count = [], len(self._endpoints)
            for step in range(int(advance), count + int(advance)):
                addresses = await _resolve([self._endpoints[(self._member + step) % count]])
                if addresses:
                    self._member = (self._member + step) % count
                    break
        if addresses:
            self.addresses = addresses
            # aetcd dials f"{host}:{port}"; split so that this reads "ipv4:ADDRESS,ADDRESS..." (or ipv6:)
            scheme = "ipv6:" if addresses[0].startswith("[") else "ipv4:"
            host, _, port = (scheme + ",".join(addresses)).rpartition(":")
            self._host, self._port = host, int(port)


def _raise_if_cancelled(exc: BaseException) -> None:
    """Re-raises a CancelledError meant for the running task. One that is not (a call on a channel closed
    under it ends cancelled; a call on one being closed raises UsageError) returns, for the caller to turn
    into Unavailable: the task must live on and retry, not end."""
    task = asyncio.current_task()
    if isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling():
        raise exc


class EtcdStore:
    """Membership state in etcd under one key prefix. One registry writes at a time (fenced by the
    generation key); every method may raise Unavailable when etcd cannot be reached."""

    def __init__(self, client: _Client, prefix: str, lease_ttl_s: int) -> None:
        self._client = client
        self._prefix = prefix.encode()
        self._lease_ttl_s = lease_ttl_s
        # mod revision of the generation key as this registry last read or wrote it (0: absent)
        self._generation_revision = 0
        self._saved_sets: dict[str, bytes] = {}
        self._saved_generation = -1
        # the one etcd lease every node record of this registry is written under (None: none granted)
        self._nodes_lease: int | None = None
        # what etcd holds for each live node: (role, address, model)
        self._node_records: dict[str, tuple[str, str, str]] = {}
        self._refreshed_at = 0.0
        self._lock = asyncio.Lock()
        self._resolving: asyncio.Task | None = None

    @classmethod
    async def connect(
        cls,
        urls: str,
        prefix: str,
        lease_s: float,
        tls: EtcdTls | None = None,
        auth: EtcdAuth | None = None,
    ) -> EtcdStore:
        """A store over the etcd cluster at urls (over TLS with tls: https:// urls; as auth's user with
        auth), its keys under prefix; node records live under leases of lease_s (rounded up)."""
        client = _Client(parse_endpoints(urls), tls, auth)
        store = cls(client, prefix, max(MIN_LEASE_TTL_S, math.ceil(lease_s)))
        # an etcd that cannot be reached (or whose names do not resolve) yet is retried by every later call
        with contextlib.suppress(aetcd.exceptions.ClientError):
            await client.connect()
        return store

    @property
    def client(self) -> aetcd.Client:
        """The etcd client (shared with the leader election)."""
        return self._client

    def unreachable(self, exc: BaseException) -> None:
        """Called with a failed request's error: when no address answered, the names are looked up again (an
        etcd pod may have moved to a new IP), in the background so that no caller waits on DNS (a leader
        must step down on time)."""
        codes = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        no_answer = (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError)
        if not (
            isinstance(exc, no_answer) or (isinstance(exc, grpc.aio.AioRpcError) and exc.code() in codes)
        ):
            return
        self._client.failed()
        if self._resolving is None or self._resolving.done():
            self._resolving = asyncio.create_task(self._client.reresolve(), name="etcd-resolve")

    def key(self, *parts: str) -> bytes:
        """The etcd key of parts under this store's prefix."""
        return self._prefix + "/".join(parts).encode()

    @property
    def _generation_key(self) -> bytes:
        return self.key("generation")

    async def load(self) -> dict | None:
        """The core's snapshot as etcd holds it (None before any registry wrote one), read at one revision;
        later writes are fenced against what was read here."""
        async with self._lock:
            # one range over the prefix: the sets and the generation as of one revision
            stored = await self._call(self._client.get_prefix(self._prefix))
            sets_key = self.key("sets", "")
            generation = next((kv for kv in stored if kv.key == self._generation_key), None)
            if generation is None:
                # nothing stored: the first write happens when this registry forms a set
                self._generation_revision = 0
                self._saved_generation = 0
                return None
            self._generation_revision = generation.mod_revision
            self._saved_sets = {
                kv.key[len(sets_key) :].decode(): kv.value for kv in stored if kv.key.startswith(sets_key)
            }
            self._saved_generation = int(generation.value)
            return {
                "version": SNAPSHOT_VERSION,
                "max_generation": self._saved_generation,
                "sets": [json.loads(value) for value in self._saved_sets.values()],
            }

    async def save(self, snapshot: Mapping) -> None:
        """Writes what changed in the snapshot since the last save, only if nobody else wrote since; raises
        Superseded otherwise. Each transaction carries at most MAX_TXN_OPS operations (etcd's default
        limit), so a large change takes several, each fenced on the revision the previous one wrote; the
        caller delivers the change's commands only once all are written, so a registry that dies halfway
        leaves sets that no node was told of (they are awaited, time out and are re-formed)."""
        async with self._lock:
            sets = {
                entry["assignment"]["set_id"]: json.dumps(entry, sort_keys=True).encode()
                for entry in snapshot["sets"]
            }
            generation = int(snapshot["max_generation"])
            if sets == self._saved_sets and generation == self._saved_generation:
                return
            ops = self._client.transactions
            changes = [
                ops.put(self.key("sets", sid), v) for sid, v in sets.items() if self._saved_sets.get(sid) != v
            ]
            changes += [ops.delete(self.key("sets", sid)) for sid in self._saved_sets.keys() - sets.keys()]
            step = MAX_TXN_OPS - 1  # one operation of each transaction writes the generation key
            for start in range(0, max(len(changes), 1), step):
                generation_put = ops.put(self._generation_key, str(generation).encode())
                await self._fenced_write([generation_put, *changes[start : start + step]])
            self._saved_sets = sets
            self._saved_generation = generation

    async def _fenced_write(self, writes: list) -> None:
        """One transaction of writes, applied only if the generation key is as this registry left it."""
        ops = self._client.transactions
        succeeded, responses = await self._call(
            self._client.transaction(
                compare=[ops.mod(self._generation_key) == self._generation_revision],
                success=writes,
                failure=[],
            )
        )
        if not succeeded:
            raise Superseded(
                "another registry changed the membership in etcd since this one read it; this registry "
                "stopped forming sets (restart it, or let the elected leader assemble)"
            )
        self._generation_revision = responses[0].response_put.header.revision

    async def sync_nodes(self, live: Mapping[str, tuple[str, str, str]], now: float) -> None:
        """Makes etcd's node records those of the core's live nodes (`Membership.live_records`, compared as
        they are and encoded only when written: this runs at every tick): new or changed nodes get a record,
        gone (dead or removed) ones lose theirs, and the records' lease is refreshed once a third of its TTL
        has passed. Every record of this registry lives under one lease: refreshing it is one request
        whatever the number of nodes (a lease per node cost the registry a keep-alive message per node and
        second, as much again as the nodes' own heartbeats). One caller at a time (the registry's clock);
        it does not take the lock of `save`, so that node records never hold up a change of sets."""
        if self._nodes_lease is not None and now - self._refreshed_at >= self._lease_ttl_s / 3:
            self._refreshed_at = now
            if await self.keep_alive([self._nodes_lease]):
                # the lease ran out (etcd unreachable for a whole TTL): its records are gone, write them anew
                self._nodes_lease = None
                self._node_records.clear()
        if self._nodes_lease is None and live:
            self._nodes_lease = (await self._call(self._client.lease(self._lease_ttl_s))).id
            self._refreshed_at = now
        gone = self._node_records.keys() - live.keys()
        changed = [(n, value) for n, value in live.items() if self._node_records.get(n) != value]
        await asyncio.gather(
            *(self._call(self._client.delete(self.key("nodes", node_id))) for node_id in gone),
            *(self._write_node(node_id, value) for node_id, value in changed),
        )
        for node_id in gone:
            del self._node_records[node_id]

    async def _write_node(self, node_id: str, record: tuple[str, str, str]) -> None:
        role, address, model = record
        value = json.dumps({"role": role, "address": address, "model": model}).encode()
        await self._call(self._client.put(self.key("nodes", node_id), value, lease=self._nodes_lease))
        self._node_records[node_id] = record

    async def node_records(self) -> dict[str, dict]:
        """The node records etcd holds now (those whose leases are alive)."""
        start = len(self.key("nodes", ""))
        stored = await self._call(self._client.get_prefix(self.key("nodes", "")))
        return {kv.key[start:].decode(): json.loads(kv.value) for kv in stored}

    # --- node sessions held through etcd, and the nodes' mailboxes -----------------------------------

    def _session_key(self, node_id: str) -> bytes:
        return self.key("sessions", node_id)

    async def grant(self, ttl_s: int) -> int:
        """A new etcd lease of ttl_s seconds; its id."""
        return (await self._call(self._client.lease(ttl_s))).id

    async def revoke(self, lease_id: int) -> None:
        """Revokes a lease: the keys under it are deleted at once."""
        await self._call(self._client.revoke_lease(lease_id))

    async def bind_session(self, node_id: str, record: bytes, identity: str, lease_id: int) -> bool:
        """Writes a node's session record under lease_id if the node id is free or bound to the same
        session identity (compare-and-swap, so two replicas cannot bind one id to two sessions); False when
        another live session holds it."""
        key = self._session_key(node_id)
        ops = self._client.transactions
        current = await self._call(self._client.get(key))
        if current is None:
            compare = [ops.create(key) == 0]
        elif json.loads(current.value)["identity"] == identity:
            compare = [ops.mod(key) == current.mod_revision]
        else:
            return False
        put = ops.put(key, record, lease=lease_id)
        succeeded, _ = await self._call(self._client.transaction(compare=compare, success=[put], failure=[]))
        return bool(succeeded)

    async def put_session(self, node_id: str, record: bytes, lease_id: int) -> None:
        """Rewrites a bound node's session record (its status or assignment changed)."""
        await self._call(self._client.put(self._session_key(node_id), record, lease=lease_id))

    async def sessions(self) -> tuple[dict[str, bytes], int]:
        """Every session record etcd holds, by node id, and the revision they were read at."""
        prefix = self._session_key("")
        stored = await self._call(self._client.get_prefix(prefix))
        return {kv.key[len(prefix) :].decode(): kv.value for kv in stored}, stored.header.revision

    async def watch_sessions(self, start_revision: int) -> AsyncIterator[tuple[str, bytes | None]]:
        """(node id, record) for every change of a session record from start_revision on; the record is
        None when it was deleted (its lease expired or was revoked)."""
        prefix = self._session_key("")
        async for event in self._watch(prefix, start_revision):
            node_id = event.kv.key[len(prefix) :].decode()
            yield node_id, (event.kv.value if event.kind == "PUT" else None)

    async def post(self, messages: list[tuple[str, bytes]]) -> None:
        """Appends messages to their nodes' mailboxes, in order (keys sort by the time they were written,
        so a later leader's messages come after an earlier one's)."""
        ops = self._client.transactions
        stamp = time.time_ns()
        puts = [
            ops.put(self.key("mailbox", node_id, f"{stamp:020d}-{i:06d}"), message)
            for i, (node_id, message) in enumerate(messages)
        ]
        for start in range(0, len(puts), MAX_TXN_OPS):
            await self._call(
                self._client.transaction(compare=[], success=puts[start : start + MAX_TXN_OPS], failure=[])
            )

    async def mailbox(self, node_id: str) -> tuple[list[tuple[bytes, bytes]], int]:
        """(key, message) of what waits in a node's mailbox, oldest first, and the revision read at (every
        mailbox's for node_id "")."""
        prefix = self.key("mailbox", node_id, "") if node_id else self.key("mailbox", "")
        stored = await self._call(self._client.get_prefix(prefix))
        return sorted((kv.key, kv.value) for kv in stored), stored.header.revision

    async def watch_mailboxes(self, start_revision: int) -> AsyncIterator[tuple[str, bytes, bytes]]:
        """(node id, key, message) of every message posted to any mailbox from start_revision on."""
        prefix = self.key("mailbox", "")
        async for event in self._watch(prefix, start_revision):
            if event.kind == "PUT":
                node_id = event.kv.key[len(prefix) :].decode().rpartition("/")[0]
                yield node_id, event.kv.key, event.kv.value

    async def delete(self, keys: list[bytes]) -> None:
        """Deletes the keys (messages a node has acted on) in one transaction per MAX_TXN_OPS."""
        ops = self._client.transactions
        deletes = [ops.delete(key) for key in keys]
        for start in range(0, len(deletes), MAX_TXN_OPS):
            chunk = deletes[start : start + MAX_TXN_OPS]
            await self._call(self._client.transaction(compare=[], success=chunk, failure=[]))

    async def clear_mailbox(self, node_id: str) -> None:
        """Drops whatever waits for a node (a registration answered with the truth supersedes it)."""
        await self._call(self._client.delete_prefix(self.key("mailbox", node_id, "")))

    async def _watch(self, prefix: bytes, start_revision: int) -> AsyncIterator:
        watch = await self._call(self._create_watch(prefix, start_revision))
        try:
            async for event in watch:
                yield event
        except WatchRefused as exc:
            await self._client.watch_refused()
            raise Unavailable(str(exc)) from None
        except (aetcd.exceptions.ClientError, grpc.aio.AioRpcError) as exc:
            self.unreachable(exc)
            raise Unavailable(f"etcd watch failed: {exc}") from None
        except (asyncio.CancelledError, grpc.aio.UsageError) as exc:
            _raise_if_cancelled(exc)
            raise Unavailable("etcd watch ended: its channel was replaced") from None
        finally:
            with contextlib.suppress(aetcd.exceptions.ClientError, grpc.aio.AioRpcError):
                await watch.cancel()

    async def _create_watch(self, prefix: bytes, start_revision: int):
        try:
            return await self._client.watch_prefix(prefix, start_revision=start_revision)
        except WatchRefused:
            await self._client.watch_refused()
            raise

    async def keep_alive(self, lease_ids: list[int], timeout: float = REQUEST_TIMEOUT_S) -> list[int]:
        """Refreshes the leases over one LeaseKeepAlive stream, within timeout seconds; returns those etcd no
        longer knows."""

        async def requests() -> AsyncIterator[aetcd.rpc.LeaseKeepAliveRequest]:
            for lease_id in lease_ids:
                yield aetcd.rpc.LeaseKeepAliveRequest(ID=lease_id)

        expired = []
        try:
            # the stub is used directly (aetcd has no call for several leases): connect as aetcd's calls do
            await self._client.connect()
            async for reply in self._client.leasestub.LeaseKeepAlive(requests(), timeout=timeout):
                if reply.TTL <= 0:
                    expired.append(reply.ID)
        except aetcd.exceptions.ClientError as exc:
            self.unreachable(exc)
            raise Unavailable(f"etcd lease keep-alive failed: {exc}") from None
        except grpc.aio.AioRpcError as exc:
            self.unreachable(exc)
            raise Unavailable(f"etcd lease keep-alive failed: {exc.code().name}: {exc.details()}") from None
        except (asyncio.CancelledError, grpc.aio.UsageError) as exc:
            _raise_if_cancelled(exc)
            raise Unavailable("etcd lease keep-alive ended: its channel was replaced") from None
        self._client.answered()
        return expired

    async def _call(self, awaitable: Awaitable[T]) -> T:
        """Awaits an etcd call, turning the client's errors into Unavailable."""
        try:
            result = await awaitable
        except (aetcd.exceptions.ClientError, grpc.aio.AioRpcError) as exc:
            self.unreachable(exc)
            raise Unavailable(f"etcd request failed: {exc}") from None
        except (asyncio.CancelledError, grpc.aio.UsageError) as exc:
            _raise_if_cancelled(exc)
            raise Unavailable("etcd request ended: its channel was replaced") from None
        self._client.answered()
        return result

    async def close(self) -> None:
        """Closes the connection; node leases are left to expire (a restarted registry re-registers nodes)."""
        if self._resolving is not None:
            self._resolving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resolving
        await self._client.close()
