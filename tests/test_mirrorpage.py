"""The mirror's page: held, arriving and failed versions, fetch, remove, "serve this" into a real
controller's catalog, the registry explorer against a local server replaying the registry's API; and the
whole way with real processes: a model fetched into the mirror from a local HTTP source, added through the
page's form, placed on a node, fetched from the mirror, served by llama.cpp and answered."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import openai
import pytest
import requests
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from llmgw import settings, store
from llmgw.cli import starter
from llmgw.mirror.fetch import Manager
from llmgw.mirror.server import api_app, files_app
from llmgw.mirror.store import MirrorDir
from llmgw.people import accounts, keys
from llmgw.procs import free_port, http_status, wait_for
from llmgw.web.app import GatewayApp
from tests.cluster import Agent, Controller
from tests.conftest import ROOT, Gateway, make_key, stop_process, wait_until, write_config
from tests.test_mirror import LIBRARY, access, gguf_bytes
from tests.test_pages import sign_in, token

PASSWORD = "a long enough password"
SHA = "0123456789abcdef0123456789abcdef01234567"


class Registry:
    """A local stand-in for a Hugging Face compatible registry, answering in the real API's shape."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.asked: list[str] = []
        self.queries: list[str] = []
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def app(self, environ, start_response):
        req = Request(environ)
        path = req.path
        self.asked.append(path)
        if path == "/api/models":
            self.queries.append(req.query_string.decode())
            body = [{"_id": "1", "id": "acme/tiny-GGUF", "likes": 12, "downloads": 3456, "pipeline_tag": "text-generation",
                     "tags": ["gguf", "license:apache-2.0"], "createdAt": "2026-10-01T00:00:00.000Z",
                     "gguf": {"total": 135_000_000, "architecture": "llama", "context_length": 8192},
                     "cardData": {"license": "apache-2.0"}},
                    {"_id": "2", "id": "acme/<b>bold</b>", "likes": 0, "downloads": 1, "tags": ["gguf"]},
                    {"_id": "3", "id": "acme/big-GGUF", "downloads": 90, "tags": ["gguf"],
                     "gguf": {"total": 70_600_000_000, "architecture": "llama", "context_length": 131072},
                     "cardData": {"license": "llama3.3", "base_model": ["meta-llama/Llama-3.3-70B-Instruct"]}},
                    {"_id": "4", "id": "acme/odd-GGUF", "downloads": 5, "tags": ["gguf"],
                     "gguf": {"total": 500_000_000, "architecture": "ggmlc", "context_length": 4096}},
                    {"_id": "5", "id": "acme/lora-GGUF", "downloads": 5, "tags": ["gguf", "lora"],
                     "gguf": {"total": 20_000_000, "architecture": "llama"}}]
        elif path == "/api/models/acme/tiny-GGUF":
            body = {"_id": "1", "id": "acme/tiny-GGUF", "sha": SHA, "cardData": {"license": "apache-2.0"},
                    "siblings": [{"rfilename": "README.md", "size": 120}] + [
                        {"rfilename": name, "size": len(data), "blobId": "x",
                         "lfs": {"sha256": "ab" * 32, "size": len(data), "pointerSize": 133}}
                        for name, data in self.files.items()]}
        elif path == f"/acme/tiny-GGUF/raw/{SHA}/README.md":
            text = ("---\nlicense: apache-2.0\n---\n# Tiny\n\nA <script>alert(1)</script> model. "
                    "[site](https://example.org) [x](javascript:alert(1)) ![p](https://tracker.example/p.png)")
            return Response(text, mimetype="text/markdown")(environ, start_response)
        elif path.startswith(f"/acme/tiny-GGUF/resolve/{SHA}/"):
            data = self.files.get(path.rsplit("/", 1)[-1])
            return Response(data, mimetype="application/octet-stream")(environ, start_response) if data else \
                Response("no", status=404)(environ, start_response)
        else:
            return Response(json.dumps({"error": "Repository not found"}), status=404)(environ, start_response)
        return Response(json.dumps(body), mimetype="application/json")(environ, start_response)

    def stop(self):
        self.server.shutdown()


