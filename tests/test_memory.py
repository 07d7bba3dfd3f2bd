"""Agents' notes: `/v1/memory` and the gateway's MCP tools, refused until a project keeps notes, scoped to it,
searched with the store's full text (FTS5 on SQLite, tsvector on PostgreSQL), expired and swept.

A real gateway on SQLite and on PostgreSQL, the real `llmgw keys memory`, and the official `mcp` SDK's
client against `/v1/mcp`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import pytest
import sqlalchemy as sa
from conftest import ROOT, Gateway, Sim, gateway_over, make_key, run_cli, run_setup_script, wait_until, write_config

from llmgw import memory, store
from llmgw.people import keeping, orgtree


@pytest.fixture
def gw(tmp_path, store_url):
    gateway = Gateway(tmp_path, store_url, workers=2, threads__sweep_every=1)
    yield gateway
    gateway.stop()


def call(gw: Gateway, key: str, method: str, path: str, body=None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(gw.url + path, data=data, method=method, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read() or b"null")


def keys_memory(tmp_path, store_url, *args) -> subprocess.CompletedProcess:
    config = write_config(tmp_path / "cli.toml", {"store.url": store_url})
    return subprocess.run([sys.executable, "-m", "llmgw", "--config", config, "keys", "memory", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def project(url: str, name: str, hours: float | None) -> tuple[str, str]:
    """A project NAME keeping notes HOURS (None: none), and a key of it."""
    engine = store.open_store(url)
    try:
        path = orgtree.add(engine, "project", name, "default/default").path
        if hours is not None:
            keeping.set_memory(engine, path, hours)
    finally:
        engine.dispose()
    return path, make_key(url, name + "-key", project=path)


def every_worker(gw: Gateway, key: str, status: int) -> None:
    """Wait until requests on new connections (any worker) all get STATUS for a listing of KEY's notes."""
    wait_until(f"every worker to answer {status}", 30,
               lambda: all(call(gw, key, "GET", "/v1/memory")[0] == status for _ in range(12)))


