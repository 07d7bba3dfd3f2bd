"""A node: discovery, the doctor, the engines' supervisor and the link to the controller.

Imported by: `agent.py` and `doctor.py`, on every node.
Concurrency: threads (the link's loop, the engine watcher); no gevent.
May import: the top-level modules except `store`, `wire` and `engines`. Never
SQLAlchemy or the store (a node has no database), nor `control`, `gateway`,
`web`, `people`, `mirror` or `cli`.
"""
