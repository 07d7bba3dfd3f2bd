#!/bin/sh
# Sets up {{ tool_name }} to use the llmgw gateway at {{ url }} (made by {{ url }}/setup/{{ tool }}).
# It holds no key: the tool reads yours from ${{ variable }} each time it runs. Files it changes are
# backed up first as FILE.bak-<time>; running it again changes nothing more.
set -eu
umask 077
LLMGW_URL={{ url | sh }}
LLMGW_MODEL={{ model | sh }}

if [ -z "${{ '{' }}{{ variable }}:-}" ]; then
  echo "llmgw setup: \${{ variable }} is not set, and {{ tool_name }} will read your key from it." >&2
  echo "Make a key on $LLMGW_URL/account, then put this in your shell's profile (~/.profile, ~/.zshrc):" >&2
  echo "  export {{ variable }}=sk-llmgw-..." >&2
  echo "open a new shell (or run that line), and run this again." >&2
  exit 1
fi

stamp=$(date +%Y%m%d-%H%M%S)
new=
trap 'rm -f "$new"' EXIT

# scratch DIR: a new empty file in DIR (the target's own directory: the same disk, the same permissions).
scratch() {
  mkdir -p "$1"
  new=$(mktemp "$1/.llmgw-setup.XXXXXX")
}

# install_file FILE: FILE gets the content of $new, FILE backed up first; nothing happens when they are equal.
install_file() {
  if [ -f "$1" ] && cmp -s "$1" "$new"; then
    rm -f "$new"
    echo "unchanged: $1"
    return 0
  fi
  if [ -f "$1" ]; then
    backup="$1.bak-$stamp"
    n=0
    while [ -e "$backup" ]; do n=$((n + 1)); backup="$1.bak-$stamp-$n"; done
    cp -p "$1" "$backup"
    echo "backed up: $1 -> $backup"
  fi
  # Through the file itself, not mv: a file that is a symlink (dotfiles kept elsewhere) stays one, and
  # keeps its mode.
  cat "$new" > "$1"
  rm -f "$new"
  echo "written: $1"
}
