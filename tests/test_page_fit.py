"""Every page at a desktop's 1280 pixels and a phone's 390, in real headless Chromium, against a gateway with a
controller, two nodes (one with eight replayed GPUs), a mirror and a store full of realistic rows: long emails
and key names, organisations with teams and projects, limits at every level, usage. Each page must fit its
screen, each table its box (or, on a phone only, scroll inside a wrapper made to scroll, with every button and
link in sight), each cell its content, and no word may be broken between two letters."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from playwright.sync_api import sync_playwright

from llmgw import store
from llmgw.people import accounts, keys, limits, memberships, orgtree
from llmgw.procs import free_port, http_status, wait_for
from tests.cluster import Agent, Controller
from tests.conftest import ROOT, Gateway, chromium, post, stop_process, write_config
from tests.test_mirror import gguf_bytes
from tests.test_mirrorpage import Registry

PASSWORD = "a long enough password"
ADMIN = "root@example.org"
WIDTHS = {"desktop": {"width": 1280, "height": 900}, "phone": {"width": 390, "height": 844}}
MODEL = {"name": "simmy", "source": "/dev/null", "scaling": {"min": 1, "max": 1},
         "profiles": [{"engine": "sim", "args": ["--ttft-ms", "1", "--tokens-per-s", "0"],
                       "node_selector": {"kind": "cpu"}}]}
LONG_MODEL = {"name": "qwen2.5-coder-32b-instruct-q4_k_m", "source": "/dev/null", "scaling": {"min": 0, "max": 2},
              "profiles": [{"engine": "sim", "node_selector": {"kind": "gpu"}}]}
# What the pages show, as people name things: long addresses, long key names, deep paths.
PEOPLE = ["margaret.hamilton@apollo-guidance.example.org", "grace.hopper@naval-research.example.org",
          "ada@example.org", "katherine.johnson.flight-dynamics@langley.example.org"]
TREE = [("org", "Acme Research", None), ("team", "machine-learning", "Acme Research"),
        ("project", "training-infrastructure", "Acme Research/machine-learning"),
        ("project", "evaluation", "Acme Research/machine-learning"), ("team", "platform", "Acme Research"),
        ("project", "customer-support-assistant", "Acme Research/platform"), ("org", "Globex", None),
        ("team", "research", "Globex"), ("project", "retrieval-augmented-generation", "Globex/research")]


def fill(url: str) -> dict:
    """The rows the pages show; returns the ids the tests need."""
    engine = store.open_store(url)
    try:
        admin = accounts.create_user(engine, ADMIN, PASSWORD, state=accounts.ACTIVE, is_admin=True)
        for n, email in enumerate(PEOPLE):
            accounts.create_user(engine, email, PASSWORD, state=accounts.PENDING if n == 2 else accounts.ACTIVE)
        accounts.suspend(engine, PEOPLE[3])
        for kind, name, parent in TREE:
            orgtree.add(engine, kind, name, parent)
        tree = orgtree.Tree.load(engine)
        acme, ml = tree.find("org", "Acme Research"), tree.find("team", "Acme Research/machine-learning")
        training = tree.find("project", "Acme Research/machine-learning/training-infrastructure")
        memberships.join(engine, ADMIN, "org", acme.id, role="manager")
        memberships.join(engine, ADMIN, "project", training.id)
        memberships.join(engine, PEOPLE[0], "project", training.id)
        memberships.join(engine, PEOPLE[1], "org", acme.id, role="manager")
        secret = keys.create_key(engine, "starter")[1]  # what `llmgw up` makes: a project key, nobody's
        keys.create_key(engine, "continuous-integration-nightly-evaluation-runner", training.id, 90 * 86400,
                        user_id=admin.id)
        keys.create_key(engine, "laptop", None, 30 * 86400, user_id=admin.id)
        keys.create_key(engine, "notebook-experiments-with-a-long-name", None, user_id=admin.id, band="low",
                        models=["simmy"])
        harness = keys.create_key(engine, "margaret-s-evaluation-harness", training.id)[0]
        limits.set_limits(engine, "cluster", "", ADMIN, rpm=600, tpm=200_000)
        limits.set_limits(engine, "org", acme.id, ADMIN, rpm=120, budget=250_000_000, period="month",
                          models=["simmy", LONG_MODEL["name"]])
        limits.set_limits(engine, "team", ml.id, ADMIN, tpm=50_000, band="high")
        limits.set_limits(engine, "project", training.id, ADMIN, rpm=300, budget=1_000_000_000)
        limits.set_limits(engine, "project_member", training.id, ADMIN, rpm=20, budget=25_000_000)
        limits.set_limits(engine, "user", admin.id, ADMIN, tpm=10_000)
        limits.set_limits(engine, "key", harness.id, ADMIN, rpm=5)
        limits.set_price(engine, "*", "0.15", "0.6", ADMIN)
        limits.set_price(engine, LONG_MODEL["name"], "1.25", "5", ADMIN)
        return {"acme": acme.id, "training": training.id, "secret": secret}
    finally:
        engine.dispose()


class Mirror:
    """`python mirror.py` on free ports, holding one model version put into its directory by hand."""

    def __init__(self, tmp):
        files, api = free_port(), free_port()
        self.base = f"http://127.0.0.1:{files}"
        self.dir = tmp / "mirror"
        self.api = f"127.0.0.1:{api}"
        version = self.dir / "tinyllama-chat" / "2024-01-v1.0-q4_k_m"
        version.mkdir(parents=True)
        (version / "tinyllama-1.1b-chat-v1.0-q4_k_m-with-a-rather-long-file-name.gguf").write_bytes(
            gguf_bytes("llama", 3000))
        config = write_config(tmp / "mirror.toml", {
            "mirror.dir": str(self.dir), "mirror.listen": f"127.0.0.1:{files}", "mirror.api_listen": self.api,
            "mirror.metrics_listen": f"127.0.0.1:{free_port()}", "controller.admin_listen": f"127.0.0.1:{free_port()}"})
        with open(tmp / "mirror.log", "wb") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "mirror.py"), "--config", config],
                                         stdout=log, stderr=subprocess.STDOUT)
        wait_for("the mirror", 30, lambda: http_status(f"http://{self.api}/api/v1/health") == 200,
                 alive=lambda: self.proc.poll() is None)

    def stop(self):
        stop_process(self.proc)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("page-fit")
    url = f"sqlite:///{tmp}/site.db"
    made = []
    try:
        registry = Registry({"tiny-q4_k_m-with-a-rather-long-file-name.gguf": gguf_bytes("llama", 100)})
        made.append(registry)
        mirror = Mirror(tmp)
        made.append(mirror)
        c = Controller(tmp, store_url=url, models=[MODEL, LONG_MODEL], mirror__base_url=mirror.base)
        made.append(c)
        ids = fill(url)  # before the gateway starts, so that every worker knows the keys
        made.append(Agent(tmp, [f"127.0.0.1:{c.agent_port}"], "cpu-node-with-a-long-name-01", c.issue_key(
            "cpu-node-with-a-long-name-01"), labels={"kind": "cpu"}))
        made.append(Agent(tmp, [f"127.0.0.1:{c.agent_port}"], "gpu-1", c.issue_key("gpu-1"), labels={"kind": "gpu"},
                          nvidia_smi_capture="nvidia-smi-8xh100.csv"))
        gw = Gateway(tmp, url, workers=2, gateway__key_file=c.gateway_key_file(), gateway__signup_open=True,
                     gateway__controller=f"127.0.0.1:{c.gateway_port}",
                     gateway__controller_admin=f"127.0.0.1:{c.admin_port}",
                     controller__keys_dir=c.values["controller.keys_dir"], mirror__api=mirror.api,
                     mirror__dir=str(mirror.dir),  # where the gateway finds the mirror's token
                     mirror__hf_endpoint=registry.url)
        made.append(gw)
        chat = {"model": "simmy", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        wait_for("the gateway to serve simmy", 60,
                 lambda: post(gw.url + "/v1/chat/completions", chat, ids["secret"])[0] == 200, interval=0.2)
        for _ in range(5):  # rows for the usage tables
            assert post(gw.url + "/v1/chat/completions", chat, ids["secret"])[0] == 200
        with sync_playwright() as p:
            browser = chromium(p)
            yield {"browser": browser, "gw": gw, "tmp": tmp, "signed_in": {}, **ids}
            for context in [*browser.contexts]:
                context.close()
            browser.close()
    finally:
        for thing in reversed(made):
            thing.stop()


def admin_at(site, width: str):
    """A page signed in as the administrator at WIDTH, one per width for the whole module (signing in is slow)."""
    if width not in site["signed_in"]:
        page = site["browser"].new_context(viewport=WIDTHS[width]).new_page()
        page.set_default_timeout(60_000)
        page.goto(site["gw"].url + "/login")
        page.fill("#email", ADMIN)
        page.fill("#password", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/account")
        site["signed_in"][width] = page
    return site["signed_in"][width]


# Run in the page: every way a page, a table or a cell fails to fit, as sentences.
MISFITS = r"""wide => {
  const found = [];
  const root = document.documentElement;
  if (root.scrollWidth > root.clientWidth) found.push(`the page is ${root.scrollWidth} px wide on a ${root.clientWidth} px screen`);
  const name = el => (el.textContent || '').trim().replace(/\s+/g, ' ').slice(0, 40);
  const letter = /[\p{L}\p{N}]/u;
  const range = document.createRange();
  for (const table of document.querySelectorAll('main table')) {
    const box = table.parentElement;
    const scrolls = ['auto', 'scroll'].includes(getComputedStyle(box).overflowX);
    const over = table.getBoundingClientRect().width - box.clientWidth;
    const seen = box.getBoundingClientRect();
    if (over > 1 && (wide || !scrolls))
      found.push(`the table "${name(table.rows[0])}" is ${Math.round(over)} px wider than its box` +
                 (scrolls ? ' (scrolling, on a wide screen)' : ''));
    // On a wide screen a figure lines up by its last digit with the others of its column (llmgw/units.py).
    for (const figure of table.querySelectorAll('td.num'))
      if (wide && getComputedStyle(figure).textAlign !== 'right') found.push(`the figure "${name(figure)}" is not right-aligned`);
    for (const cell of table.querySelectorAll('th, td')) {
      const edge = cell.getBoundingClientRect();
      if (cell.scrollWidth > cell.clientWidth + 1) found.push(`the cell "${name(cell)}" overflows`);
      for (const part of cell.querySelectorAll('a, button, input, select, code, span')) {
        const r = part.getBoundingClientRect();
        if (!r.width) continue;
        const what = `"${name(part) || part.outerHTML.slice(0, 40)}"`;
        if (r.right > edge.right + 1 || r.left < edge.left - 1) found.push(`${what} sticks out of its cell "${name(cell)}"`);
        // What a person acts on must show without scrolling the table sideways (a phone shows no scroll bar).
        else if (part.matches('a, button, input, select') && (r.right > seen.right + 1 || r.left < seen.left - 1))
          found.push(`${what} in the table "${name(table.rows[0])}" is hidden until it is scrolled to`);
      }
      const walk = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
      for (let node; (node = walk.nextNode());) {
        const text = node.data;
        for (let i = 0; i + 1 < text.length; i++) {
          if (!letter.test(text[i]) || !letter.test(text[i + 1])) continue;
          range.setStart(node, i); range.setEnd(node, i + 1);
          const a = range.getBoundingClientRect();
          range.setStart(node, i + 1); range.setEnd(node, i + 2);
          const b = range.getBoundingClientRect();
          if (a.height && b.height && b.top >= a.bottom - 1) {
            const word = text.slice(0, i + 1).split(/\s/).pop() + '|' + text.slice(i + 1).split(/\s/)[0];
            found.push(`"${word}" is broken between two letters`);
            break;
          }
        }
      }
    }
  }
  return found;
}"""


def misfits(page, width: str) -> list[str]:
    return page.evaluate(MISFITS, width == "desktop")


def looked_at(site, page, width: str, name: str) -> list[str]:
    """What does not fit on PAGE as it stands, with a screenshot left to look at."""
    page.screenshot(path=str(site["tmp"] / f"{width}-{name}.png"), full_page=True)
    return misfits(page, width)


ADMIN_PATHS = ["/account", "/account/password", "/chat", "/org", "/admin", "/admin/people", "/admin/quotas",
               "/admin/quotas?edit=project:{training}", "/admin/usage", "/admin/usage?by=person&metric=tokens",
               "/admin/nodes/cpu-node-with-a-long-name-01", "/admin/nodes/gpu-1",
               "/admin/nodes/cpu-node-with-a-long-name-01/logs", "/admin/mirror", "/admin/mirror/registry",
               "/admin/mirror/repo?id=acme/tiny-GGUF", "/no-such-page",
               "/admin/mirror/serve?model=tinyllama-chat&source=http://m/tinyllama-chat/v1/tiny.gguf"]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("path", ADMIN_PATHS)
def test_every_signed_in_page_fits(site, width, path):
    page = admin_at(site, width)
    page.goto(site["gw"].url + path.format(**site))
    page.wait_for_load_state("load")
    name = path.strip("/").split("?")[0].replace("/", "-") + ("-query" if "?" in path else "")
    assert looked_at(site, page, width, name) == [], path


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("path", ["/", "/about", "/login", "/signup", "/claim/not-a-token"])
def test_every_page_for_visitors_fits(site, width, path):
    context = site["browser"].new_context(viewport=WIDTHS[width])
    page = context.new_page()
    page.goto(site["gw"].url + path)
    assert looked_at(site, page, width, "visitor-" + (path.strip("/").replace("/", "-") or "landing")) == [], path
    if path == "/claim/not-a-token":  # the message a used link answers with
        page.click("button[type=submit]")
        assert "No key here" in page.inner_text("h1")
        assert looked_at(site, page, width, "visitor-claim-gone") == []
    context.close()


@pytest.mark.parametrize("width", WIDTHS)
def test_a_key_made_for_someone_and_claimed_fits(site, width):
    page = admin_at(site, width)
    page.goto(site["gw"].url + "/admin/people")
    summary = page.locator("summary", has_text="make a key in training-infrastructure")
    summary.click()
    place = summary.locator("..")
    place.locator("input[name=name]").fill("a-key-for-the-nightly-regression-suite")
    place.locator("input[name=claim]").check()
    place.locator("button[type=submit]").click()
    page.wait_for_selector("pre.url")
    assert looked_at(site, page, width, "admin-key") == []
    link = page.inner_text("pre.url").strip()
    visitor = site["browser"].new_context(viewport=WIDTHS[width])
    claimer = visitor.new_page()
    claimer.goto(link)
    claimer.click("button[type=submit]")
    claimer.wait_for_selector("pre.url")
    assert looked_at(site, claimer, width, "claimed") == []
    visitor.close()
