"""CURVE keys: the controller's key pair, the node and gateway key files it issues, and who holds which key.

A node authenticates with a key pair issued for it by `llmgw ctl node-key
issue NODE`, a gateway with one from `llmgw ctl gateway-key issue NAME`; the
controller keeps each public half bound to its holder's name, so a node can
only ever speak as itself and a gateway key opens only the gateways' sockets.
The key file an operator copies to the machine holds the name, its key pair
and the controller's public key (which the peer needs to encrypt to the right
server).
Who is admitted where is llmgw/control/authenticator.py.
"""

from __future__ import annotations

import os
import time
import tomllib

import sqlalchemy as sa
import zmq
from sqlalchemy.engine import Engine

from llmgw import filemodes, store


class KeyFileError(Exception):
    """A key file that cannot be used; the message says what to do."""


def write_private(path: str, text: str) -> None:
    """Write TEXT to PATH, readable by this user only (0600) from the moment it exists; a directory made for it
    is 0700. Written to a new file that then takes PATH's place, so whatever PATH was (a looser file, a link
    another user planted to a file of theirs or of root's) is replaced, never written through: opened and
    truncated in place, a password went into another user's file, and root's own files were overwritten."""
    folder = os.path.dirname(os.path.abspath(path))
    filemodes.make_private_dir(folder)
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.new")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


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


def _read_key_file(path: str, holder: str, name_field: str, issue: str, where: str) -> dict[str, str]:
    """A key file of HOLDER ("node", "gateway") whose name is NAME_FIELD; refusals end with ISSUE, the command
    that makes one, and WHERE, what to do with it here."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise KeyFileError(f"cannot read the {holder} key file {path}: {e.strerror}. On the controller, run "
                           f"`{issue} > {holder}.key`, {where}") from None
    except tomllib.TOMLDecodeError as e:
        raise KeyFileError(f"{path} is not a {holder} key file: {e}") from None
    missing = [k for k in (name_field, "public_key", "secret_key", "controller_public_key") if not data.get(k)]
    if missing:
        raise KeyFileError(f"{path} lacks {', '.join(missing)}; issue a new one with `{issue}`")
    return data


def read_gateway_key_file(path: str) -> dict[str, str]:
    return _read_key_file(path, "gateway", "gateway", "llmgw ctl gateway-key issue NAME",
                          "copy it here and set gateway.key_file (or set gateway.plaintext on a closed test network)")


def read_node_key_file(path: str) -> dict[str, str]:
    return _read_key_file(path, "node", "node_id", "llmgw ctl node-key issue NODE",
                          "copy it here (or set agent.plaintext on a closed test network)")


def _issue(engine: Engine, table: sa.Table, column: str, name: str) -> tuple[bytes, bytes]:
    """A new key pair for NAME in TABLE, replacing any earlier one (which stops working)."""
    public, secret = zmq.curve_keypair()
    with store.writing(engine) as conn:
        conn.execute(table.delete().where(table.c[column] == name))
        conn.execute(table.insert().values({column: name, "public_key": public.decode(), "created_at": time.time()}))
    return public, secret


def _issued(engine: Engine, table: sa.Table, column: str) -> dict[bytes, str]:
    """z85 public key -> holder's name, for every key issued in TABLE."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(table.c.public_key, table.c[column])).all()
    return {public.encode(): name for public, name in rows}


def issue_node_key(engine: Engine, node_id: str) -> tuple[bytes, bytes]:
    return _issue(engine, store.node_keys, "node_id", node_id)


def authorised_keys(engine: Engine) -> dict[bytes, str]:
    return _issued(engine, store.node_keys, "node_id")


def revoke_node_key(engine: Engine, node_id: str) -> bool:
    """Withdraw NODE_ID's key, so it is refused from now on; False when it had none. Deleting the row is
    the whole revocation: a key is admitted only while issued, and the controller's ring is rebuilt from
    this table (the agent server then ends the session the key holds open)."""
    with store.writing(engine) as conn:
        return conn.execute(store.node_keys.delete().where(store.node_keys.c.node_id == node_id)).rowcount > 0


def issue_gateway_key(engine: Engine, name: str) -> tuple[bytes, bytes]:
    return _issue(engine, store.gateway_keys, "name", name)


def gateway_keys(engine: Engine) -> dict[bytes, str]:
    return _issued(engine, store.gateway_keys, "name")
