"""The house in figures: for each package of llmgw, its modules, lines, and the packages it imports.

    python bench/house.py [--markdown]

Read from the source with `ast` (nothing is imported), so it runs anywhere.
`docs/architecture.md` shows its output; tests/test_house.py holds the import
rules the packages' docstrings state.
"""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("gateway", "web", "control", "node", "people", "mirror", "cli", "wire", "engines")


def package_of(module: str) -> str:
    """'llmgw.gateway.proxy' -> 'gateway'; a top-level module ('llmgw.store') -> 'top'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else "top"


def modules() -> dict[str, str]:
    """Dotted module name -> path, for every module of llmgw."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "llmgw")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports(path: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in PATH, including those inside functions;
    `from llmgw import store` names the module llmgw.store."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in ("llmgw",) or node.module.endswith(tuple(f".{p}" for p in PACKAGES)) and \
                    node.module.startswith("llmgw"):
                found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append((node.module, node.lineno))
    return found


def measure() -> dict[str, dict]:
    house: dict[str, dict] = defaultdict(lambda: {"modules": 0, "lines": 0, "imports": set()})
    for dotted, path in modules().items():
        package = package_of(dotted)
        room = house[package]
        room["modules"] += 1
        with open(path) as f:
            room["lines"] += sum(1 for _ in f)
        for target, _ in imports(path):
            if target.startswith("llmgw."):
                other = package_of(target)
                if other != package:
                    room["imports"].add(other)
    return dict(house)


def main(argv: list[str]) -> None:
    house = measure()
    order = [p for p in (*PACKAGES, "top") if p in house]
    rows = [(p, house[p]["modules"], house[p]["lines"], ", ".join(sorted(house[p]["imports"])) or "-") for p in order]
    if "--markdown" in argv:
        print("| package | modules | lines | imports |\n| --- | ---: | ---: | --- |")
        for name, count, lines, deps in rows:
            print(f"| `{name}` | {count} | {lines} | {deps} |")
    else:
        for name, count, lines, deps in rows:
            print(f"{name:9} {count:3} modules {lines:6} lines  imports: {deps}")
    total = sum(house[p]["lines"] for p in order)
    print(f"\n{sum(house[p]['modules'] for p in order)} modules, {total} lines, "
          f"{sum(len(house[p]['imports']) for p in order)} arrows between packages")


if __name__ == "__main__":
    main(sys.argv[1:])
