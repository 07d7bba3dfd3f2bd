"""Guardrails through a real gateway: sim judges scripted to answer `safe` or `unsafe\\nS1`, and one that is down.

One gateway, whose `[guard]` names the safe judge for every model; each
model's own `guard` table picks the case it stands for:

| model | judge | checks | fail |
| --- | --- | --- | --- |
| plain | judge-safe ([guard]) | both | closed |
| bad-prompt | judge-unsafe | prompts | closed |
| bad-answer | judge-unsafe | answers | closed |
| closed | judge-dead (nothing listens) | both | closed |
| open | judge-dead | both | open |

`APIS` holds the client APIs the cases run on, each with its own client
library: how to ask, and how its refusals read.
"""

import anthropic
import openai
import pytest
import sqlalchemy as sa

from llmgw import store
from llmgw.gateway import guard
from llmgw.procs import free_port
from tests.conftest import Gateway, Sim, make_key, post, wait_until

ANSWER = "Here is a careful answer."
TARGETS = {"plain": {}, "bad-prompt": {"model": "judge-unsafe", "check": "prompts"},
           "bad-answer": {"model": "judge-unsafe", "check": "answers"}, "closed": {"model": "judge-dead"},
           "open": {"model": "judge-dead", "fail": "open"}}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    url = f"sqlite:///{tmp}/gw.db"
    store.open_store(url).dispose()
    sims = {name: Sim(model=name, replica=name, ttft_ms=5, tokens_per_s=500, reply=ANSWER) for name in TARGETS}
    sims["judge-safe"] = Sim(model="judge-safe", replica="judge-safe", ttft_ms=5, reply="safe")
    sims["judge-unsafe"] = Sim(model="judge-unsafe", replica="judge-unsafe", ttft_ms=5, reply="unsafe\nS1")
    endpoints = [{"id": name, "url": sim.url, "models": [name]} for name, sim in sims.items()]
    endpoints.append({"id": "judge-dead", "url": f"http://127.0.0.1:{free_port()}", "models": ["judge-dead"]})
    models = [{"name": name, "guard": policy} if policy else {"name": name} for name, policy in TARGETS.items()]
    models += [{"name": judge, "role": "guard"} for judge in ("judge-safe", "judge-unsafe", "judge-dead")]
    key = make_key(url)
    gw = Gateway(tmp, url, endpoints=endpoints, models=models, workers=2, guard__model="judge-safe",
                 guard__timeout=5.0)

    class Env:
        pass

    e = Env()
    e.gw, e.url, e.key, e.store = gw, gw.url, key, url
    e.client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    yield e
    e.client.close()
    gw.stop()
    for sim in sims.values():
        sim.stop()


