"""What a new user tripped over (issue 9): the CLI's help, tables and refusals, `llmgw up`'s start-up check
and the configuration it writes, and the pages' rough edges."""

import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from llmgw import settings, store
from llmgw.cli.main import main
from llmgw.people import accounts, keys, limits, orgtree
from tests.conftest import send_json, write_config
from tests.test_pages import sign_in, site, token  # noqa: F401  (the fixture and helpers)

PASSWORD = "a long enough password"


def every_command(group: click.Group, path=()):
    for name, command in group.commands.items():
        yield path + (name,), command
        if isinstance(command, click.Group):
            yield from every_command(command, path + (name,))


def test_every_command_has_help():
    missing = [" ".join(path) for path, command in every_command(main) if not (command.help or "").strip()]
    assert missing == []


def test_a_command_with_no_configuration_and_no_store_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LLMGW_CONFIG", raising=False)
    result = CliRunner().invoke(main, ["keys", "list"])
    assert result.exit_code == 1
    assert str(tmp_path / "var" / "llmgw.db") in result.output
    assert "--config" in result.output and "LLMGW_CONFIG" in result.output
    assert os.listdir(tmp_path) == []  # no empty store made here


def test_revoking_a_revoked_key_says_so(tmp_path):
    store_url = f"sqlite:///{tmp_path}/keys.db"
    engine = store.open_store(store_url)
    record, _ = keys.create_key(engine, "ci")
    engine.dispose()
    runner = CliRunner()
    first = runner.invoke(main, ["--store", store_url, "keys", "revoke", record.id])
    assert first.exit_code == 0 and "revoked key" in first.output
    again = runner.invoke(main, ["--store", store_url, "keys", "revoke", record.id])
    assert again.exit_code == 0 and "was already revoked" in again.output and "nothing changed" in again.output


class FakeMirror(BaseHTTPRequestHandler):
    """The mirror's management API, answering one canned status."""
    answer: dict = {}

    def do_GET(self):
        body = json.dumps(self.answer).encode()
        self.send_response(404 if self.answer["state"] == "absent" else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_mirror(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeMirror)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = tmp_path / "llmgw.toml"
    config.write_text(f'[mirror]\napi = "127.0.0.1:{server.server_address[1]}"\n')
    yield str(config)
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_mirror_status_prints_a_table(fake_mirror, monkeypatch):
    monkeypatch.setattr(FakeMirror, "answer", {
        "model": "smollm2", "version": "1", "state": "present", "bytes": 3 * 1024 * 1024,
        "url": "http://127.0.0.1:8081/smollm2/1/",
        "files": [{"name": "a.gguf", "size": 3 * 1024 * 1024, "sha256": "ab" * 32}]})
    result = CliRunner().invoke(main, ["--config", fake_mirror, "mirror", "status", "smollm2", "1"])
    assert result.exit_code == 0, result.output
    assert "smollm2/1 is present: 1 file(s), 3 MiB" in result.output
    assert "FILE    SIZE   SHA256" in result.output and "a.gguf  3 MiB  " + "ab" * 32 in result.output
    assert "{" not in result.output
    monkeypatch.setattr(FakeMirror, "answer", {
        "model": "smollm2", "version": "1", "state": "fetching", "source": "hf:x/y", "done": 1024, "total": 2048,
        "files": [{"name": "a.gguf", "done": 1024, "total": 2048, "state": "fetching"}]})
    result = CliRunner().invoke(main, ["--config", fake_mirror, "mirror", "status", "smollm2", "1"])
    assert "arriving from hf:x/y: 1 KiB of 2 KiB so far" in result.output
    assert "a.gguf  fetching  1 KiB of 2 KiB" in result.output
    scripted = CliRunner().invoke(main, ["--config", fake_mirror, "mirror", "status", "smollm2", "1", "--json"])
    assert json.loads(scripted.output)["state"] == "fetching"
    monkeypatch.setattr(FakeMirror, "answer", {"model": "smollm2", "version": "2", "state": "absent"})
    absent = CliRunner().invoke(main, ["--config", fake_mirror, "mirror", "status", "smollm2", "2"])
    assert absent.exit_code == 1 and "smollm2/2 is not in the mirror; `llmgw mirror list` shows what is" in absent.output


def made_up(tmp_path, monkeypatch, given: dict):
    """`llmgw up`'s var/up.toml for a configuration with GIVEN, made as `up` makes it, starting nothing."""
    from llmgw.cli.up import Up

    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path / "given.toml", given) if given else None
    cfg = settings.load(config)
    up = Up(cfg, config, None, None)
    os.makedirs(up.var)
    return up.write_config()


