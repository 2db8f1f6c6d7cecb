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
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.append(port)
                return port
    raise RuntimeError(f"no free port on {host} that this process has not handed out lately")
