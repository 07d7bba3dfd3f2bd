{% include "setup/_common.sh" %}
# Codex reads providers only from $CODEX_HOME/config.toml, and a profile from $CODEX_HOME/NAME.config.toml.
codex_home=${CODEX_HOME:-$HOME/.codex}
LLMGW_PROVIDER={{ codex.provider | sh }}
LLMGW_PROFILE={{ codex.profile | sh }}
export LLMGW_PROVIDER

# config.toml: only the [model_providers.{{ provider }}] table (and with notes [mcp_servers.{{ mcp_server }}]), and
# tables under them, are replaced, where the first stands; every other line stays as it is. Without one, they go
# at the end.
config="$codex_home/config.toml"
scratch "$codex_home"
from=/dev/null
[ -f "$config" ] && from=$config
awk '
  function header(line) { return line ~ /^[ \t]*\[/ }
  function ours(line) {
    return line ~ /^[ \t]*\[[ \t]*model_providers[ \t]*\.[ \t]*{{ provider }}[ \t]*[].]/ \
      {% if mcp_patch %}|| line ~ /^[ \t]*\[[ \t]*mcp_servers[ \t]*\.[ \t]*{{ mcp_server }}[ \t]*[].]/{% endif %}
  }
  {
    if (header($0)) {
      if (ours($0)) {
        if (!done) { printf "%s", ENVIRON["LLMGW_PROVIDER"]; done = 1 }
        skipping = 1
        next
      }
      if (skipping) { print ""; skipping = 0 }
    }
    if (!skipping) print
  }
  END {
    if (!done) {
      if (NR > 0) print ""
      printf "%s", ENVIRON["LLMGW_PROVIDER"]
    }
  }' "$from" > "$new"
install_file "$config"

# The profile is a file of its own, all of it written here.
scratch "$codex_home"
printf '%s' "$LLMGW_PROFILE" > "$new"
install_file "$codex_home/{{ provider }}.config.toml"

echo "Done. Start Codex with:  codex --profile {{ provider }}"
echo "(\${{ variable }} must be set in the shell you start it from.)"