def test_notes_are_refused_until_kept_then_made_found_changed_and_deleted_in_their_project(gw, tmp_path, store_url):
    key = make_key(store_url, "k")
    every_worker(gw, key, 403)  # a busy machine's workers may take more than their wait to read a new key
    status, body = call(gw, key, "POST", "/v1/memory", {"text": "The build uses make."})
    assert status == 403 and body["error"]["code"] == "memory_off"
    assert "llmgw keys memory --project P --retain-hours N" in body["error"]["message"]

    done = keys_memory(tmp_path, store_url, "--project", "default", "--retain-hours", "24")
    assert done.returncode == 0 and "keeps notes 24 h after it was last written" in done.stderr, done.stderr
    assert "default/default/default" in keys_memory(tmp_path, store_url).stdout
    every_worker(gw, key, 200)

    made = [call(gw, key, "POST", "/v1/memory", {"text": text}) for text in (
        "The build uses make, and `make test` runs the suite.",
        "Release notes live in CHANGELOG.md under Unreleased.",
        "Prefer small modules; the linker step failed on Tuesday.")]
    assert [s for s, _ in made] == [201, 201, 201]
    # Words are read alike on both stores: in paths and file names, and in a script with vowel signs.
    path_note = call(gw, key, "POST", "/v1/memory", {"text": "Deploys go through deploy/ansible; see config.toml."})[1]
    hindi_note = call(gw, key, "POST", "/v1/memory", {"text": "यह नोट हिन्दी में लिखा है"})[1]
    for query, note in (("ansible", path_note), ("config.toml", path_note), ("TOML", path_note),
                        ("हिन्दी", hindi_note)):
        found = call(gw, key, "GET", "/v1/memory?query=" + urllib.request.quote(query))[1]["data"]
        assert [n["id"] for n in found] == [note["id"]], query
    for note in (path_note, hindi_note):
        assert call(gw, key, "DELETE", f"/v1/memory/{note['id']}")[0] == 200
    first = made[0][1]
    assert first["object"] == "memory.note" and memory.NOTE_ID.fullmatch(first["id"])
    assert call(gw, key, "GET", f"/v1/memory/{first['id']}") == (200, first)

    # Found by any of its words, best match first; listing is the last written first.
    status, found = call(gw, key, "GET", "/v1/memory?query=make%20test%20suite")
    assert status == 200 and found["data"][0]["id"] == first["id"]
    assert [n["text"] for n in call(gw, key, "GET", "/v1/memory?query=linker")[1]["data"]] == [made[2][1]["text"]]
    assert call(gw, key, "GET", "/v1/memory?query=nothing%20like%20this")[1]["data"] == []
    assert [n["id"] for n in call(gw, key, "GET", "/v1/memory?limit=2")[1]["data"]] == [made[2][1]["id"],
                                                                                      made[1][1]["id"]]
    # The full-text languages' own syntax is words here, never an error.
    for odd in ('"unbalanced', "a OR", "NEAR(x y", "make*", "'; DROP TABLE notes; --", "\\", "x:y -z ^w"):
        status, _ = call(gw, key, "GET", "/v1/memory?query=" + urllib.request.quote(odd))
        assert status == 200, odd

    status, changed = call(gw, key, "PATCH", f"/v1/memory/{first['id']}", {"text": "The build uses ninja now."})
    assert status == 200 and changed["text"] == "The build uses ninja now."
    assert call(gw, key, "GET", "/v1/memory?query=ninja")[1]["data"][0]["id"] == first["id"]
    assert call(gw, key, "GET", "/v1/memory?query=make")[1]["data"] == []  # the old words left the index

    # Another project's key: a real id and an invented one read alike; its search sees none of these.
    _, other = project(store_url, "other", 1)
    every_worker(gw, other, 200)
    for note_id in (first["id"], memory.new_id(), "not-an-id"):
        for method, body in (("GET", None), ("PATCH", {"text": "x"}), ("DELETE", None)):
            status, refused = call(gw, other, method, f"/v1/memory/{note_id}", body)
            assert status == 404 and refused["error"]["code"] == "note_not_found"
    assert call(gw, other, "GET", "/v1/memory?query=ninja")[1]["data"] == []

    assert call(gw, key, "DELETE", f"/v1/memory/{first['id']}")[0] == 200
    assert call(gw, key, "GET", f"/v1/memory/{first['id']}")[0] == 404
    assert call(gw, key, "GET", "/v1/memory?query=ninja")[1]["data"] == []

    # Bounded, and refused in OpenAI's error shape.
    for body, param in (({"text": "x" * (memory.TEXT_MOST + 1)}, "text"), ({"text": ""}, "text"),
                        ({"text": 5}, "text"), ({"text": "nul \u0000 here"}, "text")):
        status, refused = call(gw, key, "POST", "/v1/memory", body)
        assert status == 400 and refused["error"]["param"] == param, body
    for query in ("limit=0", "limit=101", "limit=many", "query=" + "x" * 501):
        assert call(gw, key, "GET", "/v1/memory?" + query)[0] == 400, query
    assert call(gw, key, "PUT", "/v1/memory", {"text": "x"})[0] == 405

    # Turned off: refused at once, and the sweep deletes what was kept.
    assert keys_memory(tmp_path, store_url, "--project", "default", "--off").returncode == 0
    every_worker(gw, key, 403)
    engine = store.open_engine(store_url)
    try:
        def left() -> int:
            with engine.connect() as conn:
                return conn.execute(sa.select(sa.func.count()).select_from(store.notes)
                                    .where(store.notes.c.scope != "")).scalar()

        wait_until("the sweep to delete the notes of a project that keeps none", 60, lambda: left() == 0)
    finally:
        engine.dispose()


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # what differs by store is tested elsewhere
def test_a_personal_key_keeps_no_notes(gw, store_url):
    from llmgw.people import accounts

    engine = store.open_store(store_url)
    try:
        person = accounts.create_user(engine, "ada@example.com", "a long enough password", state="active")
    finally:
        engine.dispose()
    key = make_key(store_url, "mine", project=None, user_id=person.id)
    every_worker(gw, key, 403)
    status, body = call(gw, key, "POST", "/v1/memory", {"text": "x"})
    assert status == 403 and body["error"]["code"] == "memory_needs_project"


async def _mcp(url: str, key: str, work):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    async with create_mcp_http_client(headers={"Authorization": f"Bearer {key}"}) as http:
        async with streamable_http_client(url, http_client=http, terminate_on_close=False) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await work(session)


