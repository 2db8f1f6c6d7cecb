"""Transport security shared by every pcpstack process: mutual TLS and a bearer token.

Settings come from flags (`add_security_arguments` / `security_from_args`) or, for any flag not given, from
the environment: PCPSTACK_TLS_CA, PCPSTACK_TLS_CERT, PCPSTACK_TLS_KEY, PCPSTACK_TOKEN, PCPSTACK_TOKEN_FILE.
A process calls `configure` once at start-up; `start_server` and `open_channel` then use those settings
unless given others, so the typed clients need no change. `configure` also exports the settings to the
environment, so child processes (prefill ranks, spawned by multiprocessing) inherit them.

- TLS is mutual: the CA, the certificate and its key are given together or not at all. A server then
  requires a client certificate signed by the CA, so a plaintext client or one whose certificate comes
  from another CA fails the handshake (the client sees UNAVAILABLE).
- A server with a token refuses the mutating RPCs (PROTECTED_METHODS) unless the call carries
  `authorization: Bearer <token>`: UNAUTHENTICATED, compared in constant time. Health and reflection stay
  open. Decode's Generate is protected too: it spends accelerator time and makes decode call Prefill, Put
  and Release on the caller's behalf, so an open Generate would be a way around those checks. The HTTP
  gateway is the user-facing API and holds the token for its upstream calls.
- Registration: `advertised_host_allowed` decides whether a node may advertise a host, given the peer
  its request came from (the registry's --verify-peer-address).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import os
import socket
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

CA_ENV = "PCPSTACK_TLS_CA"
CERT_ENV = "PCPSTACK_TLS_CERT"
KEY_ENV = "PCPSTACK_TLS_KEY"
TOKEN_ENV = "PCPSTACK_TOKEN"
TOKEN_FILE_ENV = "PCPSTACK_TOKEN_FILE"
ENV_VARS = (CA_ENV, CERT_ENV, KEY_ENV, TOKEN_ENV, TOKEN_FILE_ENV)

MIN_TOKEN_CHARS = 16
AUTHORIZATION = "authorization"

PROTECTED_METHODS = frozenset(
    {
        "/pcpstack.v1.RegistryService/Register",
        "/pcpstack.v1.RegistryService/Session",
        "/pcpstack.v1.RegistryService/Deregister",
        "/pcpstack.v1.PrefillService/Prefill",
        # Deletes store objects, as Delete does (its token is a second secret, not a way around this one).
        "/pcpstack.v1.PrefillService/Abandon",
        "/pcpstack.v1.KvStoreService/Put",
        "/pcpstack.v1.KvStoreService/Release",
        "/pcpstack.v1.KvStoreService/Delete",
        # Both change what the store holds: a Lookup's lease pins objects against eviction, and
        # PrepareStandby evicts released objects and creates segments. Prefill, their caller, holds the token.
        "/pcpstack.v1.KvStoreService/Lookup",
        "/pcpstack.v1.KvStoreService/PrepareStandby",
        "/pcpstack.v1.DecodeService/Generate",
    }
)


class SecurityConfigError(ValueError):
    """Security settings that break a rule; the message names the setting, its value and the rule."""


@dataclass(frozen=True)
class SecuritySettings:
    """Where the TLS material and the token come from (file paths, or the token itself)."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    token: str = field(default="", repr=False)
    token_file: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SecuritySettings:
        """The settings the environment names (os.environ by default)."""
        env = os.environ if env is None else env
        return cls(
            ca_file=env.get(CA_ENV, ""),
            cert_file=env.get(CERT_ENV, ""),
            key_file=env.get(KEY_ENV, ""),
            token=env.get(TOKEN_ENV, ""),
            token_file=env.get(TOKEN_FILE_ENV, ""),
        )

    def to_env(self) -> dict[str, str]:
        """Environment variables that reproduce these settings in a child process."""
        values = {
            CA_ENV: self.ca_file,
            CERT_ENV: self.cert_file,
            KEY_ENV: self.key_file,
            TOKEN_FILE_ENV: self.token_file,
            # A token read from a file is passed on as the file's path, not as its value.
            TOKEN_ENV: "" if self.token_file else self.token,
        }
        return {name: value for name, value in values.items() if value}


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes of the CA, this process's certificate (chain) and its private key."""

    ca: bytes
    cert: bytes
    key: bytes = field(repr=False)


@dataclass(frozen=True)
class Security:
    """Loaded and validated security: what servers and channels are built with."""

    tls: TlsMaterial | None = None
    token: str = field(default="", repr=False)
    settings: SecuritySettings = SecuritySettings()

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Credentials that require and verify a client certificate; None for plaintext."""
        if self.tls is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls.key, self.tls.cert)], root_certificates=self.tls.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials that verify the server against the CA and present this process's certificate."""
        if self.tls is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls.ca, private_key=self.tls.key, certificate_chain=self.tls.cert
        )

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata every outgoing call carries (the bearer token, when there is one)."""
        return ((AUTHORIZATION, f"Bearer {self.token}"),) if self.token else ()

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The token check, when a token is configured."""
        return [BearerTokenInterceptor(self.token)] if self.token else []