def serve(app):
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def rig(tmp_path):
    """An in-process mirror, a real controller, a registry, and the pages of a gateway pointed at them."""
    registry = Registry({"tiny-q4.gguf": gguf_bytes("llama", 2000), "mmproj-tiny.gguf": gguf_bytes("clip"),
                         "tiny-q8-00001-of-00002.gguf": gguf_bytes("llama", 1500), "tiny-q8-00002-of-00002.gguf": b"x" * 700})
    files_port = free_port()
    base = f"http://127.0.0.1:{files_port}"
    mirror_dir = MirrorDir(str(tmp_path / "models"))
    (tmp_path / "sources").mkdir()
    manager = Manager(mirror_dir, hf_endpoint=registry.url, library=LIBRARY, local_sources=[str(tmp_path / "sources")],
                      fetch_allow=["127.0.0.0/8"])  # the registry here is on loopback
    files = make_server("127.0.0.1", files_port, files_app(mirror_dir, base), threaded=True)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    api_port = free_port()
    api = make_server("127.0.0.1", api_port, api_app(manager, base, access(manager, f"127.0.0.1:{api_port}")),
                      threaded=True)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    controller = Controller(tmp_path, mirror__base_url=base)  # its mirror, whose sources it checks
    url = f"sqlite:///{tmp_path}/pages.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    # The gateway's configuration names the mirror's directory, where the page reads the API's token.
    cfg = settings.load(None, {"store.url": url, "mirror.api": f"127.0.0.1:{api.server_port}",
                               "mirror.dir": str(tmp_path / "models"),
                               "mirror.hf_endpoint": registry.url,
                               "gateway.controller_admin": f"127.0.0.1:{controller.admin_port}",
                               "controller.keys_dir": controller.values["controller.keys_dir"]})
    app = GatewayApp(cfg, key_source=keys)
    client = app.pages.test_client()
    sign_in(client, "root@example.org", PASSWORD)
    yield client, manager, controller, base, f"127.0.0.1:{api.server_port}", registry
    app.runtime.engine.dispose()
    engine.dispose()
    controller.stop()
    for server in (files, api):
        server.shutdown()
    registry.stop()


def post(client, path, form_page="/admin/mirror", **fields):
    return client.post(path, data={"csrf_token": token(client.get(form_page).data), **fields})


def test_fetch_serve_and_remove_from_the_page(rig, tmp_path):
    client, manager, controller, base, _, _ = rig
    page = client.get("/admin/mirror").data.decode()
    assert "Nothing is held yet" in page and f"Nodes fetch from {base}" in page
    (tmp_path / "sources" / "tiny.gguf").write_bytes(gguf_bytes("llama", 3000))
    post(client, "/admin/mirror/fetch", source=str(tmp_path / "sources" / "tiny.gguf"), model="tiny", version="v1")
    wait_for("the fetch", 10, lambda: manager.status("tiny", "v1")["state"] == "present")
    page = client.get("/admin/mirror").data.decode()
    assert "tiny/v1" in page and "Serve this" in page
    serve_link = re.search(r'href="(/admin/mirror/serve\?[^"]+)"', page).group(1).replace("&amp;", "&")
    form = client.get(serve_link).data.decode()
    assert f'value="{base}/tiny/v1/tiny.gguf"' in form and '<option value="llamacpp" selected>' in form
    done = post(client, "/admin/mirror/serve", form_page=serve_link, name="tiny", source=f"{base}/tiny/v1/tiny.gguf",
                engine="llamacpp", memory="1", max_context="2048", mode="stopped")
    assert done.status_code == 302
    (model,) = [m for m in controller.api("/api/v1/models")["models"] if m["name"] == "tiny"]
    assert (model["scaling"]["min"], model["scaling"]["max"]) == (0, 0)  # "stopped"
    page = client.get("/admin/mirror").data.decode()
    assert "in use" in page and "<td data-label=\"Used by\">tiny</td>" in page  # used by the catalog model "tiny"
    # In use: the page offers no Remove; asking anyway through the mirror still works, but not by the page.
    assert 'action="/admin/mirror/remove"' not in page.split("Held")[1]
    # A failed fetch is shown with its reason, and can be retried or forgotten.
    post(client, "/admin/mirror/fetch", source="http://127.0.0.1:9/missing.gguf", model="gone", version="v1")
    wait_for("the failure", 10, lambda: manager.status("gone", "v1")["state"] == "failed")
    page = client.get("/admin/mirror").data.decode()
    assert "gone/v1" in page and "Retry" in page and "cannot fetch" in page
    post(client, "/admin/mirror/remove", model="gone", version="v1")
    assert manager.status("gone", "v1")["state"] == "absent"


