"""Kept conversations (`x-llmgw-thread`): refused until a project turns them on, replayed to the engine after,
scoped to the project, fitted to the model's context, deleted by the client, expired and swept.

A real gateway (gunicorn, two workers) on SQLite and on PostgreSQL, a sim engine that says whether the prompt
it was sent held what an earlier turn said, the official `openai` and `anthropic` SDKs, and the real
`llmgw keys threads` command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import anthropic
import openai
import pytest
import sqlalchemy as sa
from conftest import ROOT, Gateway, Sim, make_key, post, wait_until, write_config

from llmgw import store
from llmgw.people import accounts, keeping, orgtree

REMEMBERED = "You told me before."  # holds no "Ada": a kept answer must not remember for the next turn
FORGOTTEN = "I do not know your name."
CONTEXT = 400  # tokens the model (and the sim) takes


@pytest.fixture
def served(tmp_path, store_url):
    """A gateway over a sim that answers REMEMBERED when its prompt holds the name Ada, and the sim."""
    sim = Sim(model="m", replica="m", ttft_ms=1, tokens_per_s=0, reply=FORGOTTEN, reply_if=("Ada", REMEMBERED),
              max_context=CONTEXT)
    try:
        gw = Gateway(tmp_path, store_url, endpoints=[{"id": "m", "url": sim.url, "models": ["m"]}],
                     models=[{"name": "m", "max_context": CONTEXT, "max_output": 50}], threads__sweep_every=1)
    except Exception:
        sim.stop()
        raise
    yield gw, sim
    gw.stop()
    sim.stop()


@pytest.fixture
def sdk():
    """SDK(gw, key, kind=openai.OpenAI): an SDK's client of GW with KEY, closed when the test ends."""
    made = []

    def make(gw: Gateway, key: str, kind=openai.OpenAI):
        client = kind(base_url=gw.url + ("/v1" if kind is openai.OpenAI else ""), api_key=key, max_retries=0)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def keys_threads(tmp_path, store_url, *args) -> subprocess.CompletedProcess:
    """`llmgw keys threads ARGS` run as an operator runs it."""
    config = write_config(tmp_path / "cli.toml", {"store.url": store_url})
    return subprocess.run([sys.executable, "-m", "llmgw", "--config", config, "keys", "threads", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def chat(client: openai.OpenAI, text: str, thread: str | None = None, system: str | None = None, **kwargs):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    headers = {"x-llmgw-thread": thread} if thread else {}
    return client.chat.completions.with_raw_response.create(model="m", messages=messages, extra_headers=headers,
                                                            max_tokens=20, **kwargs)


def said(raw) -> str:
    return raw.parse().choices[0].message.content.strip()


def turns(url: str, thread: str) -> list[list[dict]]:
    engine = store.open_engine(url)
    try:
        with engine.connect() as conn:
            t = store.thread_turns
            rows = conn.execute(sa.select(t.c.messages).where(t.c.thread_id == thread).order_by(t.c.seq)).scalars()
            return [json.loads(r) for r in rows]
    finally:
        engine.dispose()


def gone(url: str, thread: str, hours: float) -> bool:
    """Whether the default project's THREAD reads as expired (or absent) under HOURS, by the clock now."""
    from llmgw import conversations

    engine = store.open_engine(url)
    try:
        with engine.connect() as conn:
            scope = conn.execute(sa.select(store.projects.c.id).where(store.projects.c.name == "default")).scalar()
        return conversations.read(engine, scope, thread, hours) is None
    finally:
        engine.dispose()


def a_project(url: str, name: str) -> str:
    """A project NAME of its own (under default/default), its path."""
    engine = store.open_store(url)
    try:
        return orgtree.add(engine, "project", name, "default/default").path
    finally:
        engine.dispose()


def probe(gw: Gateway, key: str) -> int:
    """The status of a thread's request on a connection of its own, so that any worker may take it."""
    return post(gw.url + "/v1/chat/completions", {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "ping"}]}, key, {"x-llmgw-thread": "probe"})[0]


def every_worker(gw: Gateway, key: str, status: int, what: str) -> None:
    """Wait until a run of requests, each on a new connection, all get STATUS: every worker holds the keys
    that say whether KEY's project keeps conversations (each reads their revision itself)."""
    wait_until(what, 30, lambda: all(probe(gw, key) == status for _ in range(12)))


