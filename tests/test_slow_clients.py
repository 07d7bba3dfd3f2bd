"""Clients that send slowly or not at all: timeouts for the head and the body, and connections per address.

Each test drives a real gateway with raw sockets. Attackers connect from other
loopback addresses (127.0.0.2 and up; all of 127/8 is loopback on Linux), so
the probes from 127.0.0.1 are a different client. Waits are on conditions,
with deadlines generous enough for a busy machine.
"""

from __future__ import annotations

import json
import resource
import selectors
import socket
import statistics
import time

import pytest
from conftest import counted, make_key

from llmgw.addresses import AddressList
from llmgw.gateway.connguard import Connection, Limits, Registry, client_key, settle
from llmgw.gateway.metrics import GatewayMetrics

LOGIN_SLOW_BODY = (b"POST /login HTTP/1.1\r\nHost: gw\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                   b"Content-Length: 1000\r\n\r\nuser=ab")
HEALTH = b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"


def chat_head(key: str, length: int) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


OPENED: list[socket.socket] = []


@pytest.fixture(autouse=True)
def close_sockets(make_gateway):
    """Closes the test's sockets before its gateways stop."""
    yield
    while OPENED:
        OPENED.pop().close()


def connect(gw, source: str = "127.0.0.1") -> socket.socket:
    """A connection to GW from SOURCE, closed after the test."""
    sock = socket.socket()
    OPENED.append(sock)
    sock.bind((source, 0))
    sock.settimeout(30)
    sock.connect(("127.0.0.1", gw.port))
    return sock


def read_response(sock: socket.socket, timeout: float = 30) -> tuple[int | None, dict, bytes]:
    """One response from SOCK: (status, headers, body); status None when the connection closed first."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return None, {}, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed(sock: socket.socket, timeout: float = 30) -> bool:
    """Whether the gateway closes SOCK within TIMEOUT (anything it sends first is read and dropped)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


PROBE_TIMEOUT = 5.0


def health_ms(gw) -> float:
    """Milliseconds /health takes on a new connection from 127.0.0.1; PROBE_TIMEOUT's when it is not answered."""
    t0 = time.perf_counter()
    sock = connect(gw)
    try:
        sock.sendall(HEALTH)
        status, _, _ = read_response(sock, timeout=PROBE_TIMEOUT)
    except TimeoutError:
        return PROBE_TIMEOUT * 1000
    finally:
        sock.close()
    assert status == 200
    return (time.perf_counter() - t0) * 1000


@pytest.fixture
def keyed_gateway(tmp_path, make_gateway):
    """A one-worker gateway with short timeouts and a key for /v1 (the body is read before any routing)."""
    def make(**settings):
        url = f"sqlite:///{tmp_path}/gateway.db"
        key = make_key(url)
        gw = make_gateway(store_url=url, workers=1, **settings)
        return gw, key
    return make


def test_a_silent_body_gets_408_within_the_timeout(keyed_gateway):
    gw, key = keyed_gateway(gateway__body_timeout=1.0, gateway__body_min_rate=100)

    sock = connect(gw)
    t0 = time.monotonic()
    sock.sendall(LOGIN_SLOW_BODY)  # 7 of 1,000 bytes, then nothing
    status, headers, body = read_response(sock)
    waited = time.monotonic() - t0
    assert status == 408, body
    assert headers["connection"] == "close"
    assert b"gateway.body_timeout" in body
    assert 0.9 <= waited < 15
    assert closed(sock, 10)

    sock = connect(gw)
    t0 = time.monotonic()
    sock.sendall(chat_head(key, 1000) + b'{"model": ')
    status, headers, body = read_response(sock)
    waited = time.monotonic() - t0
    assert status == 408, body
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    assert "gateway.body_timeout" in error["message"]
    assert 0.9 <= waited < 15
    assert closed(sock, 10)
    assert "Traceback" not in gw.log()
    assert gw.settled_total('llmgw_client_timeouts_total{phase="body"}') == 2  # the page's and the API's


def test_a_trickled_body_is_cut(keyed_gateway):
    # 2 s, then 100 bytes a second: a byte a second falls behind at once.
    gw, key = keyed_gateway(gateway__body_timeout=2.0, gateway__body_min_rate=100)
    sock = connect(gw)
    sock.sendall(chat_head(key, 1000))
    t0 = time.monotonic()
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sent = 0
    while time.monotonic() - t0 < 30:
        if sel.select(timeout=1.0):  # the gateway answered, or closed
            break
        try:
            sock.send(b" ")
            sent += 1
        except OSError:
            break
    cut_after = time.monotonic() - t0
    status, _, body = read_response(sock)
    assert status == 408, body
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert cut_after < 15 and sent < 15


def test_an_incomplete_head_gets_408_and_a_silent_connection_is_closed(keyed_gateway):
    gw, _ = keyed_gateway(gateway__header_timeout=1.0)

    sock = connect(gw)
    t0 = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Le")
    status, headers, body = read_response(sock)
    assert status == 408 and 0.9 <= time.monotonic() - t0 < 15
    assert headers["content-type"] == "application/json"
    assert "gateway.header_timeout" in json.loads(body)["error"]["message"]

    sock = connect(gw)
    sock.sendall(b"GET /login HTTP/1.1\r\nHost: gw\r\n")
    status, headers, body = read_response(sock)
    assert status == 408 and headers["content-type"].startswith("text/plain")

    sock = connect(gw)  # sends nothing: closed, with nothing written to it
    t0 = time.monotonic()
    assert closed(sock) and 0.9 <= time.monotonic() - t0 < 15
    assert gw.settled_total('llmgw_client_timeouts_total{phase="head"}') == 2  # the silent one got no 408


def test_an_idle_kept_alive_connection_waits_longer_than_a_head(keyed_gateway):
    """Between requests the keep-alive bound applies (75 s), not the head's."""
    gw, _ = keyed_gateway(gateway__header_timeout=1.0)
    sock = connect(gw)
    sock.sendall(HEALTH)
    assert read_response(sock)[0] == 200
    sock.settimeout(2.5)
    with pytest.raises(TimeoutError):  # still open after twice the head's timeout
        sock.recv(1)
    sock.sendall(HEALTH)
    assert read_response(sock)[0] == 200


def test_a_stopping_gateway_closes_idle_connections_at_once(keyed_gateway):
    """An idle kept-alive connection does not hold a stopping worker to its graceful timeout (10 s here)."""
    gw, _ = keyed_gateway()
    sock = connect(gw)
    sock.sendall(HEALTH)
    assert read_response(sock)[0] == 200
    t0 = time.monotonic()
    assert gw.stop() == 0
    assert time.monotonic() - t0 < 6
    assert closed(sock, 1)


def test_idle_connections_make_room_for_their_address_and_busy_ones_do_not(keyed_gateway):
    # 20 connections a worker: one address holds at most 10.
    gw, _ = keyed_gateway(gateway__worker_connections=20, gateway__max_connections_per_address=100)
    kept = []
    for _ in range(10):
        sock = connect(gw, "127.0.0.3")
        sock.sendall(HEALTH)
        assert read_response(sock)[0] == 200
        kept.append(sock)
    newcomer = connect(gw, "127.0.0.3")  # the longest-idle one is closed for it
    newcomer.sendall(HEALTH)
    assert read_response(newcomer)[0] == 200
    assert closed(kept[0], 10)

    # Ten connections in the middle of a head are not idle: the eleventh is refused.
    busy = [connect(gw, "127.0.0.5") for _ in range(10)]
    for sock in busy:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
    refused = connect(gw, "127.0.0.5")
    status, _, body = read_response(refused)
    assert status == 429 and b"gateway.max_connections_per_address" in body
    assert closed(refused, 10)
    assert health_ms(gw) < PROBE_TIMEOUT * 1000  # another address is served
    assert gw.settled_total("llmgw_client_connections_refused_total") == 1  # a closed idle one is no refusal


def test_a_pipelined_request_makes_its_connection_busy(keyed_gateway):
    """A request that came in with the one before it is read without a wait on the socket: its connection
    was left counted idle, and closed under it to make room for a newcomer."""
    gw, _ = keyed_gateway(gateway__worker_connections=4, gateway__max_connections_per_address=100)  # 2 an address
    pipelined = connect(gw, "127.0.0.9")
    pipelined.sendall(HEALTH + LOGIN_SLOW_BODY)  # the login's body is 6 bytes of 1,000: it stays busy
    assert read_response(pipelined)[0] == 200
    connect(gw, "127.0.0.9").sendall(b"GET /health HTTP/1.1\r\n")  # busy too, in its head
    status, _, body = read_response(connect(gw, "127.0.0.9"))
    assert status == 429 and b"gateway.max_connections_per_address" in body
    assert not closed(pipelined, 1)


def test_a_trusted_proxy_is_not_bounded(keyed_gateway):
    gw, _ = keyed_gateway(gateway__worker_connections=20, gateway__trusted_proxies=["127.0.0.4"])
    held = [connect(gw, "127.0.0.4") for _ in range(15)]
    for sock in held:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
    last = held[-1]
    last.sendall(b"\r\n")
    assert read_response(last)[0] == 200


def test_an_address_is_an_ip_or_an_ipv6_64_and_trusted_proxies_are_not_counted():
    exempt = AddressList(["10.0.0.0/8"], "gateway.trusted_proxies")
    assert client_key(("10.1.2.3", 5000), exempt) is None
    assert client_key(("::ffff:10.1.2.3", 5000, 0, 0), exempt) is None
    assert client_key(("192.0.2.1", 5000), exempt) == "192.0.2.1"
    assert client_key(("::ffff:192.0.2.1", 5000, 0, 0), exempt) == "192.0.2.1"
    assert (client_key(("2001:db8:1:2:aaaa::1", 5000, 0, 0), exempt)
            == client_key(("2001:db8:1:2:bbbb::9", 6000, 0, 0), exempt) == "2001:db8:1:2::/64")
    assert client_key("", exempt) is None  # a Unix socket


def test_the_registry_closes_the_longest_idle_connection_before_it_refuses():
    settings = {"gateway.header_timeout": 20.0, "gateway.body_timeout": 20.0, "gateway.body_min_rate": 500,
                "gateway.send_timeout": 60.0,
                "gateway.max_connections_per_address": 3, "gateway.trusted_proxies": []}
    limits = Limits(settings, keepalive=75, worker_connections=100)
    registry = Registry(limits)
    registry.metrics = GatewayMetrics()
    a, b = socket.socketpair()
    OPENED.extend([a, b])

    def open_one() -> Connection | None:
        return Connection(b, "192.0.2.1", registry, limits) if registry.admit("192.0.2.1") else None

    first, second, third = open_one(), open_one(), open_one()
    second._rest()
    first._rest()  # idle after second: second has idled longest
    fourth = open_one()
    assert fourth is not None and not second.counted and first.counted
    assert registry.open["192.0.2.1"] == 3
    first.registry.busy(first)
    assert open_one() is None  # none idle: refused
    assert counted(registry.metrics, registry.metrics.connections_refused) == 1
    for conn in (first, third, fourth):
        registry.release(conn)
    assert registry.open == {} and registry.total == 0 and not registry.idle and not registry.idle_by_key
    assert Limits({**settings, "gateway.max_connections_per_address": 5000}, 75, 100).per_address == 50


ATTACKERS = 5000


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def test_a_worker_reads_gunicorns_settings_once():
    from gunicorn.config import Config

    cfg = Config()
    cfg.set("keepalive", 7)
    settle(cfg)
    asked = []
    type(cfg).__getattr__, real = (lambda self, name: asked.append(name)), type(cfg).__getattr__
    try:
        assert cfg.keepalive == 7 and cfg.limit_request_line == 4094 and cfg.forwarded_allow_ips
        assert not asked  # none was looked up through gunicorn's __getattr__
    finally:
        type(cfg).__getattr__ = real


def test_5000_slow_connections_from_one_address_leave_health_answering(make_gateway, tmp_path):
    """One worker with the default settings (4,096 connections, timeouts of 20 s): 5,000 connections from
    127.0.0.2, silent, stopped mid-head, or stopped mid-body, each of the kinds in turn. The worker keeps
    at most 2,048 of them (half its connections) and refuses the rest, so /health from 127.0.0.1 is
    answered: ten probes while they are held, each on a new connection with a deadline of 5 s, median under
    100 ms and none missing its deadline.

    Before the bound, 4,096 of them filled the worker and /health was never answered."""
    _raise_fd_limit(ATTACKERS + 1024)
    gw = make_gateway(workers=1)
    bits = [b"", b"GET /health HTTP/1.1\r\nHost: gw\r\nX-", LOGIN_SLOW_BODY,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 500\r\n\r\n{"]
    sel = selectors.DefaultSelector()
    socks = []
    t0 = time.monotonic()
    try:
        for i in range(ATTACKERS):
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))
            sock.settimeout(30)
            sock.connect(("127.0.0.1", gw.port))
            if bits[i % 4]:
                sock.sendall(bits[i % 4])
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
            socks.append(sock)
        opened = time.monotonic() - t0

        def collect(timeout: float) -> None:
            for key, _ in sel.select(timeout=timeout):
                try:
                    more = key.fileobj.recv(65536)
                except (ConnectionResetError, BlockingIOError):
                    more = b""
                if not more:
                    sel.unregister(key.fileobj)
                    ended.add(key.fileobj)

        # Wait until the worker has taken each in: held, or refused and closed.
        ended: set[socket.socket] = set()
        deadline = time.monotonic() + 30
        while len(ended) < ATTACKERS - 2048 and time.monotonic() < deadline:
            collect(0.5)
        taken_in = time.monotonic() - t0

        probes = [health_ms(gw) for _ in range(10)]
        collect(0)
        held = ATTACKERS - len(ended)
        print(f"opened {ATTACKERS} in {opened:.2f} s, taken in after {taken_in:.2f} s, {held} held; "
              f"/health ms: {sorted(round(p, 1) for p in probes)}")
        assert statistics.median(probes) < 100
        assert max(probes) < PROBE_TIMEOUT * 1000
        # Held while the probes ran (they time out after 20 s), and no more than the bound.
        assert held == 2048, f"{held} of {ATTACKERS} held after the probes"
    finally:
        sel.close()
        for sock in socks:
            sock.close()
    assert "Traceback" not in gw.log()