def test_the_registry_is_explored_and_its_cards_are_inert(rig):
    client, manager, _, _, _, _ = rig
    page = client.get("/admin/mirror/registry?sort=downloads").data.decode()
    assert "acme/tiny-GGUF" in page and "3,456 downloads" in page and "<b>bold</b>" not in page
    repo = client.get("/admin/mirror/repo?id=acme/tiny-GGUF").data.decode()
    assert "tiny-q4.gguf" in repo and "README.md" not in repo.split("Weights")[1].split("Model card")[0]
    assert "not a model" in repo  # the projector
    card = repo.split("Model card")[1]
    assert "<h1>Tiny</h1>" in card and "<script" not in card and 'href="javascript' not in card
    assert "<img" not in card and "license: apache" not in card
    assert f'value="hf:acme/tiny-GGUF/tiny-q4.gguf@{SHA}"' in repo  # pinned to the listing's commit
    post(client, "/admin/mirror/fetch", form_page="/admin/mirror/repo?id=acme/tiny-GGUF",
         source=f"hf:acme/tiny-GGUF/tiny-q4.gguf@{SHA}", model="tiny-gguf", version=SHA[:12])
    wait_for("the registry fetch", 10, lambda: manager.status("tiny-gguf", SHA[:12])["state"] != "fetching")
    assert manager.status("tiny-gguf", SHA[:12])["state"] == "present"
    assert client.get("/admin/mirror/repo?id=../../etc").status_code == 404
    # Browsing back asks the registry nothing new for ten minutes (Hugging Face's rate-limits).
    registry = rig[5]
    before = len(registry.asked)
    client.get("/admin/mirror/registry?sort=downloads")
    client.get("/admin/mirror/repo?id=acme/tiny-GGUF")
    assert len(registry.asked) == before


def test_an_unreachable_mirror_or_registry_is_said_in_a_sentence(tmp_path):
    url = f"sqlite:///{tmp_path}/p.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    mirror_api = f"127.0.0.1:{free_port()}"
    app = GatewayApp(settings.load(None, {"store.url": url, "mirror.api": mirror_api,
                                          "mirror.hf_endpoint": f"http://127.0.0.1:{free_port()}",
                                          "gateway.controller_admin": f"127.0.0.1:{free_port()}"}), key_source=keys)
    client = app.pages.test_client()
    sign_in(client, "root@example.org", PASSWORD)
    page = client.get("/admin/mirror").data.decode()
    assert f'<p class="problem" role="alert">The mirror at {mirror_api} cannot be reached. Check that mirror.py ' \
           "is running" in page
    assert "Nothing is held yet" not in page and "urlopen" not in page and "Errno" not in page
    post(client, "/admin/mirror/fetch", source="hf:a/b/c.gguf", model="m", version="v1")
    assert f"The mirror at {mirror_api} cannot be reached" in client.get("/admin/mirror").data.decode()
    for path in ("/admin/mirror/registry", "/admin/mirror/registry?q=tiny", "/admin/mirror/repo?id=acme/tiny"):
        page = client.get(path).data.decode()
        assert '<p class="problem" role="alert">The registry at http://127.0.0.1:' in page, path
        assert "cannot be reached from this gateway. Check that this machine reaches it" in page
        assert "urlopen" not in page and "Errno" not in page
    app.runtime.engine.dispose()
    engine.dispose()


def test_a_serve_link_with_a_size_that_is_not_bytes_is_a_400(rig):
    client = rig[0]
    ok = client.get("/admin/mirror/serve?model=m&source=http://m/x.gguf&size=2000000000")
    # 1.86 GiB of weights, half again for the context's cache and buffers, and 2 GiB for the engine.
    assert ok.status_code == 200 and 'name="memory" value="5"' in ok.data.decode()
    assert 'name="memory" value=""' in client.get("/admin/mirror/serve?model=m&source=http://m/x.gguf").data.decode()
    for size in ("abc", "-5", "1e9", str(1 << 60), "9" * 5000):
        answer = client.get(f"/admin/mirror/serve?model=m&source=http://m/x.gguf&size={size}")
        assert answer.status_code == 400, size
        assert "not a number of bytes" in answer.data.decode()