PLAINTEXT = Security()


def _read(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{setting}={path!r} cannot be read: {exc.strerror or exc}") from None


def _load_tls(settings: SecuritySettings) -> TlsMaterial | None:
    given = {CA_ENV: settings.ca_file, CERT_ENV: settings.cert_file, KEY_ENV: settings.key_file}
    if not any(given.values()):
        return None
    missing = [name for name, value in given.items() if not value]
    if missing:
        named = ", ".join(f"{n}={v!r}" for n, v in given.items())
        raise SecurityConfigError(
            f"{named}: TLS is mutual, so the CA, the certificate and its key are given together "
            f"(missing: {', '.join(missing)})"
        )
    material = TlsMaterial(
        ca=_read(settings.ca_file, CA_ENV),
        cert=_read(settings.cert_file, CERT_ENV),
        key=_read(settings.key_file, KEY_ENV),
    )
    _check_tls(material, settings)
    return material


def _check_tls(material: TlsMaterial, settings: SecuritySettings) -> None:
    """Refuses material gRPC would only reject at the first handshake, naming the file and the rule."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cas = x509.load_pem_x509_certificates(material.ca)
    except ValueError:
        raise SecurityConfigError(f"{CA_ENV}={settings.ca_file!r} must hold PEM certificates") from None
    try:
        chain = x509.load_pem_x509_certificates(material.cert)
    except ValueError:
        raise SecurityConfigError(f"{CERT_ENV}={settings.cert_file!r} must hold a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(material.key, password=None)
    except (ValueError, TypeError):
        raise SecurityConfigError(
            f"{KEY_ENV}={settings.key_file!r} must hold an unencrypted PEM private key"
        ) from None
    if key.public_key() != chain[0].public_key():
        raise SecurityConfigError(
            f"{KEY_ENV}={settings.key_file!r} is not the key of {CERT_ENV}={settings.cert_file!r}: "
            "a certificate and its key must belong together"
        )
    if len(chain) == 1 and not any(_issued_by(chain[0], ca) for ca in cas):
        raise SecurityConfigError(
            f"{CERT_ENV}={settings.cert_file!r} was not issued by {CA_ENV}={settings.ca_file!r}: peers "
            "verify each other against that CA, so every certificate must come from it"
        )


def _issued_by(cert, ca) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _load_token(settings: SecuritySettings) -> str:
    if settings.token and settings.token_file:
        raise SecurityConfigError(
            f"{TOKEN_ENV} and {TOKEN_FILE_ENV}={settings.token_file!r} are both set: give the token one way"
        )
    if settings.token_file:
        token = _read(settings.token_file, TOKEN_FILE_ENV).decode("utf-8", "replace").strip()
        setting = f"{TOKEN_FILE_ENV}={settings.token_file!r}"
    else:
        token = settings.token
        setting = TOKEN_ENV
    if not token:
        if settings.token_file:
            raise SecurityConfigError(f"{setting} is empty: a token file must hold the token")
        return ""
    if len(token) < MIN_TOKEN_CHARS or not all("!" <= ch <= "~" for ch in token):
        raise SecurityConfigError(
            f"{setting}: a token must be at least {MIN_TOKEN_CHARS} visible ASCII characters without spaces "
            "(for example `openssl rand -hex 32`)"
        )
    return token


def load(settings: SecuritySettings) -> Security:
    """Reads and checks the files the settings name; raises SecurityConfigError naming the broken rule."""
    tls = _load_tls(settings)
    token = _load_token(settings)
    if tls is None and not token:
        return PLAINTEXT
    return Security(tls=tls, token=token, settings=settings)


def from_env(env: Mapping[str, str] | None = None) -> Security:
    """The security the environment configures (os.environ by default)."""
    return load(SecuritySettings.from_env(env))


_configured: Security | None = None
_env_cache: tuple[tuple[str, ...], Security] | None = None


def configure(security: Security | None) -> None:
    """Sets the process-wide default used by start_server and open_channel, and exports it to the
    environment so child processes inherit it. None forgets it and clears those variables."""
    global _configured
    _configured = security
    for name in ENV_VARS:
        os.environ.pop(name, None)
    if security is not None:
        os.environ.update(security.settings.to_env())


def current() -> Security:
    """The configured security, or else the environment's (re-read when the variables change)."""
    global _env_cache
    if _configured is not None:
        return _configured
    key = tuple(os.environ.get(name, "") for name in ENV_VARS)
    if _env_cache is None or _env_cache[0] != key:
        _env_cache = (key, from_env())
    return _env_cache[1]


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """The shared --tls-* and --token flags; each falls back to its environment variable."""
    group = parser.add_argument_group("security (each flag defaults to its environment variable)")
    group.add_argument("--tls-ca", default=None, metavar="PEM", help=f"CA certificate(s) [{CA_ENV}]")
    group.add_argument(
        "--tls-cert", default=None, metavar="PEM", help=f"this service's certificate [{CERT_ENV}]"
    )
    group.add_argument("--tls-key", default=None, metavar="PEM", help=f"its private key [{KEY_ENV}]")
    group.add_argument(
        "--token", default=None, help=f"bearer token for mutating RPCs [{TOKEN_ENV}]; prefer --token-file"
    )
    group.add_argument(
        "--token-file", default=None, metavar="FILE", help=f"file holding the token [{TOKEN_FILE_ENV}]"
    )


def security_from_args(args: argparse.Namespace) -> Security:
    """Loads the flags' settings (environment for the flags not given); raises SecurityConfigError naming
    the broken rule (the start-up path, pcpstack.common.startup, turns it into exit status 2)."""
    env = SecuritySettings.from_env()
    settings = SecuritySettings(
        ca_file=env.ca_file if args.tls_ca is None else args.tls_ca,
        cert_file=env.cert_file if args.tls_cert is None else args.tls_cert,
        key_file=env.key_file if args.tls_key is None else args.tls_key,
        token=env.token,
        token_file=env.token_file,
    )
    if args.token is not None or args.token_file is not None:
        # A token flag replaces both token variables, so a flag and a stale variable never clash.
        settings = replace(settings, token=args.token or "", token_file=args.token_file or "")
    return load(settings)


# --- the server-side token check --------------------------------------------------------------------------


def _metadata_value(metadata: Iterable | None, key: str) -> str | None:
    for item in metadata or ():
        if item[0] == key:
            value = item[1]
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses protected methods whose call lacks `authorization: Bearer <token>` (UNAUTHENTICATED)."""

    def __init__(self, token: str, protected: Iterable[str] = PROTECTED_METHODS) -> None:
        if not token:
            raise SecurityConfigError("a token check needs a non-empty token")
        self._expected = f"Bearer {token}".encode()
        self._protected = frozenset(protected)

    def authorized(self, metadata: Iterable | None) -> bool:
        """Whether the metadata carries the right token (constant-time comparison)."""
        value = _metadata_value(metadata, AUTHORIZATION)
        if value is None:
            return False
        return hmac.compare_digest(value.encode("utf-8", "replace"), self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._protected:
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        missing = _metadata_value(handler_call_details.invocation_metadata, AUTHORIZATION) is None
        return _refusal(handler, "missing bearer token" if missing else "wrong bearer token")


def _refusal(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as handler that answers UNAUTHENTICATED. Streaming responses are async
    generators: the OpenTelemetry server interceptor iterates them."""
    details = f"{reason}: this method needs `authorization: Bearer <token>` (--token / {TOKEN_ENV})"

    async def refuse(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    async def refuse_streaming(request, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)
        yield  # never reached; makes this an async generator

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse_streaming if handler.response_streaming else refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


# --- advertised addresses -----------------------------------------------------------------------------------


IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def peer_ip(peer: str) -> IpAddress | None:
    """The IP of a gRPC peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5"); None for other transports."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = rest.rpartition(":")[0].removeprefix("[").removesuffix("]")
    host = host.split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _as_ip(host: str) -> IpAddress | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None


def _same_host(candidate: IpAddress, peer: IpAddress) -> bool:
    # Local stacks give nodes 127.0.0.x hosts while they dial the registry from 127.0.0.1.
    return candidate == peer or (candidate.is_loopback and peer.is_loopback)


async def advertised_host_allowed(
    host: str, peer: IpAddress, certificate_names: Sequence[str] = (), resolve_timeout_s: float = 2.0
) -> str | None:
    """None when a node whose request came from peer may advertise host, else the rule it breaks.

    Allowed: the peer's own IP (any loopback IP for a loopback peer), a name the node's TLS certificate
    covers, or a DNS name that resolves to the peer.
    """
    if host in certificate_names:
        return None
    ip = _as_ip(host)
    if ip is not None:
        if ip.is_unspecified:
            return f"{host} is a wildcard bind address; advertise an address others can dial (--advertise)"
        if _same_host(ip, peer):
            return None
        return f"it is not the address the request came from ({peer}) and no node certificate names it"
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), resolve_timeout_s
        )
    except (OSError, TimeoutError, UnicodeError):
        return f"{host!r} does not resolve"
    for info in infos:
        resolved = _as_ip(str(info[4][0]))
        if resolved is not None and _same_host(resolved, peer):
            return None
    return f"{host!r} does not resolve to the address the request came from ({peer})"


def certificate_names(auth_context: Mapping[str, Sequence[bytes]]) -> list[str]:
    """DNS names and IPs a verified client certificate covers (from gRPC's auth context)."""
    values = auth_context.get("x509_subject_alternative_name", ())
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in values]
