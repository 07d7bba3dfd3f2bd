"""A small pooled HTTP/1.1 client for talking to engines, with a timeout per phase.

Why not `requests` or `urllib3`: on this path every request pays for the
client, and measured here `requests` costs about a millisecond more per
request than `urllib3`, and `urllib3` about half a millisecond more than this
(proxy lookups in the environment, header objects, retries we do ourselves).
The engines are ours and speak plain HTTP/1.1: a status line, headers, and a
body framed by Content-Length, by chunks, or by closing. That is all this
reads.

Phases, each with its own limit: connecting, waiting for the response to
start (`first_byte`: its head, and then its first body byte), silence between
two pieces of a streamed body (`idle`), and the whole exchange (`deadline`),
which each read is held to: no sender stretches it by sending slowly. A
streaming engine sends its head at once and its first event only once it has
read the prompt: a coding agent's 10,000 tokens took llama.cpp on two CPU cores
over a minute, and were cut off at `idle` as if it had stalled mid-answer. Closing a `Response` from another greenlet
wakes a reader blocked on it; that is how a client's disconnect ends the
engine's work. The pages' history queries to Prometheus go through it too,
for that deadline (llmgw/web/prometheus.py).
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
import time
from urllib.parse import urlsplit

from llmgw.gateway import sockio

HEAD_LIMIT = 64 * 1024
RECV = 65536


class UpstreamError(Exception):
    """An exchange with an engine that failed. `phase` says where: connect,
    first_byte, idle, total, closed (the engine hung up), protocol; or what the
    engine answered: status (a 5xx), busy (a 429)."""

    def __init__(self, phase: str, message: str, nothing_received: bool = False, retry_after: int | None = None):
        super().__init__(message)
        self.phase = phase
        self.retry_after = retry_after  # for "busy": what the engine asked for
        # Set when a kept-alive connection turned out dead before any answer:
        # then sending again on a fresh one is safe.
        self.nothing_received = nothing_received


def _chunk_size(line: bytes) -> int | None:
    """The size a chunk's size line gives (extensions ignored); None where it gives none."""
    try:
        return int(line.split(b";", 1)[0], 16)
    except ValueError:
        return None


