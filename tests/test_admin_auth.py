"""Strangers are refused by the controller's admin API (its token, and the Host check) and by the mirror's
management API (the Host check), with real processes; `llmgw ctl` and the pages get in with the token from
the configuration."""

import http.client
import json
import os
import subprocess
import sys

import pytest

from llmgw import settings, store
from llmgw.apiguard import HostCheck, bearer_matches
from llmgw.people import accounts, keys
from llmgw.procs import free_port, http_status, wait_for
from tests.cluster import Controller
from tests.conftest import ROOT, stop_process, write_config

PASSWORD = "a long enough password"


def ask(port, method, path, headers=None, body=None):
    """(status, JSON body, headers) of one request, with exactly the headers given (Host included)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null"), resp.headers
    finally:
        conn.close()


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    c = Controller(tmp_path_factory.mktemp("admin"), controller__admin_names=["ctl.example"])
    yield c
    c.stop()


def test_the_admin_api_wants_its_token(controller):
    port, token = controller.admin_port, controller.token()
    status, body, headers = ask(port, "GET", "/api/v1/nodes")
    assert status == 401 and "Authorization: Bearer" in body["error"] and "admin.token" in body["error"]
    assert headers["WWW-Authenticate"].startswith("Bearer")
    status, body, _ = ask(port, "GET", "/api/v1/nodes", {"Authorization": "Bearer " + token[:-1] + "x"})
    assert status == 401 and "not this controller's admin token" in body["error"]
    # Not even a header in latin-1 breaks the comparison: it is a refusal like any other.
    assert ask(port, "GET", "/api/v1/status", {"Authorization": "Bearer \xe9t\xe9"})[0] == 401
    assert ask(port, "GET", "/api/v1/nodes", {"Authorization": "Basic " + token})[0] == 401
    status, body, _ = ask(port, "GET", "/api/v1/nodes", {"Authorization": "Bearer " + token})
    assert status == 200 and body == {"nodes": []}


def test_no_node_key_is_issued_without_the_token(controller):
    status, _, _ = ask(controller.admin_port, "POST", "/api/v1/node-keys", body={"node_id": "intruder"})
    assert status == 401
    engine = store.open_engine(controller.values["store.url"])
    with engine.connect() as conn:
        assert conn.execute(store.node_keys.select()).all() == []
    engine.dispose()


def test_a_rebinding_host_is_refused_even_with_the_token(controller):
    port, bearer = controller.admin_port, {"Authorization": "Bearer " + controller.token()}
    for host in ("evil.example:9090", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}", "localhost:1",
                 f"10.0.0.1:{port}"):
        status, body, _ = ask(port, "GET", "/api/v1/nodes", {"Host": host, **bearer})
        assert status == 421, host
        assert "DNS rebinding" in body["error"] and "controller.admin_names" in body["error"]
    status, _, _ = ask(port, "POST", "/api/v1/node-keys", {"Host": f"evil.example:{port}", **bearer},
                       {"node_id": "intruder"})
    assert status == 421
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "ctl.example", "ctl.example:443"):
        assert ask(port, "GET", "/api/v1/status", {"Host": host, **bearer})[0] == 200, host


def test_the_token_file_is_private_and_ctl_reads_it_from_the_configuration(controller, tmp_path):
    path = os.path.join(controller.values["controller.keys_dir"], "admin.token")
    assert os.stat(path).st_mode & 0o777 == 0o600
    run = controller.ctl("nodes")
    assert run.returncode == 0 and "no node has registered yet" in run.stderr
    # Elsewhere, with no keys_dir to read: ctl says where it looked and how to get the token.
    elsewhere = write_config(tmp_path / "elsewhere.toml", {
        "controller.admin_listen": f"127.0.0.1:{controller.admin_port}",
        "controller.keys_dir": str(tmp_path / "none")})
    run = subprocess.run([sys.executable, "-m", "llmgw", "--config", elsewhere, "ctl", "nodes"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 1 and "wants its token" in run.stderr and str(tmp_path / "none") in run.stderr
    assert "controller.admin_token" in run.stderr
    # With a copy of the token given as controller.admin_token = "@/path", it works.
    (tmp_path / "copy").write_text(controller.token() + "\n")
    copied = write_config(tmp_path / "copied.toml", {
        "controller.admin_listen": f"127.0.0.1:{controller.admin_port}",
        "controller.keys_dir": str(tmp_path / "none"), "controller.admin_token": f"@{tmp_path / 'copy'}"})
    run = subprocess.run([sys.executable, "-m", "llmgw", "--config", copied, "ctl", "status"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and run.stdout.splitlines()[0] == "0 nodes", run.stderr


def test_the_cluster_page_says_when_it_has_no_token(controller, tmp_path):
    from llmgw.web.app import GatewayApp
    from tests.test_pages import sign_in

    url = f"sqlite:///{tmp_path}/pages.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    common = {"store.url": url, "gateway.controller": f"127.0.0.1:{controller.gateway_port}",
              "gateway.controller_admin": f"127.0.0.1:{controller.admin_port}"}
    for keys_dir, shown in ((str(tmp_path / "none"), "wants its token"),
                            (controller.values["controller.keys_dir"], "Nothing needs attention.")):
        app = GatewayApp(settings.load(None, {**common, "controller.keys_dir": keys_dir}), key_source=keys)
        try:
            client = app.pages.test_client()
            sign_in(client, "root@example.org", PASSWORD)
            assert shown in client.get("/admin").data.decode()
        finally:
            app.runtime.engine.dispose()
    engine.dispose()


def test_the_mirrors_management_api_refuses_a_rebinding_host(tmp_path):
    api = free_port()
    config = write_config(tmp_path / "mirror.toml", {
        "mirror.dir": str(tmp_path / "models"), "mirror.listen": f"127.0.0.1:{free_port()}",
        "mirror.api_listen": f"127.0.0.1:{api}", "mirror.metrics_listen": f"127.0.0.1:{free_port()}",
        "mirror.api_names": ["models.example"]})
    with open(tmp_path / "mirror.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "mirror.py"), "--config", config],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for("the mirror", 20, lambda: http_status(f"http://127.0.0.1:{api}/api/v1/health") == 200,
                 alive=lambda: proc.poll() is None)
        status, body, _ = ask(api, "POST", "/api/v1/models", {"Host": f"evil.example:{api}"},
                              {"source": "/etc/hostname", "model": "x", "version": "v1"})
        assert status == 421 and "mirror.api_names" in body["error"]
        assert ask(api, "GET", "/api/v1/models", {"Host": f"evil.example:{api}"})[0] == 421
        assert not os.path.exists(tmp_path / "models" / "x")
        token = (tmp_path / "models" / ".keys" / "api.token").read_text().strip()
        for host in (f"localhost:{api}", "models.example:8443"):
            assert ask(api, "GET", "/api/v1/models", {"Host": host, "Authorization": f"Bearer {token}"})[0] == 200, host
    finally:
        stop_process(proc)


def test_the_host_check_by_listener():
    wildcard = HostCheck(":8082", [], "mirror.api_names")
    assert wildcard.allows("10.1.2.3:8082") and wildcard.allows("[fe80::1]:8082") and wildcard.allows("localhost:8082")
    assert not wildcard.allows("models.internal:8082") and not wildcard.allows("10.1.2.3:8081")
    one = HostCheck("10.0.0.5:9090", ["ctl.internal"], "controller.admin_names")
    assert one.allows("10.0.0.5:9090") and one.allows("CTL.internal") and one.allows("ctl.internal:443")
    assert not one.allows("10.0.0.6:9090") and not one.allows("localhost:9090")
    loopback = HostCheck("127.0.0.1:80", [], "controller.admin_names")
    assert loopback.allows("localhost") and loopback.allows("[::1]") and loopback.allows("127.0.0.1:80")
    for bad in (None, "", "localhost:x", "localhost:", "::1", "[::1"):
        assert not HostCheck("127.0.0.1:9090", [], "controller.admin_names").allows(bad), bad


def test_an_empty_token_matches_nothing():
    assert not bearer_matches("Bearer ", "") and not bearer_matches(None, "")
    assert bearer_matches("bearer  abc ", "abc") and not bearer_matches("Bearer abcd", "abc")