class Refused(Exception):
    """A refusal as any API's client saw it: the status (None for an error event mid-stream), the message,
    and the code where the API has one."""

    def __init__(self, status, message: str, code=None, param=None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class Chat:
    """Chat completions, through the openai library."""

    endpoint = "chat"

    @staticmethod
    def ask(env, model: str, stream: bool, text: str = "How do I bake bread?") -> str:
        """The answer's text; raises Refused when refused (before or during the stream)."""
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
        try:
            if not stream:
                reply = env.client.chat.completions.create(model=model, messages=messages, max_tokens=20)
                return reply.choices[0].message.content
            chunks = env.client.chat.completions.create(model=model, messages=messages, max_tokens=20,
                                                        stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        except openai.APIStatusError as e:
            raise Refused(e.status_code, e.body["message"], e.body["code"], e.body["param"]) from None
        except openai.APIError as e:
            raise Refused(None, e.message, (e.body or {}).get("code")) from None


class Responses:
    """The Responses API, through the openai library."""

    endpoint = "responses"

    @staticmethod
    def ask(env, model: str, stream: bool, text: str = "How do I bake bread?") -> str:
        args = dict(model=model, instructions="Be brief.", input=text, max_output_tokens=20)
        try:
            if not stream:
                return env.client.responses.create(**args).output_text
            out = []
            for event in env.client.responses.create(**args, stream=True):
                if event.type == "response.output_text.delta":
                    out.append(event.delta)
                elif event.type == "response.failed":
                    raise Refused(None, event.response.error.message, event.response.error.code)
            return "".join(out)
        except openai.APIStatusError as e:
            raise Refused(e.status_code, e.body["message"], e.body["code"], e.body["param"]) from None


class Messages:
    """Anthropic's Messages API, through the anthropic library."""

    endpoint = "messages"

    @staticmethod
    def ask(env, model: str, stream: bool, text: str = "How do I bake bread?") -> str:
        client = anthropic.Anthropic(base_url=env.url, api_key=env.key, max_retries=0)
        args = dict(model=model, system="Be brief.", messages=[{"role": "user", "content": text}], max_tokens=20)
        try:
            if not stream:
                return "".join(b.text for b in client.messages.create(**args).content if b.type == "text")
            out = []
            for event in client.messages.create(**args, stream=True):
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    out.append(event.delta.text)
            return "".join(out)
        except anthropic.APIStatusError as e:
            raise Refused(e.status_code, e.body["error"]["message"]) from None
        except anthropic.APIError as e:
            raise Refused(None, e.message) from None
        finally:
            client.close()


APIS = {"chat": Chat, "responses": Responses, "messages": Messages}
CASES = [(api, stream) for api in APIS for stream in (False, True)]


def rows(env, model: str) -> list[tuple]:
    engine = store.open_engine(env.store)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.select(store.usage.c.status, store.usage.c.guard_verdict,
                                          store.usage.c.guard_category, store.usage.c.stream,
                                          store.usage.c.endpoint)
                                .where(store.usage.c.model_served == model)).all()
    finally:
        engine.dispose()


def wait_for_row(env, model: str, want: tuple) -> None:
    wait_until(f"a usage row {want} for {model}", 20, lambda: want in [tuple(r) for r in rows(env, model)])


@pytest.mark.parametrize("api,stream", CASES)
def test_a_safe_request_passes_and_its_row_says_safe(env, api, stream):
    assert APIS[api].ask(env, "plain", stream) == ANSWER
    wait_for_row(env, "plain", (200, "safe", None, stream, APIS[api].endpoint))


@pytest.mark.parametrize("api,stream", CASES)
def test_an_unsafe_prompt_is_refused_with_400_naming_the_category(env, api, stream):
    with pytest.raises(Refused) as raised:
        APIS[api].ask(env, "bad-prompt", stream, "something dangerous")
    error = raised.value
    assert error.status == 400 and "S1 Violent Crimes" in error.message and "refused" in error.message
    if api != "messages":  # Anthropic's errors have a type and a message only
        assert error.code == "content_filter" and error.param == "messages"
    wait_for_row(env, "bad-prompt", (400, "prompt_unsafe", "S1", stream, APIS[api].endpoint))


@pytest.mark.parametrize("api,stream", CASES)
def test_an_unsafe_answer_is_withheld(env, api, stream):
    with pytest.raises(Refused) as raised:
        APIS[api].ask(env, "bad-answer", stream)
    assert "S1 Violent Crimes" in raised.value.message and "withheld" in raised.value.message
    wait_for_row(env, "bad-answer", (400, "answer_unsafe", "S1", stream, APIS[api].endpoint))


def test_no_byte_of_a_withheld_stream_reaches_the_client(env):
    status, _, body = post(env.url + "/v1/chat/completions", {
        "model": "bad-answer", "stream": True, "max_tokens": 20,
        "messages": [{"role": "user", "content": "hello"}]}, env.key)
    text = body.decode()
    assert status == 200  # the headers went out before the answer was judged
    assert "careful" not in text and "S1 Violent Crimes" in text and text.rstrip().endswith("data: [DONE]")


def test_fail_closed_with_the_judge_down_is_503_saying_why(env):
    with pytest.raises(Refused) as raised:
        Chat.ask(env, "closed", False)
    assert raised.value.status == 503
    message = raised.value.message
    assert "judge-dead" in message and "cannot judge" in message and raised.value.code == "guard_unavailable"
    wait_for_row(env, "closed", (503, "unjudged", None, False, "chat"))


def test_fail_open_passes_and_is_counted_and_logged(env):
    assert Chat.ask(env, "open", True) == ANSWER
    wait_for_row(env, "open", (200, "unjudged", None, True, "chat"))
    assert 'llmgw_guard_unavailable_total{fail="open",judge="judge-dead"}' in env.gw.metrics()
    assert "passed unjudged (guard.fail = open)" in env.gw.log()


def test_verdicts_are_counted_by_category(env):
    Chat.ask(env, "plain", False)
    with pytest.raises(Refused):
        Chat.ask(env, "bad-prompt", False)
    metrics = env.gw.metrics()
    assert ('llmgw_guard_verdicts_total{category="S1",checked="prompt",judge="judge-unsafe",verdict="unsafe"}'
            in metrics)
    assert 'llmgw_guard_verdicts_total{category="",checked="answer",judge="judge-safe",verdict="safe"}' in metrics
    assert 'llmgw_guard_judge_seconds_count{judge="judge-safe"}' in metrics
    assert 'llmgw_tokens_total{direction="out",model="judge-safe"}' in metrics  # the judge's own, metered


def test_a_judge_is_never_offered_nor_served(env):
    listed = [m.id for m in env.client.models.list().data]
    assert "plain" in listed and not any(name.startswith("judge") for name in listed)
    with pytest.raises(openai.NotFoundError):
        env.client.models.retrieve("judge-safe")
    with pytest.raises(Refused) as raised:
        Chat.ask(env, "judge-safe", False)
    assert raised.value.status == 403 and "guard model" in raised.value.message


def test_the_judge_reads_llama_guard_3s_prompt():
    class Req:
        kind, model = "chat", "m"
        body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                             {"role": "assistant", "content": None,
                              "tool_calls": [{"function": {"name": "run", "arguments": "{}"}}]},
                             {"role": "tool", "content": [{"type": "text", "text": "ok"}]}]}

    prompt = guard.judge_prompt([*guard.prompt_turns(Req), ("Agent", "done")])
    assert "S11: Suicide & Self-Harm.\nS12: Sexual Content." in prompt
    assert "User: Be brief.\n\nhi\n\nAgent: run {}\n\nUser: ok\n\nAgent: done\n\n<END CONVERSATION>" in prompt
    assert "ONLY THE LAST Agent message" in prompt and prompt.endswith("<|end_header_id|>\n\n")
    assert guard.parse_verdict("safe") is None
    assert guard.parse_verdict(" unsafe\nS1,S10 ") == ("S1", "S10")
    assert guard.named(("S1", "S10")) == "S1 Violent Crimes, S10 Hate"
    with pytest.raises(guard.Unavailable):
        guard.parse_verdict("I think it is fine")


