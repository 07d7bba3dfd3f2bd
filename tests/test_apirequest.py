import json

import pytest

from llmgw.gateway import apirequest
from llmgw.gateway.errors import ApiError


def parse(kind, body, prefix=2048):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return apirequest.parse(kind, raw, prefix)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize("kind, body, param", [
    ("chat", b"{not json", None),
    ("chat", b"\xff\xfe", None),
    ("chat", [1, 2], None),
    ("chat", {"messages": []}, "model"),
    ("chat", {"model": 7, "messages": []}, "model"),
    ("chat", {"model": "m"}, "messages"),
    ("chat", {"model": "m", "messages": "hi"}, "messages"),
    ("chat", {"model": "m", "messages": [{"content": "x"}]}, "messages"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages"),
    ("chat", {**CHAT, "stream": "yes"}, "stream"),
    ("chat", {**CHAT, "stream_options": []}, "stream_options"),
    ("chat", {**CHAT, "max_tokens": "10"}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": True}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("chat", {**CHAT, "temperature": "hot"}, "temperature"),
    ("chat", {**CHAT, "temperature": 2.5}, "temperature"),
    ("completions", {"model": "m"}, "prompt"),
    ("completions", {"model": "m", "prompt": []}, "prompt"),
    ("embeddings", {"model": "m", "input": 3}, "input"),
    ("embeddings", {"model": "m", "input": "x", "stream": True}, "stream"),
])
def test_bad_bodies_get_a_400_naming_the_field(kind, body, param):
    with pytest.raises(ApiError) as e:
        parse(kind, body)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.message.endswith(".") and len(e.value.message) > 20


def test_body_goes_through_untouched_when_nothing_changes():
    raw = json.dumps({**CHAT, "unknown_field": {"kept": True}}).encode()
    req = apirequest.parse("chat", raw, 2048)
    assert req.upstream_body("m") is raw


def test_alias_is_rewritten_to_the_engines_name():
    req = parse("chat", {**CHAT, "model": "alias"})
    assert json.loads(req.upstream_body("m"))["model"] == "m"


def test_streams_always_ask_the_engine_for_usage():
    req = parse("chat", {**CHAT, "stream": True, "stream_options": {"other": 1}})
    assert not req.client_wants_usage
    sent = json.loads(req.upstream_body("m"))
    assert sent["stream_options"] == {"other": 1, "include_usage": True}
    asked = parse("chat", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert asked.client_wants_usage and asked.upstream_body("m") is asked.raw


def test_affinity_follows_the_first_message_and_is_bounded():
    req = parse("chat", {"model": "m", "messages": [{"role": "system", "content": "s" * 5000},
                                                     {"role": "user", "content": "x"}]}, prefix=100)
    assert req.prompt_text == b"s" * 100
    later_turn = parse("chat", {"model": "m", "messages": [
        {"role": "system", "content": "s" * 5000}, {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]}, prefix=100)
    assert later_turn.prompt_text == req.prompt_text  # a conversation keeps its replica
    parts = parse("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}]})
    assert parts.prompt_text == b"ab"
    assert parse("completions", {"model": "m", "prompt": "abc"}).prompt_text == b"abc"


def test_usage_found_without_parsing_the_whole_answer():
    body = b'{"model":"m","usage":{"prompt_tokens":3,"total_tokens":3},"data":[' + b"0.1," * 100000 + b"0.2]}"
    assert apirequest.usage_of(body) == {"prompt_tokens": 3, "total_tokens": 3}
    assert apirequest.usage_of(b'{"choices":[]}') is None
    assert apirequest.usage_of(b'{"usage": null}') is None
    assert apirequest.usage_of(b'{"content":"say \\"usage\\": 1"}') is None