def test_up_listens_on_loopback_unless_told_otherwise(tmp_path, monkeypatch):
    from llmgw.cli.up import LISTENS

    path = made_up(tmp_path, monkeypatch, {})
    written = settings.load(path)
    assert written["gateway.listen"] == "127.0.0.1:8080"
    assert "controller.agent_listen" in LISTENS and "mirror.metrics_listen" in LISTENS
    for name in LISTENS:
        assert written[name].startswith("127.0.0.1:"), (name, written[name])
    assert written["agent.engine_host"] == "127.0.0.1"


def test_up_passes_the_given_configuration_on(tmp_path, monkeypatch):
    ports = {"controller.agent_listen": "127.0.0.1:17443", "mirror.listen": ":18081",
             "gateway.metrics_listen": "127.0.0.1:19092"}
    path = made_up(tmp_path, monkeypatch, {"gateway.signup_open": True, "gateway.contact": "ops@example.org",
                                           "gateway.listen": "127.0.0.1:18080", "gateway.workers": 3,
                                           "timeouts.idle": 7.0, **ports})
    written = settings.load(path)
    assert written["gateway.signup_open"] is True and written["gateway.contact"] == "ops@example.org"
    assert written["gateway.listen"] == "127.0.0.1:18080" and written["gateway.workers"] == 3
    assert written["timeouts.idle"] == 7.0
    for name, address in ports.items():
        assert written[name] == address, name  # every port is settable, and a chosen host is kept
    assert written["agent.controllers"] == ["127.0.0.1:17443"]
    assert written["mirror.base_url"] == "http://127.0.0.1:18081"


def test_up_toml_is_private_and_keeps_a_secret_as_its_file(tmp_path, monkeypatch):
    secret = tmp_path / "store-url"
    secret.write_text(f"sqlite:///{tmp_path}/hidden-name.db\n")
    path = made_up(tmp_path, monkeypatch, {"store.url": f"@{secret}"})
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    text = Path(path).read_text()
    assert f'url = "@{secret}"' in text and "hidden-name" not in text
    assert settings.load(path)["store.url"] == f"sqlite:///{tmp_path}/hidden-name.db"


class FakeGateway(BaseHTTPRequestHandler):
    """A gateway whose workers have not heard of the starter model's replica for the first few questions."""
    answers: list = []

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        send_json(self, *(self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]))

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_gateway():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


LOADING = (503, {"error": {"message": "smollm2-135m-instruct has no replica running.", "code": "no_replica_ready"}})
PARIS = (200, {"choices": [{"message": {"content": " Paris is the capital of France. "}}]})


def roles(tmp_path):
    """`llmgw up`'s and `llmgw init`'s running roles, as far as the start-up check needs them; nothing started."""
    from llmgw.cli import bringup

    config = write_config(tmp_path / "roles.toml", {"controller.keys_dir": str(tmp_path / "keys")})
    return bringup.Roles(config, settings.load(config), str(tmp_path))


def test_the_start_up_check_waits_while_the_starter_model_loads(fake_gateway, monkeypatch, tmp_path):
    monkeypatch.setattr(FakeGateway, "answers", [LOADING, LOADING, LOADING, PARIS])
    assert roles(tmp_path).ask(fake_gateway, "sk-llmgw-x") == "Paris is the capital of France."


