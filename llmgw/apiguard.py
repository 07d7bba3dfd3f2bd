"""What keeps strangers out of llmgw's own HTTP management APIs: the controller's admin API and the mirror's.

Both listen on loopback (or a private network) and trust whoever reaches them
a little. A web page open in an operator's browser can reach loopback too: it
points a name it controls at 127.0.0.1 (DNS rebinding), and its requests then
arrive from this machine, carrying that name in `Host`. `HostCheck` answers
only to the addresses an API listens on and the names an operator lists, so
such a request is refused whatever else it carries. Both also want a token
that no page can know and no other local user can read: the admin API's in
`TOKEN_FILE` beside the controller's CURVE keys, the mirror's in
`mirror.token_file` (`ensure_token` makes either). `json_body` reads what
either is sent, bounded in size and depth.

Used by the servers (llmgw/control/adminapi.py, llmgw/mirror/server.py) and,
for the tokens' files, by llmgw/apiclient.py. Imports llmgw.addresses and
llmgw.filemodes only.
"""

from __future__ import annotations

import fcntl
import hmac
import ipaddress
import json
import os
import secrets

from llmgw import addresses, filemodes

TOKEN_FILE = "admin.token"
# The mirror's token, in a directory of its own inside mirror.dir: the one place its systemd unit may write,
# and a name (leading dot) its file server never serves. The directory is 0700 whatever mirror.dir's mode.
MIRROR_TOKEN_FILE = os.path.join(".keys", "api.token")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# A model's table or a fetch order is a few kilobytes; nothing sent here needs more.
MAX_BODY = 1 << 20


def token_path(keys_dir: str) -> str:
    """Where the controller keeps the admin API's token: KEYS_DIR/admin.token."""
    return os.path.join(keys_dir, TOKEN_FILE)


def mirror_token_path(cfg) -> str:
    """Where the mirror keeps its management API's token: `mirror.token_file`, or .keys/api.token in
    `mirror.dir`. Absolute, so a refusal names the file whatever the reader's working directory."""
    return os.path.abspath(cfg["mirror.token_file"] or os.path.join(cfg["mirror.dir"], MIRROR_TOKEN_FILE))


def ensure_token(path: str) -> str:
    """The token kept in PATH, made on first use: the file 0600 from the moment it exists, in a directory made
    0700. An empty file counts as none (an empty token would let an empty `Bearer` in). Refused
    (filemodes.LooseFiles, with the chmod that fixes it) while others may read the file or its directory: a
    token any local user can read keeps nobody out."""
    folder = os.path.dirname(os.path.abspath(path))
    filemodes.make_private_dir(folder)
    filemodes.create_private(path)
    filemodes.refuse_loose({folder: filemodes.OTHERS, path: filemodes.OTHERS})
    # Made by another user before this one could (in a directory they could write), the token is theirs. Root
    # may use one the service's own user keeps (`llmgw init` hands its directories to it): the owner of the
    # directory the token's directory is in.
    trusted = {os.geteuid()} | ({os.stat(os.path.dirname(folder)).st_uid} if os.geteuid() == 0 else set())
    for held in (folder, path):
        owner = os.lstat(held).st_uid
        if owner not in trusted:
            raise filemodes.LooseFiles(f"{held} belongs to another user (uid {owner}), so a token there is not this "
                                       f"one's secret: remove it, and start again as the user it is for")
    with os.fdopen(os.open(path, os.O_RDWR | os.O_NOFOLLOW), "r+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # two first starts at once must agree on one token
        token = f.read().strip()
        if not token:
            token = secrets.token_urlsafe(32)
            f.write(token + "\n")
    return token


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an `Authorization` header carries TOKEN as a bearer token, compared in constant time.
    An empty TOKEN matches nothing."""
    scheme, _, given = (authorization or "").partition(" ")
    # compare_digest takes str only when it is ASCII; a header is whatever the client sent.
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def json_body(request):
    """A management request's body, parsed: None when it is missing, larger than MAX_BODY, not JSON, or
    nested past what the parser can follow (Flask's get_json answered that with a 500)."""
    if (request.content_length or 0) > MAX_BODY:
        return None
    try:
        return json.loads(request.stream.read(MAX_BODY + 1))
    except (ValueError, RecursionError):
        return None


def _split(address: str) -> tuple[str, int | None]:
    """(host, port) of a `Host` header, `HOST:PORT`, `[V6]:PORT` or a bare host; the host lower-cased and without
    brackets. Not `addresses.parse`: a header may omit the port, and whatever a client sends must not raise."""
    host, port = address.strip().lower(), None
    if host.startswith("["):
        host, _, rest = host[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else None
    elif host.count(":") == 1:
        host, _, port_text = host.partition(":")
    else:
        port_text = None
    if port_text is not None:
        port = int(port_text) if port_text.isdigit() else -1  # a port that can match no listener
    return host, port


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_loopback(name: str) -> bool:
    return name == "localhost" or (is_ip(name) and ipaddress.ip_address(name).is_loopback)


class HostCheck:
    """The `Host` values an API listening on LISTEN answers to.

    - its own address at its port; for a loopback listener also localhost, 127.0.0.1 and [::1];
    - for a wildcard listener (`:8082`, `0.0.0.0:8082`), any IP address or localhost at its port: a
      request by address cannot be a rebinding, which needs a name the attacker controls;
    - any of NAMES, at any port (a proxy in front may listen on 443): the setting SETTING lists them.
    """

    def __init__(self, listen: str, names: list[str], setting: str):
        host, self.port = addresses.parse(listen, "the API's listen address")
        self.host = "" if host in addresses.WILDCARDS else host.lower()
        self.names = {n.strip().lower() for n in names if n.strip()}
        self.setting = setting

    def allows(self, header: str | None) -> bool:
        if not header:
            return False
        name, port = _split(header)
        if name in self.names:
            return True
        if (port or 80) != self.port:
            return False
        if not self.host:
            return name == "localhost" or is_ip(name)
        return name == self.host or (_is_loopback(self.host) and name in LOOPBACK_NAMES)

    def refusal(self, header: str | None) -> str | None:
        """None when HEADER (the request's `Host`) is allowed; else the sentence that refuses it."""
        if self.allows(header):
            return None
        own = ("any of this machine's addresses" if not self.host
               else "localhost, 127.0.0.1 or [::1]" if _is_loopback(self.host) else self.host)
        listed = f", or to {', '.join(sorted(self.names))} ({self.setting})" if self.names else ""
        return (f"this API answers to {own} on port {self.port}{listed}, not to Host {header or '(none)'!r}: "
                f"a web page may be trying to reach it through DNS rebinding. If you reach it by that name "
                f"(a proxy, a DNS name), add the name to {self.setting}.")
