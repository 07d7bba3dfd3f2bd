"""Socket calls on a gevent socket without gevent's detours where none is needed.

gevent's `sendall` asks the system for the socket's send buffer size (a `getsockopt` call), reads the
clock, and cuts the data into memoryview chunks before its first `send`, every call: for the few hundred
bytes of a request to an engine or an answer to a client, that was as much CPU as the send itself. Such
a send almost always goes out whole, on the first try, on a socket with room: it is tried on the system
socket under gevent's, which is non-blocking, and only what it did not take goes through gevent, which
then waits for room, bounded by the socket's timeout as before.

gevent's `recv` bounds each wait with a `gevent.Timeout`, a Python object with a timer of its own, made,
entered, cancelled and closed around every wait: with the failed read before each wait, 9% of a plain
request's CPU. `recv` here bounds its wait with a bare timer on the hub's loop that throws the same
`socket.timeout` into the waiting greenlet, and can wait first, for an answer that cannot have come yet
(an engine's, just asked). A socket closed by another greenlet wakes the wait with gevent's own error,
as before. Any other socket (a TLS one, whose system socket carries its records, not the data) goes
through its own calls.
"""

from __future__ import annotations

import errno
import socket
import time

from gevent import getcurrent
from gevent.socket import socket as GeventSocket


def send_all(sock, data: bytes) -> None:
    """Send all of DATA on gevent socket SOCK (its timeout bounds any wait for room)."""
    if sock.__class__ is not GeventSocket:
        sock.sendall(data)
        return
    try:
        sent = sock._sock.send(data)
    except BlockingIOError:
        sent = 0
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def recv(sock, size: int, timeout: float | None, wait_first: bool = False) -> bytes:
    """Up to SIZE bytes from gevent socket SOCK, waiting at most TIMEOUT seconds (None: for ever) for them;
    `socket.timeout` past it. WAIT_FIRST: wait before the first read, which would find nothing."""
    if sock.__class__ is not GeventSocket:
        sock.settimeout(timeout)
        return sock.recv(size)
    raw = sock._sock
    if not wait_first:
        try:
            return raw.recv(size)
        except BlockingIOError:
            pass
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        _wait_readable(sock, None if deadline is None else deadline - time.monotonic())
        try:
            return raw.recv(size)
        except BlockingIOError:
            continue  # woken with nothing to read after all: wait again, for what is left of the time


def _expire(greenlet) -> None:
    greenlet.throw(socket.timeout("timed out"))


def _wait_readable(sock, timeout: float | None) -> None:
    watcher = sock._read_event
    if watcher is None:
        raise OSError(errno.EBADF, "the socket was closed")
    if timeout is None:
        sock.hub.wait(watcher)
        return
    if timeout <= 0:
        raise socket.timeout("timed out")
    timer = sock.hub.loop.timer(timeout, priority=-1)  # as gevent's Timeout: what is readable is read first
    timer.start(_expire, getcurrent(), update=True)
    try:
        sock.hub.wait(watcher)
    finally:
        timer.close()
