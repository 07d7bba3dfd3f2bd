"""Weights on disk: `llmgw ctl weights` lists what each node holds, and `--reclaim` removes, through the
agent, only what llmgw fetched that nothing uses; the agent refuses any other name, whoever sends it.

Before, the agent knew how to remove a download but nothing ever asked it to, so a node that cycled
through models filled its disk; and it would have removed any file whose name matched a source's hash.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import zmq

from llmgw import weights
from llmgw.procs import free_port
from llmgw.wire import agent as protocol
from tests.cluster import Agent, Controller
from tests.conftest import wait_until

URL = "http://mirror.internal/models/m.bin"


def marked(folder, source: str, data: bytes = b"weights") -> str:
    """An entry as `fetch` leaves it for SOURCE in FOLDER: the file under its name, and llmgw's mark."""
    path = weights.local_name(source, str(folder))
    with open(path, "wb") as f:
        f.write(data)
    weights.mark(source, str(folder))
    return os.path.basename(path)


def test_only_a_marked_unused_download_right_inside_the_directory_is_removed(tmp_path):
    folder, outside = tmp_path / "w", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (outside / "secret").write_text("keep me")
    fetched = marked(folder, URL)
    used = marked(folder, URL + "?used")
    local = marked(folder, URL + "?local")
    (folder / "mine.bin").write_text("the operator's own")
    # A mark copied beside another file vouches for nothing: its name is not the one made for its source.
    (folder / "copied.bin").write_text("the operator's own")
    (folder / weights.MARKS / "copied.bin.json").write_text(json.dumps({"source": URL}))
    # A link with a genuine mark, as if the directory were tampered with: never followed, never removed.
    link = weights.fetched_name(URL + "?link")
    (folder / link).symlink_to(outside / "secret")
    weights.mark(URL + "?link", str(folder))
    in_use = {used: ["s1"]}
    listed = [str(folder / local)]

    def reclaim(name):
        return weights.reclaim(name, str(folder), listed, in_use)

    for name in ("../outside/secret", str(outside / "secret"), "", ".", "..", weights.MARKS, "a/b",
                 f"{fetched}.part", 7, None):
        assert "is not the name of an entry" in reclaim(name)
    assert "was not fetched by llmgw" in reclaim("mine.bin")
    assert "was not fetched by llmgw" in reclaim("copied.bin")
    assert "is a link" in reclaim(link)
    assert "in use by s1" in reclaim(used)
    assert "agent.local_sources" in reclaim(local)
    assert (outside / "secret").read_text() == "keep me" and (folder / link).is_symlink()
    assert {"mine.bin", "copied.bin", used, local} <= set(os.listdir(folder))

    (folder / f"{fetched}.part").write_bytes(b"a download broken off")
    listing = weights.inventory(str(folder), listed, in_use)
    entry = next(f for f in listing["files"] if f["name"] == fetched)
    assert entry["fetched"] and entry["source"] == URL and entry["partial"] and entry["bytes"] == 7 + 21
    assert reclaim(fetched) is None and reclaim(fetched) is None  # gone already: done
    assert not any(n.startswith(fetched) for n in os.listdir(folder))
    assert not os.path.exists(folder / weights.MARKS / f"{fetched}.json")


def test_a_listing_is_bounded_and_counts_everything(tmp_path):
    for i in range(5):
        (tmp_path / f"f{i}").write_bytes(b"x" * (i + 1))
    listing = weights.inventory(str(tmp_path), most=2)
    assert listing["entries"] == 5 and listing["bytes"] == 15 and listing["truncated"]
    assert [f["name"] for f in listing["files"]] == ["f4", "f3"]
    assert not any(f["fetched"] for f in listing["files"])


