"""The `/v1` requests a worker reads and answers itself (llmgw/gateway/fastpath.py), over raw sockets to a real
gateway: keep-alive and pipelining, the hand-over to gunicorn mid-connection, bodies left unread, HTTP/1.0,
and an engine's header that would split the response."""

import json
import socket
import time

import pytest

from llmgw.gateway.fastpath import Answer, Body
from tests.conftest import Gateway, Sim, SocketStub, count_usage, make_key

CHAT = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fastpath")
    url = f"sqlite:///{tmp}/gw.db"
    key = make_key(url)
    sim = Sim(model="sim", replica="s", ttft_ms=0, tokens_per_s=0)
    liar = HeaderSplitter()
    endpoints = [{"id": "s", "url": sim.url, "models": ["sim"]}, {"id": "liar", "url": liar.url, "models": ["liar", "nul"]}]
    gw = Gateway(tmp, url, endpoints=endpoints, workers=1, gateway__max_body_bytes=100_000, gateway__header_timeout=2,
                 gateway__send_timeout=2)
    yield gw, key
    gw.stop()
    sim.stop()
    liar.close()


class HeaderSplitter(SocketStub):
    """An engine whose Content-Type carries a bare LF and a header after it (model "liar"), or control
    characters (model "nul")."""

    def answer(self, conn):
        with conn:
            request = self.read_head(conn)
            if request is None:
                return
            kind = b"application/json\x00\x0b\x7fX-Evil: 1" if b'"nul"' in request else \
                b"application/json\nSet-Cookie: stolen=1"
            body = b'{"choices": []}'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\nContent-Length: " +
                         str(len(body)).encode() + b"\r\n\r\n" + body)


def chat(key: str, body: bytes = CHAT, version: bytes = b"1.1", more: bytes = b"") -> bytes:
    return (b"POST /v1/chat/completions HTTP/" + version + b"\r\nHost: x\r\nAuthorization: Bearer " + key.encode() +
            b"\r\nContent-Type: application/json\r\n" + more + b"Content-Length: " + str(len(body)).encode() +
            b"\r\n\r\n" + body)


def read_answer(sock: socket.socket, buf: bytes = b"") -> tuple[bytes, bytes, bytes]:
    """(head, body, what came after it) of one response with a Content-Length."""
    while b"\r\n\r\n" not in buf:
        more = sock.recv(65536)
        assert more, f"the connection closed after {buf!r}"
        buf += more
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(rest) < length:
        more = sock.recv(65536)
        assert more, f"the connection closed in the body after {rest!r}"
        rest += more
    return head, rest[:length], rest[length:]


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_pipelined_requests_are_answered_in_turn_on_one_connection(env):
    gw, key = env
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(chat(key) * 3)
        rest = b""
        for _ in range(3):
            head, body, rest = read_answer(sock, rest)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nConnection: keep-alive\r\n" in head
            assert b"\r\nX-Request-Id: " in head and b"\r\nDate: " in head
            assert json.loads(body)["choices"][0]["message"]["content"] == "tok0 tok1 "
        assert rest == b""
        sock.sendall(chat(key))  # still open for more
        assert read_answer(sock)[0].startswith(b"HTTP/1.1 200")


def test_a_connection_goes_to_gunicorn_with_what_was_read_from_its_first_other_request(env):
    # The second request is not /v1, and came in the same read as the first: gunicorn answers it, and every
    # later one on the connection, from the bytes already read.
    gw, key = env
    escaped = chat(key).replace(b"/v1/chat/completions", b"/v1/chat%2Fcompletions")  # gunicorn unescapes it
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(chat(key) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + chat(key) + escaped)
        head, _, rest = read_answer(sock)
        assert head.startswith(b"HTTP/1.1 200")
        head, body, rest = read_answer(sock, rest)
        assert head.startswith(b"HTTP/1.1 200") and body == b""
        for _ in range(2):
            head, body, rest = read_answer(sock, rest)
            assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["usage"]["completion_tokens"] == 2


