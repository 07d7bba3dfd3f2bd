{% include "setup/_common.sh" %}
# Continue's configuration: ~/.continue/config.yaml. Only the block between the lines
# "{{ begin }}" and "{{ end }}" in its models: list is written; every other line stays.
continue_dir=$HOME/.continue
config="$continue_dir/config.yaml"
LLMGW_BLOCK={{ block | sh }}
export LLMGW_BLOCK

if [ ! -f "$config" ] && [ -f "$continue_dir/config.json" ]; then
  echo "llmgw setup: you have $continue_dir/config.json and no config.yaml. Continue reads config.yaml" >&2
  echo "instead once there is one, so writing it would hide your other models. Convert config.json to" >&2
  echo "config.yaml first, then run this again; or add this to config.json's models by hand:" >&2
  echo "  provider openai, model $LLMGW_MODEL, apiBase $LLMGW_URL/v1, apiKey \${{ '{{' }} secrets.{{ variable }} }}" >&2
  exit 1
fi

scratch "$continue_dir"
from=$new.from
if [ -s "$config" ]; then
  cp "$config" "$from"
else
  printf 'name: Local Config\nversion: 1.0.0\nschema: v1\n' > "$from"
fi
trap 'rm -f "$new" "$from"' EXIT
# Read twice: the first pass finds the block (or the models: line, and how its entries are indented), the
# second writes. An entry's indentation must match its neighbours', or the YAML is broken.
status=0
awk '
  function block(indent,   n, i, lines) {
    n = split(ENVIRON["LLMGW_BLOCK"], lines, "\n")
    for (i = 1; i <= n; i++) if (lines[i] != "" || i < n) print indent lines[i]
  }
  NR == FNR {
    if (!begin && $0 ~ /^[ \t]*{{ begin }}/) { begin = FNR; match($0, /^[ \t]*/); begin_indent = substr($0, 1, RLENGTH) }
    else if (begin && !end && $0 ~ /^[ \t]*{{ end }}/) end = FNR
    if (!models && $0 ~ /^models:[ \t]*(#.*)?$/) { models = FNR; next }
    if (!models && $0 ~ /^models:/) flow = 1
    if (models && !entry && $0 !~ /^[ \t]*(#.*)?$/) {
      entry = 1
      if ($0 ~ /^[ \t]*-/) { match($0, /^[ \t]*/); indent = substr($0, 1, RLENGTH); listed = 1 }
    }
    next
  }
  FNR == 1 && !(begin && end) && !models && flow { exit 3 }
  begin && end {
    if (FNR == begin) block(begin_indent)
    if (FNR >= begin && FNR <= end) next
    print
    next
  }
  { print }
  models && FNR == models { block(listed ? indent : "  ") }
  END { if (!(begin && end) && !models && !flow) { print "models:"; block("  ") } }
' "$from" "$from" > "$new" || status=$?
if [ "$status" = 3 ]; then
  echo "llmgw setup: $config writes models: on one line ([...]), which this script does not edit." >&2
  echo "Add this entry to that list by hand:" >&2
  printf '%s' "$LLMGW_BLOCK" >&2
  exit 1
elif [ "$status" != 0 ]; then
  exit "$status"
fi
install_file "$config"

echo "Done. Continue reloads its configuration itself; pick \"llmgw $LLMGW_MODEL\" in its model menu."
echo "(\${{ variable }} must be set where your editor starts, or in $continue_dir/.env.)"
