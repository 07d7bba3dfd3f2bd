"""People in the store: accounts, keys, the organisation tree, memberships, limits, usage reports and roll-ups.

Imported by: the CLI, the pages (gateway workers) and the controller.
Concurrency: none of its own; plain functions over a SQLAlchemy engine, safe
from threads and (with psycopg2 made green) from greenlets.
May import: the top-level modules. Never any other llmgw package: people are
data, and whoever acts on them imports this package, not the reverse.
"""
