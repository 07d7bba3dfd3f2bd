"""deploy/ha/ in front of two real gateways, terminating TLS: Debian's nginx with the shipped proxy
settings (deploy/ha/llmgw-locations.conf, included as nginx.conf there includes it), and Debian's Caddy
with the shipped Caddyfile itself (its site and gateways given in the environment).

Through each, streams pass unbuffered, the forwarded headers reach the gateways, and with one gateway
killed no new request fails.
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
CADDY = "/usr/bin/caddy"
SNIPPET = os.path.join(ROOT, "deploy", "ha", "llmgw-locations.conf")
CADDYFILE = os.path.join(ROOT, "deploy", "ha", "Caddyfile")
WAIT = 30.0
CHAT = {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def test_the_shipped_configuration_includes_the_tested_settings():
    with open(os.path.join(ROOT, "deploy", "ha", "nginx.conf")) as f:
        shipped = f.read()
    assert "upstream llmgw_gateways" in shipped and "include /etc/nginx/llmgw-locations.conf;" in shipped


@pytest.fixture(params=["nginx", "caddy"])
def proxied(request, tmp_path, make_sim, make_gateway):
    """(the proxy's port, the Host clients use, the two gateways, a key): the proxy with TLS before two
    gateways on one store and engine."""
    sim = make_sim(tokens_per_s=10, ttft_ms=0, default_tokens=20)
    url = f"sqlite:///{tmp_path}/shared.db"
    endpoints = [{"id": "sim-1", "url": sim.url, "models": ["sim"]}]
    key = make_key(url)  # before the gateways start, which read the keys then
    gateways = [make_gateway(store_url=url, endpoints=endpoints, workers=1, gateway__trusted_proxies=["127.0.0.1"])
                for _ in range(2)]
    port = free_port()
    start = start_nginx if request.param == "nginx" else start_caddy
    proc, host = start(tmp_path, port, gateways)
    try:
        try:
            wait_for(f"{request.param} to answer", WAIT, lambda: status(port, "GET", "/health", host=host) == 200,
                     alive=lambda: proc.poll() is None)
        except (RuntimeError, TimeoutError) as e:
            logs = "".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob(f"{request.param}*.log"))
            raise RuntimeError(f"{e}; its log ends:\n{logs}") from None
        yield port, host, gateways, key
    finally:
        stop_process(proc, signal.SIGQUIT if request.param == "nginx" else signal.SIGTERM)


def start_nginx(tmp_path, port: int, gateways) -> tuple[subprocess.Popen, str]:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=llm.example.org", "-keyout", str(tmp_path / "tls.key"), "-out", str(tmp_path / "tls.crt")],
                   check=True, capture_output=True)
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
    return subprocess.Popen([NGINX, "-c", str(tmp_path / "nginx.conf"), "-p", str(tmp_path), "-e",
                             str(tmp_path / "nginx-error.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT), "llm.example.org"


def start_caddy(tmp_path, port: int, gateways) -> tuple[subprocess.Popen, str]:
    # localhost gets a certificate from Caddy's own authority, with no network; its data stays in tmp_path.
    env = {**os.environ, "LLMGW_SITE": f"https://localhost:{port}", "CADDY_ADMIN": "off",
           "CADDY_HTTP_PORT": str(free_port()),  # not the machine's port 80, which anything may hold
           "LLMGW_GATEWAYS": " ".join(f"127.0.0.1:{gw.port}" for gw in gateways),
           "XDG_DATA_HOME": str(tmp_path / "caddy-data"), "XDG_CONFIG_HOME": str(tmp_path / "caddy-config")}
    log = open(tmp_path / "caddy.log", "wb")
    proc = subprocess.Popen([CADDY, "run", "--config", CADDYFILE, "--adapter", "caddyfile"], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, f"localhost:{port}"


class Connection(http.client.HTTPSConnection):
    """A TLS connection to 127.0.0.1 that names HOST (the site's name) to the proxy, certificate unchecked."""

    def __init__(self, port: int, host: str):
        super().__init__("127.0.0.1", port, timeout=60, context=ssl._create_unverified_context())
        self.server_name = host.split(":")[0] if host else None

    def connect(self):
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self.server_name)


def proxied_log(gateway):
    """Caddy's log, beside the gateways' files."""
    return gateway.log_path.parent / "caddy.log"


def connection(port: int, host: str = "") -> http.client.HTTPSConnection:
    return Connection(port, host)


def status(port: int, method: str, path: str, body=None, headers=None, host: str = "") -> int | None:
    try:
        conn = connection(port, host)
        conn.request(method, path, body=body, headers={**({"Host": host} if host else {}), **(headers or {})})
        answer = conn.getresponse()
        answer.read()
        conn.close()
        return answer.status
    except OSError:
        return None


def test_a_stream_passes_as_it_is_made(proxied):
    import json

    port, host, _, key = proxied
    conn = connection(port, host)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**CHAT, "max_tokens": 20, "stream": True}),
                 headers={"Host": host, "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
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
    port, host, _, _ = proxied
    conn = connection(port, host)
    conn.request("GET", "/", headers={"Host": host})
    page = conn.getresponse().read().decode()
    assert f"https://{host}/v1" in page  # X-Forwarded-Proto and Host, believed from a trusted proxy
    conn.close()


def test_with_one_gateway_killed_no_new_request_fails(proxied):
    import json

    port, host, gateways, key = proxied
    body = json.dumps(CHAT)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    assert [status(port, "POST", "/v1/chat/completions", body, headers, host) for _ in range(10)] == [200] * 10
    gateways[0].proc.send_signal(signal.SIGKILL)
    gateways[0].proc.wait(timeout=WAIT)
    if host.startswith("localhost"):
        # Caddy 2.6 cannot resend a request the dying gateway dropped: it fails until /ready is polled.
        log = proxied_log(gateways[0])
        wait_for("Caddy's health check to notice", WAIT,
                 lambda: f"127.0.0.1:{gateways[0].port}/ready" in log.read_text())
    # The proxy skips the gateway that refuses connections (nginx also resends what the dying one dropped).
    answers = [status(port, "POST", "/v1/chat/completions", body, headers, host) for _ in range(40)]
    assert answers == [200] * 40


@pytest.mark.parametrize("name", ["controller-a.toml", "gateway.toml", "agent.toml"])
def test_the_example_configurations_are_valid(tmp_path, name):
    from llmgw import settings

    # Their secrets are files on the real machines; here, files of the test's own.
    (tmp_path / "postgres.url").write_text("postgresql://llmgw@db.internal/llmgw\n")
    (tmp_path / "admin.token").write_text("t" * 43 + "\n")
    with open(os.path.join(ROOT, "deploy", "ha", name)) as f:
        text = f.read().replace("@/etc/llmgw/postgres.url", f"@{tmp_path}/postgres.url").replace(
            "@/etc/llmgw/admin.token", f"@{tmp_path}/admin.token")
    (tmp_path / name).write_text(text)
    cfg = settings.load(str(tmp_path / name))
    if name == "gateway.toml":
        assert cfg["gateway.controller"] == ["ctl-a.internal:7444", "ctl-b.internal:7444"]
    if name == "controller-a.toml":
        assert cfg["controller.lease_ttl"] > cfg["controller.lease_renew_interval"]