def test_a_model_fetched_added_on_the_page_placed_and_answered(tmp_path):
    """Real processes all the way: mirror.py, controller.py, agent.py, gateway.py, llama.cpp."""
    source = serve(lambda environ, start_response: _file_app(environ, start_response, starter.model_path()))
    files_port, api_port = free_port(), free_port()
    mirror_config = write_config(tmp_path / "mirror.toml", {
        "mirror.dir": str(tmp_path / "models"), "mirror.listen": f"127.0.0.1:{files_port}",
        "mirror.api_listen": f"127.0.0.1:{api_port}", "mirror.metrics_listen": f"127.0.0.1:{free_port()}",
        "mirror.fetch_allow": ["127.0.0.0/8"]})  # the model's server here is on loopback
    with open(tmp_path / "mirror.log", "wb") as log:
        mirror = subprocess.Popen([sys.executable, os.path.join(ROOT, "mirror.py"), "--config", mirror_config],
                                  stdout=log, stderr=subprocess.STDOUT)
    controller = agent = gw = None
    try:
        wait_for("the mirror", 20, lambda: http_status(f"http://127.0.0.1:{api_port}/api/v1/health") == 200)
        url = f"sqlite:///{tmp_path}/cluster.db"
        controller = Controller(tmp_path, store_url=url, mirror__base_url=f"http://127.0.0.1:{files_port}")
        agent = Agent(tmp_path, [f"127.0.0.1:{controller.agent_port}"], "n1", controller.issue_key("n1"))
        engine = store.open_store(url)
        accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
        engine.dispose()
        key = make_key(url)
        gw = Gateway(tmp_path, url, workers=1, gateway__controller=f"127.0.0.1:{controller.gateway_port}",
                     gateway__key_file=controller.gateway_key_file(),
                     gateway__controller_admin=f"127.0.0.1:{controller.admin_port}", mirror__api=f"127.0.0.1:{api_port}",
                     mirror__dir=str(tmp_path / "models"),
                     controller__keys_dir=controller.values["controller.keys_dir"])
        browser = requests.Session()
        login = browser.get(gw.url + "/login").text
        browser.post(gw.url + "/login", data={"email": "root@example.org", "password": PASSWORD,
                                              "csrf_token": _token(login)})

        def form_post(path, page, **fields):
            return browser.post(gw.url + path, data={"csrf_token": _token(browser.get(gw.url + page).text), **fields})

        # Interrupted on the first hop: the source breaks off once; the retry resumes.
        _file_app.break_once = True
        form_post("/admin/mirror/fetch", "/admin/mirror", source=f"http://127.0.0.1:{source.server_port}/smol.gguf",
                  model="smol", version="v1")
        wait_for("the first try to fail", 30, lambda: "smol/v1" in browser.get(gw.url + "/admin/mirror").text
                 and "Retry" in browser.get(gw.url + "/admin/mirror").text)
        form_post("/admin/mirror/fetch", "/admin/mirror", source=f"http://127.0.0.1:{source.server_port}/smol.gguf",
                  model="smol", version="v1")
        wait_for("the fetch", 60, lambda: "Serve this" in browser.get(gw.url + "/admin/mirror").text)
        page = browser.get(gw.url + "/admin/mirror").text
        serve_link = re.search(r'href="(/admin/mirror/serve\?[^"]+)"', page).group(1).replace("&amp;", "&")
        form = browser.get(gw.url + serve_link).text
        file_url = re.search(r'id="source" name="source" value="([^"]+)"', form).group(1)
        form_post("/admin/mirror/serve", serve_link, name="smol", source=file_url, engine="llamacpp", memory="1",
                  max_context="2048", mode="always")
        wait_for("smol to be served", 180, lambda: any(r["model"] == "smol" and r["state"] == "ready"
                                                       for r in controller.replicas()), interval=0.5)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=3, timeout=60)
        deadline = time.monotonic() + 20
        while True:
            try:
                reply = client.chat.completions.create(model="smol", max_tokens=20, messages=[
                    {"role": "user", "content": "What is the capital of France?"}])
                break
            except openai.NotFoundError:
                assert time.monotonic() < deadline  # the gateway learns of the replica within seconds
                time.sleep(0.5)
        client.close()
        assert reply.choices[0].message.content
        assert any(name.endswith("smol.gguf") for name in os.listdir(agent.folder / "weights"))
        # Its row says how it runs, and stopping it there stops its replica and takes it off the offer.
        page = browser.get(gw.url + "/admin/mirror").text
        assert '<option value="always" selected>always on</option>' in page
        form_post("/admin/mirror/runs", "/admin/mirror", model="smol", mode="stopped")
        wait_for("smol to stop", 60, lambda: not any(r["model"] == "smol" for r in controller.replicas()))
        assert '<option value="stopped" selected>stopped</option>' in browser.get(gw.url + "/admin/mirror").text
    finally:
        for part in (gw, agent, controller):
            if part is not None:
                part.stop()
        stop_process(mirror)
        source.shutdown()


