"""Serving a Prometheus registry on its own address, for every role: only `/metrics` answers there.

Imported by: each role's start-up (`gateway.py` through llmgw/gateway/metrics.py, `controller.py`,
`mirror.py`).
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from llmgw import addresses


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # a scrape every 15 s is not news
        pass


def serve_registry(listen: str, registry: CollectorRegistry) -> None:
    """Serve REGISTRY on LISTEN in a thread.

    Only `/metrics` answers there; any other path is 404, so nothing else is
    ever exposed on the address opened for Prometheus.
    """
    host, port = addresses.bind(listen, "the metrics address")
    exposition = make_wsgi_app(registry)

    def only_metrics(environ, start_response):
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"metrics are at /metrics\n"]
        return exposition(environ, start_response)

    server = make_server(host, port, only_metrics, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