def odd(key: str, line: bytes = b"POST /v1/chat/completions HTTP/1.1", more: bytes = b"",
        framing: bytes | None = None, body: bytes = CHAT) -> bytes:
    framing = b"Content-Length: %d\r\n" % len(body) if framing is None else framing
    return (line + b"\r\nHost: x\r\nAuthorization: Bearer " + key.encode() + b"\r\n" + more + framing + b"\r\n"
            + body)


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)


# Heads the fast path must not take, each with what gunicorn answers it: the hand-over decides only who answers.
ODD = {
    "duplicate Content-Length": (lambda k: odd(k, framing=b"Content-Length: %d\r\n" % len(CHAT) * 2), 400),
    "Content-Length with Transfer-Encoding": (
        lambda k: odd(k, framing=b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", body=chunked(CHAT)), 400),
    "a chunked body": (lambda k: odd(k, framing=b"Transfer-Encoding: chunked\r\n", body=chunked(CHAT)), 200),
    "a chunked body that breaks its framing": (
        lambda k: odd(k, framing=b"Transfer-Encoding: chunked\r\n", body=b"zz\r\n"), 400),
    "an unknown transfer coding": (lambda k: odd(k, framing=b"Transfer-Encoding: br\r\n", body=b""), 400),
    "obsolete line folding": (lambda k: odd(k, more=b"X-A: 1\r\n 2\r\n"), 400),
    "a lowercase method": (lambda k: odd(k, line=b"post /v1/chat/completions HTTP/1.1"), 400),
    "HTTP/1.2": (lambda k: odd(k, line=b"POST /v1/chat/completions HTTP/1.2"), 400),
    "a byte past ASCII in the path": (lambda k: odd(k, line=b"POST /v1/chat/\xe9 HTTP/1.1"), 400),
    "a duplicate Host": (lambda k: odd(k, more=b"Host: y\r\n"), 400),
    "Expect: 100-continue": (lambda k: odd(k, more=b"Expect: 100-continue\r\n"), 100),
    "an expectation nobody meets": (lambda k: odd(k, more=b"Expect: tea\r\n"), 417),
    "an escaped slash": (lambda k: odd(k, line=b"POST /v1/chat%2Fcompletions HTTP/1.1"), 200),
    "an empty line first": (lambda k: b"\r\n" + odd(k), 200),
    "a HEAD": (lambda k: odd(k, line=b"HEAD /v1/models HTTP/1.1", body=b""), 405),
    "a request line too long": (lambda k: odd(k, line=b"POST /v1/" + b"a" * 5000 + b" HTTP/1.1"), 414),
    # Never whole as CRLF ends heads: answered at once, not cut at the header timeout with a 408.
    "bare LF line ends": (lambda k: odd(k).replace(b"\r\n", b"\n"), 400),
    "a TLS hello on the plain port": (lambda k: b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40, 400),
}


@pytest.mark.parametrize("case", list(ODD))
def test_what_the_fast_path_does_not_take_gunicorn_answers_as_before(env, case):
    gw, key = env
    make, status = ODD[case]
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(make(key))
        got = b""
        while b"\r\n\r\n" not in got and (more := sock.recv(65536)):
            got += more
    assert got.startswith(b"HTTP/1.1 %d " % status), got[:300]


def test_a_body_left_unread_is_read_away_and_never_read_as_a_request(env):
    # Refused before its body was read: the body, which holds a whole request, is read away (closing with it
    # unread would have the kernel reset the connection under the 413), and the request after it is answered.
    gw, key = env
    inner = chat(key)
    body = inner + b"x" * (200_000 - len(inner))
    models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(chat(key, body) + models)
        head, answer, rest = read_answer(sock)
        assert head.startswith(b"HTTP/1.1 413") and b"\r\nConnection: keep-alive\r\n" in head
        assert json.loads(answer)["error"]["code"] == "body_too_large"
        head, answer, rest = read_answer(sock, rest)
        assert head.startswith(b"HTTP/1.1 200") and json.loads(answer)["object"] == "list"
        assert rest == b""


def test_http_1_0_and_connection_close(env):
    gw, key = env
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(chat(key, version=b"1.0"))
        head, _, _ = read_answer(sock)
        assert head.startswith(b"HTTP/1.0 200 OK\r\n") and b"\r\nConnection: close\r\n" in head
        assert closed(sock)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(chat(key, version=b"1.0", more=b"Connection: keep-alive\r\n") * 2)
        head, _, rest = read_answer(sock)
        assert b"\r\nConnection: keep-alive\r\n" in head
        assert read_answer(sock, rest)[0].startswith(b"HTTP/1.0 200")
    for said in (b"Connection: close\r\n", b"Connection: close\r\nConnection: x\r\n", b"Connection: x, Close\r\n"):
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
            sock.sendall(chat(key, more=said) + chat(key))
            head, _, _ = read_answer(sock)
            assert b"\r\nConnection: close\r\n" in head, said
            assert closed(sock)


def test_a_pipelined_head_that_stops_short_is_cut_at_the_header_timeout(env):
    # Not at the keep-alive timeout (75 s): the next request began with the last one's bytes.
    gw, key = env
    with socket.create_connection(("127.0.0.1", gw.port), timeout=60) as sock:
        sock.sendall(chat(key) + b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        _, _, rest = read_answer(sock)
        started = time.monotonic()
        head, body, _ = read_answer(sock, rest)
        assert time.monotonic() - started < 40
    assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"


def test_a_stream_is_chunked_and_the_connection_kept(env):
    gw, key = env
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(chat(key, body) + chat(key))
        got = b""
        while b"\r\n0\r\n\r\n" not in got:
            more = sock.recv(65536)
            assert more, got
            got += more
        head, _, rest = got.partition(b"\r\n\r\n")
        assert b"\r\nTransfer-Encoding: chunked\r\n" in head and b"Content-Length" not in head
        chunks, after = rest.split(b"\r\n0\r\n\r\n", 1)
        assert b"data: [DONE]" in chunks
        assert read_answer(sock, after)[0].startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("path", ["fast", "gunicorn's"])
def test_a_client_that_stops_reading_its_stream_is_closed_and_the_engine_stopped(env, path):
    gw, key = env
    sent = 'llmgw_client_timeouts_total{phase="send"}'
    before = sum(float(line.rsplit(" ", 1)[1]) for line in gw.metrics().splitlines() if line.startswith(sent))
    rows = count_usage(gw.store_url, status=499)
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300_000,
                       "stream": True}).encode()
    request = chat(key, body) if path == "fast" else \
        odd(key, framing=b"Transfer-Encoding: chunked\r\n", body=chunked(body))  # gunicorn reads a chunked body
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # full at once: the gateway's sends wait
        sock.connect(("127.0.0.1", gw.port))
        sock.sendall(request)
        # Never read: once a send has waited gateway.send_timeout (2 s) the connection is closed.
        gw.metrics_once("a send timeout", lambda text: sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(sent)) > before, limit=90)
    wait_for_row = time.monotonic() + 60
    while count_usage(gw.store_url, status=499) <= rows:  # the stream ended as a client that left
        assert time.monotonic() < wait_for_row, "no usage row with status 499"
        time.sleep(0.2)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:  # the worker serves on
        sock.sendall(chat(key))
        assert read_answer(sock)[0].startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("model", ["liar", "nul"])
