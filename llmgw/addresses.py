"""`HOST:PORT` addresses and lists of addresses, read one way for every setting, flag and socket.

One rule for a host that is empty or a wildcard (`:8080`, `0.0.0.0:8080`, `[::]:8080`, ZeroMQ's
`*:8080`): a server BINDING it listens on every address; a client DIALLING it reaches this machine,
127.0.0.1 (`::1` for the IPv6 wildcard, which a host with `bindv6only` does not open to IPv4). Before
this module some twenty call sites split on the last colon each in its own way, and disagreed about
which hosts were wildcards, so `llmgw up`, the mirror and the gateway dialled different places for
the same setting. An IPv6 host is written in brackets, `[::1]:8080`; a port is 0..65535, and 0 (any
free port) only where the caller says it can learn the port it got.

`AddressList` is a list of addresses and networks (`gateway.trusted_proxies`, `mirror.api_allow`),
parsed once with `ipaddress`; an IPv4 client seen by a dual-stack listener as `::ffff:a.b.c.d`
matches the IPv4 entries.

Top level: imports nothing of llmgw's, so settings, every package and the role files use it.
"""

from __future__ import annotations

import functools
import ipaddress
import socket

WILDCARDS = ("", "0.0.0.0", "*", "::")
EXAMPLES = "such as 127.0.0.1:8080, :8080 (every address) or [::1]:8080"


def parse(text: str, setting: str, *, free_port: bool = False) -> tuple[str, int]:
    """(host, port) of TEXT, `HOST:PORT` or `[V6]:PORT`; the host without brackets, empty when none is
    written. SETTING names where TEXT came from, for the error; FREE_PORT allows port 0.
    Raises ValueError naming SETTING and what to write instead."""
    if not isinstance(text, str):
        raise ValueError(f"{setting} is {text!r}: expected a HOST:PORT string, {EXAMPLES}")
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or not rest.startswith(":") or not _is_ipv6(host):
            raise ValueError(f"{setting} is {text!r}: write an IPv6 address as [ADDRESS]:PORT, such as [::1]:8080")
        port_text = rest[1:]
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon:
            raise ValueError(f"{setting} is {text!r}, which has no port: write HOST:PORT, {EXAMPLES}")
        if ":" in host:
            raise ValueError(f"{setting} is {text!r}: write an IPv6 address in brackets, as in [{host}]:{port_text}")
        if any(c.isspace() or c in "/[]@" for c in host):
            raise ValueError(f"{setting} is {text!r}: {host!r} is not a host name or address; write HOST:PORT, "
                             f"{EXAMPLES}")
    if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
        raise ValueError(f"{setting} is {text!r}: the port must be a number from 1 to 65535, {EXAMPLES}")
    port = int(port_text)
    if port == 0 and not free_port:
        raise ValueError(f"{setting} is {text!r}: port 0 (any free port) cannot be used here, as nobody would "
                         f"learn the port; choose one from 1 to 65535")
    return host, port


