"""The registry's typed clients, in two parts with two jobs.

- `Resolver`: where to send work (Resolve with one cache, typed `Resolution` answers) for routers: decode's
  set router, the gateway, the CLI, and a prefill node looking for its KV store.
- `NodeSession`: a worker node's registration, Session, heartbeats, status reports and commands.
"""

from pcpstack.registry.endpoints import PrefillEndpoint, Resolution, ServiceEndpoint
from pcpstack.registry.resolver import Resolver
from pcpstack.registry.session import Command, NodeSession

__all__ = ["Command", "NodeSession", "PrefillEndpoint", "Resolution", "Resolver", "ServiceEndpoint"]
