"""Clients that send slowly, or not at all, cost a worker nothing for long.

gunicorn's gevent worker waits as long as a client cares to take: a request
head or body that never completes held its connection for good, and enough of
them filled a worker. `GuardedWorker` (gunicorn's `worker_class`) hands
gunicorn each accepted socket wrapped in a `Connection`, whose `recv` bounds
every wait by the phase the connection is in:

- a request head must arrive whole within `gateway.header_timeout` of the
  connection's start, or of the first byte of a later request: past it, 408
  (a connection that sent nothing at all is closed without one);
- a body has `gateway.body_timeout`, plus a second for every
  `gateway.body_min_rate` bytes that arrive, so a large body at a fair rate
  passes and a trickle is cut: `BodyTimeout` is raised in whoever reads it
  (the proxy answers OpenAI's 408, the pages werkzeug's);
- between requests a connection may idle for gunicorn's `keepalive`.

Every send to a client waits at most `gateway.send_timeout` for room each time it waits
(llmgw/gateway/sockio.py): one that stops reading its answer is closed, and a stream's
engine stops with it. A connection is served by llmgw/gateway/fastpath.py while its requests
are plain `/v1` ones, then by gunicorn's parser and this worker's `handle_request`.

One address (an IPv6 /64) holds at most `gateway.max_connections_per_address`
connections in one worker. A new connection beyond it first closes the
address's longest-idle kept-alive connection, so idle connections never hold
a client's slots against its own new ones; only when none is idle is it
refused (429, then closed). Each refusal, each 408 and each send timeout is counted
in the worker's metrics (`llmgw_client_connections_refused_total`,
`llmgw_client_timeouts_total`). Likewise, a worker whose connections are all taken
closes its longest-idle one to keep room, and a stopping worker closes every
idle one at once rather than wait for it to its graceful timeout. Addresses in
`gateway.trusted_proxies` are not bounded: every client behind a proxy shares
its address.

Concurrency: gevent, one greenlet per connection in one worker process; the
`Registry` is touched only from those greenlets, never across processes, so
the bound is per worker.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import socket
import time

import gevent
from gunicorn import util
from gunicorn.http import errors as http_errors
from gunicorn.http import wsgi
from gunicorn.http.body import ChunkedReader, LengthReader
from gunicorn.http.errors import ParseException
from gunicorn.workers.base_async import AsyncWorker
from gunicorn.workers.ggevent import GeventWorker
from werkzeug.exceptions import RequestTimeout

from llmgw.addresses import AddressList
from llmgw.gateway import httpout, routes, sockio
from llmgw.gateway.dialect import OPENAI
from llmgw.gateway.errors import REASONS, ApiError
from llmgw.gateway.fastpath import Body, FastPath

log = logging.getLogger("llmgw.connguard")

HEAD, BODY, IDLE, SEND = "head", "body", "idle", "send"
HEAD_KEPT = 256  # bytes of a request head kept to tell, on a timeout, whether it was for /v1
WARN_EVERY = 60.0  # seconds between two warnings about refused connections
WRITE_TIMEOUT = 1.0  # seconds to hand a refusal or a 408 to a client that may not read it
# gunicorn's parse errors that are the client's, with the status each gets (400 for the rest).
CLIENT_ERRORS = ((http_errors.LimitRequestLine, 414), (http_errors.LimitRequestHeaders, 431),
                 (http_errors.ExpectationFailed, 417), (http_errors.ForbiddenProxyRequest, 403))
# What gunicorn raises for the app's own mistakes (a bad response header, its configuration): a 500, as it says.
SERVERS_FAULT = (http_errors.InvalidResponseHeader, http_errors.InvalidResponseHeaderName,
                 http_errors.ConfigurationProblem)


class HeadTimeout(Exception):
    """A request head that did not arrive whole in time; answered 408 by the worker."""

    def __init__(self, head: bytes, limits: "Limits"):
        super().__init__(f"request head incomplete after {limits.header:g} s")
        self.head = head


class BodyTimeout(RequestTimeout):
    """A request body that arrived too slowly. Raised in whatever reads `wsgi.input`; as a werkzeug
    `RequestTimeout` the pages answer it with 408 by themselves, and the proxy turns it into OpenAI's."""

    def __init__(self, limits: "Limits", received: int):
        rate = f", then at least {limits.rate} bytes a second (gateway.body_min_rate)" if limits.rate else ""
        super().__init__(f"The request body arrived too slowly: a body must arrive within {limits.body:g} s "
                         f"(gateway.body_timeout){rate}. Send the whole body at once.")
        self.received = received


