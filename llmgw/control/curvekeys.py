"""CURVE keys: the controller's key pair, the node and gateway key files it issues, and who holds which key.

A node authenticates with a key pair issued for it by `llmgw ctl node-key
issue NODE`, a gateway with one from `llmgw ctl gateway-key issue NAME`; the
controller keeps each public half bound to its holder's name, so a node can
only ever speak as itself and a gateway key opens only the gateways' sockets.
The key file an operator copies to the machine holds the name, its key pair
and the controller's public key (which the peer needs to encrypt to the right
server).
This module keeps the issued keys in the store; the key files themselves (made and read, and the
controller's own pair) are llmgw/keyfiles.py, which the node and the gateway read without a database.
Who is admitted where is llmgw/control/authenticator.py.
"""

from __future__ import annotations

import time

import sqlalchemy as sa
import zmq
from sqlalchemy.engine import Engine

from llmgw import store


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
