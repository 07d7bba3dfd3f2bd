"""Where a server may connect for a URL someone gave it: public addresses, and the networks a setting lists.

Whoever a management API admits names a URL, and the server requests it from
inside the network. The mirror fetches it and then serves the bytes on its
file port to anyone: `http://127.0.0.1:9092/metrics` published the gateway's
loopback-only metrics, unauthenticated (`mirror.fetch_allow`). The controller
sends a HEAD and reads a GGUF header before it takes a model's source, and
says whether it answered: a blind probe of the inside for whoever holds the
admin token (`controller.source_allow`). Loopback, link-local (cloud metadata
at 169.254.169.254), unspecified, multicast, private and other non-global
addresses are refused unless their network is listed, or the host and port
are one the server was configured to trust (the controller's mirror).

The check is made when a connection is made, on every address the host
resolves to, and the connection goes to an address that was checked: so a
redirect, a second DNS answer that differs from the first (rebinding), and
127.0.0.1 spelt `2130706433`, `0x7f.1` or `[::1]` all meet it. `check` makes
the same check early, so an API can answer 400 before a download starts.
Environment proxies are not used: through one, the address checked would be
the proxy's, not the model server's.

Imported by: llmgw/mirror/fetch.py, llmgw/control/catalog.py, controller.py. Imports llmgw.addresses.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import socket
import urllib.parse
import urllib.request

from llmgw.addresses import AddressList


class Refused(OSError):
    """A destination the server may not connect to. An OSError, so urllib passes it up as the reason a
    connection failed, and a download fails with it."""


def _kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """What makes IP an address not connected to unless listed, or None for a global one."""
    for kind in ("loopback", "link_local", "unspecified", "multicast", "private", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if ip.is_global else "non-global"


class Egress:
    """Fetching over http(s) from allowed destinations only; `open` is urlopen with the check."""

    def __init__(self, allow: list[str], setting: str, who: str, trusted: tuple[tuple[str, int], ...] = ()):
        """ALLOW: the addresses and networks of SETTING, which WHO ("the mirror") may connect to although not
        public. TRUSTED: (host, port) pairs connected to whatever their addresses, as configured."""
        self.allowed = AddressList(allow, setting)
        self.setting, self.who = setting, who
        self.trusted = {(host.lower(), port) for host, port in trusted}
        handlers = [_CheckedHTTP(self), _CheckedHTTPS(self), urllib.request.ProxyHandler({})]
        self.opener = urllib.request.build_opener(*handlers)

    def open(self, request, timeout: float):
        return self.opener.open(request, timeout=timeout)

    def check(self, url: str) -> None:
        """Refuse URL now when its host resolves to an address the mirror may not fetch from. A host that
        does not resolve, or a URL that cannot be parsed, is left to fail when fetched."""
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return
        if parts.hostname:
            try:
                self._addresses(parts.hostname, port)
            except socket.gaierror:
                return

    def connect(self, address: tuple[str, int], timeout, source_address=None) -> socket.socket:
        """A socket connected to one of the addresses ADDRESS's host resolves to, once every one is allowed."""
        error = None
        for sockaddr in self._addresses(*address):
            try:
                return socket.create_connection(sockaddr[:2], timeout, source_address)
            except OSError as e:
                error = e
        raise error or OSError(f"{address[0]} resolves to no address")

    def _addresses(self, host: str, port: int) -> list[tuple]:
        """Every socket address HOST resolves to; Refused when any is not allowed, as a name that also
        resolves to loopback could be connected there."""
        found = [info[4] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
        if (host.lower(), port) in self.trusted:
            return found
        for sockaddr in found:
            ip = ipaddress.ip_address(sockaddr[0].partition("%")[0])
            kind = _kind(ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else _kind(ip)
            if kind and not self.allowed.contains(str(ip)):
                shown = host if host == str(ip) else f"{host} ({ip})"
                raise Refused(f"{shown} is a {kind} address, which {self.who} does not connect to for a source: "
                              f"a source must be a public server, or one in a network {self.setting} lists (add "
                              f"the model server's address or network there, in {self.who}'s configuration)")
        return found


class _Connection:
    """An http.client connection that dials through its Egress."""

    def __init__(self, *args, egress: Egress, **kwargs):
        super().__init__(*args, **kwargs)
        # http.client sets this in __init__ (socket.create_connection), where a method would not override it:
        # the first version of this class defined a method, and connected to loopback unchecked.
        self._create_connection = egress.connect


class _HTTPConnection(_Connection, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_Connection, http.client.HTTPSConnection):
    pass


class _CheckedHTTP(urllib.request.HTTPHandler):
    def __init__(self, egress: Egress):
        super().__init__()
        self.egress = egress

    def http_open(self, req):
        return self.do_open(functools.partial(_HTTPConnection, egress=self.egress), req)


class _CheckedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, egress: Egress):
        super().__init__()
        self.egress = egress

    def https_open(self, req):
        return self.do_open(functools.partial(_HTTPSConnection, egress=self.egress), req, context=self._context)