class Target:
    """Where an engine listens, parsed once per replica rather than per request."""

    __slots__ = ("host", "port", "tls", "base_path", "host_header", "key", "auth", "family")

    def __init__(self, url: str, api_key: str | None = None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.base_path = parts.path.rstrip("/")
        self.host_header = parts.netloc.encode("idna")
        self.key = (self.host, self.port, self.tls)
        # The replica's key, sent on every request and probe: engines answer nobody without it.
        self.auth = b"Authorization: Bearer " + api_key.encode() + b"\r\n" if api_key else b""
        # An address needs no lookup: gevent sends every lookup, numeric ones too, through its thread pool,
        # and that detour was the deepest call of a request (see `Pool._connect`).
        try:
            self.family = socket.AF_INET6 if ipaddress.ip_address(self.host).version == 6 else socket.AF_INET
        except ValueError:
            self.family = None


class Connection:
    __slots__ = ("sock", "buf", "reused")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""
        self.reused = False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Cancel:
    """Lets another greenlet end an exchange whose client has left, before or after its answer began to come:
    `abort` marks it cancelled and closes the connection it is on (the pool sets `conn`), which wakes its
    reader; the exchange then fails with phase "cancelled". Whoever is done with the connection sets `conn`
    to None first, so an abort after that never closes one the pool holds for another request.

    `abandon` ends it the same way for the replica's sake, not the client's: the replica left rotation (its
    node found its engine hung) while the request waited for an answer. The exchange then fails with phase
    "abandoned", and the request may go to another replica."""

    __slots__ = ("conn", "cancelled", "abandoned")

    def __init__(self) -> None:
        self.conn: Connection | None = None
        self.cancelled = False
        self.abandoned = False

    def abort(self) -> None:
        self.cancelled = True
        self._close()

    def abandon(self) -> None:
        if self.conn is not None:
            self.abandoned = True
            self._close()

    def _close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


class Response:
    """An engine's response: status and headers read, body still on the wire."""

    def __init__(self, pool: "Pool", target: Target, conn: Connection, status: int, headers: dict[str, str],
                 framing: str, length: int, deadline: float, first_deadline: float = 0.0):
        """FIRST_DEADLINE: when the first body byte must have come (the request's first_byte limit)."""
        self.pool = pool
        self.target = target
        self.conn = conn
        self.status = status
        self.headers = headers
        self.framing = framing  # "length", "chunked" or "close"
        self.remaining = length
        self.deadline = deadline
        self.first_deadline = first_deadline
        self.started = bool(conn.buf)  # a body byte has come
        # Set by a stream's relay until the first event that is not a comment: llama.cpp sends its headers at
        # once and a `:` line every 30 s while it reads a long prompt, and that wait is the answer's first
        # byte (timeouts.first_byte), not silence within an answer (timeouts.idle). A coding agent's prompt of
        # 4,000 tokens takes a busy CPU two minutes.
        self.awaiting_answer = False
        self.done = framing == "length" and length == 0
        self.closed_by_other = False

    def _recv(self, idle: float | None) -> bytes:
        now = time.monotonic()
        left = self.deadline - now
        if left <= 0:
            raise UpstreamError("total", "the engine took longer than the whole request may")
        timeout = left if idle is None else min(idle, left)
        first = not self.started or self.awaiting_answer
        if first:
            timeout = min(left, max(timeout, self.first_deadline - now))
        try:
            data = sockio.recv(self.conn.sock, RECV, None if timeout == float("inf") else timeout)
        except socket.timeout:
            phase = "total" if time.monotonic() >= self.deadline else "first_byte" if first else "idle"
            raise UpstreamError(phase, f"the engine sent nothing for {timeout:.1f} s") from None
        except OSError as e:
            if self.closed_by_other:
                raise UpstreamError("closed", "closed by the gateway") from None
            raise UpstreamError("closed", f"the engine's connection failed: {e}") from None
        if not data:
            raise UpstreamError("closed", "the engine closed the connection before the answer was complete")
        self.started = True
        if self.awaiting_answer and b"data:" in data:
            self.awaiting_answer = False  # an event, not a comment: from here, silence is timeouts.idle's
        return data

    def iter_body(self, idle: float | None = None):
        """The body's bytes as they arrive, a piece a read (chunk framing removed)."""
        conn = self.conn
        if self.framing == "length":
            while self.remaining > 0:
                if not conn.buf:
                    conn.buf = self._recv(idle)
                piece = conn.buf[:self.remaining]
                conn.buf = conn.buf[len(piece):]
                self.remaining -= len(piece)
                yield piece
        elif self.framing == "chunked":
            yield from self._chunked_body(idle)
        else:
            while True:
                try:
                    data = conn.buf or self._recv(idle)
                except UpstreamError as e:
                    if e.phase == "closed" and not self.closed_by_other:
                        break  # closing is how this body ends
                    raise
                conn.buf = b""
                yield data
        self.done = True

    def _chunked_body(self, idle: float | None):
        """A chunked body's bytes, one piece for each read: every chunk, whole or begun, that the read brought.

        An engine writes an event a chunk, so a read often brings several; handing them on together is what
        lets the gateway write them to its client in one send (one a chunk cost a send each), and nothing
        waits for a read that has not come.
        """
        left = -1
        while True:
            data, left = self._take_chunks(left)
            if data:
                yield data
            if left == 0:
                self._skip_trailers(idle)
                return
            if not data or not self.conn.buf:  # else the rest may be a bad size line, to fail on now
                self.conn.buf += self._recv(idle)

    def _take_chunks(self, left: int) -> tuple[bytes, int]:
        """The data of every chunk, whole or begun, in the buffer, and LEFT for what follows.

        LEFT: bytes of the current chunk still to come; -1 before a size line, -2 before a chunk's closing
        CRLF; 0 once the last chunk's size line is read. The buffer is read by index and cut once: slicing it
        a chunk at a time would copy the rest of a 64 KiB read for each of its chunks.
        """
        buf, at, pieces = self.conn.buf, 0, []
        while True:
            if left > 0:
                piece = buf[at:at + left]
                if not piece:
                    break
                at += len(piece)
                left -= len(piece)
                pieces.append(piece)
                if not left:
                    left = -2
            elif left == -2:
                if len(buf) - at < 2:
                    break
                at += 2
                left = -1
            else:
                end = buf.find(b"\r\n", at)
                if end < 0:
                    break
                size = _chunk_size(buf[at:end])
                if size is None:
                    if pieces:
                        break  # the chunks before it go on first; the next call fails
                    raise UpstreamError("protocol", f"the engine sent a bad chunk size {buf[at:end][:20]!r}")
                left, at = size, end + 2
                if left == 0:
                    break
        self.conn.buf = buf[at:]
        return b"".join(pieces), left

    def _skip_trailers(self, idle: float | None) -> None:
        """Past the trailers after the last chunk, if any; they end with an empty line."""
        conn = self.conn
        while not conn.buf.startswith(b"\r\n") and b"\r\n\r\n" not in conn.buf:
            conn.buf += self._recv(idle)
        conn.buf = conn.buf[2:] if conn.buf.startswith(b"\r\n") else conn.buf.split(b"\r\n\r\n", 1)[1]

    def read(self, idle: float | None = None) -> bytes:
        return b"".join(self.iter_body(idle))

    def release(self) -> None:
        """Done with it: the connection goes back to the pool when reusable, else is closed."""
        if self.done and self.framing != "close" and self.headers.get("connection", "").lower() != "close":
            self.pool.put(self.target, self.conn)
        else:
            self.conn.close()

    def abort(self) -> None:
        """Close the connection now, from any greenlet; the engine sees its client leave."""
        self.closed_by_other = True
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise UpstreamError("protocol", f"the engine did not answer in HTTP/1.1: {lines[0][:60]!r}")
    status = int(parts[1]) if len(parts[1]) == 3 and parts[1].isascii() and parts[1].isdigit() else 0
    if not 100 <= status <= 599:  # passed on, a status outside HTTP's would break the client's reading
        raise UpstreamError("protocol", f"the engine sent a bad status line: {lines[0][:60]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return status, headers


class Pool:
    """Idle keep-alive connections per engine, for one worker."""

    def __init__(self, connect_timeout: float, max_idle: int = 256):
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.idle: dict[tuple, list[Connection]] = {}
        self._tls = None

    def put(self, target: Target, conn: Connection) -> None:
        conns = self.idle.setdefault(target.key, [])
        if len(conns) < self.max_idle and not conn.buf:
            conn.reused = True
            conns.append(conn)
        else:
            conn.close()

    def _connect(self, target: Target, deadline: float) -> Connection:
        timeout = min(self.connect_timeout, max(0.001, deadline - time.monotonic()))
        try:
            sock = self._open(target, timeout)
        except socket.timeout:
            raise UpstreamError("connect", f"no connection to {target.host}:{target.port} within {timeout:.1f} s") from None
        except OSError as e:
            raise UpstreamError("connect", f"cannot connect to {target.host}:{target.port}: {e.strerror or e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if target.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            sock = self._tls.wrap_socket(sock, server_hostname=target.host)
        return Connection(sock)

    @staticmethod
    def _open(target: Target, timeout: float) -> socket.socket:
        """A socket connected to TARGET. An address is connected to directly: each greenlet's Python frames
        live in a 16 KiB chunk of their own whose pages stay resident once touched, and the lookup's frames
        (gevent's resolver and thread pool, about 1 KiB) took a handler's deepest call past the first page:
        4 KiB more for every held stream, for the lookup of an address that needs none."""
        if target.family is None:
            return socket.create_connection((target.host, target.port), timeout=timeout)
        sock = socket.socket(target.family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect((target.host, target.port))
        except BaseException:
            sock.close()
            raise
        return sock

    def request(self, target: Target, method: str, path: str, body: bytes = b"",
                first_byte: float = 300.0, deadline: float | None = None,
                content_type: bytes = b"application/json", headers: bytes = b"", cancel: Cancel | None = None) -> Response:
        """Send a request and wait for the response's head; the body is read by the caller.

        HEADERS are extra header lines, each ending in CRLF. CANCEL, when given, is told the connection the
        exchange runs on, so that another greenlet can end it.
        """
        deadline = deadline if deadline is not None else float("inf")
        head = b"".join((method.encode(), b" ", target.base_path.encode(), path.encode(), b" HTTP/1.1\r\nHost: ",
                         target.host_header, b"\r\nContent-Type: ", content_type,
                         b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n", target.auth, headers, b"\r\n"))
        conns = self.idle.get(target.key)
        stale: UpstreamError | None = None
        while True:
            if cancel is not None and cancel.cancelled:
                raise UpstreamError("cancelled", "the request was cancelled before it was sent")
            try:
                conn = conns.pop() if conns else self._connect(target, deadline)
            except UpstreamError:
                # The engine hung up on the request and now takes no connection: it
                # died holding it, which is what the caller must hear.
                if stale is not None:
                    raise stale from None
                raise
            if cancel is not None:
                cancel.conn = conn
            try:
                return self._exchange(conn, target, method, head, body, first_byte, deadline)
            except UpstreamError as e:
                conn.close()
                if cancel is not None and cancel.cancelled:
                    raise UpstreamError("cancelled", "the request was cancelled while the engine had it") from None
                if cancel is not None and cancel.abandoned:
                    raise UpstreamError("abandoned", "the replica left rotation while the engine had the "
                                                     "request") from None
                # A kept-alive connection the engine closed while idle fails
                # with nothing received: that is not the engine failing, so the
                # request goes again on a fresh connection.
                if conn.reused and e.nothing_received:
                    stale = e
                    conns = self.idle.get(target.key)
                    continue
                raise

    def _exchange(self, conn: Connection, target: Target, method: str, head: bytes, body: bytes,
                  first_byte: float, deadline: float) -> Response:
        sock = conn.sock
        now = time.monotonic()
        left = deadline - now
        sock.settimeout(max(0.001, min(first_byte, left)))
        try:
            if len(body) <= 65536:
                sockio.send_all(sock, head + body)
            else:
                sockio.send_all(sock, head)
                sockio.send_all(sock, body)
        except socket.timeout:
            raise UpstreamError("first_byte", "the engine did not take the request in time") from None
        except OSError as e:
            raise UpstreamError("closed", f"sending to the engine failed: {e}", nothing_received=True) from None
        while True:
            status, headers = self._read_head(conn, first_byte, left, deadline)
            if status == 101:
                raise UpstreamError("protocol", "the engine switched protocols on a request")
            if not 100 <= status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real head follows
                break
        if method == "HEAD" or status in (204, 304):
            framing, length = "length", 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            framing, length = "chunked", 0
        elif "content-length" in headers:
            try:
                framing, length = "length", int(headers["content-length"])
            except ValueError:
                raise UpstreamError("protocol", "the engine sent a bad Content-Length") from None
        else:
            framing, length = "close", 0
        return Response(self, target, conn, status, headers, framing, length, deadline, now + first_byte)

    @staticmethod
    def _read_head(conn: Connection, first_byte: float, left: float, deadline: float) -> tuple[int, dict[str, str]]:
        buf = conn.buf
        while b"\r\n\r\n" not in buf:
            # Each read gets only what is left of the deadline: a server sending its head a byte a second
            # restarted a timeout set once, and held a page's query to Prometheus for as long as it liked.
            now = time.monotonic()
            if now >= deadline:
                raise UpstreamError("total", "the engine took longer than the whole request may to send its head")
            try:
                # The first read waits first: the engine cannot have answered a request just sent.
                data = sockio.recv(conn.sock, RECV, max(0.001, min(first_byte, deadline - now)), wait_first=not buf)
            except socket.timeout:
                phase = "total" if time.monotonic() >= deadline else "first_byte"
                raise UpstreamError(phase, f"the engine did not start its answer within {min(first_byte, left):.1f} s") from None
            except OSError as e:
                raise UpstreamError("closed", f"the engine's connection failed: {e}", nothing_received=not buf) from None
            if not data:
                raise UpstreamError("closed", "the engine closed the connection without answering",
                                    nothing_received=not buf)
            buf += data
            if len(buf) > HEAD_LIMIT:
                raise UpstreamError("protocol", "the engine's response headers are too large")
        head_bytes, conn.buf = buf.split(b"\r\n\r\n", 1)
        return _parse_head(head_bytes)

    def close(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.close()
        self.idle.clear()


class TooLarge(Exception):
    """A successful answer longer than the caller would read (`fetch`)."""


def fetch(url: str, path: str = "", method: str = "GET", body: bytes = b"", seconds: float = 10.0,
          most_bytes: int = 1 << 20, refusal_bytes: int = 64 * 1024, content_type: bytes = b"application/json",
          headers: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one exchange with URL (then PATH), the whole of it within SECONDS, on a
    connection of its own that is closed whatever happens: for the pages' calls to services beside the
    gateway (Prometheus, identity providers). A 2xx body past MOST_BYTES raises TooLarge; another's is cut
    at REFUSAL_BYTES. Raises ValueError for a URL that is not http(s), UpstreamError (its phase says where it
    failed), ssl.SSLError and OSError."""
    deadline = time.monotonic() + seconds
    target = Target(url)
    pool = Pool(connect_timeout=seconds)
    resp = None
    try:
        resp = pool.request(target, method, path, body, first_byte=seconds, deadline=deadline,
                            content_type=content_type, headers=headers)
        limit = most_bytes if 200 <= resp.status < 300 else refusal_bytes
        parts, size = [], 0
        for piece in resp.iter_body():
            size += len(piece)
            parts.append(piece)
            if size > limit:
                if 200 <= resp.status < 300:
                    raise TooLarge(f"more than {most_bytes} bytes")
                break
        return resp.status, resp.headers, b"".join(parts)
    finally:
        if resp is not None:
            resp.conn.close()
        pool.close()
