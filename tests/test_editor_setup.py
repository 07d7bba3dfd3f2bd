"""Connecting a coding tool: the account page's section, and the `/setup/<tool>` scripts run with sh under a
temporary HOME against files that already hold other people's settings."""

import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from conftest import make_key, run_setup_script
from test_pages import sign_in

from llmgw import settings, store
from llmgw.people import accounts, keys
from llmgw.web.app import GatewayApp

URL = "https://llm.example.com"
HOSTILE = "x'\"$(touch pwned)`touch pwned`\\"  # a model an operator named badly: still one value everywhere
KEY = "sk-llmgw-test-secret"


@pytest.fixture
def site(tmp_path):
    url = f"sqlite:///{tmp_path}/editors.db"
    engine = store.open_store(url)
    path = tmp_path / "gateway.toml"
    path.write_text(settings.to_toml(
        {"store.url": url, "gateway.public_url": URL + "/"},
        [{"id": "e", "url": "http://127.0.0.1:9", "models": ["big", "small", HOSTILE]}],
        [{"name": "big", "aliases": ["claude-sonnet-4-5"]}, {"name": "small"}]))
    app = GatewayApp(settings.load(str(path)), key_source=keys)
    app.pages.testing = True
    yield app.pages.test_client(), engine, app
    app.runtime.engine.dispose()
    engine.dispose()


def script(client, tool, model="big") -> str:
    answer = client.get(f"/setup/{tool}", query_string={"model": model})
    assert answer.status_code == 200 and answer.mimetype == "text/plain", answer.data
    return answer.get_data(as_text=True)


def run(text, home, key=KEY, path=None, **env):
    return run_setup_script(text, home, key, path, **env)


def section(page: str) -> str:
    """The "Connect your editor" section of the account page."""
    return page[page.index('<h2 id="editors">'):page.index("<h2>Budgets")]


def backups(path) -> list[str]:
    return glob.glob(f"{path}.bak-*")


def test_the_section_shows_the_address_and_the_models_the_persons_keys_may_use(site):
    client, engine, app = site
    user = accounts.create_user(engine, "ed@example.org", "a long enough password", state=accounts.ACTIVE)
    sign_in(client, "ed@example.org", "a long enough password")
    whole = client.get("/account").get_data(as_text=True)
    assert '<script src="/static/copy.js" defer>' in whole
    page = section(whole)
    assert "Connect your editor" in page and f"<code>{URL}</code>" in page
    assert all(f"<option{' selected' if m == 'big' else ''}>{m}</option>" in page for m in ("big", "small"))
    assert f"curl -fsSL &#39;{URL}/setup/codex?model=big&#39; | sh" in page
    assert "export LLMGW_API_KEY=sk-llmgw-…" in page
    assert 'data-copy="claude-settings" hidden' in page  # shown by the script only
    # A key limited to an alias: that alias's model and its names, nothing else; and the key never shows.
    _, secret = keys.create_key(engine, "editor", user_id=user.id, models=["claude-sonnet-4-5"])
    app.runtime.refresh_keys()  # what a worker does within a second
    page = section(client.get("/account?model=claude-sonnet-4-5").get_data(as_text=True))
    options = re.findall(r"<option[^>]*>([^<]*)</option>", page)
    assert options == ["big", "claude-sonnet-4-5"] and "<option selected>claude-sonnet-4-5</option>" in page
    assert "setup/claude?model=claude-sonnet-4-5" in page and secret not in page
    assert "&#34;ANTHROPIC_BASE_URL&#34;: &#34;https://llm.example.com&#34;" in page