def _token(html: str) -> str:
    return re.search(r'name="csrf_token" type="hidden" value="([^"]+)"', html).group(1)


def _file_app(environ, start_response, path):
    """PATH over HTTP with Range; after `_file_app.break_once = True`, the next whole download breaks off."""
    from werkzeug.utils import send_file

    response = send_file(path, environ, conditional=True)
    if getattr(_file_app, "break_once", False) and not environ.get("HTTP_RANGE"):
        _file_app.break_once = False
        body = b"".join(response.response)[:5_000_000]
        response.close()
        start_response("200 OK", [("Content-Length", str(os.path.getsize(path)))])
        return [body]
    return response(environ, start_response)


def test_unused_lists_what_no_catalog_model_refers_to(rig, tmp_path):
    from click.testing import CliRunner

    from llmgw.cli.main import main

    client, manager, controller, base, api, _ = rig
    for model in ("kept", "spare"):
        (tmp_path / "sources" / f"{model}.gguf").write_bytes(gguf_bytes("llama"))
        manager.fetch(str(tmp_path / "sources" / f"{model}.gguf"), model, "v1")
        wait_for(model, 10, lambda m=model: manager.status(m, "v1")["state"] == "present")
    post(client, "/admin/mirror/serve", name="kept", source=f"{base}/kept/v1/kept.gguf", engine="llamacpp",
         memory="1", max_context="2048", mode="stopped")
    config = write_config(tmp_path / "cli.toml", {"mirror.api": api, "mirror.dir": str(tmp_path / "models"),
                                                  "controller.admin_listen": f"127.0.0.1:{controller.admin_port}",
                                                  "controller.keys_dir": controller.values["controller.keys_dir"]})
    result = CliRunner().invoke(main, ["--config", config, "mirror", "unused"])
    assert result.exit_code == 0, result.output
    assert "spare  v1" in result.output and "kept" not in result.output.split("Before removing")[0]
    refused = CliRunner().invoke(main, ["--config", config, "mirror", "remove", "kept", "v1"])
    assert refused.exit_code == 1 and "still refers to kept/v1" in refused.output
    assert CliRunner().invoke(main, ["--config", config, "mirror", "remove", "spare", "v1"]).exit_code == 0


def test_the_serve_form_bounds_what_it_sends_and_says_what_is_wrong_in_a_sentence(rig, tmp_path):
    client, manager, controller, base, _, _ = rig
    (tmp_path / "sources" / "m.gguf").write_bytes(gguf_bytes("llama", 3000))
    post(client, "/admin/mirror/fetch", source=str(tmp_path / "sources" / "m.gguf"), model="m", version="v1")
    wait_for("the fetch", 10, lambda: manager.status("m", "v1")["state"] == "present")
    link = f"/admin/mirror/serve?model=m&source={base}/m/v1/m.gguf&size=2000"
    good = {"name": "m", "source": f"{base}/m/v1/m.gguf", "engine": "llamacpp", "memory": "1",
            "max_context": "2048", "mode": "stopped"}
    for field, value, said in (
            ("max_context", "0", "The context is a whole number of tokens from 1 to 2,147,483,647"),
            ("max_context", "2147483648", "The context is a whole number of tokens from 1 to 2,147,483,647"),
            ("max_context", "9" * 5000, "The context is a whole number of tokens from 1 to 2,147,483,647"),
            ("max_context", "1_000", "The context is a whole number of tokens from 1 to 2,147,483,647"),
            ("max_context", "-5", "The context is a whole number of tokens from 1 to 2,147,483,647"),
            ("memory", "nan", "The memory is a number of GiB from 0 to 100,000"),
            ("memory", "1e400", "The memory is a number of GiB from 0 to 100,000"),
            ("name", "", "Give the model a name"),
            ("name", "n" * 500, "The name is at most 128 characters"),
            ("engine", "rm -rf", "The engine is one of llamacpp, vllm, sglang"),
            ("mode", "sometimes", "The run mode is one of always, on_demand, stopped")):
        answer = post(client, "/admin/mirror/serve", form_page=link, **{**good, field: value})
        assert answer.status_code == 302, (field, value[:20])
        page = client.get("/admin/mirror").data.decode()
        assert said in page, (field, value[:20], page[page.find("problem"):][:300])
        assert "Give the model a name, a source, and numbers" not in page
    assert "m" not in [m["name"] for m in controller.api("/api/v1/models")["models"]]  # nothing reached the catalog
    done = post(client, "/admin/mirror/serve", form_page=link, **good)
    assert done.status_code == 302 and "m" in [m["name"] for m in controller.api("/api/v1/models")["models"]]


