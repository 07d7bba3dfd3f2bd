"""The chat page with a model that runs on demand, in a real headless Chromium against a real controller,
agent and gateway: the picker says the model starts when asked; sending wakes it, the page says what it
waits for, and the question goes once the model is ready, answered, its mathematics typeset, spent against
the project the person chose, a choice the page remembers."""

from playwright.sync_api import sync_playwright

from llmgw import store
from llmgw.people import accounts, memberships, orgtree
from llmgw.procs import wait_for
from tests.cluster import Agent, Controller
from tests.conftest import Gateway, chromium

PASSWORD = "a long enough password"
LAZY = {"name": "lazy", "source": "/dev/null", "scaling": {"min": 0, "max": 1},
        "profiles": [{"engine": "sim", "args": ["--ttft-ms", "5", "--reply", "Awake now: \\(x^2 + y_1\\) for $5."]}]}


def test_the_chat_page_wakes_a_model_says_what_it_waits_for_then_sends(tmp_path):
    url = f"sqlite:///{tmp_path}/wake.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "ada@example.org", PASSWORD, state=accounts.ACTIVE)
    project = orgtree.add(engine, "project", "lab", "default/default")
    memberships.join(engine, "ada@example.org", "project", project.id)
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
            browser = chromium(p)
            page = browser.new_context().new_page()
            page.goto(gw.url + "/login")
            page.fill("#email", "ada@example.org")
            page.fill("#password", PASSWORD)
            page.click("button[type=submit]")
            page.wait_for_url("**/account")
            page.goto(gw.url + "/chat")
            # Reloaded until the gateway has the catalog (a reload answers a truthy Response, so it may not be
            # the condition itself: `reload() or ...` once passed at once, and the page offered no model yet).
            wait_for("the page to offer the model", 60,
                     lambda: (page.reload(), "lazy (starts when asked)" in page.inner_text("#model"))[1])
            assert c.replicas("lazy") == []  # nothing runs until someone asks
            page.select_option("#spend", project.id)  # on their own, or the project they belong to
            page.fill("#prompt", "Are you there?")
            with page.expect_response("**/chat/wake") as woken, page.expect_request("**/chat/completions", timeout=180_000) as asked:
                page.click("#send")
            assert asked.value.headers["x-llmgw-spend"] == project.id
            # What the page is told it waits for, and shows until the model is up (for as long as that takes:
            # on a quiet machine the sim is up before anyone could read it).
            assert woken.value.json() == {"ready": False, "status": "waiting for a node with room for it"}
            wait_for("the answer", 120, lambda: "Awake now:" in (page.inner_text(".msg.assistant .body")
                                                                 if page.query_selector(".msg.assistant") else ""))
            assert page.inner_text("#status") == ""
            assert "lazy started for this, in " in page.inner_text(".msg.assistant .stats")  # said with the answer
            # Its mathematics typeset by the KaTeX the gateway serves (static/katex, made by `make`), inside
            # the page's content security policy; the dollar amount left as text.
            wait_for("the answer typeset", 30, lambda: page.query_selector(".msg.assistant .katex") is not None)
            assert "$5" in page.inner_text(".msg.assistant .body")
            page.reload()
            assert page.input_value("#spend") == project.id  # remembered, while it is still theirs to choose
            browser.close()
    finally:
        for part in reversed(made):
            part.stop()
