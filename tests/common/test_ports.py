"""free_port never names one port twice in a process: the ports a local stack hands its services are not
bound until each service has started, and two gRPC servers given one port would share it (SO_REUSEPORT)."""

from pcpstack.common.ports import free_port


def test_two_thousand_ports_handed_out_without_binding_them_are_all_different() -> None:
    # The kernel picks among ~28,000 ephemeral ports for each bind to port 0: drawn 2,000 times without
    # memory, some port would come back (birthday bound); free_port remembers what it handed out.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