def turned_on(gw: Gateway, key: str) -> None:
    every_worker(gw, key, 200, "the gateway's workers to take the project's conversations")


def keeping_key(gw: Gateway, store_url: str, hours: float) -> str:
    """A key of the default project, which keeps conversations HOURS, once every worker of GW knows it."""
    key = make_key(store_url, "k")
    engine = store.open_store(store_url)
    try:
        keeping.set_threads(engine, "default", hours)
    finally:
        engine.dispose()
    turned_on(gw, key)
    return key


def test_threads_are_refused_until_turned_on_then_replayed_scoped_and_deleted(served, tmp_path, store_url, sdk):
    gw, sim = served
    key = make_key(store_url, "project-key")
    every_worker(gw, key, 403, "every worker to know the new key")  # a busy machine's may take more than their wait
    client = sdk(gw, key)

    # Off for every project: refused, saying how to turn it on, and nothing is kept.
    with pytest.raises(openai.PermissionDeniedError) as refused:
        chat(client, "My name is Ada.", thread="t1")
    assert refused.value.code == "threads_off"
    assert "llmgw keys threads --project P --retain-hours N" in refused.value.message

    # A personal key keeps none, whatever its person's projects do.
    engine = store.open_store(store_url)
    try:
        person = accounts.create_user(engine, "ada@example.com", "a long enough password", state="active")
    finally:
        engine.dispose()
    personal = make_key(store_url, "mine", project=None, user_id=person.id)
    every_worker(gw, personal, 403, "every worker to know the personal key")
    with pytest.raises(openai.PermissionDeniedError) as refused:
        chat(sdk(gw, personal), "Hi", thread="t1")
    assert refused.value.code == "threads_need_project"

    # The operator's command turns them on, with the retention it requires.
    needs_hours = keys_threads(tmp_path, store_url, "--project", "default")
    assert needs_hours.returncode == 2 and "--retain-hours N" in needs_hours.stderr
    done = keys_threads(tmp_path, store_url, "--project", "default", "--retain-hours", "24")
    assert done.returncode == 0, done.stderr
    assert "default/default/default keeps conversations 24 h after their last turn" in done.stderr
    listed = keys_threads(tmp_path, store_url)
    assert "default/default/default" in listed.stdout and "24 h" in listed.stdout
    turned_on(gw, key)

    # The first turn says the name; the second sends only its question, and the engine was sent both.
    first = chat(client, "My name is Ada.", thread="t1", system="Answer briefly.")
    assert said(first) == REMEMBERED
    assert said(chat(client, "What is my name?")) == FORGOTTEN  # without the thread: nothing replayed
    second = chat(client, "What is my name?", thread="t1")
    assert said(second) == REMEMBERED
    assert second.headers.get("x-llmgw-thread-dropped") is None
    kept = turns(store_url, "t1")
    assert [[m["role"] for m in t] for t in kept] == [["user", "assistant"], ["user", "assistant"]]
    assert kept[0][0]["content"] == "My name is Ada." and kept[1][1]["content"] == REMEMBERED

    # A streamed answer is kept too, before the stream's end reaches the client.
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Again?"}],
                                            extra_headers={"x-llmgw-thread": "t1"}, stream=True, max_tokens=20)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip() == REMEMBERED
    assert turns(store_url, "t1")[-1] == [{"role": "user", "content": "Again?"},
                                          {"role": "assistant", "content": REMEMBERED}]

    # Another project's key naming the same id gets a thread of its own, exactly as for an unused id.
    other_path = a_project(store_url, "other")
    other = make_key(store_url, "other-key", project=other_path)
    assert keys_threads(tmp_path, store_url, "--project", other_path, "--retain-hours", "1").returncode == 0
    turned_on(gw, other)
    other_client = sdk(gw, other)
    assert said(chat(other_client, "What is my name?", thread="t1")) == FORGOTTEN
    with pytest.raises(openai.NotFoundError):
        other_client.delete(f"/threads/{'never-used'}", cast_to=object)
    other_client.delete("/threads/t1", cast_to=object)  # its own t1, made a moment ago
    assert said(chat(client, "Who am I?", thread="t1")) == REMEMBERED  # the first project's is untouched

    # Counting a turn's tokens counts its history too; a bad id is refused there as anywhere.
    claude_counter = sdk(gw, key, anthropic.Anthropic)
    alone = claude_counter.messages.count_tokens(model="m", messages=[{"role": "user", "content": "And now?"}])
    with_history = claude_counter.messages.count_tokens(model="m", messages=[{"role": "user", "content": "And now?"}],
                                                        extra_headers={"x-llmgw-thread": "t1"})
    assert with_history.input_tokens > alone.input_tokens
    with pytest.raises(anthropic.BadRequestError):
        claude_counter.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x"}],
                                             extra_headers={"x-llmgw-thread": "bad id"})

    # A lone surrogate, which JSON allows, is kept and sent again as it came.
    assert post(gw.url + "/v1/chat/completions", {"model": "m", "max_tokens": 5, "messages": [  # json escapes it
        {"role": "user", "content": "odd \ud800 text"}]}, key, {"x-llmgw-thread": "surrogate"})[0] == 200
    assert turns(store_url, "surrogate")[0][0]["content"] == "odd \ud800 text"

    # A forced tool's call is kept with the id the client was given, so the tool's result answers it.
    forced = client.chat.completions.create(
        model="m", max_tokens=20, messages=[{"role": "user", "content": "List it."}],
        tools=[{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}],
        tool_choice={"type": "function", "function": {"name": "ls"}}, extra_headers={"x-llmgw-thread": "forced"})
    assert turns(store_url, "forced")[0][1]["tool_calls"][0]["id"] == forced.choices[0].message.tool_calls[0].id

    # Anthropic's Messages API continues the same thread (the header through the SDK's own extra_headers).
    claude = sdk(gw, key, anthropic.Anthropic)
    message = claude.messages.create(model="m", max_tokens=20, messages=[{"role": "user", "content": "And now?"}],
                                     extra_headers={"x-llmgw-thread": "t1"})
    assert message.content[0].text.strip() == REMEMBERED

    # The client deletes its thread: gone at once, and a second delete finds nothing.
    deleted = client.delete("/threads/t1", cast_to=object)
    assert deleted == {"id": "t1", "object": "thread.deleted", "deleted": True}
    assert turns(store_url, "t1") == []  # the other project's t1 was deleted by its own key before
    assert said(chat(client, "What is my name?", thread="t1")) == FORGOTTEN
    client.delete("/threads/t1", cast_to=object)
    with pytest.raises(openai.NotFoundError):
        client.delete("/threads/t1", cast_to=object)


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # what differs by store is tested elsewhere
def test_bad_thread_requests_are_refused_in_the_callers_api(served, store_url, sdk):
    gw, _ = served
    key = keeping_key(gw, store_url, 1)
    client = sdk(gw, key)
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, "hi", thread="no spaces allowed")
    assert bad.value.code == "invalid_thread_id"
    # Refused thread requests count against the key's rate like any other.
    engine = store.open_store(store_url)
    try:
        from llmgw.people import keys as keymod
        from llmgw.people import limits

        record, limited = keymod.create_key(engine, "limited")
        limits.set_limits(engine, "key", record.id, "test", rpm=3)
    finally:
        engine.dispose()
    statuses = []
    wait_until("the limited key to reach the gateway", 30, lambda: probe(gw, limited) == 200)
    for _ in range(6):
        statuses.append(post(gw.url + "/v1/chat/completions", {"model": "m", "messages": [
            {"role": "user", "content": "x"}]}, limited, {"x-llmgw-thread": "bad id"})[0])
    assert 429 in statuses, statuses
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, "hi", thread="t", n=2)
    assert "n = 1" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.embeddings.create(model="m", input="hi", extra_headers={"x-llmgw-thread": "t"})
    assert "only chat requests" in bad.value.message
    claude = sdk(gw, key, anthropic.Anthropic)
    with pytest.raises(anthropic.BadRequestError) as bad_messages:
        claude.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                               extra_headers={"x-llmgw-thread": "x" * 129})
    assert bad_messages.value.body["error"]["type"] == "invalid_request_error"
    assert turns(store_url, "t") == []


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # what differs by store is tested elsewhere
def test_a_history_that_outgrows_the_context_loses_its_oldest_turns_not_its_system_prompt(served, store_url, sdk):
    gw, _ = served
    key = keeping_key(gw, store_url, 1)
    client = sdk(gw, key)
    chat(client, "My name is Ada.", thread="long", system="Be brief.")
    filler = "word " * 60  # about 75 tokens a turn as the gateway estimates it: the context holds a few
    dropped = []
    for _ in range(8):
        raw = chat(client, filler, thread="long")
        dropped.append(int(raw.headers.get("x-llmgw-thread-dropped", "0")))
    # The engine (which refuses a prompt past its context) answered every turn; the oldest turns, the name
    # among them, were left out of the later ones, and the client was told how many.
    assert dropped[0] == 0 and dropped[-1] > 0 and dropped == sorted(dropped)
    assert said(chat(client, "What is my name?", thread="long")) == FORGOTTEN
    assert len(turns(store_url, "long")) == 10  # left out of requests, never deleted


