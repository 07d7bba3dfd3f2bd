"""Connecting a coding tool: the account page's "Connect your editor" section, and `GET /setup/<tool>?model=M`.

`/setup/<tool>` answers a POSIX sh script for `curl -fsSL URL/setup/TOOL?model=M | sh`. It needs no
sign-in (curl has no session) and holds no secret: the tools read the key from an environment variable.
What it writes comes from llmgw/web/editorconfig.py, the same text the account page shows. The script is
run as whoever fetched it, so every value in it is checked first (the model must be one the catalog
lists, the gateway's address a plain URL) and shell-quoted where it is put: a `model=` of `$(rm -rf ~)`
is refused, and would be inert if it were not. Without `gateway.public_url` the address is the request's
Host, which pages.py has already checked with plain_host; a Host it refused never reaches this module.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
import time
from urllib.parse import quote

from flask import Blueprint, Response, abort, render_template, request

from llmgw.gateway.worker import Runtime
from llmgw.people import keys
from llmgw.web import editorconfig
from llmgw.web.site import site

TOOLS = {"codex": "Codex", "claude": "Claude Code", "continue": "Continue", "cline": "Cline"}
MCP_TOOLS = ("codex", "claude")  # the tools whose setup adds the gateway's MCP server with `?memory=1`
# A gateway address a script may name: scheme, host (a name, IPv4 or [IPv6]), port, path. Nothing that a
# shell, TOML, JSON or YAML would read specially, even where it stands unquoted in a comment.
HOST_PORT = re.compile(r"(\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9.-]+))(:(?P<port>[1-9][0-9]{0,4}))?")
LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
PLAIN_PATH = re.compile(r"(/[A-Za-z0-9._~\-]+)*")


def gateway_url(runtime: Runtime) -> str:
    """Where people reach the gateway: `gateway.public_url`, else the address this request came to."""
    return runtime.cfg["gateway.public_url"].rstrip("/") or request.host_url.rstrip("/")


def plain(url: str) -> bool:
    """Whether URL is a plain `scheme://host[:port][/path]`, with nothing any of the files would read specially."""
    scheme, sep, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    return scheme in ("http", "https") and bool(sep) and plain_host(host) and bool(PLAIN_PATH.fullmatch(slash + path))


def plain_host(host: str) -> bool:
    """Whether HOST (a Host header, or the host of a URL) is a DNS name, IPv4 or [IPv6] address, with an optional
    port from 1 to 65535: what Werkzeug can build a URL from, and nothing a file or a shell reads specially."""
    parts = HOST_PORT.fullmatch(host)
    if not parts or parts["port"] and int(parts["port"]) > 65535:
        return False
    if parts["ipv6"]:
        try:
            ipaddress.IPv6Address(parts["ipv6"])
        except ValueError:
            return False
        return True
    name = parts["name"].removesuffix(".")  # "example.org." is the same name, fully qualified
    return len(name) <= 253 and all(LABEL.fullmatch(label) for label in name.split("."))


def usable_models(runtime: Runtime, user_id: str, key_records) -> list[str]:
    """The names (models and aliases, as /v1/models lists them) the person may use: with keys, what any of
    their keys (KEY_RECORDS, live ones) may use; without, what they may use as themselves (the chat page)."""
    table = runtime.keys
    snapshot = runtime.router.snapshot
    now = time.time()
    live = [k for k in key_records if keys.works(k, now)]
    lists = ([table.rules.access(k.id, k.project_id, user_id).models for k in live]
             or [table.person(user_id).models])
    listed = snapshot.listed_ids()
    if any(allowlist is None for allowlist in lists):
        return [name for name, _ in listed]
    return [name for name, spec in listed if any(snapshot.allows(allowlist, spec.name) for allowlist in lists)]


def keeps_notes(runtime: Runtime, key_records) -> bool:
    """Whether any of KEY_RECORDS (a person's live keys) is a key of a project that keeps agents' notes:
    then the setup adds the gateway's MCP server to Codex and Claude Code."""
    return any(k.project_id in runtime.keys.memory for k in key_records if k.revoked_at is None)


def section(runtime: Runtime, models: list[str], chosen: str | None, memory: bool = False) -> dict:
    """What the account page's "Connect your editor" section shows for the model CHOSEN (else the first);
    MEMORY: with the gateway's MCP server (keeps_notes)."""
    url = gateway_url(runtime)
    if not models:
        return {"url": url, "models": [], "variable": editorconfig.KEY_VARIABLE}
    model = chosen if chosen in models else models[0]
    codex = editorconfig.codex(url, model, memory)
    notes = "&memory=1" if memory else ""
    return {"url": url, "models": models, "model": model, "variable": editorconfig.KEY_VARIABLE,
            "provider": editorconfig.PROVIDER, "codex": codex,
            "claude": _json(editorconfig.claude(url, model, model)),
            "claude_mcp": _json(editorconfig.claude_mcp(url)) if memory else None,
            "continue_block": editorconfig.continue_block(url, model),
            "cline": editorconfig.cline(url, model),
            "setup": {tool: f"{url}/setup/{tool}?model={_query(model)}" + (notes if tool in MCP_TOOLS else "")
                      for tool in TOOLS}}


def _json(value) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)


