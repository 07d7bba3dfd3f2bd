"""The worker's responses (llmgw/gateway/httpout.py): the head goes out with the first body bytes, and never later
than the app's first write, over a real socket pair."""

import email.utils
import os
import socket
import time

import pytest
from gunicorn.config import Config
from gunicorn.http.parser import RequestParser
from gunicorn.http.wsgi import FileWrapper

from llmgw.gateway import httpout


class Sends:
    """A real socket, with what each send call handed it kept in order."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sent: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.sent.append(bytes(data))
        self.sock.sendall(data)

    def sendfile(self, file, offset=0, count=None):
        self.sent.append(b"<file>")
        return self.sock.sendfile(file, offset, count)


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    ours.settimeout(10)
    theirs.settimeout(10)
    yield Sends(ours), theirs
    ours.close()
    theirs.close()


def request(head: bytes):
    """gunicorn's own parse of HEAD, as the worker has it."""
    cfg = Config()
    return next(RequestParser(cfg, iter([head]), ("127.0.0.1", 1))), cfg


def received(sock: socket.socket) -> bytes:
    sock.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def respond(pair, head: bytes, headers: list, *writes: bytes) -> tuple[list[bytes], bytes]:
    ours, theirs = pair
    req, cfg = request(head)
    resp = httpout.Response(req, ours, cfg)
    resp.start_response("200 OK", headers)
    for data in writes:
        resp.write(data)
    resp.close()
    ours.sock.shutdown(socket.SHUT_WR)
    return ours.sent, received(theirs)


GET = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_plain_answer_goes_in_one_send_with_its_head(pair):
    body = b'{"object": "list"}'
    sent, wire = respond(pair, GET, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))], body)
    assert len(sent) == 1 and sent[0].endswith(b"\r\n\r\n" + body)
    assert wire.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nContent-Length: 18\r\n" in wire and b"\r\nDate: " in wire


def test_a_stream_sends_its_head_with_its_first_chunk_and_ends_with_the_last_chunk(pair):
    sent, wire = respond(pair, GET, [("Content-Type", "text/event-stream")], b"data: 1\n\n", b"data: 2\n\n")
    assert len(sent) == 3
    assert b"\r\nTransfer-Encoding: chunked\r\n" in sent[0]
    assert sent[0].endswith(b"text/event-stream\r\n\r\n9\r\ndata: 1\n\n\r\n")
    assert sent[1:] == [b"9\r\ndata: 2\n\n\r\n", b"0\r\n\r\n"]
    assert wire == b"".join(sent)


def test_an_empty_write_sends_the_head_at_once(pair):
    # An app that writes nothing yet (a stream whose engine has not answered) still has its head go out.
    ours, theirs = pair
    req, cfg = request(GET)
    resp = httpout.Response(req, ours, cfg)
    resp.start_response("200 OK", [("Content-Type", "text/event-stream")])
    resp.write(b"")
    assert theirs.recv(65536).endswith(b"text/event-stream\r\n\r\n")
    resp.close()
    assert theirs.recv(65536) == b"0\r\n\r\n"


def test_an_answer_without_a_body_sends_its_head_and_last_chunk_together(pair):
    sent, wire = respond(pair, GET, [])
    assert len(sent) == 1 and wire.endswith(b"\r\n\r\n0\r\n\r\n")


def test_a_head_request_gets_the_head_alone(pair):
    sent, wire = respond(pair, b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n", [("Content-Length", "2")], b"ok")
    assert len(sent) == 1 and wire.endswith(b"Content-Length: 2\r\n\r\n")


def test_a_large_body_is_not_copied_to_join_its_head(pair):
    body = os.urandom(httpout.JOIN_AT + 1)
    sent, wire = respond(pair, GET, [("Content-Length", str(len(body)))], body)
    assert len(sent) == 2 and sent[1] == body and wire.endswith(body)


def test_a_file_answer_sends_its_head_before_the_file(pair, tmp_path):
    path = tmp_path / "f.css"
    path.write_bytes(b"body { color: red }")
    ours, theirs = pair
    req, cfg = request(GET)
    resp = httpout.Response(req, ours, cfg)
    resp.start_response("200 OK", [("Content-Length", "19")])
    with open(path, "rb") as f:
        resp.write_file(FileWrapper(f))
    resp.close()
    ours.sock.shutdown(socket.SHUT_WR)
    assert ours.sent[1] == b"<file>" and received(theirs).endswith(b"\r\n\r\nbody { color: red }")


def test_the_date_is_formatted_again_once_its_second_has_passed():
    date = httpout.HttpDate()
    date.second, date.value = 0, "Thu, 01 Jan 1970 00:00:00 GMT"  # formatted at the epoch's first second
    now = time.time()
    value = date()
    assert value in (email.utils.formatdate(now, usegmt=True), email.utils.formatdate(now + 1, usegmt=True))
    second = date.second
    assert date() is value or date.second != second  # within the same second it is not formatted again


class Failing:
    """A WSGI app whose answer fails after its head and first piece (AFTER), or before anything (not AFTER),
    raising WITH."""

    def __init__(self, after: bool, with_=ValueError):
        self.after = after
        self.raised = with_
        self.closed = False

    def __call__(self, environ, start_response):
        if not self.after:
            raise ValueError("failed before answering")
        start_response("200 OK", [("Content-Type", "text/event-stream")])
        return self

    def __iter__(self):
        yield b"data: 1\n\n"
        raise self.raised("failed part way")

    def close(self):
        self.closed = True


@pytest.mark.parametrize("raised", [ValueError, SystemExit])
def test_an_answer_that_fails_part_way_is_cut_and_logged_and_one_that_fails_first_is_left_to_answer(pair, caplog,
                                                                                                      raised):
    # The one loop both of a worker's HTTP paths answer through (fastpath and gunicorn's). A worker's exit
    # part way through cuts the answer too: kept alive, the connection left its client waiting for the rest.
    ours, theirs = pair
    req, cfg = request(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/v1/chat/completions", "wsgi.file_wrapper": FileWrapper}
    app = Failing(after=True, with_=raised)
    with pytest.raises(httpout.AnswerBroken):
        httpout.answer(app, environ, httpout.Response(req, ours, cfg), ours.sock)
    assert app.closed
    assert received(theirs).endswith(b"data: 1\n\n\r\n")  # the first piece went out, then the connection was shut
    assert "failed while answering POST /v1/chat/completions" in caplog.text
    # Before the head is fixed, the caller answers the failure (a 500): it is raised as it came.
    with pytest.raises(ValueError, match="failed before answering"):
        httpout.answer(Failing(after=False), environ, httpout.Response(req, ours, cfg), ours.sock)
