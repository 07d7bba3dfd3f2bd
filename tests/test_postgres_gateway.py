"""The gateway on PostgreSQL: gevent workers talk to it cooperatively, keys and usage behave as on SQLite."""

import openai
from click.testing import CliRunner

from llmgw import store
from llmgw.cli.main import main as cli
from llmgw.people import keys
from tests.conftest import count_usage, post, store_url_for, wait_until, wipe


def test_gateway_with_postgresql(pg_url, tmp_path, make_gateway, make_sim):
    wipe(pg_url)
    url = store_url_for(pg_url)
    engine = store.open_store(url)
    record, secret = keys.create_key(engine, "pg")
    engine.dispose()
    sim = make_sim(replica="s", ttft_ms=1, tokens_per_s=0)
    gw = make_gateway(store_url=pg_url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=2)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=secret, max_retries=0)
    for _ in range(10):
        list(client.chat.completions.create(model="sim", max_tokens=2, stream=True,
                                            messages=[{"role": "user", "content": "x"}]))
    client.close()
    wait_until("usage rows in PostgreSQL", 10, lambda: count_usage(url, status=200) == 10)
    CliRunner().invoke(cli, ["--store", pg_url, "keys", "revoke", record.id])
    body = {"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    # The two-second promise is held in test_gateway; here a loaded machine gets some slack.
    wait_until("the revocation to reach both workers", 30,
               lambda: all(post(gw.url + "/v1/chat/completions", body, secret)[0] == 401 for _ in range(6)))
