"""The `/v1` requests a worker reads and answers itself, without gunicorn's request and response objects.

gunicorn's request (the Python around its C parser, the environ built a header at a time, the body's
readers) and its response (each header matched against regular expressions, the head built line by
line) were 40% of a plain request's CPU in the worker (docs/performance.md, issue 14). A `/v1` request
is read here instead: its head is parsed, checked and made into a WSGI environ in one call into
gunicorn_h1c, the C parser gunicorn itself uses with `http_parser = "fast"`, with the same checks (the
limits, header names and values, and the framing rules that stop request smuggling: one Content-Length,
never with Transfer-Encoding); its body is taken from the bytes that came with the head; its answer
goes out with its head in one send (a stream: chunk by chunk, as gunicorn frames it).

Only what is plain is taken: a head that parses, for a path under `/v1/` in printable ASCII without
percent-escapes or a fragment, by GET or POST, whose body has a Content-Length or none, and that asks
nothing more of the connection (no Transfer-Encoding, Expect or Upgrade). From the first request that
is not, the connection goes to gunicorn with the bytes read so far (`Connection.pending`), and gunicorn
reads and answers it as it would have without this module, its refusals of malformed requests
included: nothing a client can send is answered here in a way gunicorn would not have answered it.
The connection guard's deadlines and counts hold here as there: every read goes through the same
`Connection` (llmgw/gateway/connguard.py).
"""

from __future__ import annotations

import errno
import logging
import re
import sys

import gevent
import gunicorn_h1c
from gunicorn import SERVER, SERVER_SOFTWARE, util
from gunicorn.http.errors import InvalidResponseHeader, InvalidResponseHeaderName
from gunicorn.http.message import TOKEN_RE
from gunicorn.http.wsgi import HEADER_VALUE_RE, STATUS_RE, FileWrapper

from llmgw.gateway import httpout
from llmgw.gateway.httpout import JOIN_AT, LAST_CHUNK, http_date
from llmgw.gateway.sockio import SendTimeout, send_all

log = logging.getLogger("llmgw.fastpath")

HEAD_MOST = 32768  # bytes of head read here before it goes to gunicorn, which reads (or refuses) the rest
RECV = 65536
BODY_RECV = 262144  # bytes asked of one read while a large body arrives
METHODS = ("GET", "POST")
# A request with any of these goes to gunicorn: each asks the connection for more than a body of known length.
ASKS_MORE = ("HTTP_TRANSFER_ENCODING", "HTTP_EXPECT", "HTTP_UPGRADE")
# A client that left: not worth a line in the log (gunicorn's worker says nothing of these either).
QUIET_ERRNOS = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF)


class Body:
    """A request's `wsgi.input`: the bytes that came with its head, then the connection's, LEFT in all.
    What came after the body (the next request, pipelined) stays in `buf` for the connection."""

    __slots__ = ("conn", "buf", "left", "must_close")

    def __init__(self, conn, buf: bytes, left: int):
        self.conn = conn
        self.buf = buf
        self.left = left
        self.must_close = False  # set by the connection's guard when the body came too slowly

    def read(self, size: int | None = -1) -> bytes:
        want = self.left if size is None or size < 0 else min(size, self.left)
        buf = self.buf
        if len(buf) < want:
            parts, have = [buf], len(buf)
            while have < want:
                data = self.conn.recv(min(want - have, BODY_RECV))
                if not data:
                    break  # the client stopped sending: what came is the body
                parts.append(data)
                have += len(data)
            buf = b"".join(parts)
        piece, self.buf = buf[:want], buf[want:]
        self.left -= len(piece)
        return piece

    # The rest of PEP 3333's input stream: the `/v1` pipeline reads a body whole, with `read`.
    def readline(self, size: int | None = -1) -> bytes:
        rest = self.read()
        line, _, after = rest.partition(b"\n")
        line = line + b"\n" if len(line) < len(rest) else line
        if size is not None and 0 <= size < len(line):
            line = line[:size]
        unread = rest[len(line):]
        self.buf, self.left = unread + self.buf, self.left + len(unread)
        return line

    def readlines(self, hint=None) -> list[bytes]:
        return list(iter(self.readline, b""))

    def __iter__(self):
        return iter(self.readline, b"")

    def drain(self) -> bool:
        """Read away what the app left of the body; whether it all came (within the body's deadline)."""
        self.conn.answered = True  # a deadline passed now ends the connection quietly
        try:
            while self.left:
                if not self.read(BODY_RECV):
                    return False
        except OSError:
            return False
        return True


