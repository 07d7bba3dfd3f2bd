"""Streams through a gateway worker: a thousand at once all complete, and each engine read goes out in one
write without waiting for more."""

import json
import socket
import subprocess
import sys
import threading

from llmgw.gateway.sse import DONE
from llmgw.procs import wait_for
from tests.conftest import ROOT, SocketStub, count_usage, make_key

STREAMS = 1000


def test_a_thousand_concurrent_streams_complete(tmp_path, make_gateway, make_sim):
    # Every stream's first token waits until all of them are open at once (the engine's peak proves it),
    # however long a busy machine takes to open a thousand connections; then ten tokens at ten a second.
    sim = make_sim(replica="s", ttft_ms=120_000, tokens_per_s=10, gather=STREAMS)
    url = f"sqlite:///{tmp_path}/streams.db"
    key = make_key(url)
    gw = make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=1)
    run = subprocess.run([sys.executable, f"{ROOT}/bench/loadgen.py", "--url", gw.url, "--key", key, "--stream",
                          "--max-tokens", "10", "--requests", str(STREAMS), "--concurrency", str(STREAMS),
                          "--timeout", "180"], capture_output=True, text=True, timeout=300)
    result = json.loads(run.stdout)
    assert result["ok"] == STREAMS and result["failed"] == 0, result
    assert sim.metrics()["llmgw_sim_running_peak"] == STREAMS
    assert "Traceback" not in gw.log()


def sse(delta: dict | None = None, usage: dict | None = None) -> bytes:
    body = {"choices": [{"index": 0, "delta": delta}] if delta else [], **({"usage": usage} if usage else {})}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class OneStreamEngine(SocketStub):
    """An engine that answers a chat stream with one event, waits until `sent_on` is set, then sends the rest,
    an HTTP chunk an event as engines write them, all in one packet. Anything else it answers with a 404."""

    def __init__(self, rest: list[bytes]):
        self.rest = rest
        self.sent_on = threading.Event()
        super().__init__()

    def answer(self, conn):
        with conn:
            if (head := self.read_head(conn)) is None:
                return
            if not head.startswith(b"POST /v1/chat/completions "):
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + http_chunk(sse({"content": "a"})))
            if self.sent_on.wait(30):
                conn.sendall(b"".join(http_chunk(event) for event in self.rest) + b"0\r\n\r\n")


def read_chunks(sock: socket.socket):
    """The gateway's chunked response on SOCK, one HTTP chunk (one write of the gateway's) at a time."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, buf = buf.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
    while True:
        while b"\r\n" not in buf:
            buf += sock.recv(65536)
        size, buf = buf.split(b"\r\n", 1)
        size = int(size, 16)
        while len(buf) < size + 2:
            buf += sock.recv(65536)
        if not size:
            return
        yield buf[:size]
        buf = buf[size + 2:]


def test_what_one_engine_read_brings_goes_out_in_one_write_and_a_lone_first_event_at_once(tmp_path, make_gateway):
    tokens = [sse({"content": c}) for c in "bcde"]
    usage = sse(usage={"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
    engine = OneStreamEngine([*tokens, usage, DONE])
    url = f"sqlite:///{tmp_path}/onesend.db"
    key = make_key(url)
    gw = make_gateway(store_url=url, endpoints=[{"id": "e", "url": engine.url, "models": ["m"]}], workers=1)
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        chunks = read_chunks(sock)
        # The engine sends the rest only once the client has the first event: held back, it never would.
        assert next(chunks) == sse({"content": "a"})
        engine.sent_on.set()
        # The four tokens and [DONE] came in one read: one write (the usage event the client did not ask for
        # is dropped).
        assert list(chunks) == [b"".join(tokens) + DONE]
    wait_for("the stream's usage row", 30, lambda: count_usage(url, completion_tokens=5) == 1)
    engine.close()
