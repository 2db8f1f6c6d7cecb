"""User-and-password authentication to etcd (`--etcd-user` with `--etcd-password-file`).

etcd with authentication on takes a request only with a token, which its Authenticate call hands out for a
user's name and password. A token stops working: a simple token after --auth-token-ttl seconds unused
(300 by default), a JWT after its own TTL however much it is used, any token once etcd's users or roles
change ("revision of auth store is old"). aetcd asks for a token once, when it connects, and never again,
so a registry would lose etcd for good after an outage of five minutes. Here every channel the client
opens carries `Tokens`, an interceptor that adds the current token to each request, and when etcd refuses
it as stale asks for a new one (one task at a time; the others wait for it) and sends a one-shot request
again. A stream cannot be sent again: a watch etcd refuses for a stale token ends WatchRefused, and the
store asks for a new token before the next one (etcd_store).

A password etcd refuses is asked about again at most every AUTH_RETRY_S: every failed request would
otherwise make etcd hash a password (bcrypt, deliberately slow) several times a second. The password file is
read again before each Authenticate, so a password changed in etcd and in the file (a rotated Kubernetes
Secret) is taken without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aetcd.rpc
import grpc

from pcpstack.common.config import ConfigError
from pcpstack.common.logs import ThrottledWarning

log = logging.getLogger(__name__)

AUTHENTICATE_METHOD = b"/etcdserverpb.Auth/Authenticate"
# Seconds between two Authenticate calls after one was refused (a wrong password, an unknown user).
AUTH_RETRY_S = 5.0
# Seconds before asking again after an Authenticate that got no answer (etcd down or unreachable).
UNANSWERED_RETRY_S = 1.0
# Seconds one Authenticate call may take.
AUTH_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class EtcdAuth:
    """The etcd user this registry authenticates as, and its password (kept out of the repr) as read at
    start-up from password_file ("": given directly, never read again)."""

    user: str
    password: str = field(repr=False)
    password_file: str = ""


def read_password(path: str) -> str:
    """The password a file holds (one line; a trailing newline is not part of it); ValueError with the rule
    the file breaks."""
    try:
        password = Path(path).read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"must be readable text: {reason}") from None
    if not password:
        raise ValueError("is empty: it must hold the password")
    if "\n" in password:
        raise ValueError("must hold one line, the password")
    return password


def load_auth(user: str = "", password_file: str = "") -> EtcdAuth | None:
    """The authentication the flags describe (None: none), the password read now from its file (read_password;
    Tokens reads it again before each Authenticate); raises ConfigError naming the flag and the rule."""
    if not user and not password_file:
        return None
    if not user:
        rule = "needs --etcd-user: the password is that user's"
        raise ConfigError.broken("--etcd-password-file", password_file, rule)
    if not password_file:
        rule = "needs --etcd-password-file: a file holding the user's password (never a flag: ps shows flags)"
        raise ConfigError.broken("--etcd-user", user, rule)
    try:
        password = read_password(password_file)
    except ValueError as exc:
        raise ConfigError.broken("--etcd-password-file", password_file, str(exc)) from None
    return EtcdAuth(user, password, password_file)


def token_refused(code: grpc.StatusCode, details: str) -> bool:
    """Whether etcd refused a request for its token: expired or unknown, issued before etcd's users or
    roles changed, or missing (authentication was turned on after this client last asked)."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return True
    stale = ("revision of auth store is old", "user name is empty")
    return code == grpc.StatusCode.INVALID_ARGUMENT and any(text in details for text in stale)


