"""CURVE keys: the controller's key pair, the node and gateway key files it issues, and who holds which key.

A node authenticates with a key pair issued for it by `llmgw ctl node-key
issue NODE`, a gateway with one from `llmgw ctl gateway-key issue NAME`; the
controller keeps each public half bound to its holder's name, so a node can
only ever speak as itself and a gateway key opens only the gateways' sockets.
The key file an operator copies to the machine holds the name, its key pair
and the controller's public key (which the peer needs to encrypt to the right
server).

`Authenticator` is the ZAP handler for every socket the controller binds: each
socket names a domain (agents, gateways), and a domain admits only the keys
of its ring. Without a ZAP handler CURVE admits every key, so each socket
enforces its domain: with no handler answering, connections fail closed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import tomllib

import sqlalchemy as sa
import zmq
from sqlalchemy.engine import Engine
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from llmgw import store

log = logging.getLogger("llmgw.curvekeys")

AGENTS = "llmgw"  # the agents' ZAP domain (its name predates the gateways')
GATEWAYS = "llmgw-gateways"


class KeyFileError(Exception):
    """A key file that cannot be used; the message says what to do."""


def write_private(path: str, text: str) -> None:
    """Write TEXT to PATH, readable by this user only (0600) from the moment it exists, even over a looser file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def controller_keypair(keys_dir: str) -> tuple[bytes, bytes]:
    """(public, secret) of the controller, made on first use and kept in KEYS_DIR/controller.key."""
    path = os.path.join(keys_dir, "controller.key")
    if not os.path.exists(path):
        public, secret = zmq.curve_keypair()
        write_private(path, f'public_key = "{public.decode()}"\nsecret_key = "{secret.decode()}"\n')
    with open(path, "rb") as f:
        data = tomllib.load(f)
    return data["public_key"].encode(), data["secret_key"].encode()


def node_key_file(node_id: str, public: bytes, secret: bytes, controller_public: bytes) -> str:
    return (f"# llmgw node key for {node_id}. Keep it secret: mode 0600, readable by the agent only.\n"
            f'node_id = "{node_id}"\npublic_key = "{public.decode()}"\nsecret_key = "{secret.decode()}"\n'
            f'controller_public_key = "{controller_public.decode()}"\n')


def gateway_key_file(name: str, public: bytes, secret: bytes, controller_public: bytes) -> str:
    return (f"# llmgw gateway key for {name}. Keep it secret: mode 0600, readable by the gateway only.\n"
            f'gateway = "{name}"\npublic_key = "{public.decode()}"\nsecret_key = "{secret.decode()}"\n'
            f'controller_public_key = "{controller_public.decode()}"\n')


def read_gateway_key_file(path: str) -> dict[str, str]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise KeyFileError(f"cannot read the gateway key file {path}: {e.strerror}. On the controller, run "
                           "`llmgw ctl gateway-key issue NAME > gateway.key`, copy it here and set "
                           "gateway.key_file (or set gateway.plaintext on a closed test network)") from None
    except tomllib.TOMLDecodeError as e:
        raise KeyFileError(f"{path} is not a gateway key file: {e}") from None
    missing = [k for k in ("gateway", "public_key", "secret_key", "controller_public_key") if not data.get(k)]
    if missing:
        raise KeyFileError(f"{path} lacks {', '.join(missing)}; issue a new one with "
                           "`llmgw ctl gateway-key issue NAME`")
    return data


def read_node_key_file(path: str) -> dict[str, str]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise KeyFileError(f"cannot read the node key file {path}: {e.strerror}. On the controller, run "
                           "`llmgw ctl node-key issue NODE > node.key` and copy it here "
                           "(or set agent.plaintext on a closed test network)") from None
    except tomllib.TOMLDecodeError as e:
        raise KeyFileError(f"{path} is not a node key file: {e}") from None
    missing = [k for k in ("node_id", "public_key", "secret_key", "controller_public_key") if not data.get(k)]
    if missing:
        raise KeyFileError(f"{path} lacks {', '.join(missing)}; issue a new one with `llmgw ctl node-key issue NODE`")
    return data


def issue_node_key(engine: Engine, node_id: str) -> tuple[bytes, bytes]:
    """A new key pair for NODE_ID, replacing any earlier one (which stops working)."""
    public, secret = zmq.curve_keypair()
    with engine.begin() as conn:
        conn.execute(store.node_keys.delete().where(store.node_keys.c.node_id == node_id))
        conn.execute(store.node_keys.insert().values(node_id=node_id, public_key=public.decode(),
                                                     created_at=time.time()))
    return public, secret


def authorised_keys(engine: Engine) -> dict[bytes, str]:
    """z85 public key -> node id, for every issued key."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(store.node_keys.c.public_key, store.node_keys.c.node_id)).all()
    return {public.encode(): node_id for public, node_id in rows}


def issue_gateway_key(engine: Engine, name: str) -> tuple[bytes, bytes]:
    """A new key pair for the gateway NAME, replacing any earlier one (which stops working)."""
    public, secret = zmq.curve_keypair()
    with engine.begin() as conn:
        conn.execute(store.gateway_keys.delete().where(store.gateway_keys.c.name == name))
        conn.execute(store.gateway_keys.insert().values(name=name, public_key=public.decode(), created_at=time.time()))
    return public, secret


def gateway_keys(engine: Engine) -> dict[bytes, str]:
    """z85 public key -> gateway name, for every issued gateway key."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(store.gateway_keys.c.public_key, store.gateway_keys.c.name)).all()
    return {public.encode(): name for public, name in rows}


class KeyRing:
    """Issued keys (z85 public key -> holder's name); replaced whole when a key is issued."""

    def __init__(self, keys: dict[bytes, str], kind: str = "node"):
        self.keys = dict(keys)
        self.kind = kind
        self.lock = threading.Lock()

    def replace(self, keys: dict[bytes, str]) -> None:
        with self.lock:
            self.keys = dict(keys)

    def node_for(self, z85_key: bytes) -> str | None:
        return self.keys.get(z85_key)

    # The credentials-provider interface of pyzmq's authenticator.
    def callback(self, domain: str, z85_key: bytes) -> bool:
        allowed = z85_key in self.keys
        if not allowed:
            log.warning("refused a connection with a key no %s was issued (%s...)", self.kind, z85_key[:8].decode())
        return allowed


class Authenticator(ThreadAuthenticator):
    """The ZAP handler: each domain admits its ring's keys, and a message carries its holder's name as User-Id."""

    def __init__(self, context: zmq.Context, rings: dict[str, KeyRing]):
        super().__init__(context)
        self.rings = rings

    def start(self) -> "Authenticator":
        super().start()
        for domain, ring in self.rings.items():
            self.configure_curve_callback(domain=domain, credentials_provider=ring)
        return self

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = z85.encode(client_public_key)
        for ring in self.rings.values():
            name = ring.node_for(key)
            if name is not None:
                return name
        return ""


def serve_curve(sock: zmq.Socket, keypair: tuple[bytes, bytes], domain: str) -> None:
    """Make SOCK a CURVE server in DOMAIN; call before bind."""
    public, secret = keypair
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.zap_domain = domain.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.curve_server = True  # must come before bind
