"""What `llmgw login --browser` and the gateway's `/login/cli` share (RFC 7636 and RFC 8252): the S256
challenge of a verifier, and the words both show the person so that they can tell the command they ran
from a listener someone else started.

Imported by llmgw/cli/login.py and llmgw/web/clilogin.py. Pure functions.
"""

from __future__ import annotations

import base64
import hashlib


def challenge_of(verifier: str) -> str:
    """The S256 challenge of VERIFIER: its SHA-256, base64url without padding."""
    return base64.urlsafe_b64encode(hashlib.sha256(verifier.encode("ascii")).digest()).rstrip(b"=").decode()


def confirmation_words(port: int, challenge: str) -> str:
    """What the command prints and the page shows, for the person to compare: the command's port (which nobody
    else can hold while it listens) and the challenge's first twelve characters."""
    return f"{port} {challenge[:12]}"