def _refused(exc: grpc.aio.AioRpcError) -> bool:
    """Whether etcd answered an Authenticate with a refusal of the user or password (not: no answer)."""
    return exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    if not token:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add("token", token)
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class Tokens:
    """The etcd token of one client, added to every request on each channel it opens (`interceptors`).
    channel() is the channel Authenticate goes over: the client's current one (tokens are the cluster's,
    not a member's)."""

    def __init__(self, auth: EtcdAuth, channel: Callable[[], grpc.aio.Channel]) -> None:
        self._auth = auth
        self._password = auth.password  # the last one the password file held
        self._file_warnings = ThrottledWarning(log, interval_s=60.0)
        self._channel = channel
        self._token = ""
        self._auth_off = False  # etcd answered that authentication is off: requests go without a token
        self._lock = asyncio.Lock()
        self._failure: grpc.aio.AioRpcError | None = None  # the last Authenticate's, until one succeeds
        self._failed_at = -math.inf
        self._forgotten_at = -math.inf

    async def token(self, stale: str | None = None) -> str:
        """The token to send ("" with authentication off): the one held, or a new one when none is held
        yet or etcd refused the held one (stale). Raises the refusal of the user or password, for
        AUTH_RETRY_S after it came, without asking again; and the failure of an Authenticate that got no
        answer, for UNANSWERED_RETRY_S (the tasks waiting here fail together, not one timeout each)."""
        async with self._lock:
            if (self._token or self._auth_off) and self._token != stale:
                return self._token
            if self._failure is not None:
                wait = AUTH_RETRY_S if _refused(self._failure) else UNANSWERED_RETRY_S
                if time.monotonic() - self._failed_at < wait:
                    raise self._failure
            request = aetcd.rpc.AuthenticateRequest(name=self._auth.user, password=self._current_password())
            try:
                reply = await aetcd.rpc.AuthStub(self._channel()).Authenticate(
                    request, timeout=AUTH_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in (
                    exc.details() or ""
                ):
                    if not self._auth_off:
                        log.warning(
                            "etcd has authentication off: --etcd-user is not needed; requests go without"
                        )
                    self._token, self._auth_off = "", True
                    return ""
                self._failure, self._failed_at = exc, time.monotonic()
                raise
            self._token, self._auth_off, self._failure = reply.token, False, None
            return self._token

    def _current_password(self) -> str:
        """The password as the password file holds it now: a password changed in etcd and in the file (a
        Kubernetes Secret mounted as a file is updated in place) is taken without a restart. A file that
        no longer holds one keeps the last password it held, with a warning once a minute."""
        path = self._auth.password_file
        if not path:
            return self._password
        try:
            password = read_password(path)
        except ValueError as exc:
            self._file_warnings.warning(
                "unreadable",
                "etcd password file %s %s; authenticating with the password it held before",
                path,
                exc,
            )
            return self._password
        if password != self._password:
            log.info("etcd password file %s holds a new password: authenticating with it", path)
            self._password = password
        return password

    def forget(self) -> None:
        """Drops the token held, at most once every AUTH_RETRY_S, so that the next request asks for a new
        one: etcd refused a watch, which it does alike for a stale token and for a user without the right
        to read (and a watch refused for the latter, retried, must not make etcd hash the password each
        time)."""
        if time.monotonic() - self._forgotten_at >= AUTH_RETRY_S:
            self._forgotten_at = time.monotonic()
            self._token = ""

    def interceptors(self) -> list:
        """The interceptors a channel is opened with (gRPC takes one per kind of call)."""
        return [_UnaryUnary(self), _UnaryStream(self), _StreamStream(self)]

    async def send_unary(self, continuation, client_call_details, request):
        """A one-shot request with the token; sent again with a new one if etcd refused it as stale."""
        if client_call_details.method == AUTHENTICATE_METHOD:
            return await continuation(client_call_details, request)
        token = await self.token()
        call = await continuation(_with_token(client_call_details, token), request)
        if token_refused(await call.code(), await call.details() or ""):
            token = await self.token(stale=token)
            call = await continuation(_with_token(client_call_details, token), request)
        return call

    async def open_stream(self, continuation, client_call_details, request):
        """A stream with the token. A stream cannot be sent again: a watch etcd refuses for a stale token
        ends WatchRefused, and the store then asks for a new one (forget); a lease keep-alive is not checked
        for a token by etcd."""
        return await continuation(_with_token(client_call_details, await self.token()), request)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await self._tokens.send_unary(continuation, client_call_details, request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await self._tokens.open_stream(continuation, client_call_details, request)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await self._tokens.open_stream(continuation, client_call_details, request_iterator)
