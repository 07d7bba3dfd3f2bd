"""deploy/ha/ in front of two real gateways: Debian's nginx with the shipped proxy settings
(deploy/ha/llmgw-locations.conf, included as nginx.conf there includes it), terminating TLS.

Streams pass unbuffered, the forwarded headers reach the gateways, and with one gateway killed no new
request fails.
"""

import http.client
import os
import signal
import ssl
import subprocess
import time

import pytest

from llmgw.procs import free_port, wait_for
from tests.conftest import ROOT, make_key, stop_process

NGINX = "/usr/sbin/nginx"
SNIPPET = os.path.join(ROOT, "deploy", "ha", "llmgw-locations.conf")
WAIT = 30.0
CHAT = {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def test_the_shipped_configuration_includes_the_tested_settings():
    with open(os.path.join(ROOT, "deploy", "ha", "nginx.conf")) as f:
        shipped = f.read()
    assert "upstream llmgw_gateways" in shipped and "include /etc/nginx/llmgw-locations.conf;" in shipped


@pytest.fixture
def proxied(tmp_path, make_sim, make_gateway):
    """(nginx's port, the two gateways, a key): nginx with TLS before two gateways on one store and engine."""
    sim = make_sim(tokens_per_s=10, ttft_ms=0, default_tokens=20)
    url = f"sqlite:///{tmp_path}/shared.db"
    endpoints = [{"id": "sim-1", "url": sim.url, "models": ["sim"]}]
    key = make_key(url)  # before the gateways start, which read the keys then
    gateways = [make_gateway(store_url=url, endpoints=endpoints, workers=1, gateway__trusted_proxies=["127.0.0.1"])
                for _ in range(2)]
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=llm.example.org", "-keyout", str(tmp_path / "tls.key"), "-out", str(tmp_path / "tls.crt")],
                   check=True, capture_output=True)
    port = free_port()
    upstreams = "\n".join(f"server 127.0.0.1:{gw.port} max_fails=1 fail_timeout=5s;" for gw in gateways)
    temp = " ".join(f"{kind}_temp_path {tmp_path}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi",
                                                                       "scgi"))
    (tmp_path / "nginx.conf").write_text(f"""
{"user root;" if os.getuid() == 0 else ""}
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/nginx-error.log;
daemon off;
events {{}}
http {{
    access_log {tmp_path}/nginx-access.log;
    {temp}
    upstream llmgw_gateways {{
        {upstreams}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {tmp_path}/tls.crt;
        ssl_certificate_key {tmp_path}/tls.key;
        include {SNIPPET};
    }}
}}
""")
    proc = subprocess.Popen([NGINX, "-c", str(tmp_path / "nginx.conf"), "-p", str(tmp_path), "-e",
                             str(tmp_path / "nginx-error.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for("nginx to answer", WAIT, lambda: status(port, "GET", "/health") == 200,
                 alive=lambda: proc.poll() is None)
        yield port, gateways, key
    finally:
        stop_process(proc, signal.SIGQUIT)


def connection(port: int) -> http.client.HTTPSConnection:
    return http.client.HTTPSConnection("127.0.0.1", port, timeout=60, context=ssl._create_unverified_context())


def status(port: int, method: str, path: str, body=None, headers=None) -> int | None:
    try:
        conn = connection(port)
        conn.request(method, path, body=body, headers=headers or {})
        answer = conn.getresponse()
        answer.read()
        conn.close()
        return answer.status
    except OSError:
        return None


def test_a_stream_passes_as_it_is_made(proxied):
    import json

    port, _, key = proxied
    conn = connection(port)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**CHAT, "max_tokens": 20, "stream": True}),
                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    sent = time.monotonic()
    answer = conn.getresponse()
    assert answer.status == 200 and answer.getheader("Content-Type", "").startswith("text/event-stream")
    first = None
    while line := answer.readline():
        if line.startswith(b"data: {") and first is None:
            first = time.monotonic() - sent
    took = time.monotonic() - sent
    # 20 tokens at 10 a second: about 2 s in all. A buffering proxy would hand over the first token at the end.
    assert took >= 1.5 and first < took - 1.0, (first, took)
    conn.close()


def test_the_gateways_see_the_host_and_scheme_the_client_used(proxied):
    port, _, _ = proxied
    conn = connection(port)
    conn.request("GET", "/", headers={"Host": "llm.example.org"})
    page = conn.getresponse().read().decode()
    assert "https://llm.example.org/v1" in page  # X-Forwarded-Proto and Host, believed from a trusted proxy
    conn.close()


def test_with_one_gateway_killed_no_new_request_fails(proxied):
    import json

    port, gateways, key = proxied
    body = json.dumps(CHAT)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    assert [status(port, "POST", "/v1/chat/completions", body, headers) for _ in range(10)] == [200] * 10
    gateways[0].proc.send_signal(signal.SIGKILL)
    gateways[0].proc.wait(timeout=WAIT)
    # nginx skips the gateway that refuses connections, and resends what the dying one dropped unanswered.
    assert [status(port, "POST", "/v1/chat/completions", body, headers) for _ in range(40)] == [200] * 40
