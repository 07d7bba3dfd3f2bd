"""Noticing a client that leaves, for the cost of an I/O watcher rather than a greenlet.

Without it a client gone mid-stream is only noticed on the second write after it left, which with
slow tokens is many seconds of the engine generating for nobody; closing the engine's connection
stops its work. A greenlet a stream waiting on the client's socket did this, and kept 6.3 KiB of a
held stream's memory while it waited (docs/performance.md). A watcher on the hub's loop keeps a
few hundred bytes; a greenlet is started only once the client's socket is readable, which during
a stream means it left, or sent its next request early. Requests answered whole are watched too until
their answer is in: a client that gave up on one left the engine generating until it ended or
`timeouts.first_byte` passed.
"""

from __future__ import annotations

import socket

import gevent


class ClientWatch:
    """Abort RESP (anything with `abort`: the engine's answer being streamed, or an upstream.Cancel for a
    request not yet answered) as soon as the client on SOCK hangs up; `stop` once it is done."""

    __slots__ = ("sock", "resp", "watcher")

    def __init__(self, sock, resp) -> None:
        self.sock = sock
        self.resp = resp
        self.watcher = gevent.get_hub().loop.io(sock.fileno(), 1)  # 1: readable
        self.watcher.start(self._readable)

    def _readable(self) -> None:
        # On the hub, where nothing may wait: what the socket holds is looked at from a greenlet.
        self.watcher.stop()
        gevent.spawn(self._check)

    def _check(self) -> None:
        if self.resp is None:
            return  # it ended first
        try:
            # The system socket's own peek (under the connection's gevent socket), which never waits: a wake-up
            # with nothing to read after all watches on.
            if self.sock.sock._sock.recv(1, socket.MSG_PEEK):
                return  # the client sent more (a pipelined request): it did not leave
        except BlockingIOError:
            if self.resp is not None:
                self.watcher.start(self._readable)
            return
        except OSError:
            pass
        if self.resp is not None:
            self.resp.abort()

    def stop(self) -> None:
        self.watcher.close()
        self.resp = None
