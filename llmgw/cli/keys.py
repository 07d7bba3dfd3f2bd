"""What `llmgw keys create --models` holds a key's allowlist to: names the catalog holds.

A name the catalog does not hold allows nothing: `--models nosuchmodel` (a
typo, a model's name on another cluster) was accepted silently, and the key's
holder met a 403 on every request. A name is refused unless the catalog holds
it as a model or an alias, and the refusal lists what it holds; a model that
will be added later is allowed with `--allow-unknown-models`.

The catalog is read where this command can see it, without a network call
where it can: the configuration's `[[models]]` (and the models of its
`[[endpoints]]`, which a gateway without a controller serves) and the models
added at run time, which the store keeps. Only a name found in neither is
asked of the controller's admin API, when the configuration follows a
controller, since a gateway's configuration does not hold the controller's
`[[models]]`. A controller that does not answer is said so: an unreachable
catalog must not look like one without the model.
"""

from __future__ import annotations

import json

import click
import sqlalchemy as sa

from llmgw import settings, store
from llmgw.apiclient import ApiError, admin_client


def check_models(cfg: settings.Config, engine, names: list[str]) -> None:
    """Refuse (click.ClickException) NAMES, a key's allowlist, where the catalog does not hold one of them."""
    known = _local_names(cfg, engine)
    missing = [n for n in names if n not in known]
    if not missing:
        return
    unreachable = ""
    if cfg["gateway.controller"]:
        try:
            known |= _controller_names(cfg)
        except ApiError as e:
            unreachable = f" The controller's catalog could not be read: {e}"
        missing = [n for n in missing if n not in known]
        if not missing:
            return
    shown = ", ".join(sorted(known)) or "none"
    raise click.ClickException(
        f"the catalog holds no model called {', '.join(map(repr, missing))} (it holds: {shown}).{unreachable} "
        "Check the name (`llmgw ctl models` lists the catalog), or pass --allow-unknown-models for a model "
        "that will be added later.")


def _local_names(cfg: settings.Config, engine) -> set[str]:
    """The models and aliases the configuration and the store hold."""
    names = set()
    for table in cfg.models:
        names.add(table["name"])
        names.update(table.get("aliases", ()))
    for endpoint in cfg.endpoints:
        names.update(endpoint.get("models", ()))
    with engine.connect() as conn:
        rows = conn.execute(sa.select(store.catalog_models.c.name, store.catalog_models.c.spec)).all()
    for row in rows:
        names.add(row.name)
        try:
            aliases = json.loads(row.spec).get("aliases")
        except (ValueError, AttributeError):  # a row the controller itself would skip
            continue
        names.update(a for a in aliases or () if isinstance(a, str))
    return names


def _controller_names(cfg: settings.Config) -> set[str]:
    """The models and aliases of the controller's catalog, from its admin API; raises ApiError."""
    models = admin_client(cfg, cfg["controller.admin_listen"]).call("GET", "/api/v1/models", timeout=10)["models"]
    return {name for m in models for name in (m["name"], *m.get("aliases", ()))}
