"""The worker's HTTP/1 responses: gunicorn's, with the head sent with the first body bytes.

gunicorn writes a response's head in one `sendall` and each body write in another, so a plain answer took two
socket sends, and a stream one more than its events; each gevent `sendall` costs about as much as the rest of
writing the response. Here the head waits, built, until the first body bytes and goes out with them in one
send (with the last chunk, for an answer with no body). Whenever the app writes and nothing goes with the head
(an empty chunk, a body the response may not carry), the head goes out then, alone: a stream's head still
leaves as soon as the app writes anything, as with gunicorn. The Date header is formatted once a second.

Joining the head to a body copies the body; past `JOIN_AT` bytes the copy costs more than the send it saves,
and the two go out one after the other.

`answer` is the one loop that runs the app and writes its answer, for both of a worker's HTTP paths (the
plain `/v1` requests read in llmgw/gateway/fastpath.py, and gunicorn's, llmgw/gateway/connguard.py): a fix to
how an answer is written, or how a failure part way through one ends, is made once.
"""

from __future__ import annotations

import contextlib
import email.utils
import logging
import socket
import time

import gevent
from gunicorn import util
from gunicorn.http import wsgi

log = logging.getLogger("llmgw.httpout")

JOIN_AT = 65536  # bytes of body up to which the head is sent joined to it
LAST_CHUNK = b"0\r\n\r\n"


class HttpDate:
    """The Date header's value, formatted once a second rather than for every response."""

    def __init__(self):
        self.second = -1
        self.value = ""

    def __call__(self) -> str:
        now = time.time()
        if int(now) != self.second:
            self.second = int(now)
            self.value = email.utils.formatdate(now, usegmt=True)
        return self.value


http_date = HttpDate()


class AnswerBroken(Exception):
    """The app failed after its answer's head was fixed or part of it sent: logged, and the connection shut."""


def answer(app, environ, out, sock, begun=None) -> None:
    """Run the WSGI APP on ENVIRON and write its answer through OUT (`start_response`, `write`, `close`,
    `headers_sent`: this module's Response, or fastpath's Answer), closing the app's iterable however it ends.
    BEGUN(), when given, is called once the app has returned its iterable, before anything is written.

    Raises OSError (sockio.SendTimeout among them) when the connection fails; GreenletExit as it comes (a
    killed request ends quietly); what the app raised before its head was fixed (SystemExit included), for
    the caller to answer; and AnswerBroken when the app failed after its head was fixed: a 500 then would
    corrupt what went out, so the failure is logged here and SOCK shut, which the client sees as a cut answer
    (a connection kept alive after it would leave the client waiting for the rest of an answer that never
    comes).
    """
    try:
        respiter = app(environ, out.start_response)
        try:
            if begun is not None:
                begun()
            write_file = getattr(out, "write_file", None)
            if write_file is not None and isinstance(respiter, environ["wsgi.file_wrapper"]):
                write_file(respiter)
            else:
                for item in respiter:
                    out.write(item)
            out.close()
        finally:
            if hasattr(respiter, "close"):
                respiter.close()
    except (OSError, gevent.GreenletExit):
        raise
    except (Exception, SystemExit):
        if not out.headers_sent:
            raise
        log.exception("failed while answering %s %s", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"))
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        raise AnswerBroken() from None


class Response(wsgi.Response):
    def __init__(self, req, sock, cfg):
        super().__init__(req, sock, cfg)
        self.head = b""  # built and not yet sent

    def default_headers(self) -> list[str]:
        if self.upgrade:
            connection = "upgrade"
        elif self.should_close():
            connection = "close"
        else:
            connection = "keep-alive"
        version = self.req.version
        headers = [f"HTTP/{version[0]}.{version[1]} {self.status}\r\n", f"Server: {self.version}\r\n",
                   f"Date: {http_date()}\r\n", f"Connection: {connection}\r\n"]
        if self.chunked:
            headers.append("Transfer-Encoding: chunked\r\n")
        return headers

    def send_headers(self) -> None:
        """Build the head, to go out with what is written next. `headers_sent` is set as gunicorn sets it:
        from here on the status and headers are fixed, and a failure cannot be answered with a 500."""
        if self.headers_sent:
            return
        lines = self.default_headers()
        lines.extend([f"{name}: {value}\r\n" for name, value in self.headers])
        lines.append("\r\n")
        self.head = "".join(lines).encode("latin-1")
        self.headers_sent = True

    def _emit_body(self, data: bytes) -> None:
        if self.chunked:
            data = b"%X\r\n%b\r\n" % (len(data), data)
        head, self.head = self.head, b""
        if head and len(data) <= JOIN_AT:
            self.sock.sendall(head + data)
            return
        if head:
            self.sock.sendall(head)
        self.sock.sendall(data)

    def write(self, arg) -> None:
        super().write(arg)
        self.flush_head()  # nothing went with it: it goes alone, as gunicorn's would have

    def flush_head(self) -> None:
        if self.head:
            head, self.head = self.head, b""
            util.write(self.sock, head)

    def sendfile(self, respiter) -> bool:
        # gunicorn's sendfile sends the head itself (send_headers) and then the file: the head must be out first.
        self.send_headers()
        self.flush_head()
        return super().sendfile(respiter)

    def close(self) -> None:
        self.send_headers()
        head, self.head = self.head, b""
        tail = LAST_CHUNK if self.chunked else b""
        if head or tail:
            self.sock.sendall(head + tail)