def join(host: str, port: int) -> str:
    """`HOST:PORT`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_host(host: str) -> str:
    """HOST as a server binds it: a wildcard is every IPv4 address (`::` stays itself)."""
    return "0.0.0.0" if host in ("", "*") else host


def dial_host(host: str) -> str:
    """HOST as a client on this machine dials it: a wildcard is loopback."""
    return "::1" if host == "::" else "127.0.0.1" if host in WILDCARDS else host


def advertised(text: str, setting: str) -> str:
    """`HOST:PORT` other machines reach the listening address TEXT of SETTING at: a wildcard is this machine's
    name."""
    host, port = parse(text, setting)
    return join(socket.getfqdn() if host in WILDCARDS else host, port)


def bind(text: str, setting: str, *, free_port: bool = False) -> tuple[str, int]:
    """(host, port) for a server to bind on the address TEXT of SETTING."""
    host, port = parse(text, setting, free_port=free_port)
    return bind_host(host), port


def dial(text: str, setting: str) -> str:
    """`HOST:PORT` a client on this machine can dial for TEXT, the address of SETTING."""
    host, port = parse(text, setting)
    return join(dial_host(host), port)


def zmq_bind(text: str, setting: str, *, free_port: bool = False) -> str:
    """The ZeroMQ endpoint a socket binds for TEXT: `tcp://*:PORT` for a wildcard. With FREE_PORT, ZeroMQ
    picks a port for port 0; `bound_port` reads which."""
    host, port = parse(text, setting, free_port=free_port)
    return f"tcp://{join('*' if host in WILDCARDS and host != '::' else host, port)}"


def bound_port(last_endpoint: bytes) -> int:
    """The port a ZeroMQ socket bound, from its `last_endpoint` (`tcp://HOST:PORT`)."""
    return parse(last_endpoint.decode().removeprefix("tcp://"), "ZeroMQ's endpoint")[1]


def zmq_connect(text: str, setting: str) -> str:
    """The ZeroMQ endpoint a socket connects to for TEXT."""
    return f"tcp://{dial(text, setting)}"


def url(text: str, setting: str) -> str:
    """`http://HOST:PORT` for TEXT, dialled from this machine."""
    return f"http://{dial(text, setting)}"


def _is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


@functools.lru_cache(maxsize=16384)
def _ip(text: str | None):
    """TEXT as an IP address, an IPv4 one seen as `::ffff:a.b.c.d` as itself; None when it is not one.
    Remembered: a gateway checks each replica's URL and node address at every snapshot, and parsing them was
    four fifths of reading one (20,000 replicas, 0.44 s); a fleet has a few thousand addresses."""
    try:
        ip = ipaddress.ip_address((text or "").strip("[]"))
    except ValueError:
        return None
    return ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip


def same_machine(host: str | None, address: str | None) -> bool:
    """Whether HOST, written in a URL, is ADDRESS, a peer's IP as a socket reports it. Both must be IP
    addresses: a name could be pointed anywhere. Loopback matches loopback whatever its form (127.0.0.1,
    ::1): a peer on this machine may be dialled on any of them, and nothing else may be dialled there."""
    ip, peer = _ip(host), _ip(address)
    if ip is None or peer is None:
        return False
    return ip == peer or (ip.is_loopback and peer.is_loopback)


def is_loopback(address: str | None) -> bool:
    """Whether ADDRESS, an IP address as a socket reports it, is one of this machine's loopback ones."""
    ip = _ip(address)
    return ip is not None and ip.is_loopback


def url_host(url: str) -> str | None:
    """The host of an `http://HOST:PORT/...` URL, without brackets; None for anything else."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return None
    authority = rest.split("/", 1)[0]
    if "@" in authority:
        return None  # credentials in an engine's URL: nothing a node has reason to send
    try:
        return parse(authority, "a URL")[0] or None
    except ValueError:
        return None


class AddressList:
    """Addresses and networks (CIDR), parsed once; `contains(ip)` for a client's address."""

    def __init__(self, entries: list[str], setting: str):
        self.networks = []
        for entry in entries:
            try:
                self.networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except (ValueError, TypeError, AttributeError):
                raise ValueError(f"{setting}: {entry!r} is not an address or a network (CIDR), such as "
                                 f"10.0.0.5, 10.0.0.0/8 or fd00::/8") from None

    def __bool__(self) -> bool:
        return bool(self.networks)

    def contains(self, address: str | None) -> bool:
        """Whether ADDRESS (a client's IP, as a server reports it) is in the list; anything that is not an
        IP address is not."""
        ip = _ip(address)
        return ip is not None and any(ip in net for net in self.networks)


def check_listen(value: str, setting: str) -> None:
    """A settings validator: VALUE is an address to bind."""
    parse(value, setting)


def check_listen_free_port(value: str, setting: str) -> None:
    """A settings validator: VALUE is an address to bind, where port 0 picks a free one."""
    parse(value, setting, free_port=True)


def check_dial_or_url(value: str, setting: str) -> None:
    """A settings validator: VALUE is an address to dial, an http(s) URL, or empty for none."""
    if value and not value.startswith(("http://", "https://")):
        parse(value, setting)


def check_dial_or_url_list(value: list, setting: str) -> None:
    """A settings validator: VALUE is a list of addresses to dial or http(s) URLs."""
    for item in value:
        check_dial_or_url(item, setting)


def check_dial_list(value: list, setting: str) -> None:
    """A settings validator: VALUE is a list of addresses to dial."""
    for item in value:
        parse(item, setting)


def check_list(value: list, setting: str) -> None:
    """A settings validator: VALUE is an `AddressList`."""
    AddressList(value, setting)
