{% include "setup/_common.sh" %}
# Cline keeps its provider settings in the editor's own storage (VS Code's state database and secret
# store), which a script cannot safely write. So this writes nothing, and says what to enter.
echo "Cline keeps its settings inside your editor, where this script cannot write them safely."
echo "Open Cline, click the gear (Settings), and enter:"
{% for name, value in fields %}printf '  %s: %s\n' {{ name | sh }} {{ value | sh }}
{% endfor %}echo
echo "To copy the key without showing it:  printenv {{ variable }} | pbcopy   (macOS)"
echo "                                     printenv {{ variable }} | xclip -selection clipboard   (Linux)"
