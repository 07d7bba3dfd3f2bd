"""`free_port` hands out ports that outgoing connections are never given, and none twice in a row."""

import socket

from llmgw import procs


def test_free_ports_lie_below_the_ephemeral_range_and_skip_one_that_is_held():
    low = procs._ephemeral_low()
    held = socket.socket()
    try:
        first = procs.free_port()
        held.bind(("127.0.0.1", first + 1 if first + 1 < low else procs.LOWEST_PORT))
        ports = [procs.free_port() for _ in range(50)]
        assert all(procs.LOWEST_PORT <= p < low for p in [first, *ports])
        assert held.getsockname()[1] not in ports and len(set(ports)) == 50
        with socket.socket() as s:
            s.bind(("127.0.0.1", ports[-1]))  # free as promised
    finally:
        held.close()
