"""The engine client against a scripted HTTP server on loopback: framings, keep-alive, each timeout."""

import select
import socket
import threading
import time

import pytest

from llmgw.gateway.upstream import Pool, Target, UpstreamError
from llmgw.procs import wait_for
from tests.conftest import SocketStub


class Scripted(SocketStub):
    """A server that answers each connection's requests with the next scripted replies: bytes to send, seconds
    to pause, or "close". A pause ends early when the client hangs up, and `hangups` has the time it did."""

    def __init__(self, replies, host="127.0.0.1", name=None):
        self.replies = list(replies)
        self.requests = []
        self.hangups: list[float] = []
        super().__init__(host, name)

    def answer(self, conn):
        try:
            self.reply(conn)
        except (ConnectionResetError, BrokenPipeError):
            self.hangups.append(time.monotonic())
        except (OSError, ValueError, IndexError):
            pass  # the test is over
        finally:
            conn.close()

    def pause(self, conn, seconds: float) -> bool:
        """SECONDS of silence, or less when the client hangs up: then True."""
        until = time.monotonic() + seconds
        if select.select([conn], [], [], seconds)[0] and not conn.recv(1, socket.MSG_PEEK):
            self.hangups.append(time.monotonic())
            return True
        time.sleep(max(0.0, until - time.monotonic()))  # what the client sent meanwhile waits its turn
        return False

    def reply(self, conn):
        buf = b""
        while self.replies:
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            head, buf = buf.split(b"\r\n\r\n", 1)
            lengths = [h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
            length = int(lengths[0].split(b":")[1]) if lengths else 0  # a GET of urllib's has none
            while len(buf) < length:
                buf += conn.recv(65536)
            self.requests.append(head + b"\r\n\r\n" + buf[:length])
            buf = buf[length:]
            reply = self.replies.pop(0)
            for part in reply if isinstance(reply, list) else [reply]:
                if isinstance(part, (int, float)):
                    if self.pause(conn, part):
                        return
                elif part == "close":
                    conn.close()
                    return
                else:
                    conn.sendall(part)
        conn.close()


@pytest.fixture
def pool():
    pool = Pool(connect_timeout=1)
    yield pool
    pool.close()


def ok(body=b"hello", extra=b""):
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def test_content_length_and_keep_alive_reuse(pool):
    server = Scripted([ok(b"one"), ok(b"two")])
    target = Target(server.url)
    for expected in (b"one", b"two"):
        resp = pool.request(target, "POST", "/v1/x", b'{"a":1}')
        assert resp.status == 200 and resp.read() == expected
        resp.release()
    assert server.connections == 1
    assert server.requests[0].startswith(b"POST /v1/x HTTP/1.1\r\n") and server.requests[0].endswith(b'{"a":1}')
    server.close()


def test_chunked_body_streams_piece_by_piece(pool):
    chunks = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"5\r\nhello\r\n", 0.2,
              b"6;ext=1\r\n world\r\n", b"0\r\n\r\n"]
    server = Scripted([chunks])
    resp = pool.request(Target(server.url), "POST", "/", b"")
    pieces = []
    started = time.monotonic()
    for piece in resp.iter_body(idle=5):
        pieces.append((piece, time.monotonic() - started))
    assert b"".join(p for p, _ in pieces) == b"hello world"
    assert pieces[0][1] < 0.15  # the first piece did not wait for the rest
    assert resp.done
    resp.release()
    server.close()


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_the_chunks_one_read_brings_come_out_as_one_piece(pool):
    # An engine writes an event a chunk; what one read brings is handed on at once, for one write to the client.
    events = [b"data: %d\n\n" % i for i in range(5)]
    server = Scripted([[CHUNKED, b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events), 0.3, b"0\r\n\r\n"]])
    resp = pool.request(Target(server.url), "POST", "/", b"")
    assert list(resp.iter_body(idle=5)) == [b"".join(events)]
    assert resp.done
    resp.release()
    server.close()


