"""The `llmgw` command: `ctl`, `keys`, `users`, `org`, `limits`, `mirror`, `usage`, `sim`, `up`, `node add`.

Imported by: the `llmgw` entry point and `python -m llmgw`.
Concurrency: none; one command at a time in one process (`up` starts the
others as child processes).
May import: anything but `gateway` and `web`, whose code runs only inside a
gateway's workers.
"""