def _query(value: str) -> str:
    return quote(value, safe="")


bp = Blueprint("editors", __name__)


@bp.app_template_filter("sh")
def sh(value: str) -> str:
    return shlex.quote(value)


@bp.get("/setup/<tool>")
def setup(tool):
    runtime = site().runtime
    if tool not in TOOLS:
        abort(404, f"There is no setup script for {tool!r}. There are: {', '.join(TOOLS)}.")
    url = gateway_url(runtime)
    if not plain(url):  # gateway.public_url: pages.py refuses a Host that is not plain before it gets here
        return refusal(500, f"This gateway's address ({url!r}) is not one a setup script can name safely. "
                            "An operator should set gateway.public_url to a plain https:// address.")
    listed = [name for name, _ in runtime.router.snapshot.listed_ids()]
    model = request.args.get("model", "")
    small = request.args.get("small", model)
    for given in (model, small):
        if given not in listed:
            # No list here: this page needs no sign-in, and the catalog is for key holders (/v1/models).
            what = f"The model {given!r} is not one this gateway serves." if given else "No model was given."
            return refusal(400, f"{what} Name one with ?model=NAME; your account page ({url}/account) shows "
                                "the ones your keys may use.")
    # The script cannot know the key's project (it holds no key): the account page asks for the MCP server
    # where the person's project keeps notes; elsewhere the server would refuse every request.
    memory = request.args.get("memory") == "1" and tool in MCP_TOOLS
    values = {"tool": tool, "tool_name": TOOLS[tool], "url": url, "model": model,
              "variable": editorconfig.KEY_VARIABLE, "provider": editorconfig.PROVIDER,
              "mcp_server": editorconfig.MCP_SERVER,
              "mcp_patch": _json(editorconfig.claude_mcp(url)) if memory else None,
              "codex": editorconfig.codex(url, model, memory), "patch": _json(editorconfig.claude(url, model, small)),
              "block": editorconfig.continue_block(url, model), "begin": editorconfig.BEGIN,
              "end": editorconfig.END, "fields": editorconfig.cline(url, model)}
    script = render_template(f"setup/{tool}.sh", **values)
    return Response(script, mimetype="text/plain", headers={"Cache-Control": "no-store"})


def refusal(status: int, text: str) -> Response:
    """A refusal the way `curl -fsSL ... | sh` shows it: plain text (curl -f prints the status; without
    -f, sh runs the answer, so every line is a comment and the last exits)."""
    body = "".join(f"# {line}\n" for line in text.splitlines()) + f"echo {shlex.quote(text)} >&2\nexit 1\n"
    return Response(body, status, mimetype="text/plain")