@pytest.fixture
def served(tmp_path):
    """An HTTP server for model files, as a mirror would serve them."""
    root = tmp_path / "served"
    root.mkdir()
    for name in ("a.bin", "b.bin", "c.bin"):
        (root / name).write_bytes(name.encode() * 1000)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def add(c: Controller, tmp_path, name: str, source: str) -> None:
    (tmp_path / f"{name}.toml").write_text(f'name = "{name}"\nsource = "{source}"\nscaling = {{min = 1, max = 1}}\n'
                                           '[[profiles]]\nengine = "sim"\n')
    run = c.ctl("model", "add", "-f", str(tmp_path / f"{name}.toml"))
    assert run.returncode == 0, run.stderr


def test_ctl_weights_lists_and_reclaims_only_unused_downloads(tmp_path, served):
    from llmgw import settings, store
    from llmgw.people import accounts, keys
    from llmgw.web import history
    from llmgw.web.app import GatewayApp
    from tests.test_pages import sign_in

    made = []
    try:
        c = Controller(tmp_path, controller__source_allow=["127.0.0.1"])  # the model server is on loopback
        made.append(c)
        a = Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"))
        made.append(a)
        folder = a.folder / "weights"
        wait_until("the node", 30, lambda: c.state("n1") == "ready", interval=0.2)
        for name, file in (("inuse", "a.bin"), ("gone", "b.bin"), ("kept", "c.bin")):
            add(c, tmp_path, name, f"{served}/{file}")
        wait_until("three replicas", 60, lambda: all(c.ready(m) for m in ("inuse", "gone", "kept")), interval=0.2)
        (folder / "mine.bin").write_text("the operator's own")
        # The catalog keeps `kept` (it may be scaled up again); `gone` leaves it.
        assert c.ctl("scale", "kept", "--min", "0", "--max", "0").returncode == 0
        assert c.ctl("model", "remove", "gone").returncode == 0
        wait_until("only inuse running", 60, lambda: not c.replicas("gone") and not c.replicas("kept")
                   and len(a.engines()) == 1, interval=0.2)

        run = c.ctl("weights", "n1", "--json")
        assert run.returncode == 0, run.stderr
        (node,) = [json.loads(line) for line in run.stdout.splitlines()]
        entries = {f["source"] if f["fetched"] else f["name"]: f for f in node["files"]}
        shard = c.ready("inuse")[0]["shard_id"]
        a_bin, b_bin, c_bin = (entries[f"{served}/{n}"] for n in ("a.bin", "b.bin", "c.bin"))
        assert (a_bin["models"], a_bin["replicas"], a_bin["reclaimable"]) == (["inuse"], [shard], False)
        assert (b_bin["models"], b_bin["replicas"], b_bin["reclaimable"]) == ([], [], True)
        assert (c_bin["models"], c_bin["kept"]) == (["kept"], "the catalog's kept uses it")
        assert entries["mine.bin"]["kept"] == "not fetched by llmgw" and b_bin["bytes"] == 5000
        assert node["entries"] == 4 and node["reclaimable_bytes"] == 5000

        table = c.ctl("weights")
        assert table.returncode == 0 and "ENTRY" in table.stdout and "no: used by replica " + shard in table.stdout
        assert "n1: 4 entries" in table.stderr and "4.9 KiB reclaimable" in table.stderr

        # Asked first; a "no" removes nothing.
        said_no = subprocess.run([sys.executable, "-m", "llmgw", "--config", c.config, "ctl", "weights", "n1",
                                  "--reclaim"], input="n\n", capture_output=True, text=True, timeout=30)
        assert said_no.returncode == 1 and "Remove these 1 entries (4.9 KiB) from n1?" in said_no.stderr
        assert (folder / b_bin["name"]).exists()

        done = c.ctl("weights", "--reclaim", "--yes")
        assert done.returncode == 0 and "n1: removed 1 entries, 4.9 KiB freed" in done.stderr, done.stderr
        assert not (folder / b_bin["name"]).exists()
        for kept in (a_bin["name"], c_bin["name"], "mine.bin"):
            assert (folder / kept).exists(), kept
        # The controller tells a node only names it has just listed, and only those nothing uses.
        refused = api_post(c, "/api/v1/nodes/n1/weights/reclaim", {"names": ["../../etc/passwd", a_bin["name"]]})
        assert refused["removed"] == [] and "does not hold it now" in refused["refused"]["../../etc/passwd"]
        assert refused["refused"][a_bin["name"]] == f"used by replica {shard}"
        assert c.ctl("weights", "--reclaim", "--yes").stderr.endswith("not llmgw's\n")

        # The heartbeat says what the directory holds now; the cluster page shows it.
        held = sum(os.path.getsize(folder / n) for n in (a_bin["name"], c_bin["name"], "mine.bin"))
        wait_until("the heartbeat's figure", 20,
                   lambda: c.nodes()["n1"]["status"].get("weights", {}).get("bytes") == held, interval=0.2)
        url = f"sqlite:///{tmp_path}/pages.db"
        engine = store.open_store(url)
        accounts.create_user(engine, "root@example.org", "a long enough password", state=accounts.ACTIVE,
                             is_admin=True)
        app = GatewayApp(settings.load(None, {"store.url": url, "gateway.controller": f"127.0.0.1:{c.gateway_port}",
                                              "gateway.controller_admin": f"127.0.0.1:{c.admin_port}",
                                              "controller.keys_dir": c.values["controller.keys_dir"]}),
                         key_source=keys)
        try:
            client = app.pages.test_client()
            sign_in(client, "root@example.org", "a long enough password")
            page = client.get("/admin").data.decode()
            assert "Weights on disk" in page and history.human_bytes(held) in page
        finally:
            app.runtime.engine.dispose()
            engine.dispose()
    finally:
        for thing in reversed(made):
            thing.stop()