def test_expired_threads_read_as_gone_and_the_sweep_deletes_them(served, tmp_path, store_url, sdk):
    gw, _ = served
    key = keeping_key(gw, store_url, 2 / 3600)
    client = sdk(gw, key)
    chat(client, "My name is Ada.", thread="brief")
    wait_until("the thread's two seconds to pass", 30, lambda: gone(store_url, "brief", 2 / 3600))
    # Past its retention the thread reads as gone, and its next turn starts it afresh.
    assert said(chat(client, "What is my name?", thread="brief")) == FORGOTTEN
    assert all(t[0]["content"] != "My name is Ada." for t in turns(store_url, "brief"))
    # The gateway's own sweep (threads.sweep_every = 1 s here) deletes what expired.
    wait_until("the sweep to delete expired threads", 60, lambda: turns(store_url, "brief") == [])

    # Turned off, a project's threads go at the next sweep, and new turns are refused.
    keeping_on = keys_threads(tmp_path, store_url, "--project", "default", "--retain-hours", "1")
    assert keeping_on.returncode == 0
    chat(client, "My name is Ada.", thread="kept")
    assert turns(store_url, "kept")
    off = keys_threads(tmp_path, store_url, "--project", "default", "--off")
    assert off.returncode == 0 and "deleted at the next hourly sweep" in off.stderr
    wait_until("the sweep to delete a project's threads once it keeps none", 60,
               lambda: turns(store_url, "kept") == [])

    every_worker(gw, key, 403, "every worker to refuse threads again")