# The app's header names at once, a line each: each a token (gunicorn's TOKEN_RE) that is not one of the
# connection's own headers (gunicorn drops those: framing and the connection are the server's to say).
NAMES_RE = re.compile(r"(?:(?!(?i:connection|keep-alive|proxy-authenticate|proxy-authorization|te|trailers|"
                      r"transfer-encoding|upgrade|server|date)(?:\n|$))[!#$%&'*+\-.^_`|~0-9a-zA-Z]+(?:\n|$))*")
# Its header lines at once: each value visible characters, spaces and tabs (gunicorn's HEADER_VALUE_RE). With
# as many line ends as headers, no value holds one. Two matches of the whole block cost about what one
# header's checks do; a block that does not match is looked at header by header.
FIELDS_RE = re.compile(r"(?:[^:\r\n]+: [ \t\x21-\x7e\x80-\xff]*\r\n)*")


def _fields(headers: list) -> str:
    """HEADERS as header lines, checked (`NAMES_RE`, `FIELDS_RE`); raises gunicorn's InvalidResponseHeader(Name)."""
    try:
        text = "".join([name + ": " + value + "\r\n" for name, value in headers])  # a name or value not a str: raises
        names = "\n".join([name for name, _ in headers])
    except TypeError:
        text = names = ""
    if text.count("\n") == len(headers) and NAMES_RE.fullmatch(names) and FIELDS_RE.fullmatch(text):
        return text
    kept = []
    for name, value in headers:
        if not isinstance(name, str) or not TOKEN_RE.fullmatch(name):
            raise InvalidResponseHeaderName(repr(name))
        if not isinstance(value, str) or not HEADER_VALUE_RE.fullmatch(value):
            raise InvalidResponseHeader(repr(name))  # the name only: the value may hold what is not to be logged
        if not util.is_hoppish(name):
            kept.append(f"{name}: {value}\r\n")
    return "".join(kept)