def api_post(c: Controller, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{c.admin_port}{path}", data=json.dumps(body).encode(),
                                 method="POST", headers={"Authorization": f"Bearer {c.token()}",
                                                         "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_a_hostile_controller_cannot_make_an_agent_remove_anything_else(tmp_path):
    """A controller (or whoever holds its socket) that names paths the node never listed is refused by the
    agent itself: the agent checks every name as if anyone had sent it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("keep me")
    folder = tmp_path / "agent-n1" / "weights"
    folder.mkdir(parents=True)
    (folder / "mine.bin").write_text("the operator's own")
    link = weights.fetched_name(URL)
    (folder / link).symlink_to(outside)
    weights.mark(URL, str(folder))
    port = free_port()
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    agent = Agent(tmp_path, [f"127.0.0.1:{port}"], "n1", None, plaintext=True)
    try:
        def receive(kind: str, limit: float = 30) -> tuple[bytes, dict]:
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline:
                if router.poll(200):
                    identity, data = router.recv_multipart()
                    message = protocol.decode(data)
                    if message["type"] == kind:
                        return identity, message
            raise AssertionError(f"no {kind} from the agent within {limit} s")

        identity, _ = receive("register")
        router.send_multipart([identity, protocol.encode("registered", node_id="n1", heartbeat_interval=0.2)])
        names = ["../outside/secret", str(outside / "secret"), str(outside), "../../", ".llmgw-fetched", link,
                 "mine.bin", "", "weights/../../outside"]
        router.send_multipart([identity, protocol.encode("reclaim_weights", request_id="r1", names=names)])
        _, reply = receive("weights_reply")
        assert reply["request_id"] == "r1" and reply["removed"] == [] and set(reply["refused"]) == set(names)
        assert "is a link" in reply["refused"][link] and "not fetched by llmgw" in reply["refused"]["mine.bin"]
        assert (outside / "secret").read_text() == "keep me" and (folder / "mine.bin").exists()
        assert (folder / link).is_symlink()
        listed = {f["name"]: f for f in reply["files"]}
        assert listed["mine.bin"]["fetched"] is False and reply["weights_dir"] == str(folder)
        assert "refused to reclaim" in agent.log()
    finally:
        agent.stop()
        router.close(0)
        context.term()