def test_the_sweep_deletes_in_batches_past_one(tmp_path):
    """More threads than one batch: all that expired go, the live stay."""
    from llmgw import conversations

    engine = store.open_store(f"sqlite:///{tmp_path}/s.db")
    now = time.time()
    for i in range(conversations.SWEEP_BATCH + 7):
        conversations.append(engine, "p", f"old-{i}", 1, None, [{"role": "user", "content": "x"}], 1,
                             now=now - 7200)
    conversations.append(engine, "p", "live", 1, None, [{"role": "user", "content": "x"}], 1, now=now)
    conversations.append(engine, "q", "off", 1, None, [{"role": "user", "content": "x"}], 1, now=now)
    assert conversations.sweep(engine, {"p": 1}, now) == conversations.SWEEP_BATCH + 8
    with engine.connect() as conn:
        assert conn.execute(sa.select(store.threads.c.id)).scalars().all() == ["live"]
        assert conn.execute(sa.select(sa.func.count()).select_from(store.thread_turns)).scalar() == 1
    assert os.stat(f"{tmp_path}/s.db").st_mode & 0o077 == 0


def test_the_system_prompt_is_kept_when_old_turns_are_left_out():
    """The thread's system messages go first in every request; a request's own replace them."""
    from llmgw import conversations
    from llmgw.gateway import apirequest, threads
    from llmgw.gateway.snapshot import ModelSpec

    class Ex:
        model = ModelSpec(name="m", max_context=200)

        def __init__(self, messages):
            self.req = apirequest.parse("chat", json.dumps({"model": "m", "messages": messages,
                                                            "max_tokens": 20}).encode(), 0)

    history = conversations.History([{"role": "system", "content": "Be brief."}], [
        conversations.Turn(i + 1, [{"role": "user", "content": f"turn {i}"}, {"role": "assistant", "content": "ok"}],
                           60) for i in range(5)])
    kept = threads.Threads.__new__(threads.Threads)
    kept.prefix_bytes = 0
    ex = Ex([{"role": "user", "content": "now"}])
    turn = kept.prepend(ex, "p", "t", 1, history)
    sent = ex.req.body["messages"]
    assert sent[0] == {"role": "system", "content": "Be brief."} and sent[-1]["content"] == "now"
    assert turn.dropped == 3 and [m["content"] for m in sent[1:-1]] == ["turn 3", "ok", "turn 4", "ok"]
    assert json.loads(ex.req.raw)["messages"] == sent and turn.system is None
    ex = Ex([{"role": "system", "content": "Be long."}, {"role": "user", "content": "now"}])
    turn = kept.prepend(ex, "p", "t", 1, history)
    assert ex.req.body["messages"][0]["content"] == "Be long." and turn.system == [ex.req.body["messages"][0]]


