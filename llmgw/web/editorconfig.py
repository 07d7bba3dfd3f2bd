"""What each coding tool (Codex, Claude Code, Continue, Cline) is told to reach this gateway: its configuration text.

One place makes the text for a gateway URL and a model, and both the account
page (shown, to copy) and the `/setup/<tool>` scripts (written into the
person's files) use it, so the two never disagree. Every value is written in
the file format's own quoting (TOML basic strings and YAML double-quoted
scalars both take a JSON string), so a name with a quote, a backslash or a
line break stays one value. No key is ever in this text: each tool is told
the name of an environment variable (KEY_VARIABLE), and reads the key from it
where it can.
"""

from __future__ import annotations

import dataclasses
import json

from llmgw.principals import KEY_VARIABLE

__all__ = ["KEY_VARIABLE"]
PROVIDER = "llmgw"  # Codex's provider and profile id: `codex --profile llmgw`
MCP_SERVER = "llmgw-memory"  # the name the gateway's MCP server (agents' notes) is added under
MCP_PATH = "/v1/mcp"
BEGIN = "# >>> llmgw >>>"  # Continue's block is found again by these lines
END = "# <<< llmgw <<<"


def quoted(value: str) -> str:
    """VALUE as a TOML basic string, a YAML double-quoted scalar and a JSON string alike.

    Not json.dumps' ASCII escapes: TOML refuses the surrogate pairs it writes for characters past U+FFFF.
    The control characters JSON leaves as they are (DEL, C1) and the line and paragraph separators YAML 1.1
    reads as line breaks are escaped; every one of them is in the Basic Multilingual Plane."""
    text = json.dumps(value, ensure_ascii=False)
    return "".join(f"\\u{ord(c):04x}" if 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029" else c for c in text)


@dataclasses.dataclass(frozen=True)
class Codex:
    """Codex reads providers only from `$CODEX_HOME/config.toml`; since 0.134 a profile is a file of its own,
    `$CODEX_HOME/<name>.config.toml`, and `[profiles.x]` tables there are legacy (Codex refuses to write a
    file holding them)."""
    provider: str  # the `[model_providers.llmgw]` table, and with notes `[mcp_servers.llmgw-memory]`, for config.toml
    profile: str  # the whole of llmgw.config.toml


def codex(url: str, model: str, memory: bool = False) -> Codex:
    """MEMORY: the gateway's MCP server too, its bearer token read from the key's variable."""
    provider = (f"[model_providers.{PROVIDER}]\n"
                f"name = {quoted('llmgw')}\n"
                f"base_url = {quoted(url + '/v1')}\n"
                f"wire_api = \"responses\"\n"
                f"env_key = {quoted(KEY_VARIABLE)}\n")
    if memory:
        provider += (f"\n[mcp_servers.{MCP_SERVER}]\n"
                     f"url = {quoted(url + MCP_PATH)}\n"
                     f"bearer_token_env_var = {quoted(KEY_VARIABLE)}\n")
    profile = (f"# Written by llmgw's setup script: `codex --profile {PROVIDER}` uses the gateway.\n"
               f"model_provider = {quoted(PROVIDER)}\n"
               f"model = {quoted(model)}\n")
    return Codex(provider, profile)


def claude(url: str, model: str, small: str) -> dict:
    """What Claude Code's `~/.claude/settings.json` gets: its own keys, merged into whatever is there.

    The base URL has no /v1 (Claude Code adds /v1/messages). The key comes from `apiKeyHelper`, a command
    Claude Code runs in /bin/sh and sends the output of as `X-Api-Key` and `Authorization: Bearer`:
    `printenv` reads the variable at that moment and fails when it is unset, where writing the key into
    `env` would put it in the file. The opus and sonnet names map to the main model too: `--model opus`,
    `/model sonnet` and the default without ANTHROPIC_MODEL otherwise ask for Anthropic's names of the day
    (Claude Code 2.1.332 asks for claude-opus-5-5), which no catalog holds, and Claude Code answers "There's
    an issue with the selected model". ANTHROPIC_SMALL_FAST_MODEL is the older name of the Haiku-class model
    setting; both are set so older versions use the small model too."""
    return {"apiKeyHelper": f"printenv {KEY_VARIABLE}",
            "env": {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_MODEL": model,
                    "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
                    "ANTHROPIC_DEFAULT_HAIKU_MODEL": small, "ANTHROPIC_SMALL_FAST_MODEL": small}}


def claude_mcp(url: str) -> dict:
    """What Claude Code's `~/.claude.json` (where it keeps MCP servers) gets for the gateway's MCP server.
    Claude Code expands `${VAR}` in a server's headers when it connects, so the file names the variable,
    not the key."""
    return {"mcpServers": {MCP_SERVER: {"type": "http", "url": url + MCP_PATH,
                                        "headers": {"Authorization": f"Bearer ${{{KEY_VARIABLE}}}"}}}}


def continue_block(url: str, model: str) -> str:
    """One model entry for the `models:` list of Continue's `~/.continue/config.yaml`, between the markers,
    unindented (the script indents it like the list's other entries). Continue resolves
    `${{ secrets.NAME }}` from ~/.continue/.env, then the process environment (since 2025, PR #5961)."""
    return (f"{BEGIN}\n"
            f"- name: {quoted('llmgw ' + model)}\n"
            f"  provider: openai\n"
            f"  model: {quoted(model)}\n"
            f"  apiBase: {quoted(url + '/v1')}\n"
            f"  apiKey: {quoted('${{ secrets.' + KEY_VARIABLE + ' }}')}\n"
            f"{END}\n")


def cline(url: str, model: str) -> list[tuple[str, str]]:
    """The fields of Cline's settings panel. Cline keeps them in the editor's own storage (VS Code's state
    database and secret store), which no script can safely write, so they are shown to paste."""
    return [("API Provider", "OpenAI Compatible"), ("Base URL", url + "/v1"),
            ("API Key", f"the value of ${KEY_VARIABLE}"), ("Model ID", model)]