def test_an_engines_header_cannot_split_the_response(env, model):
    gw, key = env
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(chat(key, body))
        head, _, _ = read_answer(sock)
    assert head.startswith(b"HTTP/1.1 500") and b"stolen" not in head and b"\x00" not in head
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:  # the worker serves on
        sock.sendall(chat(key))
        assert read_answer(sock)[0].startswith(b"HTTP/1.1 200")


class Sent:
    """A socket that keeps what each send was handed."""

    def __init__(self):
        self.data = []

    def sendall(self, data):
        self.data.append(bytes(data))


def answered(minor: int, status: str, headers: list, *writes: bytes, keep=True) -> tuple[bytes, Answer]:
    sent = Sent()
    answer = Answer(sent, minor, keep)
    answer.start_response(status, headers)
    for data in writes:
        answer.write(data)
    answer.close()
    return b"".join(sent.data), answer


def test_an_answer_without_a_body_carries_none():
    data, _ = answered(1, "204 No Content", [("Content-Length", "3")], b"abc")
    assert b"Content-Length" not in data and data.endswith(b"\r\n\r\n") and b"Transfer-Encoding" not in data


def test_an_answer_of_unknown_length_is_chunked_or_ends_the_connection():
    data, answer = answered(1, "200 OK", [("Content-Type", "text/plain")], b"ab", b"", b"cd")
    assert data.endswith(b"\r\n\r\n2\r\nab\r\n2\r\ncd\r\n0\r\n\r\n") and answer.keep
    data, answer = answered(0, "200 OK", [("Content-Type", "text/plain")], b"ab")
    assert data.endswith(b"\r\n\r\nab") and b"Connection: close" in data and not answer.keep