def test_the_serve_form_warns_of_what_the_fleet_cannot_run(rig):
    from tests.cluster import Agent

    client, _, controller, _, _, _ = rig
    agent = Agent(controller.tmp, [f"127.0.0.1:{controller.agent_port}"], "cpu-1", controller.issue_key("cpu-1"))
    try:
        wait_until("the node", 60, lambda: controller.state("cpu-1") == "ready")
        huge = client.get(f"/admin/mirror/serve?model=m&source=http://m/x.gguf&size={400 << 30}").data.decode()
        assert "No node has 602 GiB: the largest, cpu-1, has" in huge  # a CPU node's memory, no card
        folder = client.get("/admin/mirror/serve?model=m&source=http://m/qwen/1/&size=1000").data.decode()
        assert "These weights are safetensors, which vLLM or SGLang serve on GPUs, and no node has a GPU" in folder
        small = client.get("/admin/mirror/serve?model=m&source=http://m/x.gguf&size=1000").data.decode()
        assert "Warning:" not in small
    finally:
        agent.stop()


def test_the_registry_is_filtered_here_and_hides_what_these_nodes_cannot_run_saying_how_many(rig):
    client, manager, _, _, _, registry = rig
    page = client.get("/admin/mirror/registry").data.decode()
    for shown in ("acme/tiny-GGUF", "acme/big-GGUF", "&lt;b&gt;bold&lt;/b&gt;"):
        assert shown in page
    assert "acme/odd-GGUF" not in page and "acme/lora-GGUF" not in page
    assert "2 hidden: adapters, or an architecture this llama.cpp cannot load" in page
    assert "0.1 B parameters" in page and "70.6 B parameters" in page and "131,072 tokens" in page
    assert "licence llama3.3" in page and "from meta-llama/Llama-3.3-70B-Instruct" in page
    assert 'the llama.cpp installed here loads this architecture">✓' in page
    # One registry call a listing, asking for every figure at once.
    assert "expand%5B%5D=gguf" in registry.queries[-1] and "filter=gguf" in registry.queries[-1]
    everything = client.get("/admin/mirror/registry?show=all").data.decode()
    assert "acme/odd-GGUF" in everything and "does not know this architecture\">✗" in everything
    assert "acme/lora-GGUF" in everything and "an adapter" in everything and "data-hidden" not in everything
    for query, only in (("size=large", "acme/big-GGUF"), ("context=128k", "acme/big-GGUF"),
                        ("licence=apache-2.0", "acme/tiny-GGUF"), ("size=small&licence=llama3.3", None)):
        page = client.get(f"/admin/mirror/registry?{query}").data.decode()
        listed = re.findall(r'<li><a href="/admin/mirror/repo\?id=([^"]+)"', page)
        assert listed == ([only] if only else []), (query, listed)
    client.get("/admin/mirror/registry?task=feature-extraction")
    assert "pipeline_tag=feature-extraction" in registry.queries[-1]  # the registry filters the task itself
    assert client.get("/admin/mirror/registry?size=%3Cscript%3E").status_code == 200  # unknown: ignored


