"""Finding a free TCP port, for services, rendezvous points and tests that must name one before binding."""

import socket
import threading
from collections import deque

# Ports this process handed out lately. A port is named before the process given it binds it; until then the
# kernel sees it free and may hand it out again, and gRPC servers bind with SO_REUSEPORT, so two services
# given the same port would both listen on it and split its connections (a local stack once had its KV
# store and its decode worker on one port). The most recent ones are enough: older ones are bound by now.
_RECENT = 4096
_handed_out: deque[int] = deque(maxlen=_RECENT)
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago and that this process has not handed out lately
    (another process may still take it before it is bound)."""
    with _lock:
        for _ in range(64):
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.append(port)
                return port
    raise RuntimeError(f"no free port on {host} that this process has not handed out lately")


def check_bindable(host: str, port: int) -> None:
    """Raises OSError when nothing could listen on host:port now: the port is taken (a gRPC server there
    would share it through SO_REUSEPORT and split its connections with the holder), or the host is not an
    address of this machine. Time-wait leftovers of a stopped server do not count."""
    infos = socket.getaddrinfo(
        host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    failure: OSError | None = None
    for family, kind, proto, _, address in infos:  # a name may have several: one that binds will do
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
            return
        except OSError as exc:
            failure = exc
    raise failure or OSError(f"{host} resolves to no address")
