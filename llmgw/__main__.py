"""`python -m llmgw` is the `llmgw` command."""

from llmgw.cli import main

main()