class Limits:
    """The timeouts and the bound, read once from the configuration."""

    def __init__(self, cfg, keepalive: float, worker_connections: int):
        self.header = float(cfg["gateway.header_timeout"])
        self.body = float(cfg["gateway.body_timeout"])
        self.rate = int(cfg["gateway.body_min_rate"])
        self.send = float(cfg["gateway.send_timeout"])
        self.per_byte = 1.0 / self.rate if self.rate else 0.0
        self.idle = float(keepalive)
        bound = int(cfg["gateway.max_connections_per_address"])
        # One address never holds more than half a worker, whatever the setting says.
        self.per_address = min(bound, max(1, worker_connections // 2)) if bound else 0
        self.capacity = worker_connections
        self.exempt = AddressList(cfg["gateway.trusted_proxies"], "gateway.trusted_proxies")


def client_key(addr, exempt: AddressList) -> str | None:
    """What ADDR (a peer address as accepted) counts against: its IP, its IPv6 /64, or None when it is
    not bounded (a trusted proxy, a Unix socket)."""
    if not isinstance(addr, tuple) or not addr:
        return None
    host = addr[0]
    if exempt and exempt.contains(host):
        return None
    if ":" not in host:
        return host
    try:
        ip = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.ipv4_mapped:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))


def body_done(req) -> bool:
    """Whether the body of REQ, a gunicorn request or the fast path's body, has been read to its end."""
    if type(req) is Body:
        return req.left == 0
    reader = getattr(getattr(req, "body", None), "reader", None)
    if isinstance(reader, LengthReader):
        return reader.length == 0
    if isinstance(reader, ChunkedReader):
        return reader.parser is None
    return True