def test_a_chunked_body_cut_anywhere_between_reads_comes_out_whole(pool):
    cuts = [b"5\r", b"\nhel", b"lo\r", b"\n6;x=1\r\n wor", b"ld\r\n0\r", b"\nTrailer: t\r\n", b"\r\nnext"]
    server = Scripted([[CHUNKED, *(part for cut in cuts for part in (cut, 0.05))]])
    resp = pool.request(Target(server.url), "POST", "/", b"")
    assert b"".join(resp.iter_body(idle=5)) == b"hello world"
    assert resp.done and resp.conn.buf == b"next"  # past the trailers, and not a byte further
    resp.abort()
    server.close()


def test_a_bad_chunk_size_is_a_protocol_error(pool):
    server = Scripted([[CHUNKED, b"5\r\nhello\r\nzz\r\n"]])
    resp = pool.request(Target(server.url), "POST", "/", b"")
    pieces = resp.iter_body(idle=5)
    assert next(pieces) == b"hello"
    with pytest.raises(UpstreamError) as e:
        next(pieces)
    assert e.value.phase == "protocol"
    resp.abort()
    server.close()


def test_close_delimited_body(pool):
    server = Scripted([[b"HTTP/1.1 200 OK\r\n\r\nuntil the end", "close"]])
    resp = pool.request(Target(server.url), "POST", "/", b"")
    assert resp.read() == b"until the end"
    resp.release()
    server.close()


def test_a_kept_alive_connection_the_engine_closed_is_retried_on_a_fresh_one(pool):
    server = Scripted([[ok(b"first"), "close"], ok(b"second")])
    target = Target(server.url)
    resp = pool.request(target, "POST", "/", b"")
    assert resp.read() == b"first"
    resp.release()
    time.sleep(0.1)  # the server has closed its end meanwhile
    resp = pool.request(target, "POST", "/", b"")
    assert resp.read() == b"second"
    resp.release()
    assert server.connections == 2
    server.close()


def test_connection_refused(pool):
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{port.getsockname()[1]}"
    port.close()
    with pytest.raises(UpstreamError) as e:
        pool.request(Target(url), "POST", "/", b"")
    assert e.value.phase == "connect"


def test_first_byte_timeout(pool):
    server = Scripted([[2.0, ok()]])
    started = time.monotonic()
    with pytest.raises(UpstreamError) as e:
        pool.request(Target(server.url), "POST", "/", b"", first_byte=0.3)
    assert e.value.phase == "first_byte" and time.monotonic() - started < 1.5
    server.close()


def test_idle_and_total_timeouts_while_streaming(pool):
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server = Scripted([[head, b"1\r\na\r\n", 3.0, b"0\r\n\r\n"], [head] + [b"1\r\na\r\n", 0.2] * 20])
    resp = pool.request(Target(server.url), "POST", "/", b"")
    with pytest.raises(UpstreamError) as e:
        list(resp.iter_body(idle=0.3))
    assert e.value.phase == "idle"
    resp.abort()
    resp = pool.request(Target(server.url), "POST", "/", b"", deadline=time.monotonic() + 0.7)
    with pytest.raises(UpstreamError) as e:
        list(resp.iter_body(idle=5))
    assert e.value.phase == "total"
    resp.abort()
    server.close()


def test_a_streams_first_event_may_take_first_byte_and_later_ones_idle(pool):
    # A streaming engine sends its head at once and its first event once it has read the prompt: llama.cpp
    # on two CPU cores took over a minute for a coding agent's, and was cut off at idle as if it had stalled.
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server = Scripted([[head, 0.8, b"1\r\na\r\n", b"0\r\n\r\n"], [head, 2.0, b"1\r\na\r\n"]])
    resp = pool.request(Target(server.url), "POST", "/", b"", first_byte=3.0)
    assert b"".join(resp.iter_body(idle=0.3)) == b"a"
    resp.release()
    started = time.monotonic()
    resp = pool.request(Target(server.url), "POST", "/", b"", first_byte=0.6)
    with pytest.raises(UpstreamError) as e:
        list(resp.iter_body(idle=0.3))
    assert e.value.phase == "first_byte" and time.monotonic() - started < 1.5
    resp.abort()
    server.close()


