"""The chat and administration pages in a real headless Chromium, with the real SmolLM2 behind llama.cpp:
chatting (streamed, rendered, kept across a reload, stopped), approving a sign-up, a quota changed on
the page and enforced, model output rendered inert, and every page at phone width."""

import re
import time

import openai
import pytest
import sqlalchemy as sa
from playwright.sync_api import sync_playwright

from llmgw import store
from llmgw.cli import starter
from llmgw.people import accounts
from llmgw.procs import wait_for
from tests.conftest import Gateway, Sim, chromium, llamacpp_engine, make_key
from tests.test_mirror import gguf_bytes
from tests.test_mirrorpage import Registry

PHONE = {"width": 390, "height": 844}
PASSWORD = "a long enough password"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser-pages")
    with llamacpp_engine(tmp, ctx_size=2048, threads=2, parallel=2) as engine_url:
        sim = Sim(model="sim", replica="s", ttft_ms=1, tokens_per_s=0)
        registry = Registry({"tiny-q4_k_m-with-a-rather-long-file-name.gguf": gguf_bytes("llama", 100)})
        url = f"sqlite:///{tmp}/pages.db"
        db = store.open_store(url)
        admin = accounts.create_user(db, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
        db.dispose()
        try:
            gw = Gateway(tmp, url, workers=2, gateway__signup_open=True, mirror__hf_endpoint=registry.url,
                         endpoints=[{"id": "cpu", "url": engine_url, "models": [starter.NAME]},
                                    {"id": "s", "url": sim.url, "models": ["sim"]}],
                         models=[{"name": starter.NAME, "max_output": 400, "description": "SmolLM2 on a CPU"}])
        except Exception:
            sim.stop()
            registry.stop()
            raise
        with sync_playwright() as p:
            browser = chromium(p)
            yield {"browser": browser, "gw": gw, "url": url, "tmp": tmp, "engine": engine_url, "admin": admin}
            browser.close()
        gw.stop()
        sim.stop()
        registry.stop()


def signed_in(cluster, email="root@example.org", password=PASSWORD, viewport=PHONE):
    context = cluster["browser"].new_context(viewport=viewport)
    page = context.new_page()
    page.goto(cluster["gw"].url + "/login")
    page.fill("#email", email)
    page.fill("#password", password)
    page.click("button[type=submit]")
    page.wait_for_url("**/account")
    return context, page


def fits_the_screen(page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth") <= page.viewport_size["width"]


def usage_rows(cluster, **where):
    engine = store.open_engine(cluster["url"])
    try:
        query = sa.select(store.usage.c.status, store.usage.c.completion_tokens)
        for column, value in where.items():
            query = query.where(store.usage.c[column] == value)
        with engine.connect() as conn:
            return conn.execute(query).all()
    finally:
        engine.dispose()


def test_chat_with_the_real_model_renders_keeps_and_stops(cluster):
    context, page = signed_in(cluster)
    page.goto(cluster["gw"].url + "/chat")
    page.select_option("#model", starter.NAME)
    page.click("summary:has-text('Settings')")
    page.fill("#temperature", "0")  # a 135M model sampling at 0.7 wanders; greedy answers the same every time
    page.dispatch_event("#temperature", "change")
    page.fill("#prompt", "What is the capital of France? Answer in one sentence.")
    page.press("#prompt", "Enter")
    stats = page.wait_for_selector(".msg.assistant .stats", timeout=60_000)
    assert re.search(r"\d+ tokens · [\d.]+ tokens/s · first token after \d+ ms", stats.inner_text())
    page.wait_for_selector(".msg.assistant .body.md", timeout=10_000)  # rendered by the server
    assert "Paris" in page.inner_text(".msg.assistant .body")
    page.screenshot(path=str(cluster["tmp"] / "chat-phone.png"), full_page=True)
    assert fits_the_screen(page)
    page.reload()  # the conversation is kept in the browser
    assert "Paris" in page.inner_text(".msg.assistant .body")
    assert page.input_value("#model") == starter.NAME

    # Stop: the browser drops the stream, the gateway closes the engine's request, the engine stops.
    page.fill("#prompt", "Write a long story about a dragon who learns to bake bread. Use at least 300 words.")
    page.press("#prompt", "Enter")
    # Polled from here: wait_for_function evaluates its string in the page, which the pages' CSP forbids.
    answers = page.locator(".msg.assistant")
    wait_for("the second answer to stream", 60, lambda: answers.count() == 2 and len(answers.nth(1).inner_text()) > 40,
             interval=0.2)
    page.click("#stop")
    stats = page.wait_for_selector(".msg.assistant:nth-of-type(4) .stats", timeout=10_000)
    assert "stopped" in stats.inner_text()
    wait_for("the engine to stop generating", 10, lambda: "requests_processing 0" in
             _get(cluster["engine"] + "/metrics"))
    session_key = f"session:{cluster['admin'].id}"
    # Both answers are recorded against the person (each worker writes its rows within a second or so).
    wait_for("the usage rows of both answers", 10, lambda: {200, 499} <= {r.status for r in usage_rows(
        cluster, key_id=session_key)})
    page.click("#clear")
    assert page.query_selector(".msg") is None
    context.close()


def _get(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def test_html_in_model_output_is_inert(cluster):
    context, page = signed_in(cluster)
    page.goto(cluster["gw"].url + "/chat")
    hostile = ('Hi <script>window.pwned = 1</script> <img src=x onerror="window.pwned = 2"> '
               '[click](javascript:window.pwned=3) ![pixel](https://tracker.example/p.png) [ok](https://example.org)')
    rendered = page.evaluate("""text => fetch('/chat/render', {method: 'POST', credentials: 'same-origin',
        headers: {'Content-Type': 'application/json',
                  'X-CSRF-Token': document.querySelector('meta[name=csrf-token]').content},
        body: JSON.stringify({text})}).then(r => r.json())""", hostile)["html"]
    assert "<script" not in rendered and "<img" not in rendered and 'href="javascript' not in rendered
    assert '<a href="https://example.org" rel="noopener noreferrer nofollow" target="_blank">ok</a>' in rendered
    page.evaluate("""([content, html]) => localStorage.setItem('llmgw-chat', JSON.stringify(
        {messages: [{role: 'user', content: content}, {role: 'assistant', content: content, html: html}]}))""",
                  [hostile, rendered])
    page.reload()
    page.wait_for_selector(".msg.assistant")
    assert page.evaluate("window.pwned") is None
    assert page.query_selector(".msg img") is None and page.query_selector(".msg script") is None
    # A forged render request (no token) is refused.
    status = page.evaluate("""() => fetch('/chat/render', {method: 'POST', credentials: 'same-origin',
        headers: {'Content-Type': 'application/json'}, body: '{"text": "x"}'}).then(r => r.status)""")
    assert status == 400
    chat = page.evaluate("""() => fetch('/chat/completions', {method: 'POST', credentials: 'same-origin',
        headers: {'Content-Type': 'application/json'}, body: '{"model": "sim", "messages": []}'}).then(r => r.status)""")
    assert chat == 403
    context.close()


def test_a_sign_up_approved_on_the_people_page(cluster):
    gw = cluster["gw"]
    visitor = cluster["browser"].new_context(viewport=PHONE)
    page = visitor.new_page()
    page.goto(gw.url + "/signup")
    page.fill("#email", "grace@example.org")
    page.fill("#password", PASSWORD)
    page.fill("#repeat", PASSWORD)
    page.click("button[type=submit]")
    assert "waits for an operator" in page.inner_text("main")
    context, admin = signed_in(cluster)
    admin.goto(gw.url + "/admin/people")
    admin.screenshot(path=str(cluster["tmp"] / "people-phone.png"), full_page=True)
    admin.click("li:has-text('grace@example.org') >> text=Approve")
    assert "Approved grace@example.org, on their own." in admin.inner_text("[role=status]")
    context.close()
    page.goto(gw.url + "/login")
    page.fill("#email", "grace@example.org")
    page.fill("#password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/account")
    assert "Personal" in page.inner_text("#spends")
    visitor.close()


def test_a_quota_changed_on_the_page_is_enforced(cluster):
    gw = cluster["gw"]
    key = make_key(cluster["url"], "quota-test")
    context, page = signed_in(cluster)
    page.set_default_timeout(90_000)  # a form answered behind a loaded machine's other tests (seen: over 30 s)
    page.goto(gw.url + "/admin/quotas?edit=cluster:")
    page.fill("#rpm", "2")
    page.click("form.stack button[type=submit]")
    assert "Limits saved" in page.inner_text("[role=status]")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    try:
        # Each worker takes the new limit up within a couple of seconds; until then it neither limits nor
        # counts the key's requests. Those that were limited say so in their headers, and the third is refused.
        limited = 0
        deadline = time.monotonic() + 60
        with pytest.raises(openai.RateLimitError, match="2 requests a minute"):
            while time.monotonic() < deadline:
                answer = client.chat.completions.with_raw_response.create(
                    model="sim", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
                if answer.headers.get("x-ratelimit-limit-requests") == "2":
                    limited += 1
                else:
                    time.sleep(0.1)  # a poll: this worker has not read the limit yet
        assert limited == 2
    finally:
        client.close()
        page.goto(gw.url + "/admin/quotas?edit=cluster:")
        page.fill("#rpm", "")
        page.click("form.stack button[type=submit]")
        assert "Limits saved" in page.inner_text("[role=status]")  # cleared, so later tests are unlimited
        context.close()


@pytest.mark.parametrize("path", ["/account", "/account/password", "/chat", "/admin", "/admin/people",
                                  "/admin/quotas", "/admin/usage", "/org", "/admin/quotas?edit=cluster:",
                                  "/admin/mirror", "/admin/mirror/serve?model=smol&source=http://m/smol/1/smol.gguf",
                                  "/admin/mirror/registry", "/admin/mirror/repo?id=acme/tiny-GGUF", "/no-such-page"])
def test_every_signed_in_page_fits_a_phone(cluster, path):
    context, page = signed_in(cluster)
    page.goto(cluster["gw"].url + path)
    name = path.strip("/").replace("/", "-").replace("?", "-").replace(":", "") or "root"
    page.screenshot(path=str(cluster["tmp"] / f"phone-{name}.png"), full_page=True)
    assert fits_the_screen(page), path
    context.close()


def test_the_pages_break_no_rule_of_their_content_security_policy_and_still_refresh(cluster):
    # The policy runs only the site's script files; an inline script left in a template would stop working
    # without a word, except this one in the console.
    context, page = signed_in(cluster, viewport={"width": 1280, "height": 900})
    refused = []
    page.on("console", lambda message: refused.append(message.text) if "Content Security Policy" in message.text
            else None)
    for path in ("/", "/account", "/chat", "/admin/people", "/admin/quotas", "/admin/usage", "/admin/mirror"):
        page.goto(cluster["gw"].url + path)
        page.wait_for_load_state("load")
    # The cluster page refreshes its figures in place (static/refresh.js), as it did from an inline script.
    page.goto(cluster["gw"].url + "/admin")
    with page.expect_response(lambda r: "/admin?partial=1" in r.url, timeout=30_000) as refreshed:
        pass
    assert refreshed.value.status == 200
    assert refused == []
    context.close()
