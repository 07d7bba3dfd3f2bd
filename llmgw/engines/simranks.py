"""The simulated engine over several nodes: its ranks meet at rank 0, as vLLM's do, and fail as vLLM's fail.

A test instrument for the lifecycle of a replica over several nodes, replaying what a real vLLM over two
processes did here (../shared/engines-offline.md): rank 0 serves HTTP and listens at its master address
for the other ranks; its `/health` fails until every rank has joined (a real rank 0 started alone waits
without an error); the other ranks run headless, joining rank 0 and then waiting. A rank that goes leaves
rank 0 answering `/health` but failing every request (a real one hangs, then exits); rank 0 gone leaves the
others running, as a real headless rank never exits by itself. What stops the rest is the agents'
reports and the controller, which is what the tests check.

A rank says `llmgw-sim GROUP RANK` on its first line; rank 0 counts only ranks of its own group and ranks, so
an engine of another replica that dials the port by mistake is not taken for one of its own.
"""

from __future__ import annotations

import logging
import socket

import gevent
import gevent.server

from llmgw import addresses

log = logging.getLogger("llmgw.sim")
HELLO_MOST = 300  # bytes of a rank's first line


class Gathering:
    """Rank 0's side: which ranks have joined, and whether one has left since."""

    def __init__(self, group: str, ranks: int):
        self.group = group
        self.ranks = ranks
        self.joined: set[int] = set()
        self.left: int | None = None  # the first rank that went

    @property
    def complete(self) -> bool:
        return len(self.joined) == self.ranks - 1

    def waiting(self) -> str | None:
        """Why a request cannot be served now, or None."""
        if self.left is not None:
            return f"rank {self.left} of the replica's {self.ranks} left; the engine cannot serve"
        if not self.complete:
            return f"waiting for the replica's ranks: {len(self.joined) + 1} of {self.ranks} joined"
        return None

    def serve(self, master: str) -> gevent.server.StreamServer:
        server = gevent.server.StreamServer(addresses.bind(master, "--master"), self._rank)
        server.start()
        return server

    def _rank(self, sock: socket.socket, _address) -> None:
        reader = sock.makefile("rb")
        try:
            words = reader.readline(HELLO_MOST).decode("ascii", "replace").split()
            if len(words) != 3 or words[:2] != ["llmgw-sim", self.group] or not words[2].isdigit():
                return
            rank = int(words[2])
            if not 0 < rank < self.ranks or rank in self.joined:
                return
            self.joined.add(rank)
            log.info("rank %d joined (%d of %d)", rank, len(self.joined) + 1, self.ranks)
            reader.read()  # until it goes
            self.left = rank if self.left is None else self.left
            log.warning("rank %d left", rank)
        finally:
            reader.close()
            sock.close()


def follow(master: str, group: str, rank: int, announce=print) -> None:
    """A headless rank: join rank 0 at MASTER (trying again until it answers), then wait for ever."""
    host, port = addresses.parse(master, "--master")
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            gevent.sleep(0.2)
    sock.settimeout(None)
    sock.sendall(f"llmgw-sim {group} {rank}\n".encode())
    announce(f"llmgw sim: rank {rank} joined its group at {master}")
    sock.recv(1)  # rank 0 gone: a headless rank stays, as a real one does, until it is stopped
    announce(f"llmgw sim: rank {rank}'s rank 0 went; waiting to be stopped")
    gevent.sleep(10 ** 9)