def test_responses_are_stored_continued_fetched_and_deleted_within_the_project(served, store_url, sdk):
    gw, _ = served
    key = make_key(store_url, "k")
    every_worker(gw, key, 403, "every worker to know the new key")
    client = sdk(gw, key)

    # A project that keeps nothing: a response is not stored (and says so), and none can be continued from.
    unkept = client.responses.create(model="m", input="My name is Ada.", max_output_tokens=20)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.responses.create(model="m", input="Who?", previous_response_id=unkept.id, max_output_tokens=20)
    assert refused.value.code == "threads_off" and "previous_response_id cannot be used" in refused.value.message

    engine = store.open_store(store_url)
    try:
        keeping.set_threads(engine, "default", 1)
    finally:
        engine.dispose()
    turned_on(gw, key)

    # Stored by default (OpenAI's default), continued from by id, the history replayed to the engine.
    first = client.responses.create(model="m", input="My name is Ada.", instructions="Answer briefly.",
                                    max_output_tokens=20)
    assert first.store is True and first.output_text.strip() == REMEMBERED
    second = client.responses.create(model="m", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=20)
    assert second.output_text.strip() == REMEMBERED and second.previous_response_id == first.id
    assert client.responses.create(model="m", input="What is my name?",
                                   max_output_tokens=20).output_text.strip() == FORGOTTEN

    # Streamed, then continued from: the stream's final response object is what is kept and fetched.
    with client.responses.stream(model="m", input="Again?", previous_response_id=second.id,
                                 max_output_tokens=20) as stream:
        streamed = stream.get_final_response()
    assert streamed.store is True
    fetched = client.responses.retrieve(streamed.id)
    assert fetched.id == streamed.id and fetched.output_text == streamed.output_text
    assert fetched.previous_response_id == second.id
    assert client.responses.retrieve(first.id).output_text.strip() == REMEMBERED

    # Continued from an earlier response than the last: a branch of its own, the later turns not in it.
    branch = client.responses.create(model="m", input="Branching.", previous_response_id=first.id,
                                     max_output_tokens=20)
    assert [t[0]["content"] for t in turns(store_url, "@" + branch.id)] == ["My name is Ada.", "Branching."]
    assert len(turns(store_url, "@" + first.id)) == 3  # the original thread goes on untouched

    # store false continues from a kept response and keeps nothing of its own.
    unstored = client.responses.create(model="m", input="Who?", previous_response_id=first.id, store=False,
                                       max_output_tokens=20)
    assert unstored.store is False and unstored.output_text.strip() == REMEMBERED
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)

    # Another project's key finds nothing, alike for a real id and an invented one.
    other_path = a_project(store_url, "other")
    other = make_key(store_url, "other-key", project=other_path)
    engine = store.open_store(store_url)
    try:
        keeping.set_threads(engine, other_path, 1)
    finally:
        engine.dispose()
    turned_on(gw, other)
    stranger = sdk(gw, other)
    for rid in (second.id, "resp_" + "0" * 24):
        with pytest.raises(openai.NotFoundError) as missing:
            stranger.responses.retrieve(rid)
        assert missing.value.code == "response_not_found"
        with pytest.raises(openai.BadRequestError) as missing_previous:
            stranger.responses.create(model="m", input="x", previous_response_id=rid, max_output_tokens=5)
        assert missing_previous.value.code == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            stranger.responses.delete(rid)

    # Deleted by its own project: gone, and nothing continues from it.
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="x", previous_response_id=first.id, max_output_tokens=5)
    assert client.responses.retrieve(second.id).id == second.id

    # Ids of no shape this gateway makes are refused as not found, never a 500 (the store is not asked).
    for odd in ("\ud800", "resp_\udfff", "\u0000abc", "resp_" + "g" * 24):
        status, _, body = post(gw.url + "/v1/responses", {"model": "m", "input": "x", "max_output_tokens": 5,
                                                          "previous_response_id": odd}, key)
        assert status == 400 and json.loads(body)["error"]["code"] == "previous_response_not_found", odd
    for path in ("%00", "%ED%A0%80", "x" * 300):
        assert post(gw.url + "/v1/responses/" + path, b"", key)[0] == 405  # only GET and DELETE
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(path)

    # Both at once is ambiguous, and refused.
    with pytest.raises(openai.BadRequestError) as both:
        client.responses.create(model="m", input="x", previous_response_id=second.id, max_output_tokens=5,
                                extra_headers={"x-llmgw-thread": "t"})
    assert "not both" in both.value.message


