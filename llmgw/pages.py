"""The web pages, as a Flask app: for now the landing page a person with no key sees.

Pages are not on the `/v1` path, so they can afford Flask and Jinja2. They
read only what the worker already holds in memory.
"""

from __future__ import annotations

import os

from flask import Flask, render_template, request

from llmgw.worker import Runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def create_app(runtime: Runtime) -> Flask:
    app = Flask("llmgw", template_folder=os.path.join(ROOT, "templates"),
                static_folder=os.path.join(ROOT, "static"))

    @app.get("/")
    def landing():
        snapshot = runtime.router.snapshot
        models = [(spec, bool(runtime.router.available(spec.name)))
                  for spec in sorted(snapshot.models.values(), key=lambda m: m.name)]
        base_url = request.host_url.rstrip("/") + "/v1"
        return render_template("landing.html", models=models, base_url=base_url,
                               contact=runtime.cfg["gateway.contact"])

    return app
