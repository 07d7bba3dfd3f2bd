"""Key files: the controller's CURVE key pair, and the node and gateway key files it issues, made and read.

A key file an operator copies to a machine holds its holder's name, its key pair and the controller's
public key (which the peer needs to encrypt to the right server). Read at start by the agent, the
doctor and the gateway, which have no database: who holds which key is kept by the controller
(llmgw/control/curvekeys.py).
"""

from __future__ import annotations

import os
import tomllib

import zmq

from llmgw.filemodes import write_private


class KeyFileError(Exception):
    """A key file that cannot be used; the message says what to do."""


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
