"""The client's half of CURVE: a socket that dials a controller (or a gateway master's accountant) with its key.

A peer holds its own key pair and the server's public key. Knowing the
server's key is what makes a client refuse an impostor: the handshake fails
against any process that does not hold the matching secret key, so a forger
that binds a controller's port during a restart is never heard. The servers'
half (which keys a socket admits) is the controller's, in
`llmgw.control.curvekeys`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ClientKeys:
    """z85 keys: the server to trust, and this peer's own pair."""
    server_public: bytes
    public: bytes
    secret: bytes


def dial(sock, keys: ClientKeys | None) -> None:
    """Make SOCK (pyzmq, plain or green) a CURVE client with KEYS; None leaves it plaintext. Call before connect."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
