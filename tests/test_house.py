"""The house rules: which llmgw package may import which, as each package's docstring states.

A failure names the module, the line and the import that broke a rule. The
rules are read from the source (bench/house.py), so nothing is imported here.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.house import PACKAGES, imports, modules, package_of  # noqa: E402

EVERY = set(PACKAGES) | {"top"}
# package -> the llmgw packages it may import ("top" is the top-level modules).
MAY_IMPORT = {
    "wire": {"wire", "rules", "modelnames"},
    "engines": {"engines", "top"},
    "node": {"node", "top", "wire", "engines"},
    "mirror": {"mirror", "top"},
    "people": {"people", "top"},
    "control": {"control", "top", "wire", "people"},
    "gateway": {"gateway", "top", "wire", "engines"},
    "web": {"web", "top", "gateway", "people"},
    "cli": EVERY - {"gateway", "web"},
    "top": {"top"},
}
# Third-party packages a package must never import, whatever imports it.
MUST_NOT = {
    "node": {"sqlalchemy", "gevent", "flask"},
    "mirror": {"sqlalchemy", "gevent"},
    "control": {"gevent"},
    "people": {"gevent", "zmq", "flask"},
    "wire": {"sqlalchemy", "gevent", "flask"},
}
# Top-level modules that a package may not import although they are top-level.
NOT_THE_STORE = {"node", "mirror", "engines", "wire"}
# Role file -> the llmgw packages it may import: the code of its own process, wired together.
ROLE_MAY_IMPORT = {
    # The gateway's master hosts the stand-in accountant (control.standin) when no controller is followed,
    # and reads keys from the store (people): both handed to the server from here.
    "gateway.py": {"top", "gateway", "web", "people", "control", "wire"},
    "controller.py": {"top", "control", "people", "wire"},
    "agent.py": {"top", "node", "engines", "wire"},
    "doctor.py": {"top", "node", "engines", "wire"},
    "mirror.py": {"top", "mirror"},
}
# Role file -> what its process must never load, followed through every import it makes (a node has no
# database; the controller runs threads, never gevent).
ROLE_MUST_NOT_LOAD = {
    "agent.py": {"sqlalchemy", "gevent", "flask", "llmgw.store"},
    "doctor.py": {"sqlalchemy", "gevent", "flask", "llmgw.store"},
    "mirror.py": {"sqlalchemy", "gevent", "llmgw.store"},
    "controller.py": {"gevent"},
}
# Crossings allowed although they cross a rule, each with its reason.
KNOWN = {
    ("llmgw.top.__main__", "llmgw.cli.main"),  # `python -m llmgw` is the command line
}


def _module_of(target: str, known: dict[str, str]) -> str:
    """TARGET as a module name: `llmgw.people.keys.KeyTable` -> `llmgw.people.keys`."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target


def broken_rules() -> list[str]:
    found = modules()
    problems = []
    for dotted, path in sorted(found.items()):
        package = package_of(dotted)
        allowed = MAY_IMPORT[package]
        where = os.path.relpath(path, ROOT)
        for target, line in imports(path):
            top = target.split(".")[0]
            if top in MUST_NOT.get(package, ()):
                problems.append(f"{where}:{line} imports {target}: {package}/ must not use {top}")
            if top != "llmgw":
                continue
            module = _module_of(target, found)
            if not module or module == "llmgw":
                continue
            other = package_of(module)
            exempt = (dotted.replace("llmgw.", "llmgw.top.") if package == "top" else dotted, module) in KNOWN
            if other not in allowed and module.rpartition(".")[2] not in allowed and not exempt:
                problems.append(f"{where}:{line} imports {module}: {package}/ may import only "
                                f"{', '.join(sorted(allowed))}")
            if package in NOT_THE_STORE and module == "llmgw.store":
                problems.append(f"{where}:{line} imports llmgw.store: {package}/ runs where there is no database")
    return problems


def test_every_package_keeps_to_its_imports():
    assert broken_rules() == []


def loaded_by(path: str, found: dict[str, str]) -> dict[str, str]:
    """Everything PATH's process loads by following its imports (those inside functions too): llmgw modules
    and third-party packages, each with the module that first brought it in."""
    loaded: dict[str, str] = {}
    todo = [("(the role file)", path)]
    while todo:
        importer, current = todo.pop()
        for target, _ in imports(current):
            if target.split(".")[0] != "llmgw":
                loaded.setdefault(target.split(".")[0], importer)
                continue
            module = _module_of(target, found)
            if module and module != "llmgw" and module not in loaded:
                loaded[module] = importer
                todo.append((module, found[module]))
    return loaded


def test_every_role_file_imports_only_its_own_process_code_and_loads_nothing_it_must_not():
    found = modules()
    problems = []
    for role, allowed in ROLE_MAY_IMPORT.items():
        path = os.path.join(ROOT, role)
        for target, line in imports(path):
            module = _module_of(target, found) if target.startswith("llmgw.") else None
            if module and package_of(module) not in allowed:
                problems.append(f"{role}:{line} imports {module}: {role} may import only {', '.join(sorted(allowed))}")
        loaded = loaded_by(path, found)
        for name in sorted(ROLE_MUST_NOT_LOAD.get(role, ())):
            if name in loaded:
                problems.append(f"{role} loads {name} (imported by {loaded[name]}), which its process must not")
    assert problems == []


def test_the_rules_catch_a_forbidden_import(tmp_path, monkeypatch):
    # A node module that reaches for the store must be named, with its line.
    import bench.house as house

    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom llmgw import store\n")
    real = house.modules()
    monkeypatch.setattr(sys.modules[__name__], "modules", lambda: {**real, "llmgw.node.bad": str(bad)})
    problems = broken_rules()
    assert any("bad.py:2 imports llmgw.store" in p for p in problems), problems


def test_every_package_says_where_it_runs_and_what_it_may_import():
    for package in PACKAGES:
        with open(os.path.join(ROOT, "llmgw", package, "__init__.py")) as f:
            doc = f.read()
        assert "Imported by:" in doc and "Concurrency:" in doc and "May import:" in doc, package
