"""Writing to a gevent socket without gevent's detours where the system socket takes the bytes at once.

gevent's `sendall` asks the system for the socket's send buffer size (a `getsockopt` call), reads the
clock, and cuts the data into memoryview chunks before its first `send`, every call: for the few hundred
bytes of a request to an engine or an answer to a client, that was as much CPU as the send itself. Such
a send almost always goes out whole, on the first try, on a socket with room: it is tried on the system
socket under gevent's, which is non-blocking, and only what it did not take goes through gevent, which
then waits for room, bounded by the socket's timeout as before.
"""

from __future__ import annotations

from gevent.socket import socket as GeventSocket


def send_all(sock, data: bytes) -> None:
    """Send all of DATA on gevent socket SOCK (its timeout bounds any wait for room). Any other socket (a TLS
    one, whose system socket carries its records, not DATA) sends as its own `sendall` does."""
    if sock.__class__ is not GeventSocket:
        sock.sendall(data)
        return
    try:
        sent = sock._sock.send(data)
    except BlockingIOError:
        sent = 0
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])