def mcp_session(gw: Gateway, key: str, work):
    return asyncio.run(_mcp(gw.url + "/v1/mcp", key, work))


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # what differs by store is tested elsewhere
def test_the_mcp_tools_work_with_the_official_sdk(gw, store_url):
    _, key = project(store_url, "agents", 24)
    every_worker(gw, key, 200)

    async def work(session):
        tools = await session.list_tools()
        names = [t.name for t in tools.tools]
        remembered = await session.call_tool("remember", {"text": "Deploys go through deploy/ansible."})
        await session.call_tool("remember", {"text": "The staging host is stage-2."})
        recalled = await session.call_tool("recall", {"query": "ansible deploys"})
        listed = await session.call_tool("list_notes", {"limit": 5})
        note_id = remembered.content[0].text.split()[-1].rstrip(".")
        forgot = await session.call_tool("forget", {"id": note_id})
        again = await session.call_tool("forget", {"id": note_id})
        empty = await session.call_tool("remember", {"text": ""})
        return names, remembered, recalled, listed, note_id, forgot, again, empty

    names, remembered, recalled, listed, note_id, forgot, again, empty = mcp_session(gw, key, work)
    assert names == ["remember", "recall", "list_notes", "forget"]
    assert not remembered.is_error and memory.NOTE_ID.fullmatch(note_id)
    assert "deploy/ansible" in recalled.content[0].text and "stage-2" not in recalled.content[0].text
    assert "stage-2" in listed.content[0].text and "deploy/ansible" in listed.content[0].text
    assert not forgot.is_error and again.is_error and "No note" in again.content[0].text
    assert empty.is_error and "text is required" in empty.content[0].text
    # What the tools made is what /v1/memory holds.
    assert [n["text"] for n in call(gw, key, "GET", "/v1/memory")[1]["data"]] == ["The staging host is stage-2."]


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # what differs by store is tested elsewhere
def test_the_mcp_server_refuses_a_project_without_notes_and_what_is_not_mcp(gw, store_url):
    _, key = project(store_url, "plain", None)
    every_worker(gw, key, 403)
    with pytest.raises(ExceptionGroup) as failed:  # the SDK's client stops at its handshake, saying why
        mcp_session(gw, key, lambda session: session.list_tools())
    assert "MCPError(-32001, \"This key's project keeps no notes." in repr(failed.value)
    initialize = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}).encode()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(gw.url + "/v1/mcp", data=initialize, method="POST", headers={
            "Authorization": f"Bearer {key}"}), timeout=10)
    with refused.value as answer:
        error = json.loads(answer.read())["error"]
    assert refused.value.code == 403 and error["code"] == -32001
    assert "llmgw keys memory --project P --retain-hours N" in error["message"]
    _, kept = project(store_url, "kept", 1)
    every_worker(gw, kept, 200)
    post = lambda body: urllib.request.Request(gw.url + "/v1/mcp", data=body, method="POST",  # noqa: E731
                                               headers={"Authorization": f"Bearer {kept}"})
    for body, code in ((b"{", -32700), (b"[]", -32600), (b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}', -32600),
                       (b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]', -32600),  # no batches
                       (b"[" * 5000 + b"]" * 5000, -32700), (b'{"a":' * 5000 + b"1" + b"}" * 5000, -32700),
                       (b'{"jsonrpc": "2.0", "id": "\\ud800", "method": "ping"}', -32600),
                       (b'{"jsonrpc": "2.0", "id": 1, "method": 5}', -32600),
                       (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": [1]}', -32602),
                       (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "list_notes", '
                        b'"arguments": []}}', -32602)):
        try:
            with urllib.request.urlopen(post(body), timeout=10) as resp:
                answer = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            with e:
                answer = json.loads(e.read())
        assert answer["error"]["code"] == code, body[:40]
    for arguments, said in (({"name": "recall", "arguments": {}}, "query is required"),
                            ({"name": "remember", "arguments": {"text": "x", "bogus": 1}}, "not an argument"),
                            ({"name": "list_notes", "arguments": {"limit": "5"}}, "whole number")):
        message = json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": arguments}).encode()
        with urllib.request.urlopen(post(message), timeout=10) as r:
            result = json.loads(r.read())["result"]
        assert result["isError"] and said in result["content"][0]["text"], result
    with urllib.request.urlopen(post(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}'), timeout=10) as r:
        assert r.status == 202 and r.read() == b""
    with urllib.request.urlopen(post(b'{"jsonrpc": "2.0", "id": 7, "method": "server/discover"}'), timeout=10) as r:
        assert json.loads(r.read())["error"]["code"] == -32601
    get = urllib.request.Request(gw.url + "/v1/mcp", headers={"Authorization": f"Bearer {kept}"})
    with pytest.raises(urllib.error.HTTPError) as not_allowed:
        urllib.request.urlopen(get, timeout=10)
    assert not_allowed.value.code == 405
    not_allowed.value.close()


def test_notes_expire_from_their_last_write_and_a_longer_window_brings_none_back(tmp_path):
    engine = store.open_store(f"sqlite:///{tmp_path}/m.db")
    now = time.time()
    old = memory.add(engine, "p", "an old note about apples", 1, now=now - 7200)
    fresh = memory.add(engine, "p", "a fresh note about apples", 1, now=now)
    assert [n.id for n in memory.search(engine, "p", "apples", 1, 10, now=now)] == [fresh.id]
    assert memory.get(engine, "p", old.id, 5, now=now) is None  # it expired under 1 h: 5 h does not revive it
    assert not memory.delete(engine, "p", old.id, 1, now=now)  # reads as gone, and is deleted all the same
    memory.add(engine, "q", "another project's", 1, now=now)
    assert memory.sweep(engine, {"p": 1}, now=now) == 1  # q keeps none: its note goes
    assert [n.id for n in memory.listing(engine, "p", 1, 10, now=now)] == [fresh.id]
    engine.dispose()


def test_codex_and_claude_code_set_up_by_the_gateway_keep_notes_through_its_mcp_tools(tmp_path, codex_cli,
                                                                                       claude_cli):
    """`/setup/codex` and `/setup/claude` with memory=1 (what the account page offers a person whose project
    keeps notes) add the gateway's MCP server; with only the files they write, both real agents offer its
    tools to the model, and a sim that calls `remember` makes each keep a note, which /v1/memory then holds."""
    url = f"sqlite:///{tmp_path}/agents.db"
    store.open_store(url).dispose()
    _, key = project(url, "agents", 24)
    # Codex offers the server's tools by their own names, Claude Code as mcp__SERVER__TOOL; the requests that
    # offer neither (a title, a check of the prompt) get a line.
    sims = {"codex-sim": Sim(model="codex-sim", replica="codex-sim", ttft_ms=1, tokens_per_s=0, reply="Noted.",
                             tool_call=("remember", json.dumps({"text": "Codex was here."}))),
            "claude-sim": Sim(model="claude-sim", replica="claude-sim", ttft_ms=1, tokens_per_s=0, reply="Noted.",
                              tool_call=("mcp__llmgw-memory__remember", json.dumps({"text": "Claude Code was here."})))}
    with gateway_over(tmp_path, url, sims, [{"name": name} for name in sims]) as gw:
        for tool, model in (("codex", "codex-sim"), ("claude", "claude-sim")):
            with urllib.request.urlopen(f"{gw.url}/setup/{tool}?model={model}&memory=1", timeout=30) as answer:
                script = answer.read().decode()
            home = tmp_path / f"{tool}-home"
            home.mkdir()
            done = run_setup_script(script, home, key)
            assert done.returncode == 0, done.stdout + done.stderr
            if tool == "codex":
                assert 'bearer_token_env_var = "LLMGW_API_KEY"' in (home / ".codex" / "config.toml").read_text()
                # Non-interactive, a call of an MCP tool needs what `codex exec` runs tools with unasked.
                ran = run_cli([codex_cli, "--profile", "llmgw", "exec", "--skip-git-repo-check", "-s",
                               "danger-full-access", "-c", "approval_policy=never", "Remember that Codex was here."],
                              tmp_path, {"HOME": str(home), "LLMGW_API_KEY": key})
                assert "Remembered as note_" in ran.stdout + ran.stderr, ran.stdout + ran.stderr
            else:
                assert key not in (home / ".claude.json").read_text()  # the file names the variable
                ran = run_cli([claude_cli, "-p", "Remember that Claude Code was here.",
                               "--allowedTools", "mcp__llmgw-memory__remember"], tmp_path, {
                    "HOME": str(home), "LLMGW_API_KEY": key,
                    # Its first request waits for the server, and offers its tools rather than a search for them.
                    "CLAUDE_CODE_MCP_PREWAIT_SERVERS": "llmgw-memory", "ENABLE_TOOL_SEARCH": "false"})
                assert "Remembered as note_" in ran.stdout, ran.stdout + ran.stderr
        kept = sorted(n["text"] for n in call(gw, key, "GET", "/v1/memory")[1]["data"])
        assert kept == ["Claude Code was here.", "Codex was here."]


def test_a_shorter_window_is_final_for_notes_and_threads(tmp_path):
    """Cut a project's window, then lengthen it again: what the cut expired stays expired."""
    from llmgw import conversations

    url = f"sqlite:///{tmp_path}/w.db"
    path, _ = project(url, "windows", 24)
    engine = store.open_store(url)
    try:
        scope = orgtree.Tree.load(engine).find("project", path).id
        keeping.set_threads(engine, path, 24)
        two_hours_ago = time.time() - 7200
        note = memory.add(engine, scope, "written two hours ago", 24, now=two_hours_ago)
        conversations.append(engine, scope, "t", 24, None, [{"role": "user", "content": "x"}], 1, now=two_hours_ago)
        for kind in ("memory", "threads"):
            keeping.set_keeping(engine, kind, path, 1)
            keeping.set_keeping(engine, kind, path, 24)
        assert memory.get(engine, scope, note.id, 24) is None
        assert conversations.read(engine, scope, "t", 24) is None
    finally:
        engine.dispose()
