"""Random identifiers for rows people address (projects, keys): short, unguessable, URL-safe."""

import secrets


def new_id() -> str:
    return secrets.token_hex(8)
