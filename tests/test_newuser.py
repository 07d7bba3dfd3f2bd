"""What a new user tripped over (issue 9): the CLI's help, tables and refusals, `llmgw up`'s start-up check
and the configuration it writes, and the pages' rough edges."""

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import click
import pytest
from click.testing import CliRunner

from llmgw import store
from llmgw.cli.main import main
from llmgw.people import keys


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


def test_revoking_a_revoked_key_says_so(store_url):
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
        self.send_response(200)
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
    assert "smollm2/1 is present: 1 file(s), 3.0 MiB" in result.output
    assert "FILE    SIZE     SHA256" in result.output and "a.gguf  3.0 MiB  " + "ab" * 32 in result.output
    assert "{" not in result.output
    monkeypatch.setattr(FakeMirror, "answer", {
        "model": "smollm2", "version": "1", "state": "fetching", "source": "hf:x/y", "done": 1024, "total": 2048,
        "files": [{"name": "a.gguf", "done": 1024, "total": 2048, "state": "fetching"}]})
    result = CliRunner().invoke(main, ["--config", fake_mirror, "mirror", "status", "smollm2", "1"])
    assert "arriving from hf:x/y: 1.0 KiB of 2.0 KiB so far" in result.output
    assert "a.gguf  fetching  1.0 KiB of 2.0 KiB" in result.output
    scripted = CliRunner().invoke(main, ["--config", fake_mirror, "mirror", "status", "smollm2", "1", "--json"])
    assert json.loads(scripted.output)["state"] == "fetching"
