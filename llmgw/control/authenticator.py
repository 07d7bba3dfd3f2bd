"""Who may open which of the controller's sockets: the rings of issued keys, and the ZAP handler that consults them.

`Authenticator` is the ZAP handler for every socket the controller binds (and
for a gateway master's own accountant): each socket names a domain (agents,
gateways), and a domain admits only the keys of its ring. Without a ZAP
handler CURVE admits every key, so each socket enforces its domain: with no
handler answering, connections fail closed. Kept apart from the key files
(llmgw/control/curvekeys.py) because pyzmq's authenticator brings asyncio,
which a node reading its key file has no use for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger("llmgw.authenticator")

AGENTS = "llmgw"  # the agents' ZAP domain (its name predates the gateways')
GATEWAYS = "llmgw-gateways"
RELOAD_EVERY = 1.0  # seconds: how often an unknown key may make a ring read the store
# Seconds a handshake with an unknown key waits for that read. The ZAP handler answers one handshake at a
# time, so a store that hung (a PostgreSQL server stopped, a network that drops without a reset) once held
# up every handshake behind it, known keys too, for as long as it hung.
LOOKUP_WAIT = 0.5


class KeyRing:
    """Issued keys (z85 public key -> holder's name); replaced whole when a key is issued or revoked, so a
    reader on another thread sees one set or the other, never half of each.

    With RELOAD (the issued keys, read from the store), a key not in the ring is looked up there once more
    before it is refused, at most once a second: a key issued through another controller on the same store
    (the leader, while this one stands by) is admitted at its first try. A refused CURVE handshake is not
    tried again by the client's socket, so a ring that catches up later would be too late. The look-up runs
    in a thread of its own and is waited for LOOKUP_WAIT at most; while one has not come back, unknown
    keys are refused at once and known ones admitted as ever."""

    def __init__(self, keys: dict[bytes, str], kind: str = "node", reload: Callable[[], dict] | None = None):
        self.keys = dict(keys)
        self.kind = kind
        self.reload = reload
        self.reloaded = 0.0
        self.generation = 0  # how many times the keys were replaced
        self.lock = threading.Lock()
        self.lookup: threading.Thread | None = None  # the read of the store in progress, if any

    def replace(self, keys: dict[bytes, str], unless_replaced_since: int | None = None) -> None:
        """Take KEYS; with UNLESS_REPLACED_SINCE (a generation), only if nothing replaced them since: keys read
        from the store before a revocation must not bring the revoked key back."""
        with self.lock:
            if unless_replaced_since is not None and self.generation != unless_replaced_since:
                return
            self.keys = dict(keys)
            self.generation += 1

    def node_for(self, z85_key: bytes) -> str | None:
        return self.keys.get(z85_key)

    # The credentials-provider interface of pyzmq's authenticator.
    def callback(self, domain: str, z85_key: bytes) -> bool:
        allowed = z85_key in self.keys
        if not allowed and self.reload is not None:
            self._look_up()
            allowed = z85_key in self.keys
        if not allowed:
            log.warning("refused a connection with a key no %s was issued (%s...)", self.kind, z85_key[:8].decode())
        return allowed

    def _look_up(self) -> None:
        """Read the issued keys from the store again, unless a read is under way or one began within
        RELOAD_EVERY; wait LOOKUP_WAIT for it at most."""
        if self.lookup is not None and self.lookup.is_alive():
            return  # the store has not answered the last one: ask nothing more of it, and wait for nothing
        if time.monotonic() - self.reloaded <= RELOAD_EVERY:
            return
        self.reloaded = time.monotonic()
        self.lookup = threading.Thread(target=self._reload, args=(self.generation,), name=f"{self.kind}-keys",
                                       daemon=True)
        self.lookup.start()
        self.lookup.join(LOOKUP_WAIT)
        if self.lookup.is_alive():
            log.warning("the store did not answer within %.1f s when asked for the issued %s keys: keys this "
                        "controller does not hold yet are refused until it does", LOOKUP_WAIT, self.kind)

    def _reload(self, generation: int) -> None:
        try:
            self.replace(self.reload(), unless_replaced_since=generation)
        except sa.exc.SQLAlchemyError as e:
            log.warning("could not read the issued %s keys from the store: %s", self.kind, str(e).splitlines()[0])


class Authenticator(ThreadAuthenticator):
    """The ZAP handler: each domain admits its ring's keys, and every message carries the key its session
    was opened with as User-Id (z85). The key, not its holder's name: a session stays open after its key is
    revoked or replaced, and only the key tells its messages from those of the holder's new session."""

    def __init__(self, context: zmq.Context, rings: dict[str, KeyRing]):
        super().__init__(context)
        self.rings = rings

    def start(self) -> "Authenticator":
        super().start()
        for domain, ring in self.rings.items():
            self.configure_curve_callback(domain=domain, credentials_provider=ring)
        return self

    def curve_user_id(self, client_public_key: bytes) -> str:
        return z85.encode(client_public_key).decode()


def serve_curve(sock: zmq.Socket, keypair: tuple[bytes, bytes], domain: str) -> None:
    """Make SOCK a CURVE server in DOMAIN; call before bind."""
    public, secret = keypair
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.zap_domain = domain.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.curve_server = True  # must come before bind