class Answer:
    """One response: `start_response` for the app, then its body written with the head in the first send."""

    __slots__ = ("sock", "minor", "keep", "status", "headers", "length", "sent", "chunked", "omits", "head")

    def __init__(self, sock, minor: int, keep: bool):
        self.sock = sock  # the gevent socket under the connection
        self.minor = minor
        self.keep = keep  # whether the connection may serve another request after this one
        self.status = None
        self.head = b""  # built, and not yet sent
        self.headers: list = []
        self.length = None
        self.sent = 0  # body bytes written, of LENGTH
        self.chunked = False
        self.omits = False

    def start_response(self, status: str, headers: list, exc_info=None):
        if exc_info:
            try:
                if self.head:  # the head is fixed: the error can only end the response
                    raise exc_info[1].with_traceback(exc_info[2])
            finally:
                exc_info = None
        elif self.status is not None:
            raise AssertionError("Response headers already set!")
        if not isinstance(status, str) or not STATUS_RE.fullmatch(status):
            raise ValueError(f"Invalid status {status!r}")
        self.status = status
        self.headers = headers
        self.length = None
        code = int(status[:3])
        # RFC 9110: a 1xx, 204 or 304 carries no body (and a 1xx or 204 no Content-Length).
        self.omits = code < 200 or code in (204, 304)
        for name, value in headers:
            if len(name) == 14 and name.lower() == "content-length":
                self.length = int(value)
        if self.omits and code != 304:
            self.headers = [(n, v) for n, v in headers if n.lower() != "content-length"]
            self.length = None
        self.chunked = self.length is None and self.minor >= 1 and not self.omits
        if self.length is None and not self.chunked and not self.omits:
            self.keep = False  # HTTP/1.0 without a length: the body ends where the connection does
        return self.write

    def build(self) -> None:
        """Build the head, its headers checked: the app's are its own, but a value may carry what an engine
        or a client said, and a CR or LF in one would end the head there."""
        if self.head:
            return
        if self.status is None:
            raise AssertionError("The app wrote a body before it called start_response")
        framing = "Transfer-Encoding: chunked\r\n" if self.chunked else ""
        self.head = (f"HTTP/1.{self.minor} {self.status}\r\nServer: {SERVER}\r\nDate: {http_date()}\r\nConnection: "
                     f"{'keep-alive' if self.keep else 'close'}\r\n{framing}{_fields(self.headers)}\r\n"
                     ).encode("latin-1")

    def write(self, data: bytes) -> None:
        self.build()
        if self.omits:
            data = b""
        elif self.length is not None:
            data = data[:self.length - self.sent]  # never more than the length said: the rest would be a response
            self.sent += len(data)
        elif self.chunked and data:  # an empty chunk would end the body: nothing is sent for one but the head
            data = b"%X\r\n%b\r\n" % (len(data), data)
        head, self.head = self.head, b"sent"
        if head == b"sent":
            if data:
                send_all(self.sock, data)
        elif len(data) <= JOIN_AT:
            send_all(self.sock, head + data)
        else:
            send_all(self.sock, head)
            send_all(self.sock, data)

    def close(self) -> None:
        """The body is over: the head if it has not gone, and a chunked body's last chunk."""
        self.build()
        head = self.head if self.head != b"sent" else b""
        self.head = b"sent"
        tail = LAST_CHUNK if self.chunked else b""
        if head or tail:
            send_all(self.sock, head + tail)
        if self.length is not None and self.sent < self.length and not self.omits:
            self.keep = False  # the body came short of its length: the client reads on into what comes next

    @property
    def headers_sent(self) -> bool:
        return bool(self.head)


