"""The gateway: the `/v1` pipeline and everything a gateway process holds.

Imported by: `gateway.py`, whose gunicorn master and gevent workers run it.
Concurrency: gevent. Each worker is patched by gunicorn before the app is
built, so sockets are green; ZeroMQ is used through `zmq.green`. Nothing on
the request path queries the database or blocks a worker; background SQLite
work runs in one native thread (`offloop`).
May import: the top-level modules, `wire` and `engines` (reading an engine's
load). Never `web` (the app that mounts the pages is `web.app`, handed to the
server by `gateway.py`), `control`, `people`, `node`, `mirror` or `cli`: what
a gateway knows of keys, limits and replicas arrives over the wire or is
handed to it by `gateway.py`.
"""