def test_the_start_up_check_says_what_is_wrong_in_a_sentence(fake_gateway, monkeypatch, tmp_path):
    from llmgw.cli import bringup

    checking = roles(tmp_path)
    monkeypatch.setattr(FakeGateway, "answers", [
        (401, {"error": {"message": "The API key is not known here.", "code": "invalid_api_key"}})])
    with pytest.raises(click.ClickException) as refused:
        checking.ask(fake_gateway, "sk-llmgw-x")
    assert refused.value.message == ("the gateway refused the start-up check's question to smollm2-135m-instruct "
                                     f"with 401: The API key is not known here. See {tmp_path}/gateway.log.")
    monkeypatch.setattr(FakeGateway, "answers", [LOADING])
    monkeypatch.setattr(bringup, "SERVE_LIMIT", 1.0)
    with pytest.raises(click.ClickException) as gave_up:
        checking.ask(fake_gateway, "sk-llmgw-x")
    assert "gave up waiting for the gateway to answer with smollm2-135m-instruct" in gave_up.value.message
    assert "its last answer: 503, smollm2-135m-instruct has no replica running." in gave_up.value.message


def test_the_start_up_check_waits_for_the_starter_model_not_any_model(tmp_path):
    checking = roles(tmp_path)
    models = [{"name": "added-at-run-time", "ready": 1}, {"name": "smollm2-135m-instruct", "ready": 0}]
    checking.admin = lambda path: {"models": models}
    assert not checking.starter_ready()
    models[1]["ready"] = 1
    assert checking.starter_ready()


@pytest.fixture
def admin_client(site):  # noqa: F811
    pages, engine, app = site
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    client = pages.test_client()
    sign_in(client, "root@example.org", PASSWORD)
    return client, engine, app


def post_form(client, path, **fields):
    page = client.get(path).data
    return client.post(path, data={"csrf_token": token(page), **fields})


def test_the_quota_form_shows_current_values_defaults_to_month_and_clears(admin_client):
    client, engine, _ = admin_client
    acme = orgtree.add(engine, "org", "Acme")
    edit = f"/admin/quotas?edit=org:{acme.id}"
    post_form(client, edit, scope="org", id=acme.id, rpm="10", tpm="", budget="1500", models="m1, m2")
    with engine.connect() as conn:
        assert limits.read_all(conn)[("org", acme.id)].period == "month"  # as `llmgw limits set` does
    page = client.get(edit).data.decode()
    assert 'name="rpm" inputmode="numeric" value="10"' in page
    assert 'name="budget" inputmode="decimal" value="1500"' in page  # no thousands separator to trip on
    assert '<option value="month" selected>' in page and 'name="models" value="m1, m2"' in page
    saved = post_form(client, edit, scope="org", id=acme.id, rpm="10", budget="1500", period="month",
                      models="m1, m2")
    assert saved.status_code == 302
    with engine.connect() as conn:
        assert limits.read_all(conn)[("org", acme.id)].budget == 1_500_000_000
    post_form(client, edit, scope="org", id=acme.id, rpm="", tpm="", budget="", period="month", models="", band="")
    with engine.connect() as conn:
        assert ("org", acme.id) not in limits.read_all(conn)  # every field emptied: nothing set here


def test_the_quota_form_shows_what_an_empty_field_leaves_in_force(admin_client):
    client, engine, _ = admin_client
    acme = orgtree.add(engine, "org", "Acme")
    orgtree.add(engine, "team", "ml", "Acme")
    project = orgtree.add(engine, "project", "p", "Acme/ml")
    limits.set_limits(engine, "org", acme.id, "test", rpm=10)
    page = client.get(f"/admin/quotas?edit=project:{project.id}").data.decode()
    assert 'name="rpm" inputmode="numeric" value="" placeholder="empty: 10 from Acme"' in page
    assert '<option value="month" selected>' in page  # a new budget's period, as the CLI's


class FakeAdminApi:
    """The controller's admin API as the cluster page reads it: one node, two models, one replica."""

    url = "http://127.0.0.1:9090"

    def __init__(self, *args, **kwargs):
        pass

    def call(self, method, path, body=None, timeout=None):
        return {
            "/api/v1/nodes": {"nodes": [{"node_id": "gpu-a", "state": "ready", "last_heard_s": 1.0, "facts": {},
                                         "status": {}}]},
            "/api/v1/models": {"models": [
                {"name": "full", "ready": 1, "replicas": 1, "scaling": {"min": 1, "max": 1}, "last_failure": None,
                 "unplaced": {"gpu-b": "needs 80 GiB of GPU memory, has 24"}},
                {"name": "wants-more", "ready": 1, "replicas": 1, "scaling": {"min": 1, "max": 3},
                 "last_failure": None, "unplaced": {"gpu-b": "needs 80 GiB of GPU memory, has 24",
                                                    "gpu-c": "cordoned"}}]},
            "/api/v1/replicas": {"replicas": [{"shard_id": "full-1", "model": "full", "node": "gpu-a",
                                               "state": "ready", "age_s": 12.0}]},
        }[path]