def test_a_shard_set_is_one_row_and_one_fetch_of_every_part(rig):
    client, manager, _, _, _, _ = rig
    repo = client.get("/admin/mirror/repo?id=acme/tiny-GGUF").data.decode()
    assert "tiny-q8-0000N-of-00002.gguf (2 files)" in repo and "Fetch all 2" in repo
    assert "tiny-q8-00002-of-00002.gguf" not in repo  # one row, fetched by its first part
    assert repo.count('name="source"') == 2  # tiny-q4.gguf and the set; the projector is not a model
    post(client, "/admin/mirror/fetch", form_page="/admin/mirror/repo?id=acme/tiny-GGUF",
         source=f"hf:acme/tiny-GGUF/tiny-q8-00001-of-00002.gguf@{SHA}", model="tiny-q8", version="v1")
    wait_for("the set's fetch", 20, lambda: manager.status("tiny-q8", "v1")["state"] != "fetching")
    assert sorted(f["name"] for f in manager.store.files("tiny-q8", "v1")) == [
        "tiny-q8-00001-of-00002.gguf", "tiny-q8-00002-of-00002.gguf"]


def test_held_versions_are_grouped_by_family_then_model_with_a_busy_model_first(rig, tmp_path):
    client, manager, _, _, _, _ = rig
    for model, version in (("qwen2.5-coder-7b", "v1"), ("qwen3-8b", "v1"), ("qwen3-8b", "v2"), ("tiny", "v1")):
        folder = manager.store.arriving_dir(model, version)
        os.makedirs(folder)
        with open(os.path.join(folder, "w.gguf"), "wb") as f:
            f.write(gguf_bytes("llama", 1000))
        manager.store.publish(model, version, {})
    page = client.get("/admin/mirror").data.decode()
    heads = re.findall(r'<tr class="(family|model)"><th colspan="6" scope="rowgroup">([^<]+)', page)
    assert heads == [("family", "qwen · 2 models · " + heads[0][1].split(" · ")[2]),
                     ("model", "qwen2.5-coder-7b "), ("model", "qwen3-8b "), ("model", "tiny ")], heads
    assert "· 2 versions ·" in page.split("qwen3-8b <span")[1].split("</th>")[0]
    # A model with a failed fetch comes first, its heading says so.
    post(client, "/admin/mirror/fetch", source="http://127.0.0.1:9/missing.gguf", model="tiny", version="v9")
    wait_for("the failure", 10, lambda: manager.status("tiny", "v9")["state"] == "failed")
    page = client.get("/admin/mirror").data.decode()
    heads = re.findall(r'<tr class="(?:family|model)"><th colspan="6" scope="rowgroup">([^<]+)', page)
    assert heads[0] == "tiny " and "downloading or failed, above" in page.split("Held")[1]


def test_what_a_broken_registry_answers_is_shown_as_unknown_never_a_500():
    import datetime

    from llmgw.web import registryview

    now = datetime.datetime.now(datetime.timezone.utc)
    odd = registryview.describe({"id": "a/b", "createdAt": "2024-01-01", "tags": 5, "downloads": -3, "likes": True,
                                 "gguf": {"total": 10 ** 400, "architecture": 7}, "cardData": "x"}, now)
    assert odd["age_days"] > 300 and odd["downloads"] is None and odd["likes"] is None
    assert odd["size"] == "parameters not given" and odd["arch"] is None and odd["licence"] is None
    rows = registryview.weight_files([{"rfilename": 5}, {"rfilename": "m-00001-of-00003.gguf", "size": -1},
                                      {"rfilename": "m-00002-of-00003.gguf", "size": 5},
                                      {"rfilename": "sub/x@evil.gguf", "size": 3},
                                      {"rfilename": "m-00009-of-00003.gguf", "size": 1},
                                      {"rfilename": "ok.gguf", "lfs": {"size": 9, "sha256": "ab" * 32}}], "c" * 40)
    by_name = {r["name"]: r for r in rows}
    assert by_name["m-0000N-of-00003.gguf"]["incomplete"] and by_name["m-0000N-of-00003.gguf"]["size"] is None
    assert not by_name["m-0000N-of-00003.gguf"]["fetchable"] and not by_name["sub/x@evil.gguf"]["fetchable"]
    assert not by_name["m-00009-of-00003.gguf"]["incomplete"]  # a part past its set's end is no set: one file
    assert by_name["ok.gguf"]["fetchable"] and by_name["ok.gguf"]["size"] == 9
    assert not registryview.weight_files([{"rfilename": "ok.gguf"}], "main")[0]["fetchable"]  # not pinned
