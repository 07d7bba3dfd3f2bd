"""What the CLI sends and prints when names and text from elsewhere are hostile: each path segment quoted,
every control character written out, and the bench's API key never on its command line.

A stub admin API and gateway on a real socket answer with hostile names, facts, log lines and errors, and
record what the CLI asked; the CLI runs as the operator runs it, in its own process.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading

import pytest

from llmgw.cli.tables import printable
from tests.conftest import send_json

ESC_NODE = "n1\x1b]0;owned\x07"  # would retitle the terminal
NODES = {"nodes": [{"node_id": ESC_NODE, "state": "ready", "last_heard_s": 1.0, "status": {},
                    "facts": {"address": "\x1b[2J10.0.0.1", "cpu": {"count": 4}, "gpus": []}}]}
LOGS = {"sources": ["agent", "s-1\x1b[1A"], "lines": ["plain\ttabbed", "\x1b[31mred\x9b\x7f"]}
MODELS = {"models": [{"name": "cap", "ready": 1, "replicas": 1, "scaling": {"min": 1, "max": 1}, "origin": "runtime",
                      "aliases": [], "unplaced": {}, "last_failure": None}]}
REPLICAS = {"replicas": [{"shard_id": "cap-1", "model": "cap", "node": ESC_NODE, "state": "ready",
                          "url": "http://127.0.0.1:9", "profile": "simcpu", "stale_profile": False, "fetch": None,
                          "engine": "sim"}]}


class Stub(http.server.BaseHTTPRequestHandler):
    """The admin API and a gateway in one: canned answers by path; every request recorded on the server."""

    def log_message(self, *args):
        pass

    def _any(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.seen.append((self.command, self.path, self.headers.get("Authorization")))
        path = self.path.split("?")[0]
        if path == "/api/v1/nodes":
            return send_json(self, 200, NODES)
        if path.endswith("/logs"):
            return send_json(self, 200, LOGS)
        if path == "/api/v1/models":
            return send_json(self, 200, MODELS)
        if path == "/api/v1/replicas":
            return send_json(self, 200, REPLICAS)
        if path == "/health":
            return send_json(self, 200, {"ok": True})
        if path == "/v1/chat/completions":
            return send_json(self, 401, {"error": {"code": "invalid_api_key", "message": "no such key \x1b[2J"}})
        if self.command == "DELETE":
            return send_json(self, 200, {"stopped": [], "unconfirmed": []})
        return send_json(self, 404, {"error": "no such thing \x1b[2J here"})

    do_GET = do_POST = do_PUT = do_DELETE = _any


@pytest.fixture
def stub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(10)


def cli(tmp_path, server, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    config = tmp_path / "llmgw.toml"
    if not config.exists():
        config.write_text('[controller]\nadmin_token = "t"\n')
        config.chmod(0o600)
    url = f"http://127.0.0.1:{server.server_port}"
    clean = {k: v for k, v in os.environ.items() if k != "LLMGW_API_KEY"}
    return subprocess.run([sys.executable, "-m", "llmgw", "--config", str(config), "ctl", "--admin", url, *args],
                          capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})


def test_printable_writes_out_every_control_character_and_keeps_the_rest():
    assert printable("a\x1b[31mb\x00\n\r\x7f\x9b\x85é 中") == "a\\x1b[31mb\\x00\\x0a\\x0d\\x7f\\x9b\\x85é 中"
    assert printable("a\tb") == "a\\x09b" and printable("a\tb\x1b", tabs=True) == "a\tb\\x1b"
    assert printable(7) == "7"


@pytest.mark.parametrize("args, method, path", [
    (["node", "remove", "a?force=1"], "DELETE", "/api/v1/nodes/a%3Fforce%3D1"),
    (["cordon", "../models/x"], "POST", "/api/v1/nodes/..%2Fmodels%2Fx/cordon"),
    (["model", "remove", "m/scale"], "DELETE", "/api/v1/models/m%2Fscale"),
    (["capacity", "forget", "m#x", "--profile", "p&q=1"], "DELETE", "/api/v1/models/m%23x/capacity?profile=p%26q%3D1"),
])
def test_a_name_is_one_path_segment_whatever_it_holds(tmp_path, stub, args, method, path):
    """Unquoted, `node remove 'a?force=1'` asked to force-remove node a."""
    cli(tmp_path, stub, *args)
    assert (method, path) in [(m, p) for m, p, _ in stub.seen], stub.seen


def test_hostile_names_facts_and_log_lines_are_printed_inert(tmp_path, stub):
    nodes = cli(tmp_path, stub, "nodes")
    assert nodes.returncode == 0, nodes.stderr
    assert "\x1b" not in nodes.stdout and "n1\\x1b]0;owned\\x07" in nodes.stdout and "\\x1b[2J10.0.0.1" in nodes.stdout
    logs = cli(tmp_path, stub, "logs", "n1")
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.splitlines() == ["plain\ttabbed", "\\x1b[31mred\\x9b\\x7f"]  # tabs kept, the rest written out
    assert "\x1b" not in logs.stderr and "s-1\\x1b[1A" in logs.stderr
    refused = cli(tmp_path, stub, "explain-placement", "cap")
    assert refused.returncode != 0 and "no such thing \\x1b[2J here" in refused.stderr and "\x1b" not in refused.stderr


def test_the_bench_reads_its_key_from_the_environment_or_a_file_only_you_can_read(tmp_path, stub):
    gateway = ["--gateway", f"http://127.0.0.1:{stub.server_port}"]
    run = cli(tmp_path, stub, "bench", "cap", *gateway, env={"LLMGW_API_KEY": "sk-from-env\n"})
    assert run.returncode != 0 and "no such key \\x1b[2J" in run.stderr and "\x1b" not in run.stderr, run.stderr
    assert ("POST", "/v1/chat/completions", "Bearer sk-from-env") in stub.seen

    key_file = tmp_path / "bench.key"
    key_file.write_text("sk-from-file\n")
    key_file.chmod(0o644)
    loose = cli(tmp_path, stub, "bench", "cap", *gateway, "--key-file", str(key_file))
    assert loose.returncode != 0 and f"chmod 600 {key_file}" in loose.stderr, loose.stderr
    key_file.chmod(0o600)
    stub.seen.clear()
    cli(tmp_path, stub, "bench", "cap", *gateway, "--key-file", str(key_file), env={"LLMGW_API_KEY": "sk-other"})
    assert ("POST", "/v1/chat/completions", "Bearer sk-from-file") in stub.seen  # the file named wins

    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    empty.chmod(0o600)
    assert f"{empty} is empty" in cli(tmp_path, stub, "bench", "cap", "--key-file", str(empty)).stderr
    missing = cli(tmp_path, stub, "bench", "cap", "--key-file", str(tmp_path / "nope"))
    assert missing.returncode != 0 and "cannot read" in missing.stderr and "LLMGW_API_KEY" in missing.stderr
    neither = cli(tmp_path, stub, "bench", "cap")
    assert neither.returncode == 2 and "$LLMGW_API_KEY or in a file named by --key-file PATH" in neither.stderr
    old = cli(tmp_path, stub, "bench", "cap", "--key", "sk-in-ps")
    assert old.returncode == 2 and "--key is gone" in old.stderr and "--key-file" in old.stderr
