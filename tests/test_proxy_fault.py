"""A fault in the gateway's own code costs one request, answered and accounted for like any other.

In process, through the worker's WSGI app (llmgw/web/app.py), with a step of the pipeline made to fail:
the client gets a 500 in its own API's shape, and the request is counted, settled and given its usage row
once (llmgw/gateway/exchange.py), as a refused or answered one is.
"""

import json

import sqlalchemy as sa
from werkzeug.test import Client, EnvironBuilder

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


def _app_over(tmp_path, sim_url: str):
    url = f"sqlite:///{tmp_path}/fault.db"
    engine = store.open_store(url)
    _, secret = keys.create_key(engine, "k")
    cfg = settings.load(None, {"store.url": url}, [f"r1={sim_url}=sim"])
    return engine, secret, GatewayApp(cfg, key_source=keys)


def _close(app, engine):
    app.runtime.close()
    app.runtime.engine.dispose()
    engine.dispose()


def test_a_bug_inside_an_attempt_gives_the_replica_back(tmp_path, make_sim, monkeypatch):
    # The replica's count of requests on it is what routing and the unmeasured capacity limit go by: a
    # request that failed on a bug must not hold a place on it for ever.
    sim = make_sim()
    engine, secret, app = _app_over(tmp_path, sim.url)
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("a bug")

        monkeypatch.setattr(app.runtime.pool, "request", broken)
        chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}
        answer = Client(app).post("/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {secret}"})
        assert answer.status_code == 500
        assert [r.outstanding for r in app.runtime.router.available("sim")] == [0]
    finally:
        _close(app, engine)


def test_a_stream_the_server_closes_before_it_began_gives_its_replica_back_and_is_accounted(tmp_path, make_sim):
    # A client that leaves, or a worker that stops, between the answer's head and its first piece: the
    # server closes the iterable unstarted, and a generator closed so runs none of its `finally`.
    sim = make_sim()
    engine, secret, app = _app_over(tmp_path, sim.url)
    try:
        chat = {"model": "sim", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        environ = EnvironBuilder(path="/v1/chat/completions", method="POST", json=chat,
                                 headers={"Authorization": f"Bearer {secret}"}).get_environ()
        heads = []
        answer = app(environ, lambda status, headers, exc_info=None: heads.append(status))
        assert heads == ["200 OK"]
        assert [r.outstanding for r in app.runtime.router.available("sim")] == [1]
        answer.close()
        assert [r.outstanding for r in app.runtime.router.available("sim")] == [0]
        assert app.runtime.usage.flush() == 1
        with engine.connect() as conn:
            assert conn.execute(sa.select(store.usage.c.status)).scalars().all() == [499]
    finally:
        _close(app, engine)