class Registry:
    """One worker's open connections: how many each address holds, and which are idle (oldest first)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.open: dict[str, int] = {}
        self.total = 0
        self.idle: dict[Connection, None] = {}  # every idle connection, longest idle first
        self.idle_by_key: dict[str, dict[Connection, None]] = {}
        self.refused = 0
        self.warned = 0.0
        # The worker's GatewayMetrics, set once its app is loaded (GuardedWorker.load_wsgi), before any
        # connection is accepted.
        self.metrics = None

    def admit(self, key: str | None) -> bool:
        """Count a new connection from KEY, making room by closing an idle one; False: refuse it."""
        bound = self.limits.per_address
        if key is not None and bound:
            held = self.open.get(key, 0)
            if held >= bound:
                idle = self.idle_by_key.get(key)
                if not idle:
                    self._refused(key)
                    return False
                next(iter(idle)).evict()
            self.open[key] = self.open.get(key, 0) + 1
        self.total += 1
        if self.total >= self.limits.capacity and self.idle:
            next(iter(self.idle)).evict()
        return True

    def release(self, conn: Connection) -> None:
        if not conn.counted:
            return
        conn.counted = False
        self.busy(conn)
        self.total -= 1
        key = conn.key
        if key is not None and self.limits.per_address:
            held = self.open.get(key, 1) - 1
            if held > 0:
                self.open[key] = held
            else:
                self.open.pop(key, None)

    def rest(self, conn: Connection) -> None:
        self.idle[conn] = None
        key = conn.key
        if key is not None:
            self.idle_by_key.setdefault(key, {})[conn] = None

    def close_idle(self) -> None:
        """Close every idle connection (the worker is stopping: they would hold it to its graceful timeout)."""
        while self.idle:
            next(iter(self.idle)).evict()

    def busy(self, conn: Connection) -> None:
        if conn not in self.idle:
            return
        del self.idle[conn]
        key = conn.key
        if key is not None:
            idle = self.idle_by_key[key]
            del idle[conn]
            if not idle:
                del self.idle_by_key[key]

    def _refused(self, key: str) -> None:
        self.metrics.connections_refused.inc()
        self.refused += 1
        now = time.monotonic()
        if now - self.warned >= WARN_EVERY:
            log.warning("refused %d connection(s) from %s and others beyond %d open from one address "
                        "(gateway.max_connections_per_address) in the last %.0f s", self.refused, key,
                        self.limits.per_address, min(now - self.warned, WARN_EVERY))
            self.warned = now
            self.refused = 0


class Connection:
    """An accepted socket as gunicorn sees it, whose reads are bounded by the phase it is in.

    Everything but `recv` is the socket's own. Reads with flags (the proxy's `MSG_PEEK` that watches
    for a client leaving a stream) are passed through untouched."""

    def __init__(self, sock, key: str | None, registry: Registry, limits: Limits):
        self.sock = sock
        self.key = key
        self.registry = registry
        self.limits = limits
        self.counted = True
        # What gunicorn calls while answering, bound here rather than found through __getattr__; a send waits for
        # room at most the socket's timeout (gateway.send_timeout) each time it waits (llmgw/gateway/sockio.py).
        self.sendall = functools.partial(sockio.send_all, sock)
        self.send = sock.send
        self.fileno = sock.fileno
        self.phase = HEAD
        self.since = time.monotonic()
        self.deadline = self.since + limits.header
        self.head = b""
        self.req = None
        self.received = 0
        self.answered = False
        self.pending = b""  # what llmgw/gateway/fastpath.py read and left to gunicorn, read first

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def recv(self, size: int, flags: int = 0) -> bytes:
        if flags:
            return self.sock.recv(size, flags)
        if self.pending:
            data, self.pending = self.pending[:size], self.pending[size:]
            return data
        phase = self.phase
        if phase is BODY:
            if self.answered and body_done(self.req):
                self._rest()
                phase = IDLE
                deadline = self.deadline
            else:
                deadline = self.since + self.limits.body + self.received * self.limits.per_byte
        else:
            deadline = self.deadline
        try:
            data = sockio.recv(self.sock, size, deadline - time.monotonic())
        except TimeoutError:
            return self._late(phase)
        if phase is BODY:
            self.received += len(data)
        elif phase is HEAD:
            if len(self.head) < HEAD_KEPT:
                self.head += data[:HEAD_KEPT]
        elif data:  # IDLE: the next request has begun
            self.begun(data)
        return data

    def begun(self, data: bytes) -> None:
        """The next request has begun with DATA: its head must be whole within the header timeout from now."""
        self.registry.busy(self)
        self.phase = HEAD
        self.deadline = time.monotonic() + self.limits.header
        self.head = data[:HEAD_KEPT]

    def _late(self, phase: str) -> bytes:
        """The wait in PHASE ran out: b"" (an end of stream gunicorn closes quietly) or an exception."""
        if phase is HEAD and self.head:
            self.registry.metrics.client_timeouts.labels(HEAD).inc()
            raise HeadTimeout(self.head, self.limits)
        if phase is BODY:
            if self.answered:
                raise TimeoutError("the rest of an unread body came too slowly")  # gunicorn closes quietly
            if self.req is not None:
                self.req.must_close = True
            self.registry.metrics.client_timeouts.labels(BODY).inc()
            raise BodyTimeout(self.limits, self.received)
        return b""

    def begin(self, req) -> None:
        """REQ's head is in: its body's clock starts. A request that came in with the one before it (pipelined)
        was read without a wait on the socket, so the connection is taken off the idle ones here, not in `recv`."""
        self.registry.busy(self)
        self.phase = BODY
        self.req = req
        self.since = time.monotonic()
        self.received = 0
        self.answered = False

    def end(self) -> None:
        """REQ has been answered: idle now, unless what it sent is still to be drained."""
        if body_done(self.req):
            self._rest()
        else:
            self.answered = True

    def _rest(self) -> None:
        self.phase = IDLE
        self.req = None
        self.answered = False  # a malformed next request is answered (a 400), not closed on as a drained body
        self.deadline = time.monotonic() + self.limits.idle
        if self.counted:
            self.registry.rest(self)

    def evict(self) -> None:
        """Close this idle connection to make room: its reader sees the end of the stream."""
        self.registry.release(self)
        with contextlib.suppress(OSError, AttributeError):
            # The system socket's shutdown under gevent's: gevent's own would raise EBADF in the greenlet
            # waiting on it, where gunicorn logs it as an error.
            self.sock._sock.shutdown(socket.SHUT_RDWR)


def early_response(status: int, head: bytes, message: str, code: str) -> bytes:
    """A whole HTTP response for a request that never reached the app: the error object (CODE) of the API
    HEAD's /v1 path speaks (OpenAI's unless it is another's), plain text otherwise."""
    parts = head.split(b" ", 2)
    if len(parts) > 1 and parts[1].startswith(b"/v1/"):
        path = parts[1].split(b"?", 1)[0].decode("latin-1")
        _, dialect = routes.ROUTES.get(path) or (None, OPENAI)
        body, headers = dialect.error(ApiError(status, message, code))
        kind = dict(headers)["Content-Type"]
    else:
        body, kind = message.encode() + b"\n", "text/plain; charset=utf-8"
    return (f"HTTP/1.1 {REASONS[status]}\r\nConnection: close\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def send_quietly(sock, data: bytes) -> None:
    """Write DATA to gevent socket SOCK, giving up after WRITE_TIMEOUT on a client that does not read."""
    sock.timeout = WRITE_TIMEOUT
    with contextlib.suppress(OSError):
        sock.sendall(data)


def settle(cfg) -> None:
    """Make each of gunicorn's settings an attribute of CFG, read as any attribute is.

    gunicorn finds a setting through `Config.__getattr__` and the setting's `get`, and reads a dozen a
    request while parsing, building the environ and answering: 3.5 to 5.3% of a plain request's CPU. A worker's
    configuration is fixed once its start's hooks have run (a reload starts new workers), so each value is
    read once then; a `cfg.set` after it would not be seen. `__getattr__` is only asked for what an instance
    does not hold."""
    for name, setting in cfg.settings.items():
        cfg.__dict__[name] = setting.get()


class GuardedWorker(GeventWorker):
    """gunicorn's gevent worker, with each connection's reads bounded and each address's connections counted."""

    def init_process(self):
        cfg = self.app.llmgw_cfg
        self.limits = Limits(cfg, self.cfg.keepalive, self.worker_connections)
        self.registry = Registry(self.limits)
        super().init_process()

    def load_wsgi(self):
        super().load_wsgi()
        # The counters the app made in this worker (prometheus-client's multi-process files are per process).
        self.registry.metrics = self.wsgi.runtime.metrics
        self.fast = FastPath(self)

    def run(self):
        # Once every hook has run: post_worker_init sets the worker's own graceful_timeout (gateway/server.py),
        # and a copy taken before it drained for the master's, which kills the worker before it writes its usage.
        settle(self.cfg)
        super().run()

    def handle(self, listener, client, addr):
        # Every send to the client waits at most gateway.send_timeout for room: one that stopped reading its
        # stream held a greenlet, and the engine generating for it, for as long as it liked.
        client.settimeout(self.limits.send)
        key = client_key(addr, self.limits.exempt)
        if not self.registry.admit(key):
            self._refuse(client)
            return
        conn = Connection(client, key, self.registry, self.limits)
        try:
            done = True
            try:
                done = self.fast.serve(conn, addr, listener.getsockname())
            finally:
                if done:
                    util.close(conn)
            if not done:
                # The rest is gunicorn's (GeventWorker.handle only sets the socket blocking, done above).
                AsyncWorker.handle(self, listener, conn, addr)
        finally:
            self.registry.release(conn)

    def _refuse(self, client) -> None:
        message = (f"Too many connections from your address (at most {self.limits.per_address} at once, "
                   "gateway.max_connections_per_address). Reuse the ones you have.")
        send_quietly(client, early_response(429, b"", message, "too_many_connections"))
        with contextlib.suppress(OSError):
            client.close()

    def notify(self):
        super().notify()
        if not self.alive:
            # Stopping: gunicorn closes a connection after the request it is serving; close the idle ones now.
            self.registry.close_idle()

    def timeout_ctx(self):
        # Every wait for a request is bounded by the connection's recv (idle, then head).
        return contextlib.nullcontext()

    def handle_request(self, listener_name, req, sock, addr):
        sock.begin(req)
        try:
            self._serve(listener_name, req, sock, addr)
        except (gevent.GreenletExit, SystemExit):
            pass  # as gunicorn's gevent worker: a killed request ends its connection quietly
        finally:
            sock.end()

    def _serve(self, listener_name, req, sock, addr) -> None:
        """gunicorn's AsyncWorker.handle_request with llmgw's response (httpout.py: the head goes out with the first
        body bytes), and without what the gateway's configuration never sets (server.py): no access log (its
        clock read twice a request), no pre_request or post_request hook."""
        resp, environ = wsgi.create(req, sock, addr, listener_name, self.cfg, response_class=httpout.Response)
        environ["wsgi.multithread"] = True
        self.count_request()
        if not self.alive or not self.cfg.keepalive:
            resp.force_close()
        # OSError and a failure before the head was fixed go up as they come: handle() tells a client that
        # left from a fault, and handle_error answers the failure.
        try:
            httpout.answer(self.wsgi, environ, resp, sock)
        except sockio.SendTimeout:
            self.send_timed_out(addr)
            raise StopIteration() from None  # a client that did not read its answer: closed, as one that left
        except httpout.AnswerBroken:
            raise StopIteration() from None
        if resp.should_close():
            raise StopIteration()

    def count_request(self) -> None:
        """One more request: past gunicorn's max_requests, the worker restarts once the request is answered."""
        self.nr += 1
        if self.nr >= self.max_requests and self.alive:
            self.log.info("Autorestarting worker after current request.")
            self.alive = False

    def send_timed_out(self, addr) -> None:
        """The client at ADDR did not make room for its answer within gateway.send_timeout: its connection is
        closed (a stream's engine stops with it)."""
        self.registry.metrics.client_timeouts.labels(SEND).inc()
        log.debug("closed the connection of %s: it did not read its answer (gateway.send_timeout)", addr)

    def handle_error(self, req, client, addr, exc):
        if isinstance(exc, HeadTimeout):
            log.debug("408 to %s: %s", addr, exc)
            message = (f"The request's head did not arrive whole within {self.limits.header:g} s "
                       "(gateway.header_timeout). Send the request line and headers at once.")
            send_quietly(client.sock, early_response(408, exc.head, message, "request_timeout"))
            return
        if isinstance(exc, BodyTimeout):
            # Raised outside the app (it never read the body, or let the exception out).
            log.debug("408 to %s: %s", addr, exc.description)
            if not client.answered:
                head = f"{req.method} {req.path} ".encode() if req is not None else b""
                send_quietly(client.sock, early_response(408, head, exc.description, "request_timeout"))
            return
        if isinstance(exc, ParseException) and not isinstance(exc, SERVERS_FAULT):
            # Not HTTP as gunicorn reads it. gunicorn would answer an HTML page, and 501 to a transfer coding
            # it does not know; a client that sent /v1 gets OpenAI's error object, and every such request a 4xx.
            status = next((code for kind, code in CLIENT_ERRORS if isinstance(exc, kind)), 400)
            log.debug("%s to %s: %s", status, addr, exc)
            if not client.answered:
                send_quietly(client.sock, early_response(status, client.head, f"The request is not HTTP this "
                                                                              f"gateway reads: {exc}.", "invalid_request"))
            return
        super().handle_error(req, client, addr, exc)
