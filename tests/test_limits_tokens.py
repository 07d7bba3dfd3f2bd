"""Tokens a minute and budgets hold to one request's error whatever the prompt is made of: the real llama.cpp
(SmolLM2-135M on the CPU) counting, a real controller's accountant, two gateways of two workers each, eight
clients at once.

Admission held a prompt as its bytes over four; a prompt of symbols is about 0.7 tokens a byte, so eight
clients were served 2,584 tokens in 40 s against a limit of 1,000 a minute, and a budget was overspent alike.
"""

import concurrent.futures
import json
import random
import string
import urllib.request

import pytest
import sqlalchemy as sa

from llmgw import rules, store
from llmgw.cli import starter
from llmgw.gateway import promptcount
from llmgw.people import keys, limits
from tests.cluster import Controller
from tests.conftest import Gateway, post, wait_until

LIMIT = 1000
random.seed(25)
SYMBOLS = "".join(random.choice(string.punctuation) for _ in range(400))  # 348 tokens with the template
ENGLISH = ("The quick brown fox jumps over the lazy dog while the farmer counts his sheep in the meadow. " * 12)


def chat(text: str) -> dict:
    return {"model": starter.NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 1}


def fire(urls, key, body, clients=8, each=4):
    """CLIENTS clients at once over URLS, each sending BODY EACH times in a row: the answers served."""
    def client(i):
        served = []
        for _ in range(each):
            status, _, raw = post(urls[i % len(urls)] + "/v1/chat/completions", body, key, timeout=120)
            if status == 200:
                served.append(json.loads(raw)["usage"])
            else:
                assert status == 429, raw
        return served

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return [u for served in pool.map(client, range(clients)) for u in served]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, starter_engine):
    """A controller, its keys (each limited alone, so each test has pools of its own), two gateways following
    it in front of one llama.cpp."""
    tmp = tmp_path_factory.mktemp("limits_tokens")
    url = f"sqlite:///{tmp}/shared.db"
    controller = Controller(tmp, store_url=url)
    engine = store.open_engine(url)
    made = {}
    for name, limit in (("symbols", {"tpm": LIMIT}), ("english", {"tpm": LIMIT}), ("probe", {"rpm": 1_000_000}),
                        ("budget", {"budget": rules.parse_money(str(LIMIT)), "period": "day"})):
        record, made[name] = keys.create_key(engine, name)
        limits.set_limits(engine, "key", record.id, "test", **limit)
    # One unit a prompt token, nothing for the answer: a budget of 1,000 units is 1,000 prompt tokens.
    limits.set_price(engine, starter.NAME, "1000000", "0", "test")
    endpoints = [{"id": "cpu", "url": starter_engine, "models": [starter.NAME]}]
    gws = []
    try:
        for i in range(2):
            gws.append(Gateway(tmp, url, endpoints=endpoints, workers=2, limits__accountant_timeout=20.0,
                               gateway__controller=f"127.0.0.1:{controller.gateway_port}",
                               gateway__key_file=controller.gateway_key_file(f"gw{i}")))
        # Until a worker has the controller's first snapshot it waives rate limits; the probe's answers say
        # when each worker reaches the accountant.
        wait_until("every gateway to reach the accountant", 60, lambda: all(
            all("X-RateLimit-Limit-Requests" in post(gw.url + "/v1/chat/completions", chat("hi"), made["probe"])[1]
                for _ in range(8)) for gw in gws))
        yield [gw.url for gw in gws], made, engine
    finally:
        for gw in gws:
            gw.stop()
        engine.dispose()
        controller.stop()


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": SYMBOLS}],
    [{"role": "user", "content": " ".join(str(j % 10) for j in range(300))}],  # a token a byte
    [{"role": "user", "content": "漢字仮名交じり文" * 30}],
    [{"role": "user", "content": "😀🎉🚀" * 50}],
    [{"role": "system", "content": "x"}, *[{"role": r, "content": "y"} for r in ("user", "assistant") * 20]],
], ids=["empty", "symbols", "digits", "cjk", "emoji", "many-turns"])
def test_the_bound_holds_a_prompt_as_llama_cpp_counts_it(starter_engine, messages):
    def ask(path, value):
        req = urllib.request.Request(starter_engine + path, json.dumps(value).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    body = {"model": starter.NAME, "messages": messages}
    counted = promptcount.count(ask, body, starter.NAME)
    compact = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    assert 0 < counted <= promptcount.bound(compact), (counted, len(compact))


def test_a_prompt_of_symbols_spends_at_most_one_request_past_a_tokens_a_minute_limit(cluster):
    urls, made, _ = cluster
    # Within a minute (the whole test), so everything served counts against the one limit.
    served = fire(urls, made["symbols"], chat(SYMBOLS))
    spent = sum(u["total_tokens"] for u in served)
    one = max(u["total_tokens"] for u in served)
    # Dense: bytes over four held not half of what each request spent, and admitted seven of the first eight at
    # once, 2,443 tokens against 1,000.
    assert one > 2 * (len(json.dumps(chat(SYMBOLS)).encode()) // 4)
    print(f"symbols: {len(served)} served, {spent} tokens against {LIMIT} a minute")
    assert spent <= LIMIT + one, (spent, len(served))
    assert len(served) >= 2  # counted by the engine once the bound was refused, a second one fit


def test_a_prompt_whose_bytes_pass_the_limit_is_let_in_by_its_tokens(cluster):
    urls, made, _ = cluster
    body = chat(ENGLISH)
    assert promptcount.bound(json.dumps(body).encode()) > LIMIT
    served = fire(urls, made["english"], body, clients=1, each=5)
    # Each about 240 tokens: the first finds the minute empty; the next are counted by llama.cpp when their
    # bytes are refused, and fit until the tokens do not.
    spent = sum(u["total_tokens"] for u in served)
    print(f"english: {len(served)} served, {spent} tokens against {LIMIT} a minute")
    assert len(served) >= 3 and spent <= LIMIT, [u["total_tokens"] for u in served]


def test_a_budget_is_overspent_by_at_most_one_request_of_symbols(cluster):
    urls, made, engine = cluster
    served = fire(urls, made["budget"], chat(SYMBOLS))
    one = max(u["prompt_tokens"] for u in served) * rules.MICROS
    budget = sa.select(store.api_keys.c.id).where(store.api_keys.c.name == "budget")
    query = sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(store.usage.c.cost_micros), 0)).where(
        store.usage.c.key_id.in_(budget), store.usage.c.status == 200)

    def rows():
        with engine.connect() as conn:
            return conn.execute(query).one()

    wait_until("the usage rows", 30, lambda: rows()[0] >= len(served))
    # Bytes over four reserved not half of each: all eight of the first wave were let in, 2,784 units.
    print(f"budget: {len(served)} served, {rows()[1] / rules.MICROS} units against {LIMIT}")
    assert rows()[1] <= LIMIT * rules.MICROS + one, (rows(), len(served))
    status, _, raw = post(urls[0] + "/v1/chat/completions", chat(SYMBOLS), made["budget"])
    assert status == 429 and json.loads(raw)["error"]["code"] == "budget_exhausted"