def test_a_judge_and_a_models_guard_travel_from_the_catalog_to_gateways():
    from llmgw.control import catalog, publisher
    from llmgw.gateway.follower import from_controller
    from llmgw.gateway.snapshot import Snapshot
    from llmgw.wire import gateways

    profiles = [{"engine": "sim"}]
    judge = catalog.parse_model({"name": "j", "source": "/m", "role": "guard", "profiles": profiles})
    target = catalog.parse_model({"name": "t", "source": "/m", "guard": {"model": "j", "fail": "open"},
                                  "profiles": profiles})
    body = publisher.snapshot_body({"j": judge, "t": target}, [])
    message = gateways.decode(gateways.encode("snapshot", epoch="e", version=1, **body))
    snapshot = from_controller(message, Snapshot(version=0, models={}, replicas={}))
    assert snapshot.models["j"].role == "guard" and [m.name for m in snapshot.offered()] == ["t"]
    assert dict(snapshot.models["t"].guard) == {"model": "j", "fail": "open"}
    for wrong, says in (({"role": "judge"}, "the only role is"), ({"guard": {"check": "sometimes"}}, "not one of"),
                        ({"guard": {"judge": "j"}}, "guard.judge is not known")):
        with pytest.raises(catalog.CatalogError, match=says):
            catalog.parse_model({"name": "x", "source": "/m", "profiles": profiles, **wrong})


@pytest.mark.parametrize("toml,says", [
    ('[guard]\nfail = "sometimes"\n', "guard.fail: 'sometimes' is not one of closed, open"),
    ('[[models]]\nname = "m"\nguard = {check = "all"}\n', "model m .*guard.check: 'all' is not one of prompts"),
    ('[[models]]\nname = "m"\nrole = "judge"\n', "model m .*the only role is \"guard\""),
])
def test_a_wrong_guard_in_the_configuration_is_refused_saying_what(tmp_path, toml, says):
    from llmgw import settings

    path = tmp_path / "llmgw.toml"
    path.write_text(toml)
    with pytest.raises(settings.ConfigError, match=says):
        settings.load(str(path))
