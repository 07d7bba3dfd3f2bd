"""Every message between llmgw's processes: its schema as data, versioned, with fields only ever added.

Imported by: every process that speaks to another (controller, agents, gateways).
Concurrency: none; encoding and checking are pure functions, and socket setup
takes the caller's own ZeroMQ context (threads or `zmq.green`).
May import: itself, `llmgw.rules` and `llmgw.modelnames` only, so a message's
shape never depends on any one process's code. `docs/protocol.md` documents every message.
"""
