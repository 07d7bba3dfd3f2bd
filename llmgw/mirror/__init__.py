"""The model mirror: its directory of versions, fetching into it, and its two HTTP servers.

Imported by: `mirror.py`.
Concurrency: threads (a threaded werkzeug server; one thread per download).
May import: the top-level modules except `store` (the mirror has no
database). Never another llmgw package.
"""
