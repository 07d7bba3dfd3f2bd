"""The pages: sign-in, account, chat, and the administration pages, as Flask blueprints.

Imported by: `gateway.py`, which hands `web.app` to the gateway's server; in its gevent workers.
Concurrency: gevent (a page's work is short; nothing here spawns greenlets).
May import: the top-level modules, `gateway` (what a worker holds: its
runtime, the accountant's client, its HTTP client) and `people` (the pages
manage people, keys and limits in the store). Never `control`, `node` or `mirror`: the
controller's and the mirror's state is read through their HTTP APIs
(`llmgw.apiclient`).
"""
