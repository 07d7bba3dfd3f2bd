"""What every page response carries against framing and injected script, and where a page may send people.

Pages may run only the site's own script files (no inline script, no other
site's), may not be framed by any site (clickjacking a button such as
"Remove"), and a page that shows a secret is never kept in a cache. A
redirect built from something a visitor sent (`?next=`, `Referer`) goes only
to a path of this site: `/account` yes; `//evil.example`, `http://evil`,
`/\\evil` (browsers read `\\` as `/`) and anything with control characters or
spaces (browsers drop tabs and line breaks from URLs) no.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from flask import g, request

# Inline style attributes stay allowed (meters and indents set their width in the template); script
# may come only from /static.
POLICY = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
          "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


def no_store() -> None:
    """Mark this response as showing a secret: no browser or proxy keeps a copy."""
    g.llmgw_no_store = True


def add_headers(response):
    """Flask `after_request`: the headers every page response carries."""
    response.headers["Content-Security-Policy"] = POLICY
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    if g.get("llmgw_no_store"):
        response.headers["Cache-Control"] = "no-store"
    return response


def local_path(target: str | None) -> str | None:
    """TARGET when it is a path on this site, else None."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")):
        return None
    if "\\" in target or any(ord(c) <= 0x20 or ord(c) == 0x7F for c in target):
        return None
    parts = urlsplit(target)
    return target if not parts.scheme and not parts.netloc else None


def back(default: str) -> str:
    """Where to send someone back to after a form: the page they came from, when it is this site's."""
    referrer = request.referrer
    if referrer:
        parts = urlsplit(referrer)
        if parts.netloc == request.host and parts.scheme in ("http", "https"):
            return local_path(parts.path + (f"?{parts.query}" if parts.query else "")) or default
    return default


def has_control_characters(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)
