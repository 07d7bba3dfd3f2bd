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
    choices = metering.answer_choices(answer)
    prompt, completion = metering.billed(req, USAGE, metering.answer_floor(choices))
    assert prompt >= 300 * 3 and completion >= 300 * 5
    # What the engine's tokenizer is asked, and what its count of the prompts comes to.
    assert metering.settle(choices, USAGE) == (0, choices)  # none says it stopped at its limit
    assert metering.to_tokenize(req, choices, choices) == (["say something long"] * 300,
                                                           ["tok0 tok1 tok2 tok3 tok4 tok5 "] * 300)
    assert metering.billed(req, USAGE, 1800, metering.counted_prompts(req, 1500)) == (1500, 1800)


def test_several_choices_are_billed_each():
    # llama.cpp's whole answer to n=4 reports the first choice's 30 tokens.
    req = parse("chat", {"model": "m", "n": 4, "max_tokens": 30, "messages": [{"role": "user", "content": "Write"}]})
    assert metering.answers(req) == 4 and metering.trusted(req, USAGE) is None
    answer = json.dumps({"choices": [{"index": i, "message": {"content": "x" * 60}} for i in range(4)]}).encode()
    choices = metering.answer_choices(answer)
    assert metering.to_tokenize(req, choices, choices) == ([], ["x" * 60] * 4) and metering.counted_prompts(req, 0) == 0
    assert metering.billed(req, USAGE, 120) == (4, 120)
    # A stream's reports, one per choice, summed: each repeats the prompt, billed once.
    assert metering.trusted(req, {"prompt_tokens": 4 * 31, "completion_tokens": 120}, reports=4) == (31, 120)
    assert metering.trusted(req, {"prompt_tokens": 3 * 31, "completion_tokens": 90}, reports=3) is None


def test_a_choice_that_calls_a_tool_counts_its_arguments():
    call = {"index": 1, "message": {"content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "write", "arguments": "{\"text\": \"" + "x" * 400 + "\"}"}}]},
        "finish_reason": "tool_calls"}
    choices = [{"index": 0, "message": {"content": "x" * 12}, "finish_reason": "stop"}, call]
    assert metering.answer_floor(choices) == 3 + len("write{\"text\": \"" + "x" * 400 + "\"}") // 6 + 1
    req = parse("chat", {"model": "m", "n": 2, "messages": [{"role": "user", "content": "Write"}]})
    assert metering.to_tokenize(req, choices, choices)[1][1].startswith("write{")


def test_choices_that_stopped_at_their_limit_count_what_the_first_did():
    # Exactly, not from their text: tokens that render as nothing (an end-of-text token forced under
    # ignore_eos) leave none to count, and text tokenized again can come to more than was generated.
    empty = [{"index": i, "message": {"content": ""}, "finish_reason": "length"} for i in range(4)]
    assert metering.settle(empty, {"completion_tokens": 30}) == (120, [])
    req = parse("chat", {"model": "m", "n": 4, "messages": [{"role": "user", "content": "Write"}]})
    assert metering.to_tokenize(req, empty, []) == ([], [])
    # A choice that ended of itself is left to count; so are all when the first did not reach its limit.
    stop = {"index": 1, "message": {"content": "x" * 12}, "finish_reason": "stop"}
    mixed = [empty[0], stop]
    assert metering.settle(mixed, {"completion_tokens": 30}) == (30, [stop])
    assert metering.to_tokenize(req, mixed, [stop]) == ([], ["x" * 12])
    assert metering.answer_floor([stop]) == 3
    assert metering.settle(mixed[::-1], {"completion_tokens": 30}) == (0, mixed[::-1])
    assert metering.settle(empty, None) == (0, empty)


def test_a_prompt_of_token_ids_in_a_list_counts_itself():
    req = parse("completions", {"model": "m", "prompt": [[1, 2, 3, 4], "some text"]})
    assert metering.to_tokenize(req, [], []) == (["some text"], [])
    assert metering.counted_prompts(req, 2) == 6


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
    assert metering.answer_choices(b"<html>") == [] and metering.answer_floor([]) == 0