def test_codex_gets_its_provider_table_and_profile_and_nothing_else_changes(site, tmp_path):
    client, _, _ = site
    home = tmp_path / "home"
    config = home / ".codex" / "config.toml"
    config.parent.mkdir(parents=True)
    theirs = ('model = "gpt-5.5"\n\n[model_providers.other]\nbase_url = "https://other.example/v1"\n'
              'env_key = "OTHER_KEY"\n\n[model_providers.llmgw]\nbase_url = "http://old.example/v1"\n\n'
              '[model_providers.llmgw.http_headers]\nX-Old = "1"\n\n[mcp_servers.docs]\ncommand = "docs"\n')
    config.write_text(theirs)
    first = run(script(client, "codex"), home)
    assert first.returncode == 0, first.stderr
    written = tomllib.loads(config.read_text())
    assert written["model_providers"]["llmgw"] == {"name": "llmgw", "base_url": f"{URL}/v1", "wire_api": "responses",
                                                   "env_key": "LLMGW_API_KEY"}
    assert written["model"] == "gpt-5.5" and written["mcp_servers"] == {"docs": {"command": "docs"}}
    assert written["model_providers"]["other"] == {"base_url": "https://other.example/v1", "env_key": "OTHER_KEY"}
    assert KEY not in config.read_text()
    profile = tomllib.loads((home / ".codex" / "llmgw.config.toml").read_text())
    assert profile == {"model_provider": "llmgw", "model": "big"}
    [backup] = backups(config)
    assert pathlib.Path(backup).read_text() == theirs
    before = config.read_bytes()
    again = run(script(client, "codex"), home)
    assert again.returncode == 0 and again.stdout.count("unchanged:") == 2, again.stdout
    assert config.read_bytes() == before and backups(config) == [backup]
    assert not glob.glob(str(home / ".codex" / ".llmgw-setup.*"))  # no scratch file left


def test_codex_honours_codex_home_and_a_name_with_quotes_stays_one_value(site, tmp_path):
    client, _, _ = site
    home, codex_home = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    done = run(script(client, "codex", HOSTILE), home, CODEX_HOME=str(codex_home))
    assert done.returncode == 0, done.stderr
    assert not (home / ".codex").exists() and not (home / "pwned").exists()
    assert tomllib.loads((codex_home / "llmgw.config.toml").read_text())["model"] == HOSTILE
    assert "llmgw" in tomllib.loads((codex_home / "config.toml").read_text())["model_providers"]
    assert backups(codex_home / "config.toml") == []  # a new file: nothing to back up


