"""Believing `X-Forwarded-Proto` and `X-Forwarded-Host` only from configured proxies.

Behind a TLS-terminating proxy the gateway needs the scheme (for `Secure`
cookies) and the host clients used (for the base URL it shows). Anyone can
send these headers, so they count only when the connection comes from an
address in `gateway.trusted_proxies`; from anyone else they are removed.
"""

from __future__ import annotations

from llmgw.addresses import AddressList


class TrustedProxies:
    def __init__(self, entries: list[str]):
        self.proxies = AddressList(entries, "gateway.trusted_proxies")

    def trusts(self, address: str | None) -> bool:
        return self.proxies.contains(address)

    def apply(self, environ: dict) -> None:
        """Rewrite ENVIRON's scheme and host from the headers, or drop the headers."""
        proto = environ.pop("HTTP_X_FORWARDED_PROTO", None)
        host = environ.pop("HTTP_X_FORWARDED_HOST", None)
        if not self.trusts(environ.get("REMOTE_ADDR")):
            return
        # A proxy that appends rather than sets leaves a list; the first entry
        # is what the client used.
        if proto:
            proto = proto.split(",")[0].strip().lower()
            if proto in ("http", "https"):
                environ["wsgi.url_scheme"] = proto
        if host:
            environ["HTTP_HOST"] = host.split(",")[0].strip()

    def client(self, environ: dict) -> str:
        """The client's address: the peer's, or behind trusted proxies the nearest one in
        `X-Forwarded-For` that is not a trusted proxy (entries further left are the client's word)."""
        address = environ.get("REMOTE_ADDR") or ""
        hops = [h.strip() for h in environ.get("HTTP_X_FORWARDED_FOR", "").split(",") if h.strip()]
        while self.trusts(address) and hops:
            address = hops.pop()
        return address
