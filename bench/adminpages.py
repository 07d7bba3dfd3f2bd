"""An administrator signed in to a gateway's pages in the benchmark's own process (Flask's test client), for
the benchmarks that time pages over a large store: bench/limits.py, bench/usage.py."""

from __future__ import annotations

import re

PASSWORD = "a long enough password"


def signed_in(url: str):
    """(app, client): the pages of a gateway on the store at URL, signed in as a new administrator. The caller
    disposes of `app.runtime.engine` when done."""
    from llmgw import settings, store
    from llmgw.people import accounts, keys
    from llmgw.web.app import GatewayApp

    engine = store.open_engine(url)
    accounts.create_user(engine, "bench@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    engine.dispose()
    app = GatewayApp(settings.load(None, {"store.url": url}), key_source=keys)
    client = app.pages.test_client()
    page = client.get("/login").data
    csrf = re.search(rb'name="csrf_token" type="hidden" value="([^"]+)"', page).group(1).decode()
    client.post("/login", data={"email": "bench@example.org", "password": PASSWORD, "csrf_token": csrf})
    return app, client
