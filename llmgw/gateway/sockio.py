"""Socket calls on a gevent socket without gevent's detours where none is needed.

gevent's `sendall` asks the system for the socket's send buffer size (a `getsockopt` call), reads the
clock, and cuts the data into memoryview chunks before its first `send`, every call: for the few hundred
bytes of a request to an engine or an answer to a client, that was as much CPU as the send itself. Such
a send almost always goes out whole, on the first try, on a socket with room: it is sent on the system
socket under gevent's, which is non-blocking. Where that has no room for the rest, the send waits under
the same bare timer as a read (below), each wait bounded by the socket's timeout: gevent bounded its whole
`sendall` by it, which cut off a client that read a large answer steadily but slower than that.

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


class SendTimeout(socket.timeout):
    """A send waited its socket's timeout for room, and the peer took nothing meanwhile."""


def send_all(sock, data: bytes) -> None:
    """Send all of DATA on gevent socket SOCK. Each wait for room is bounded by the socket's timeout, not the
    whole send: a client that reads a large answer slowly but steadily gets all of it, and one that stops
    reading gets `SendTimeout`."""
    if sock.__class__ is not GeventSocket:
        sock.sendall(data)
        return
    raw = sock._sock
    try:
        sent = raw.send(data)
    except BlockingIOError:
        sent = 0
    if sent == len(data):
        return
    view = memoryview(data)
    while sent < len(data):
        _wait(sock, sock._write_event, sock.timeout, SendTimeout)
        try:
            sent += raw.send(view[sent:])
        except BlockingIOError:
            continue  # woken with no room after all: wait again


def recv(sock, size: int, timeout: float | None, wait_first: bool = False) -> bytes:
    """Up to SIZE bytes from gevent socket SOCK, waiting at most TIMEOUT seconds (None: for ever) for them;
    `socket.timeout` past it. WAIT_FIRST: wait before the first read, which would find nothing."""
    if sock.__class__ is not GeventSocket:
        sock.settimeout(None if timeout is None else max(timeout, 0.0))
        return sock.recv(size)
    raw = sock._sock
    if not wait_first:
        try:
            return raw.recv(size)
        except BlockingIOError:
            pass
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        _wait(sock, sock._read_event, None if deadline is None else deadline - time.monotonic(), socket.timeout)
        try:
            return raw.recv(size)
        except BlockingIOError:
            continue  # woken with nothing to read after all: wait again, for what is left of the time


def _expire(greenlet, error) -> None:
    greenlet.throw(error("timed out"))


def _wait(sock, watcher, timeout: float | None, error) -> None:
    """Wait for WATCHER, one of gevent socket SOCK's, at most TIMEOUT seconds (None: for ever); ERROR past it."""
    if watcher is None:
        raise OSError(errno.EBADF, "the socket was closed")
    if timeout is None:
        sock.hub.wait(watcher)
        return
    if timeout <= 0:
        raise error("timed out")
    timer = sock.hub.loop.timer(timeout, priority=-1)  # as gevent's Timeout: what is ready is taken first
    timer.start(_expire, getcurrent(), error, update=True)
    try:
        sock.hub.wait(watcher)
    finally:
        timer.close()
