{% include "setup/_common.sh" %}
# Claude Code's user settings: $CLAUDE_CONFIG_DIR/settings.json, else ~/.claude/settings.json. Only the keys
# below are set (the `env` entries merged into what is there); every other setting stays.
claude_dir=${CLAUDE_CONFIG_DIR:-$HOME/.claude}
settings="$claude_dir/settings.json"
LLMGW_PATCH={{ patch | sh }}
export LLMGW_PATCH

# merge FILE: $new gets FILE (a JSON object, or nothing) with $LLMGW_PATCH's keys set, objects merged into
# what is there.
merge() {
  if command -v node >/dev/null 2>&1; then
    node -e '
      const fs = require("fs");
      const file = process.argv[1];
      let text = "";
      try { text = fs.readFileSync(file, "utf8"); } catch (e) { if (e.code !== "ENOENT") throw e; }
      let settings = {};
      try { if (text.trim()) settings = JSON.parse(text); } catch (e) { settings = null; }
      if (settings === null || typeof settings !== "object" || Array.isArray(settings)) {
        console.error("llmgw setup: " + file + " is not a JSON object; fix it or move it away, then run this again.");
        process.exit(1);
      }
      const patch = JSON.parse(process.env.LLMGW_PATCH);
      for (const [key, value] of Object.entries(patch)) {
        const held = settings[key];
        settings[key] = typeof value === "object"
          ? Object.assign(held && typeof held === "object" && !Array.isArray(held) ? held : {}, value) : value;
      }
      process.stdout.write(JSON.stringify(settings, null, 2) + "\n");
    ' "$1" > "$new"
  elif command -v python3 >/dev/null 2>&1; then
    python3 -c '
import json, os, sys
file = sys.argv[1]
try:
    with open(file, encoding="utf-8") as f:
        text = f.read()
except FileNotFoundError:
    text = ""
try:
    settings = json.loads(text) if text.strip() else {}
except ValueError:
    settings = None
if not isinstance(settings, dict):
    sys.exit("llmgw setup: " + file + " is not a JSON object; fix it or move it away, then run this again.")
for key, value in json.loads(os.environ["LLMGW_PATCH"]).items():
    held = settings.get(key)
    settings[key] = {**(held if isinstance(held, dict) else {}), **value} if isinstance(value, dict) else value
sys.stdout.write(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
' "$1" > "$new"
  else
    echo "llmgw setup: editing $1 needs node or python3, and neither is here." >&2
    echo "Add these keys to it by hand (objects merged into any you have):" >&2
    printf '%s\n' "$LLMGW_PATCH" >&2
    exit 1
  fi
}

scratch "$claude_dir"
merge "$settings"
install_file "$settings"
{% if mcp_patch %}
# Your project keeps agents' notes: the gateway's MCP server goes where Claude Code keeps MCP servers,
# $CLAUDE_CONFIG_DIR/.claude.json, else ~/.claude.json (only its "{{ mcp_server }}" entry is set).
LLMGW_PATCH={{ mcp_patch | sh }}
claude_json=${CLAUDE_CONFIG_DIR:+$CLAUDE_CONFIG_DIR/.claude.json}
claude_json=${claude_json:-$HOME/.claude.json}
scratch "$(dirname "$claude_json")"
merge "$claude_json"
install_file "$claude_json"
{% endif %}
echo "Done. Start Claude Code with:  claude"
echo "(\${{ variable }} must be set in the shell you start it from; /status shows the gateway's URL.)"