@pytest.fixture
def cluster_client(tmp_path, monkeypatch):
    from llmgw.web import adminpages
    from llmgw.web.app import GatewayApp

    url = f"sqlite:///{tmp_path}/pages.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    cfg = settings.load(None, {"store.url": url}, endpoints=["r1=http://127.0.0.1:9=full"])
    app = GatewayApp(cfg, key_source=keys)
    cfg.values["gateway.controller"] = "127.0.0.1:7444"  # the page asks the (fake) admin API
    monkeypatch.setattr(adminpages, "leader_client", FakeAdminApi)
    client = app.pages.test_client()
    sign_in(client, "root@example.org", PASSWORD)
    yield client
    app.runtime.engine.dispose()
    engine.dispose()


def test_the_cluster_page_names_nodes_and_explains_its_figures(cluster_client):
    page = cluster_client.get("/admin").data.decode()
    # The Node column is filled, and names the node's page.
    assert re.search(r'<td><a [^>]*>full-1</a></td><td>full</td><td><a href="/admin/nodes/gpu-a">gpu-a</a></td>', page)
    assert "{" not in page.split("<h2>Models</h2>")[1].split("</table>")[0]  # no Python dict
    full = page.split("<td>full</td>")[1].split("</tr>")[0]
    assert "At its maximum (1)." in full and "80 GiB" not in full
    more = page.split("<td>wants-more</td>")[1].split("</tr>")[0]
    assert "gpu-b: needs 80 GiB of GPU memory, has 24; gpu-c: cordoned" in more
    routes = cluster_client.get("/admin?partial=1").data.decode().split("<h2>What this gateway routes to</h2>")[1]
    assert "?" not in routes and "0.0" not in routes
    assert routes.count('title="Not known now: this gateway worker reads an engine') == 2  # waiting and KV cache
    assert "<dt>Waiting in engine</dt><dd>Requests the engine has accepted but not yet started" in routes
    assert "<dt>KV cache in use</dt>" in routes


def test_error_pages_use_the_site_layout_and_v1_keeps_json(site):  # noqa: F811
    from werkzeug.test import Client

    pages, engine, gateway = site
    pages.testing = False  # a failing view is answered with a 500 page, as in service, not raised

    @pages.get("/fails")
    def fails():
        raise RuntimeError("a bug")

    accounts.create_user(engine, "plain@example.org", PASSWORD, state=accounts.ACTIVE)
    client = Client(gateway)  # the whole gateway: it gives each request its id
    missing = client.get("/no/such/page")
    assert missing.status_code == 404 and '<link rel="stylesheet"' in missing.data.decode()
    assert "<h1>No such page</h1>" in missing.data.decode()
    failed = client.get("/fails")
    assert failed.status_code == 500 and "<h1>Something went wrong</h1>" in failed.data.decode()
    assert "a bug" not in failed.data.decode() and "Request id" in failed.data.decode()
    sign_in(client, "plain@example.org", PASSWORD)
    refused = client.get("/admin/quotas")
    assert refused.status_code == 403 and '<link rel="stylesheet"' in refused.data.decode()
    api = client.get("/v1")
    assert api.status_code == 404 and api.json["error"]["code"] == "not_found"
    wrong_method = client.put("/login")
    assert wrong_method.status_code == 405 and "GET" in wrong_method.headers["Allow"]
    assert "<h1>Not like that</h1>" in wrong_method.data.decode()
    expired = client.post("/logout", data={})
    assert expired.status_code == 400 and "The form expired" in expired.data.decode()


def test_every_page_has_an_icon(site):  # noqa: F811
    pages, _, _ = site
    client = pages.test_client()
    icon = client.get("/favicon.ico")
    assert icon.status_code == 200 and icon.mimetype == "image/svg+xml" and b"<svg" in icon.data
    icon.close()
    assert 'rel="icon"' in client.get("/").data.decode()