class FastPath:
    """A worker's reader of plain `/v1` requests; `serve` one connection until it is done or goes to gunicorn."""

    def __init__(self, worker):
        self.worker = worker
        cfg = worker.cfg
        self.app = worker.wsgi
        self.multiprocess = cfg.workers > 1
        # As gunicorn gives them to the same parser: 0 is no limit, which the parser takes as a large one.
        self.limits = dict(limit_request_line=cfg.limit_request_line or 1 << 20,
                           limit_request_fields=cfg.limit_request_fields,
                           limit_request_field_size=cfg.limit_request_field_size or 8190,
                           permit_unconventional_http_method=cfg.permit_unconventional_http_method,
                           permit_unconventional_http_version=cfg.permit_unconventional_http_version)

    def serve(self, conn, addr, server) -> bool:
        """Serve CONN's requests; True once the connection is done with (closed), False when the rest of it
        is gunicorn's, with what was read of it in `conn.pending`."""
        buf = b""
        while True:
            end = buf.find(b"\r\n\r\n")
            while end < 0:
                if len(buf) >= HEAD_MOST:
                    conn.pending = buf
                    return False
                try:
                    data = conn.recv(RECV)
                except OSError:
                    return True  # the client's connection failed
                except Exception as e:  # the guard's: a head that did not arrive in time (a 408)
                    self.worker.handle_error(None, conn, addr, e)
                    return True
                if not data:
                    return True  # the client left between requests, or before its first
                buf += data
                end = buf.find(b"\r\n\r\n", max(0, len(buf) - len(data) - 3))
                if end < 0 and not self._may_end(buf):
                    conn.pending = buf  # not HTTP gunicorn takes (a bare LF, a TLS hello): its 400, now
                    return False
            environ = self._environ(buf, addr, server)
            if environ is None:
                conn.pending = buf
                return False
            consumed = environ.pop("_consumed")
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = Body(conn, buf[consumed:], length)
            environ["wsgi.input"] = body
            environ["gunicorn.socket"] = conn
            if not self._answer(conn, environ, body, addr):
                return True
            buf = body.buf
            if buf:
                conn.begun(buf)  # the next request came with this one: its head's clock runs from now

    def _may_end(self, buf: bytes) -> bool:
        """Whether BUF, a head not yet whole, may still become one gunicorn takes: what it refuses at once is
        handed to it at once, not waited on for the header timeout."""
        try:
            gunicorn_h1c.parse_request(buf, **self.limits)
        except gunicorn_h1c.IncompleteError:
            return True
        except Exception:
            return False
        return True

    def _environ(self, buf: bytes, addr, server) -> dict | None:
        """The environ of the request whose head BUF begins with, or None when it is not one for this path."""
        if buf[:2] == b"\r\n":
            return None  # an empty line before the request line: gunicorn's to measure and allow
        try:
            environ = gunicorn_h1c.parse_to_wsgi_environ(buf, server, addr, **self.limits)
        except Exception:  # anything it refuses, gunicorn refuses in its own words
            return None
        path, query = environ["PATH_INFO"], environ["QUERY_STRING"]
        if (not path.startswith("/v1/") or environ["REQUEST_METHOD"] not in METHODS or "%" in path or "#" in path
                or "#" in query or not path.isascii() or not query.isascii()
                or any(name in environ for name in ASKS_MORE)):
            return None
        environ["RAW_URI"] = f"{path}?{query}" if query else path
        environ["SCRIPT_NAME"] = ""
        environ["SERVER_SOFTWARE"] = SERVER_SOFTWARE
        environ["wsgi.version"] = (1, 0)
        environ["wsgi.errors"] = sys.stderr  # gunicorn's error log, which the gateway writes to standard error
        environ["wsgi.multithread"] = True
        environ["wsgi.multiprocess"] = self.multiprocess
        environ["wsgi.run_once"] = False
        environ["wsgi.input_terminated"] = True
        environ["wsgi.file_wrapper"] = FileWrapper
        return environ

    def _answer(self, conn, environ: dict, body: Body, addr) -> bool:
        """Answer the request in ENVIRON; whether the connection may serve another."""
        worker = self.worker
        minor = 0 if environ["SERVER_PROTOCOL"] == "HTTP/1.0" else 1
        answer = Answer(conn.sock, minor, self._keeps(environ, minor))
        worker.count_request()
        conn.begin(body)

        def begun() -> None:  # the app has read what it will of the body, and the worker may be stopping since
            answer.keep = answer.keep and worker.alive and not body.must_close

        try:
            httpout.answer(self.app, environ, answer, conn.sock, begun)
            # What the app did not read of the body (a refusal before it) is read away, as gunicorn does:
            # closing with it unread would have the kernel reset the connection, and the client miss the answer.
            return answer.keep and body.drain()
        except (gevent.GreenletExit, SystemExit, httpout.AnswerBroken):
            return False  # as gunicorn's gevent worker: a killed request ends its connection quietly
        except OSError as e:
            if isinstance(e, SendTimeout):  # the client did not make room for its answer within gateway.send_timeout
                worker.send_timed_out(addr)
            elif e.errno not in QUIET_ERRNOS:
                log.exception("socket error answering %s %s", environ["REQUEST_METHOD"], environ["PATH_INFO"])
            return False  # the client left (or its socket failed): what it was sent is moot
        except Exception as e:
            worker.handle_error(None, conn, addr, e)  # logged, and answered 500 as gunicorn answers
            return False
        finally:
            conn.end()

    @staticmethod
    def _keeps(environ: dict, minor: int) -> bool:
        """Whether the client lets the connection serve another request: not when any Connection header says
        close (two are read as one, joined by a comma), else by its word or its version (gunicorn's rule)."""
        value = environ.get("HTTP_CONNECTION")
        if value is not None:
            tokens = [token.strip(" \t") for token in value.lower().split(",")]
            if "close" in tokens:
                return False
            if "keep-alive" in tokens:
                return True
        return minor >= 1
