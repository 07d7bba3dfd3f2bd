"""A key's model allowlist shapes what it is shown, and holds only names the catalog has.

`/v1/models` listed every model to a key that could use one, and `llmgw keys create --models nosuchmodel`
made a key that could use nothing, silently.
"""

import http.server
import json
import threading
import time
import urllib.error
import urllib.request

import sqlalchemy as sa
from click.testing import CliRunner

from llmgw import store
from llmgw.cli.main import main
from llmgw.procs import free_port
from tests.conftest import gateway_over, make_key, write_config

MODELS = [{"name": "sim", "aliases": ["sim-alias"]}, {"name": "other"}]


def get(url: str, key: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def test_a_key_is_shown_only_the_models_it_may_use(tmp_path, make_sim):
    url = f"sqlite:///{tmp_path}/models.db"
    sims = {"sim": make_sim(replica="a"), "other": make_sim(model="other", replica="b")}
    every = make_key(url, "every")
    one = make_key(url, "one", models=["sim-alias"])  # an alias allows its model, and the model every alias
    with gateway_over(tmp_path, url, sims, MODELS, workers=1) as gw:
        assert [m["id"] for m in get(gw.url + "/v1/models", every)[1]["data"]] == ["other", "sim", "sim-alias"]
        assert [m["id"] for m in get(gw.url + "/v1/models", one)[1]["data"]] == ["sim", "sim-alias"]
        assert get(gw.url + "/v1/models/sim", one)[0] == 200
        # Asked of one it may not use, it is told so, as a request for it is, and what it may use instead.
        status, answer = get(gw.url + "/v1/models/other", one)
        assert status == 403 and answer["error"]["code"] == "model_not_allowed", answer
        assert "sim-alias" in answer["error"]["message"]
        assert get(gw.url + "/v1/models/other", every)[0] == 200
        # A name that exists nowhere lists what the key may use, not the whole catalog.
        status, answer = get(gw.url + "/v1/models/nope", one)
        assert status == 404 and "sim" in answer["error"]["message"] and "other" not in answer["error"]["message"]


def test_keys_create_refuses_a_model_the_catalog_does_not_hold(tmp_path):
    url = f"sqlite:///{tmp_path}/cli.db"
    config = write_config(tmp_path / "gateway.toml", {"store.url": url}, models=MODELS,
                          endpoints=[{"id": "e", "url": "http://127.0.0.1:9", "models": ["served"]}])
    engine = store.open_store(url)
    with engine.begin() as conn:  # a model added at run time (`llmgw ctl model add`) is kept in the store
        conn.execute(store.catalog_models.insert().values(name="added", updated_at=time.time(),
                                                          spec=json.dumps({"name": "added", "aliases": ["later"]})))
    runner = CliRunner()

    def create(name, *more):
        return runner.invoke(main, ["--config", config, "keys", "create", name, *more])

    refused = create("typo", "--models", "sim,nosuchmodel")
    assert refused.exit_code != 0 and "nosuchmodel" in refused.output and "--allow-unknown-models" in refused.output
    assert "sim-alias" in refused.output and "added" in refused.output  # what the catalog holds
    for name, names in (("by-name", "sim,other"), ("by-alias", "sim-alias"), ("served", "served"),
                        ("at-run-time", "added,later")):
        made = create(name, "--models", names)
        assert made.exit_code == 0, made.output
    assert create("ahead", "--models", "coming-soon", "--allow-unknown-models").exit_code == 0
    with engine.connect() as conn:
        names = set(conn.execute(sa.select(store.api_keys.c.name)).scalars())
    engine.dispose()
    assert names == {"by-name", "by-alias", "served", "at-run-time", "ahead"}


class Catalog(http.server.BaseHTTPRequestHandler):
    """A controller's admin API, as far as `GET /api/v1/models` with its token."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        ok = self.path == "/api/v1/models" and self.headers.get("Authorization") == "Bearer admin-token"
        data = json.dumps({"models": [{"name": "remote", "aliases": ["far"]}]} if ok else {"error": "no"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_behind_a_controller_keys_create_asks_its_catalog(tmp_path):
    url = f"sqlite:///{tmp_path}/cli.db"
    store.open_store(url).dispose()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Catalog)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings = {"store.url": url, "gateway.controller": "127.0.0.1:1", "controller.admin_token": "admin-token"}

    def create(name, models, admin):
        config = write_config(tmp_path / f"{name}.toml", {**settings, "controller.admin_listen": admin})
        return CliRunner().invoke(main, ["--config", config, "keys", "create", name, "--models", models])

    try:
        # A gateway's configuration holds no [[models]]: the controller's catalog is asked.
        assert create("remote", "remote,far", f"127.0.0.1:{server.server_port}").exit_code == 0
        refused = create("typo", "remot", f"127.0.0.1:{server.server_port}")
        assert refused.exit_code != 0 and "remote" in refused.output
    finally:
        server.shutdown()
        server.server_close()
    # A controller that does not answer is said so, not taken for a catalog without the model.
    silent = create("silent", "remote", f"127.0.0.1:{free_port()}")
    assert silent.exit_code != 0 and "could not be read" in silent.output and "does not answer" in silent.output