def _bin_without_node(tmp_path) -> str:
    """A PATH with what the script uses, python3 but no node."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("sh", "cat", "cmp", "cp", "date", "mkdir", "mktemp", "rm", "awk", "printf"):
        os.symlink(shutil.which(tool), folder / tool)
    os.symlink(sys.executable, folder / "python3")  # not a pyenv shim: that is a bash script
    return str(folder)


@pytest.mark.parametrize("runtime", ["node", "python3"])
def test_claude_code_gets_its_own_keys_merged_into_the_settings(site, tmp_path, runtime):
    if not shutil.which(runtime):
        pytest.skip(f"{runtime} is not installed here")
    client, _, _ = site
    home = tmp_path / "home"
    settings_file = home / ".claude" / "settings.json"
    settings_file.parent.mkdir(parents=True)
    theirs = {"permissions": {"allow": ["Bash(ls)"]}, "env": {"DISABLE_TELEMETRY": "1",
                                                                "ANTHROPIC_BASE_URL": "https://old.example"}}
    settings_file.write_text(json.dumps(theirs))
    path = _bin_without_node(tmp_path) if runtime == "python3" else None
    text = client.get("/setup/claude", query_string={"model": "big", "small": "small"}).get_data(as_text=True)
    first = run(text, home, path=path)
    assert first.returncode == 0, first.stderr
    written = json.loads(settings_file.read_text())
    assert written["permissions"] == theirs["permissions"]
    assert written["env"] == {"DISABLE_TELEMETRY": "1", "ANTHROPIC_BASE_URL": URL, "ANTHROPIC_MODEL": "big",
                              "ANTHROPIC_DEFAULT_OPUS_MODEL": "big", "ANTHROPIC_DEFAULT_SONNET_MODEL": "big",
                              "ANTHROPIC_DEFAULT_HAIKU_MODEL": "small", "ANTHROPIC_SMALL_FAST_MODEL": "small"}
    assert KEY not in settings_file.read_text()
    # Claude Code runs the helper in /bin/sh with its own environment: it prints the key, or fails without it.
    helper = subprocess.run(["/bin/sh", "-c", written["apiKeyHelper"]], capture_output=True, text=True,
                            env={"PATH": os.environ["PATH"], "LLMGW_API_KEY": KEY})
    assert helper.stdout.strip() == KEY
    assert subprocess.run(["/bin/sh", "-c", written["apiKeyHelper"]], env={"PATH": os.environ["PATH"]}).returncode
    [backup] = backups(settings_file)
    assert json.loads(pathlib.Path(backup).read_text()) == theirs
    assert run(text, home, path=path).returncode == 0 and backups(settings_file) == [backup]
    assert json.loads(settings_file.read_text()) == written


def test_claude_code_refuses_a_settings_file_that_is_not_json(site, tmp_path):
    client, _, _ = site
    home = tmp_path / "home"
    (home / ".claude").mkdir(parents=True)
    (home / ".claude" / "settings.json").write_text("{not json")
    done = run(script(client, "claude"), home)
    assert done.returncode == 1 and "is not a JSON object" in done.stderr
    assert (home / ".claude" / "settings.json").read_text() == "{not json" and not backups(home / ".claude" / "settings.json")


@pytest.mark.parametrize("indent", ["", "  "])
def test_continue_gets_one_entry_indented_like_the_others(site, tmp_path, indent):
    client, _, _ = site
    home = tmp_path / "home"
    config = home / ".continue" / "config.yaml"
    config.parent.mkdir(parents=True)
    theirs = (f"name: Mine\nversion: 1.0.0\nschema: v1\nmodels:\n{indent}- name: Theirs\n{indent}  provider: ollama\n"
              f"{indent}  model: llama3\ncontext:\n  - provider: code\n")
    config.write_text(theirs)
    first = run(script(client, "continue", "small"), home)
    assert first.returncode == 0, first.stderr
    entry = (f"{indent}# >>> llmgw >>>\n{indent}- name: \"llmgw small\"\n{indent}  provider: openai\n"
             f"{indent}  model: \"small\"\n{indent}  apiBase: \"{URL}/v1\"\n"
             f"{indent}  apiKey: \"${{{{ secrets.LLMGW_API_KEY }}}}\"\n{indent}# <<< llmgw <<<\n")
    assert config.read_text() == theirs.replace("models:\n", "models:\n" + entry)
    [backup] = backups(config)
    # Another model replaces the block in place; the same one again changes nothing.
    assert run(script(client, "continue", "big"), home).returncode == 0
    assert config.read_text() == theirs.replace("models:\n", "models:\n" + entry.replace("small", "big"))
    assert len(backups(config)) == 2
    assert "unchanged" in run(script(client, "continue", "big"), home).stdout and len(backups(config)) == 2


def test_continue_makes_a_new_file_and_leaves_a_json_configuration_alone(site, tmp_path):
    client, _, _ = site
    home = tmp_path / "home"
    home.mkdir()
    assert run(script(client, "continue"), home).returncode == 0
    text = (home / ".continue" / "config.yaml").read_text()
    assert text.startswith("name: Local Config\nversion: 1.0.0\nschema: v1\nmodels:\n  # >>> llmgw >>>\n  - name: ")
    other = tmp_path / "other"
    (other / ".continue").mkdir(parents=True)
    (other / ".continue" / "config.json").write_text('{"models": []}')
    refused = run(script(client, "continue"), other)
    assert refused.returncode == 1 and "Convert config.json" in refused.stderr
    assert os.listdir(other / ".continue") == ["config.json"]


def test_cline_is_told_what_to_enter_and_nothing_is_written(site, tmp_path):
    client, _, _ = site
    home = tmp_path / "home"
    home.mkdir()
    done = run(script(client, "cline", HOSTILE), home)
    assert done.returncode == 0, done.stderr
    assert f"Base URL: {URL}/v1" in done.stdout and f"Model ID: {HOSTILE}" in done.stdout
    assert "API Key: the value of $LLMGW_API_KEY" in done.stdout and KEY not in done.stdout
    assert os.listdir(home) == []


@pytest.mark.parametrize("tool", ["codex", "claude", "continue", "cline"])
def test_without_the_variable_each_script_says_so_and_changes_nothing(site, tmp_path, tool):
    client, _, _ = site
    home = tmp_path / "home"
    home.mkdir()
    done = run(script(client, tool), home, key=None)
    assert done.returncode == 1 and "$LLMGW_API_KEY is not set" in done.stderr and "export LLMGW_API_KEY=" in done.stderr
    assert os.listdir(home) == []


def test_a_hostile_model_is_refused_and_its_answer_runs_nothing(site, tmp_path):
    client, _, _ = site
    home = tmp_path / "home"
    home.mkdir()
    answer = client.get("/setup/codex", query_string={"model": "$(touch pwned)\n`touch pwned`"})
    assert answer.status_code == 400 and answer.mimetype == "text/plain"
    text = answer.get_data(as_text=True)
    # The page needs no sign-in: it names no model of the catalog, which is for key holders.
    assert "/account" in text and not any(name in text for name in ("big", "claude-sonnet-4-5", "small"))
    done = run(text, home)  # what `curl -sSL ... | sh` (no -f) would run
    assert done.returncode == 1 and "is not one this gateway serves" in done.stderr
    assert os.listdir(home) == []
    assert client.get("/setup/codex").status_code == 400  # no model at all


def test_an_unknown_tool_is_a_page_in_the_sites_style(site):
    client, _, _ = site
    answer = client.get("/setup/emacs")
    assert answer.status_code == 404 and b"<h1>No such page</h1>" in answer.data
    assert b"There are: codex, claude, continue, cline." in answer.data


def test_curl_into_sh_against_a_real_gateway(make_gateway, tmp_path):
    if not shutil.which("curl"):
        pytest.skip("curl is not installed here")
    gateway = make_gateway(workers=1, endpoints=[{"id": "e", "url": "http://127.0.0.1:9", "models": ["big"]}])
    make_key(gateway.store_url)  # a gateway with a key, as in use; the script needs none
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run(["sh", "-c", f"curl -fsSL '{gateway.url}/setup/codex?model=big' | sh"], capture_output=True,
                          text=True, env={"HOME": str(home), "PATH": os.environ["PATH"], "LLMGW_API_KEY": KEY},
                          timeout=60)
    assert done.returncode == 0, done.stderr
    provider = tomllib.loads((home / ".codex" / "config.toml").read_text())["model_providers"]["llmgw"]
    assert provider["base_url"] == f"{gateway.url}/v1"  # no public_url: the address curl used
    refused = subprocess.run(["sh", "-c", f"curl -fsSL '{gateway.url}/setup/codex?model=nope' | sh"],
                             capture_output=True, text=True, env={"HOME": str(home), "PATH": os.environ["PATH"]},
                             timeout=60)
    # The pipe's status is sh's, which ran nothing: curl -f says what went wrong.
    assert "returned error: 400" in refused.stderr and refused.stdout == ""


def test_with_notes_kept_the_scripts_add_the_gateways_mcp_server_and_keep_every_other(site, tmp_path):
    """?memory=1, which the account page asks for where a person's project keeps notes: Codex's config.toml
    and Claude Code's ~/.claude.json get the gateway's MCP server, naming the key's variable; what else
    they hold stays, a second run changes nothing, and the account page shows it only to such a person."""
    client, engine, app = site
    home = tmp_path / "home"
    config = home / ".codex" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('[mcp_servers.docs]\ncommand = "docs"\n\n[mcp_servers.llmgw-memory]\nurl = "http://old"\n')
    claude_json = home / ".claude.json"
    claude_json.write_text(json.dumps({"numStartups": 3, "mcpServers": {"docs": {"command": "docs"}}}))
    for tool in ("codex", "claude"):
        answer = client.get(f"/setup/{tool}", query_string={"model": "big", "memory": "1"})
        done = run(answer.get_data(as_text=True), home)
        assert done.returncode == 0, done.stderr
        again = run(answer.get_data(as_text=True), home)
        assert again.returncode == 0 and "unchanged:" in again.stdout and "changed:" not in again.stdout.replace(
            "unchanged:", ""), again.stdout
    written = tomllib.loads(config.read_text())
    assert written["mcp_servers"] == {"docs": {"command": "docs"}, "llmgw-memory": {
        "url": f"{URL}/v1/mcp", "bearer_token_env_var": "LLMGW_API_KEY"}}
    held = json.loads(claude_json.read_text())
    assert held["numStartups"] == 3 and held["mcpServers"] == {"docs": {"command": "docs"}, "llmgw-memory": {
        "type": "http", "url": f"{URL}/v1/mcp", "headers": {"Authorization": "Bearer ${LLMGW_API_KEY}"}}}
    assert KEY not in config.read_text() + claude_json.read_text()
    # Without memory=1 nothing of it is written.
    assert "mcp" not in client.get("/setup/claude", query_string={"model": "big"}).get_data(as_text=True).lower()

    user = accounts.create_user(engine, "ed@example.org", "a long enough password", state=accounts.ACTIVE)
    sign_in(client, "ed@example.org", "a long enough password")
    keys.create_key(engine, "editor", store.DEFAULT_PATH, user_id=user.id)
    app.runtime.refresh_keys()
    assert "memory=1" not in section(client.get("/account").get_data(as_text=True))
    from llmgw.people import keeping

    keeping.set_memory(engine, "default", 24)
    app.runtime.refresh_keys()
    page = section(client.get("/account").get_data(as_text=True))
    assert f"{URL}/setup/codex?model=big&amp;memory=1" in page and "data-copy=\"claude-mcp\"" in page
    assert "setup/continue?model=big&#39;" in page  # only the tools that take MCP servers
