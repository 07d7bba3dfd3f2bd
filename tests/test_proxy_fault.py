"""A fault in the gateway's own code costs one request, answered and accounted for like any other.

In process, through the worker's WSGI app (llmgw/web/app.py), with a step of the pipeline made to fail:
the client gets a 500 in its own API's shape, and the request is counted, settled and given its usage row
once (llmgw/gateway/exchange.py), as a refused or answered one is.
"""

import json

import sqlalchemy as sa
from werkzeug.test import Client

from llmgw import settings, store
from llmgw.people import keys
from llmgw.web.app import GatewayApp


def test_a_bug_in_the_pipeline_is_a_500_in_the_callers_shape_and_is_accounted_for_once(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/fault.db"
    engine = store.open_store(url)
    _, secret = keys.create_key(engine, "k")
    cfg = settings.load(None, {"store.url": url}, ["r1=http://127.0.0.1:9=m"])
    app = GatewayApp(cfg, key_source=keys)
    try:
        def broken(req, model):
            raise RuntimeError("a bug")

        monkeypatch.setattr(app.proxy.guard, "check_prompt", broken)
        client = Client(app)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        openai_answer = client.post("/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {secret}"})
        assert openai_answer.status_code == 500
        assert json.loads(openai_answer.data)["error"]["code"] == "internal_error"
        # The same fault through Anthropic's Messages API is answered in Anthropic's shape.
        messages = client.post("/v1/messages", json={**chat, "max_tokens": 5}, headers={"x-api-key": secret})
        assert messages.status_code == 500 and json.loads(messages.data)["type"] == "error"
        assert app.runtime.usage.flush() == 2
        with engine.connect() as conn:
            rows = conn.execute(sa.select(store.usage.c.status, store.usage.c.model_served, store.usage.c.endpoint)).all()
        assert sorted(rows) == [(500, "m", "chat"), (500, "m", "messages")]
    finally:
        app.runtime.close()
        app.runtime.engine.dispose()
        engine.dispose()