def test_the_store_forgets_what_it_was_told_to_and_brings_nothing_back(tmp_path):
    """Deleting a response deletes its copies in branches and a thread left empty; an expired thread stays
    gone under a longer window; a read is bounded; a lone surrogate is kept as it came."""
    from llmgw import conversations as c

    engine = store.open_store(f"sqlite:///{tmp_path}/c.db")
    now = time.time()
    say = lambda words: [{"role": "user", "content": words}, {"role": "assistant", "content": "ok"}]  # noqa: E731
    c.append(engine, "p", "@r1", 1, [{"role": "system", "content": "SECRET"}], say("first"), 5, "resp_1", "{}",
             now=now)
    c.append(engine, "p", "@r1", 1, None, say("second"), 5, "resp_2", "{}", after=1, fork="@r2", now=now)
    branch, _ = c.append(engine, "p", "@r1", 1, None, say("branch"), 5, "resp_3", "{}", after=1, fork="@r3", now=now)
    assert branch == "@r3" and [t.messages[0]["content"] for t in c.read(engine, "p", "@r3", 1, now).turns] == [
        "first", "branch"]
    assert c.delete_response(engine, "p", "resp_1", 1, now)
    assert [t.messages[0]["content"] for t in c.read(engine, "p", "@r3", 1, now).turns] == ["branch"]
    assert c.delete_response(engine, "p", "resp_2", 1, now)
    assert c.read(engine, "p", "@r1", 1, now) is None  # no turn left: the thread (and its system text) went
    with engine.connect() as conn:
        assert "SECRET" not in json.dumps([list(r) for r in conn.execute(sa.select(store.threads)).all()
                                           if r.id == "@r1"])

    c.append(engine, "p", "t", 1, None, say("bad \ud800 text"), 5, now=now)
    assert c.read(engine, "p", "t", 1, now).turns[0].messages[0]["content"] == "bad \ud800 text"
    for i in range(5):
        c.append(engine, "p", "t", 1, None, say(f"turn {i} " + "x" * 100), 5, now=now)
    bounded = c.read(engine, "p", "t", 1, now, most_bytes=400)
    assert len(bounded.turns) == 2 and bounded.left_out == 4 and bounded.turns[-1].messages[0]["content"][:6] == "turn 4"

    c.append(engine, "p", "old", 1, None, say("old"), 5, now=now - 7200)
    assert c.read(engine, "p", "old", 5, now) is None  # expired under 1 h: a 5 h window does not revive it
    assert not c.delete(engine, "p", "old", 5, now)  # reads as gone, and is deleted all the same
    with engine.connect() as conn:
        assert conn.execute(sa.select(store.threads.c.id).where(store.threads.c.id == "old")).first() is None
    engine.dispose()


def test_a_replayed_history_never_starts_with_a_tools_result():
    from llmgw import conversations
    from llmgw.gateway import apirequest, threads
    from llmgw.gateway.snapshot import ModelSpec

    class Ex:
        model = ModelSpec(name="m", max_context=200)
        req = apirequest.parse("chat", json.dumps({"model": "m", "max_tokens": 20, "messages": [
            {"role": "user", "content": "now"}]}).encode(), 0)

    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}
    history = conversations.History(None, [
        conversations.Turn(1, [{"role": "user", "content": "list"}, call], 60),
        conversations.Turn(2, [{"role": "tool", "tool_call_id": "c1", "content": "a b"},
                               {"role": "assistant", "content": "two files"}], 60),
        conversations.Turn(3, [{"role": "user", "content": "and?"}, {"role": "assistant", "content": "done"}], 60)])
    kept = threads.Threads.__new__(threads.Threads)
    kept.prefix_bytes = 0
    ex = Ex()
    turn = kept.prepend(ex, "p", "t", 1, history)
    # The context holds two turns; the call's turn went first, so its result goes too.
    assert turn.dropped == 2 and [m["role"] for m in ex.req.body["messages"]] == ["user", "assistant", "user"]
