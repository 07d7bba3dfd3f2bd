"""Downloads that are interrupted resume where they stopped, and are never visible half-written."""

import http.server
import os
import threading

import pytest

from llmgw import weights
from llmgw.procs import wait_for

BLOB = os.urandom(300_000)


class Flaky(http.server.BaseHTTPRequestHandler):
    broke = []

    def do_GET(self):
        start = 0
        if self.headers.get("Range"):
            start = int(self.headers["Range"].split("=")[1].rstrip("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(BLOB) - 1}/{len(BLOB)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(BLOB) - start))
        self.end_headers()
        if not self.broke:
            self.broke.append(1)
            self.wfile.write(BLOB[start:start + 100_000])  # then hang up
            self.wfile.flush()
            self.connection.shutdown(2)
            return
        self.wfile.write(BLOB[start:])

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Flaky.broke = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/models/tiny.gguf"
    httpd.shutdown()
    httpd.server_close()


def test_interrupted_download_resumes(server, tmp_path):
    progress = []
    with pytest.raises(weights.FetchError, match="broke off after 100000 of 300000 bytes"):
        weights.fetch(server, str(tmp_path), lambda done, total: progress.append((done, total)))
    final = weights.local_name(server, str(tmp_path))
    assert not os.path.exists(final) and os.path.getsize(final + ".part") == 100_000
    path = weights.fetch(server, str(tmp_path), lambda done, total: progress.append((done, total)))
    with open(path, "rb") as f:
        assert path == final and f.read() == BLOB
    assert progress[-1] == (300_000, 300_000) and not os.path.exists(final + ".part")
    # Once there, it is not fetched again.
    assert weights.fetch(server, str(tmp_path)) == final


def test_a_path_is_used_where_it_is_inside_the_listed_directories(tmp_path):
    listed, weights_dir = tmp_path / "models", tmp_path / "weights"
    listed.mkdir()
    weights_dir.mkdir()
    (listed / "m.gguf").write_bytes(b"GGUF")
    (weights_dir / "w.gguf").write_bytes(b"GGUF")
    (listed / "out.gguf").symlink_to("/etc/shadow")
    assert weights.fetch(str(listed / "m.gguf"), str(weights_dir), local_sources=[str(listed)]) == str(listed / "m.gguf")
    assert weights.fetch(f"file://{listed}/m.gguf", str(weights_dir), local_sources=[str(listed)]) == str(listed / "m.gguf")
    assert weights.fetch(str(weights_dir / "w.gguf"), str(weights_dir)) == str(weights_dir / "w.gguf")  # always
    for source in ("/etc/shadow", "file:///etc/shadow", str(listed / "out.gguf"), f"{listed}/../../../etc/shadow",
                   "relative/m.gguf", "../../etc/shadow", str(listed / "m.gguf")):
        local_sources = [] if source == str(listed / "m.gguf") else [str(listed)]  # nothing listed: nothing
        with pytest.raises(weights.LocalRefused, match="add its directory to agent.local_sources"):
            weights.fetch(source, str(weights_dir), local_sources=local_sources)


def test_a_missing_file_says_what_the_server_said(server, tmp_path):
    with pytest.raises(weights.FetchError, match="cannot fetch"):
        weights.fetch("http://127.0.0.1:1/x.gguf", str(tmp_path))


def test_the_agent_removes_only_what_it_fetched(tmp_path):
    from llmgw.node.supervisor import Supervisor

    supervisor = Supervisor("n", str(tmp_path / "work"), str(tmp_path / "w"), "127.0.0.1", "127.0.0.1", print)
    assert "never deletes files it did not fetch" in supervisor.remove_weights("/models/mine.gguf")
    os.makedirs(tmp_path / "w")
    fetched = weights.local_name("http://mirror/m.gguf", str(tmp_path / "w"))
    open(fetched, "wb").close()
    # The name alone vouches for nothing: a file without llmgw's mark is the operator's.
    assert "was not fetched by llmgw" in supervisor.remove_weights("http://mirror/m.gguf")
    weights.mark("http://mirror/m.gguf", str(tmp_path / "w"))
    assert supervisor.remove_weights("http://mirror/m.gguf") is None
    assert not os.path.exists(fetched)
    assert supervisor.remove_weights("http://mirror/m.gguf") is None  # gone already: done


def test_a_node_never_hands_an_engine_a_file_outside_its_directories(tmp_path, caplog):
    """An administrator's catalog entry `source = "/etc/shadow"` once had llama.cpp open the file and print
    its first bytes into the shard's log (`invalid magic characters: 'root'`)."""
    from llmgw.node.supervisor import Supervisor

    reports = []
    listed = tmp_path / "models"
    listed.mkdir()
    (listed / "escape.gguf").symlink_to("/etc/shadow")
    supervisor = Supervisor("n", str(tmp_path / "work"), str(tmp_path / "w"), "127.0.0.1", "127.0.0.1",
                            reports.append, local_sources=[str(listed)])
    for i, source in enumerate(("/etc/shadow", "file:///etc/shadow", str(listed / "escape.gguf"),
                                f"{listed}/../../../../etc/shadow", "../../../etc/shadow")):
        caplog.clear()
        with caplog.at_level("WARNING", logger="llmgw.supervisor"):
            supervisor.start({"shard_id": f"s{i}", "model": "probe", "engine": "llamacpp", "source": source})
            wait_for(f"shard s{i} to fail", 10, lambda shard=f"s{i}": any(
                r["shard_id"] == shard and r["state"] == "failed" for r in reports))
        (failed,) = [r for r in reports if r["shard_id"] == f"s{i}" and r["state"] == "failed"]
        assert "add its directory to agent.local_sources" in failed["detail"] and "pid" not in failed, failed
        assert not os.path.exists(tmp_path / "work" / "shards" / f"s{i}.log")  # no engine ever started
        assert any("refused shard" in r.getMessage() for r in caplog.records)
