"""What the body checks are for, tried against the real engine: no body the gateway lets through makes llama.cpp answer 5xx.

A fuzz of mutated chat bodies (wrong types, nulls, lists and objects where the
other belongs) is checked by `apirequest.parse`; every body it accepts is sent
to llama.cpp serving SmolLM2, which must not answer with a server error (the
gateway would take it for a sick replica). Image and audio parts are left out
of the mutations: a model without a projector answers them 500 however well
formed they are, which only the model's catalog entry can tell.
"""

import json
import random
import urllib.error
import urllib.request

import pytest

from llmgw.gateway import apirequest
from llmgw.gateway.errors import ApiError
from tests.conftest import llamacpp_engine

ODD = [None, 0, -1, 1.5, True, "", "x", [], [1], ["x"], {}, {"a": 1}, [{}], [None], {"type": "function"}, {"name": 1}]
# Where a mutation lands: top-level fields and the insides of messages, parts, tools and tool calls.
PLACES = [("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"), ("messages", 0, "name"),
          ("messages", 0, "tool_calls"), ("messages", 0, "tool_call_id"), ("messages", 0, "content", 0),
          ("messages", 0, "content", 0, "text"), ("messages", 0, "content", 0, "type"),
          ("messages", 0, "tool_calls", 0), ("messages", 0, "tool_calls", 0, "function"),
          ("messages", 0, "tool_calls", 0, "function", "arguments"), ("tools",), ("tools", 0, "function"),
          ("tools", 0, "function", "name"), ("tools", 0, "function", "parameters"),
          ("tools", 0, "function", "description"), ("tool_choice",), ("stop",), ("stop", 0), ("n",), ("logprobs",),
          ("top_logprobs",), ("seed",), ("logit_bias",), ("logit_bias", "5"), ("response_format",),
          ("response_format", "type"), ("temperature",), ("top_p",), ("max_completion_tokens",), ("n_predict",),
          ("stream_options",), ("parallel_tool_calls",), ("user",), ("presence_penalty",)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with llamacpp_engine(tmp_path_factory.mktemp("bodycheck"), ctx_size=512, threads=1, parallel=1) as url:
        yield url


def place(body: dict, path: tuple, value) -> None:
    """Set BODY at PATH to VALUE, making (or replacing) the lists and objects on the way to it."""
    here = body
    for key, following in zip(path, path[1:]):
        kind = list if isinstance(following, int) else dict
        _fit(here, key)
        if not isinstance(here[key], kind):
            here[key] = kind()
        here = here[key]
    _fit(here, path[-1])
    here[path[-1]] = value


def _fit(here, key) -> None:
    if isinstance(here, list):
        here.extend([None] * (key + 1 - len(here)))
    else:
        here.setdefault(key, None)


def mutants(count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(rng.randint(1, 2)):
            place(body, rng.choice(PLACES), json.loads(json.dumps(rng.choice(ODD))))
        body["max_tokens"] = 2
        yield json.dumps(body).encode()


def status_of(url: str, raw: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url + "/v1/chat/completions", data=raw,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, b""
    except urllib.error.HTTPError as e:
        return e.code, e.read()[:300]


def test_no_body_the_gateway_accepts_makes_the_engine_fail(engine):
    accepted = refused = 0
    for raw in mutants(1000, seed=9):
        try:
            apirequest.parse("chat", raw, 0)
        except ApiError as e:
            assert e.status == 400 and e.param
            refused += 1
            continue
        accepted += 1
        status, text = status_of(engine, raw)
        assert status < 500, (raw, text)
    assert accepted > 20 and refused > 100, (accepted, refused)  # the fuzz tries both sides of the line
