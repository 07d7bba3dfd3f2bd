"""Who a request can be from: a key's record, and the hash a secret is known by.

The store (`llmgw.people.keys`) makes and keeps keys; a gateway worker
(`llmgw.gateway.keytable`) holds them in memory, from the store or as the
controller pushes them. Both speak of a key with this one record.
"""

from __future__ import annotations

import dataclasses
import hashlib

SECRET_PREFIX = "sk-llmgw-"
SECRET_CHARS = 43  # after the prefix: secrets.token_urlsafe(32)
_URLSAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
PERSONAL = "personal"  # a key's project when it belongs to a person rather than a project
# The environment variable people keep their key in: the coding tools' setup reads it (llmgw/web/editorconfig.py),
# and `llmgw login` says to set it.
KEY_VARIABLE = "LLMGW_API_KEY"


@dataclasses.dataclass(frozen=True, slots=True)  # slots: a gateway worker holds one per key, a million at a time
class KeyRecord:
    id: str
    name: str
    project_id: str | None  # None for a personal key
    project: str  # the project's path, or "personal"
    prefix: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    user_id: str | None = None  # whose key it is, when it is a person's


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def well_formed(secret: str) -> bool:
    """Whether SECRET has the shape of a key llmgw makes (whether or not it is one)."""
    return (len(secret) == len(SECRET_PREFIX) + SECRET_CHARS and secret.startswith(SECRET_PREFIX)
            and _URLSAFE.issuperset(secret[len(SECRET_PREFIX):]))
