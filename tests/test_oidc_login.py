"""`llmgw login` gets a person a key through the identity provider's device flow, without a password (issue 31):
the command, as a person runs it, against the gateway's pages served on a loopback port, and the real
provider (npm's oidc-provider) where the person confirms the code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import requests
from werkzeug.serving import make_server

from llmgw.people import accounts, keys, orgtree
from llmgw.procs import free_port
from tests.oidcprovider import OidcProvider
from tests.test_oidc_signin import CALLBACK, gateway

LLMGW = os.path.join(os.path.dirname(sys.executable), "llmgw")


@pytest.fixture(scope="module")
def provider(tmp_path_factory):
    p = OidcProvider(tmp_path_factory.mktemp("oidc"), {
        "ada": {"email": "ada@example.org", "email_verified": True, "groups": []}}, [{
            "client_id": "llmgw", "client_secret": "a-client-secret", "redirect_uris": [CALLBACK],
            "grant_types": ["authorization_code", "urn:ietf:params:oauth:grant-type:device_code"],
            "response_types": ["code"]}])
    yield p
    p.stop()


@pytest.fixture
def served(tmp_path, provider):
    """The gateway's pages on a loopback port, and their store."""
    port = free_port()
    app, engine = gateway(tmp_path, provider, public_url=f"http://127.0.0.1:{port}",
                          oidc_approve_domains=["example.org"])
    server = make_server("127.0.0.1", port, app.pages, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", engine
    server.shutdown()
    thread.join(timeout=10)


def run_login(provider, url: str, *args: str) -> subprocess.CompletedProcess:
    """Run `llmgw login URL ARGS --json`, confirming its code at the provider as ada when it shows one."""
    proc = subprocess.Popen([LLMGW, "login", url, *args, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "LLMGW_CONFIG": ""})
    shown = proc.stderr.readline() + proc.stderr.readline()
    where = re.search(r"Open (\S+)", shown)
    if where:
        assert "Sign-in Success" in provider.confirm_device(where.group(1), "ada")
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, shown + err)


def test_llmgw_login_gives_a_key_through_the_device_flow(served, provider):
    url, engine = served
    done = run_login(provider, url)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["email"] == "ada@example.org" and got["project"] == "personal" and got["base_url"] == url + "/v1"
    ada = accounts.find(engine, "ada@example.org")
    made = keys.list_keys(engine, user_id=ada.id)
    assert [k.id for k in made] == [got["key_id"]] and got["key"].startswith(made[0].prefix)
    assert made[0].expires_at == pytest.approx(time.time() + 30 * 86400, abs=600)  # auth.login_key_lifetime
    assert "at Corp SSO" in done.stderr  # where to confirm, said to the person

    # The handle is good once: asking again after the key was made gets nothing.
    started = requests.post(url + "/login/device", json={}, timeout=10).json()
    asked = requests.post(url + "/login/device/poll", json={"handle": started["handle"]}, timeout=10)
    # Asked at once: told to slow down, without the provider being asked.
    assert asked.status_code == 202 and asked.json() == {"status": "pending", "slow_down": True}
    assert requests.post(url + "/login/device/poll", json={"handle": "made-up"}, timeout=10).status_code == 410


def test_a_project_the_person_is_not_in_is_refused_and_said(served, provider):
    url, engine = served
    orgtree.add(engine, "org", "acme")
    orgtree.add(engine, "team", "research", "acme")
    orgtree.add(engine, "project", "chat", "acme/research")
    done = run_login(provider, url, "--project", "acme/research/chat")
    assert done.returncode == 1 and "You are not a member of acme/research/chat" in done.stderr


def test_a_gateway_without_a_provider_says_so(tmp_path):
    from llmgw import settings, store
    from llmgw.web.app import GatewayApp
    store.open_store(f"sqlite:///{tmp_path}/p.db").dispose()
    app = GatewayApp(settings.load(None, {"store.url": f"sqlite:///{tmp_path}/p.db"}), key_source=keys)
    answer = app.pages.test_client().post("/login/device", json={})
    assert answer.status_code == 404 and "signs nobody in through an identity provider" in answer.json["error"]
