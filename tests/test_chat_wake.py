"""The chat page with a model that runs on demand, in a real headless Chromium against a real controller,
agent and gateway: the picker says the model starts when asked; sending wakes it, the page says what it
waits for, and the question goes once the model is ready, answered, its mathematics typeset."""

from playwright.sync_api import sync_playwright

from llmgw import store
from llmgw.people import accounts
from llmgw.procs import wait_for
from tests.cluster import Agent, Controller
from tests.conftest import Gateway

PASSWORD = "a long enough password"
LAZY = {"name": "lazy", "source": "/dev/null", "scaling": {"min": 0, "max": 1},
        # Slow enough to start that the page is seen waiting: the sim's first answer comes after 2 s.
        "profiles": [{"engine": "sim", "args": ["--ttft-ms", "5", "--reply", "Awake now: \\(x^2 + y_1\\) for $5."]}]}


def test_the_chat_page_wakes_a_model_says_what_it_waits_for_then_sends(tmp_path):
    url = f"sqlite:///{tmp_path}/wake.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "ada@example.org", PASSWORD, state=accounts.ACTIVE)
    engine.dispose()
    made = []
    try:
        c = Controller(tmp_path, store_url=url, models=[LAZY])
        made.append(c)
        made.append(Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1")))
        gw = Gateway(tmp_path, url, workers=1, gateway__controller=f"127.0.0.1:{c.gateway_port}",
                     gateway__key_file=c.gateway_key_file())
        made.append(gw)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            page = browser.new_context().new_page()
            page.goto(gw.url + "/login")
            page.fill("#email", "ada@example.org")
            page.fill("#password", PASSWORD)
            page.click("button[type=submit]")
            page.wait_for_url("**/account")
            page.goto(gw.url + "/chat")
            wait_for("the page to offer the model", 30,
                     lambda: page.reload() or "lazy (starts when asked)" in page.inner_text("#model"))
            assert c.replicas("lazy") == []  # nothing runs until someone asks
            page.fill("#prompt", "Are you there?")
            page.click("#send")
            # Said while it waits: the page's polls are every 2 s, these every 50 ms.
            wait_for("the page to say what the model waits for", 30,
                     lambda: page.inner_text("#status").startswith("Starting lazy: "), interval=0.05)
            wait_for("the answer", 120, lambda: "Awake now:" in (page.inner_text(".msg.assistant .body")
                                                                 if page.query_selector(".msg.assistant") else ""))
            assert page.inner_text("#status") == ""
            # Its mathematics typeset by the KaTeX the gateway serves (static/katex, made by `make`), inside
            # the page's content security policy; the dollar amount left as text.
            wait_for("the answer typeset", 30, lambda: page.query_selector(".msg.assistant .katex") is not None)
            assert "$5" in page.inner_text(".msg.assistant .body")
            browser.close()
    finally:
        for part in reversed(made):
            part.stop()
