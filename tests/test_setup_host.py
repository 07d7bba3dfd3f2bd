"""A Host header no page can build a URL from, sent over a raw socket to a real gateway: `/setup/<tool>` and every
other page answer 400 in plain text that says what to send, and that runs nothing when piped to sh (never a 500,
which blamed the operator, or gunicorn's bare one); a plain Host still gets its script."""

import socket
import subprocess

import pytest

from tests.conftest import Gateway, Sim

# What a hostile or broken client can put in a Host header, and what gunicorn lets through to the pages.
BAD_HOSTS = [b"", b"two words", b"example.org/path", b"example.org?x=1", "exämple.org".encode(), b"\xe4.example.org",
             b"x" * 5000, b"..", b"a..b.example.org", b"-leading.example.org", b"host:99999", b"host:0", b"host:abc",
             b"host:", b"[::1", b"[::g]:80", b"$(touch pwned)", b"a'b", b"a\tb", b"user@host", b"a,b",
             "a\u2028b".encode()]
# Refused by gunicorn itself, before the pages: still a 400.
UNREADABLE_HOSTS = [b"a\rb", b"a\x00b", b"a\x7fb"]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("setup-host")
    sim = Sim(model="sim", replica="s", ttft_ms=1, tokens_per_s=0)
    try:
        gw = Gateway(tmp, f"sqlite:///{tmp}/gw.db", workers=1, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}])
    except Exception:
        sim.stop()
        raise
    yield gw
    gw.stop()
    sim.stop()


def get(gw, path: str, host: bytes) -> tuple[int, dict, bytes]:
    """GET PATH with exactly HOST as its Host header: status, headers (lower-case names), body."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as s:
        s.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((name.strip().lower(), value.strip()) for name, _, value in (h.partition(":") for h in lines[1:]))
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("host", BAD_HOSTS, ids=lambda h: ascii(h[:20]))
def test_a_bad_host_gets_a_400_that_runs_nothing_in_sh(gateway, host, tmp_path):
    status, headers, body = get(gateway, "/setup/codex?model=sim", host)
    assert status == 400, body
    assert headers["content-type"].startswith("text/plain")
    assert b"Host header" in body and b"Send the gateway's own address" in body
    # Piped to sh (`curl -sSL ... | sh`, without -f): it says why on stderr, exits 1, and does nothing else.
    run = subprocess.run(["sh"], input=body, capture_output=True, cwd=tmp_path, env={"HOME": str(tmp_path),
                                                                                     "PATH": "/usr/bin:/bin"})
    assert run.returncode == 1 and b"is not a host name this gateway can answer to" in run.stderr
    assert run.stdout == b"" and list(tmp_path.iterdir()) == []
    for path in ("/", "/login", "/no-such-page"):
        assert get(gateway, path, host)[0] == 400, path


@pytest.mark.parametrize("host", UNREADABLE_HOSTS, ids=ascii)
def test_a_host_with_control_characters_never_reaches_the_pages(gateway, host):
    status, _, body = get(gateway, "/setup/codex?model=sim", host)
    assert status == 400 and b"Invalid control character" in body


@pytest.mark.parametrize("host", [b"gateway.example.org:8443", b"[::1]:8080", b"127.0.0.1:80", b"LLM.Example.ORG."])
def test_a_plain_host_gets_its_script(gateway, host):
    status, _, body = get(gateway, "/setup/codex?model=sim", host)
    assert status == 200 and body.startswith(b"#!/bin/sh")
    assert b"http://" + host.lower().removesuffix(b":80") in body.lower()
