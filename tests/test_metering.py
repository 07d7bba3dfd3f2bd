"""What a request is billed when the engine's usage covers it, and when it does not."""

import json

from llmgw.gateway import apirequest, metering


def parse(kind, body):
    return apirequest.parse(kind, json.dumps(body).encode(), 0)


CHAT = parse("chat", {"model": "m", "messages": [{"role": "user", "content": "hello there"}]})
USAGE = {"prompt_tokens": 4, "completion_tokens": 16}


def test_the_engines_usage_is_taken_as_it_is_for_one_prompt():
    assert metering.trusted(CHAT, USAGE) == (4, 16)
    one = parse("completions", {"model": "m", "prompt": [1, 2, 3]})  # token ids: one prompt
    assert metering.prompt_count(one) == 1 and metering.trusted(one, USAGE) == (4, 16)


def test_a_list_of_prompts_is_billed_for_every_prompt_and_every_choice():
    # llama.cpp answers 300 choices and reports usage for the first prompt only.
    req = parse("completions", {"model": "m", "prompt": ["say something long"] * 300})
    assert metering.prompt_count(req) == 300 and metering.trusted(req, USAGE) is None
    answer = json.dumps({"choices": [{"index": i, "text": "tok0 tok1 tok2 tok3 tok4 tok5 "} for i in range(300)],
                         "usage": USAGE}).encode()
    prompt, completion = metering.billed(req, USAGE, metering.answer_floor(answer))
    assert prompt >= 300 * 3 and completion >= 300 * 5


def test_the_engines_figures_win_where_they_are_larger():
    req = parse("completions", {"model": "m", "prompt": ["a", "b"]})
    assert metering.billed(req, {"prompt_tokens": 50, "completion_tokens": 90}, 10) == (50, 90)


def test_a_cut_stream_bills_its_prompt_and_what_was_delivered():
    assert metering.trusted(CHAT, None) is None
    prompt, completion = metering.billed(CHAT, None, 190)
    assert prompt >= 2 and completion == 190


def test_embeddings_bill_every_input_and_no_completion():
    req = parse("embeddings", {"model": "m", "input": ["one", "two", "three"]})
    assert metering.billed(req, None, 0) == (3, None)


def test_an_answer_that_is_not_json_floors_at_nothing():
    assert metering.answer_floor(b"<html>") == 0