def test_the_head_goes_out_with_the_first_bytes_of_the_body():
    sent = Sent()
    answer = Answer(sent, 1, True)
    answer.start_response("200 OK", [("Content-Length", "5")])
    answer.write(b"hello")
    answer.close()
    assert len(sent.data) == 1 and sent.data[0].endswith(b"\r\n\r\nhello")


def test_an_answer_keeps_the_connections_own_headers_and_its_length():
    data, answer = answered(1, "200 OK", [("Content-Length", "3"), ("Connection", "upgrade"), ("X-A", "1"),
                                          ("transfer-encoding", "gzip")], b"abcdef")
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"upgrade" not in head and b"gzip" not in head and b"\r\nX-A: 1" in head and body == b"abc"
    data, answer = answered(1, "200 OK", [("Content-Length", "9")], b"abc")
    assert not answer.keep  # short of its length: the connection cannot serve another


@pytest.mark.parametrize("status", ["99 Odd", "200", "abc OK", "200 OK\r\nX: 1", 200])
def test_a_status_that_is_not_one_is_the_apps_error(status):
    answer = Answer(Sent(), 1, True)
    if status == "200":
        answer.start_response(status, [])  # a code alone is one
        return
    with pytest.raises(ValueError):
        answer.start_response(status, [])


@pytest.mark.parametrize("headers", [[("X-A", "a\x00b")], [("X A", "b")], [("X-A", "a\x7f")],
                                     [("X-A", "a\r\nSet-Cookie: s=1")], [("Set-Cookie: s=1\r\nX-A", "a")],
                                     [("X-A: b", "c")], [("", "c")], [("X-A", 5)], [(b"X-A", "c")]])
def test_a_header_that_is_not_one_is_the_apps_error(headers):
    from gunicorn.http.errors import InvalidResponseHeader, InvalidResponseHeaderName

    with pytest.raises((InvalidResponseHeader, InvalidResponseHeaderName)):
        answered(1, "200 OK", headers, b"")


class Feed:
    """A connection's reads: the pieces given, then the end."""

    def __init__(self, *pieces: bytes):
        self.pieces = list(pieces)
        self.answered = False

    def recv(self, size: int) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""


def test_a_body_is_read_from_what_came_with_the_head_then_the_connection():
    body = Body(Feed(b"lo\nwor", b"ld\nNEXT"), b"hel", 12)
    assert body.readline() == b"hello\n" and list(body) == [b"world\n"] and body.read() == b""
    assert body.left == 0 and body.buf == b"NEXT"  # the next request's, left to the connection
    short = Body(Feed(b"ab"), b"", 10)
    assert short.read(5) == b"ab" and not short.drain()  # the client stopped sending
