"""What the real llama.cpp is billed for: several choices, lists of dense prompts, streams cut short, and
answers that outlast timeouts.first_byte, through a real gateway (SmolLM2-135M on the CPU)."""

import concurrent.futures
import json
import socket

import pytest

from llmgw.cli import starter
from llmgw.procs import http_status, wait_for
from tests.conftest import Gateway, make_key, post
from tests.test_blame import breaker_open, rows, streamed

# 300 digits and spaces: 599 tokens to SmolLM2's tokenizer, about two bytes a token.
DIGITS = " ".join(str(j % 10) for j in range(300))


@pytest.fixture(scope="module")
def real(tmp_path_factory, starter_engine):
    tmp = tmp_path_factory.mktemp("llamacpp_metering")
    store_url = f"sqlite:///{tmp}/real.db"
    key = make_key(store_url)
    gw = Gateway(tmp, store_url, endpoints=[{"id": "cpu", "url": starter_engine, "models": [starter.NAME]}],
                 workers=1)
    yield gw, key, store_url
    gw.stop()


def last_row(url, count):
    wait_for("the usage row", 30, lambda: len(rows(url)) >= count)
    return rows(url)[count - 1]


def test_every_choice_is_billed(real):
    gw, key, url = real
    write = {"model": starter.NAME, "messages": [{"role": "user", "content": "Write"}], "n": 4, "max_tokens": 30,
             "ignore_eos": True}
    before = len(rows(url))
    status, _, raw = post(gw.url + "/v1/chat/completions", write, key, timeout=120)
    answer = json.loads(raw)
    assert status == 200 and len(answer["choices"]) == 4 and answer["usage"]["completion_tokens"] == 30
    row = last_row(url, before + 1)
    # Each choice stopped at its limit, as the first (whose 30 the usage reports) did. Counting the texts
    # again missed tokens that render as nothing (an end-of-text token under ignore_eos): 113 of 120.
    assert row.completion_tokens == 120
    body = {"model": starter.NAME, "prompt": "Write", "n": 3, "max_tokens": 15, "ignore_eos": True}
    assert streamed(gw.url + "/v1/completions", body, key)[-1] == b"[DONE]"
    row = last_row(url, before + 2)
    assert (row.prompt_tokens, row.completion_tokens) == (1, 45)


def test_lists_of_dense_prompts_are_billed_exactly(real):
    gw, key, url = real
    before = len(rows(url))
    status, _, raw = post(gw.url + "/v1/completions", {"model": starter.NAME, "prompt": [DIGITS] * 8,
                                                       "max_tokens": 1}, key, timeout=300)
    assert status == 200 and json.loads(raw)["usage"]["prompt_tokens"] == 599  # the first prompt's alone
    row = last_row(url, before + 1)
    assert (row.prompt_tokens, row.completion_tokens) == (8 * 599, 8)
    body = {"model": starter.NAME, "prompt": [DIGITS] * 3, "max_tokens": 1}
    assert streamed(gw.url + "/v1/completions", body, key)[-1] == b"[DONE]"
    row = last_row(url, before + 2)
    assert (row.prompt_tokens, row.completion_tokens) == (3 * 599, 3)


def cut(port: int, path: str, key: str, body: dict, started: bytes) -> None:
    """Ask for BODY streamed on PATH, and hang up once the stream holds STARTED (the answer has begun)."""
    payload = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        received = b""
        while started not in received:
            more = sock.recv(65536)
            assert more, received
            received += more


@pytest.mark.parametrize("path, started", [("/v1/chat/completions", b'"content"'),
                                           ("/v1/messages", b"content_block_delta")], ids=["chat", "messages"])
def test_a_stream_cut_short_bills_its_prompt_with_the_template(real, path, started):
    gw, key, url = real
    messages = [{"role": "user", "content": "Write a long story about the sea."}]
    before = len(rows(url))
    status, _, raw = post(gw.url + "/v1/chat/completions", {"model": starter.NAME, "messages": messages,
                                                            "max_tokens": 1}, key)
    whole = json.loads(raw)["usage"]["prompt_tokens"]
    cut(gw.port, path, key, {"model": starter.NAME, "messages": messages, "max_tokens": 400, "ignore_eos": True},
        started)
    row = last_row(url, before + 2)
    # Counted from its text alone, without the chat template's markup and default system prompt: 6 of 38.
    assert row.status == 499 and row.prompt_tokens == whole > 30 and row.completion_tokens >= 1


def test_answers_that_outlast_first_byte_leave_the_replica_in_rotation(real, starter_engine, tmp_path):
    # A gateway of its own on the same engine, whose first_byte timeout 400 tokens outlast (two cores make
    # 20 to 40 a second, fewer when busy), and whose breaker two strikes would open. The timeout leaves a
    # three-token answer time enough on a loaded machine.
    gw, key, _ = real
    short = Gateway(tmp_path, gw.store_url, endpoints=[{"id": "cpu", "url": starter_engine, "models": [starter.NAME]}],
                    workers=1, timeouts__first_byte=3.0, breaker__failures=2)
    try:
        slow = {"model": starter.NAME, "messages": [{"role": "user", "content": "Write"}], "max_tokens": 400,
                "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: post(short.url + "/v1/chat/completions", slow, key), range(3)))
        assert [status for status, _, _ in answers] == [504] * 3
        assert http_status(short.url + "/ready") == 200 and not breaker_open(short, "cpu")
        # The replica still serves: once llama.cpp has dropped the abandoned answers (it notices the
        # gateway left between two tokens), a short one is answered within the same second.
        quick = {**slow, "max_tokens": 3}
        wait_for("a short answer through the same gateway", 120,
                 lambda: post(short.url + "/v1/chat/completions", quick, key)[0] == 200, interval=0.5)
        assert not breaker_open(short, "cpu")
    finally:
        short.stop()