def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_deadline(pool):
    trickle = [part for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100 for part in (bytes([byte]), 0.1)]
    server = Scripted([trickle])
    started = time.monotonic()
    with pytest.raises(UpstreamError) as e:
        pool.request(Target(server.url), "GET", "/", first_byte=5, deadline=time.monotonic() + 0.7)
    assert e.value.phase == "total" and time.monotonic() - started < 2.5
    wait_for("the server to see its client leave", 10, lambda: server.hangups)
    server.close()


def test_engine_hanging_up_mid_body_is_an_error(pool):
    server = Scripted([[b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", "close"]])
    resp = pool.request(Target(server.url), "POST", "/", b"")
    with pytest.raises(UpstreamError) as e:
        resp.read()
    assert e.value.phase == "closed"
    resp.abort()
    server.close()


def test_abort_from_another_thread_wakes_the_reader(pool):
    server = Scripted([[b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", 5.0]])
    resp = pool.request(Target(server.url), "POST", "/", b"")
    threading.Timer(0.2, resp.abort).start()
    started = time.monotonic()
    with pytest.raises(UpstreamError):
        list(resp.iter_body(idle=10))
    assert time.monotonic() - started < 2 and resp.closed_by_other
    server.close()


def test_not_http(pool):
    server = Scripted([[b"SSH-2.0-OpenSSH\r\n\r\n", "close"]])
    with pytest.raises(UpstreamError) as e:
        pool.request(Target(server.url), "POST", "/", b"")
    assert e.value.phase == "protocol"
    server.close()


@pytest.mark.parametrize("line", [b"HTTP/1.1 099 Odd", b"HTTP/1.1 -1 Odd", b"HTTP/1.1 600 Odd", b"HTTP/1.1 2000 OK",
                                  b"HTTP/1.1 101 Switching Protocols", "HTTP/1.1 2\u00b20 OK".encode("latin-1")])
def test_a_status_outside_https_is_a_protocol_error(pool, line):
    # Passed on, it broke the client's reading: a 99 carries no body, and the client took the next answer for it.
    server = Scripted([[line + b"\r\nContent-Length: 2\r\n\r\nhi", "close"]])
    with pytest.raises(UpstreamError) as e:
        pool.request(Target(server.url), "POST", "/", b"")
    assert e.value.phase == "protocol"
    server.close()


def test_interim_answers_are_passed_over(pool):
    server = Scripted([b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n" + ok(b"real")])
    resp = pool.request(Target(server.url), "POST", "/", b"")
    assert resp.status == 200 and resp.read() == b"real"
    resp.release()
    server.close()


@pytest.mark.parametrize("host,name", [("127.0.0.1", None), ("::1", None), ("127.0.0.1", "localhost")])
def test_an_engine_at_an_address_or_a_name(pool, host, name):
    """Addresses are connected to without a lookup (see Pool._open), names through one."""
    if ":" in host and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        server = Scripted([ok()], host, name)
    except OSError as e:
        pytest.skip(f"cannot listen on {host}: {e}")
    resp = pool.request(Target(server.url), "POST", "/", b"{}")
    assert (resp.status, resp.read()) == (200, b"hello")
    resp.release()
    server.close()


def test_target_parses_once():
    t = Target("http://10.0.0.5:8001/prefix/")
    assert (t.host, t.port, t.tls, t.base_path) == ("10.0.0.5", 8001, False, "/prefix")
    with pytest.raises(ValueError):
        Target("ftp://x")
