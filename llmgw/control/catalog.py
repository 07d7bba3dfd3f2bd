"""The catalog: which models the cluster should serve, from where, on what, and how many.

A model comes from the configuration file (`[[models]]`, declarative: present
on every start, changed only by editing the file) or is added while running
(`llmgw ctl model add -f model.toml`, kept in the store). Each has a source
(a path used in place, or a URL the node fetches), limits, scaling
`{min, max, idle_timeout}`, and profiles: ways to run it (an engine, a GPU
class and count, memory, a node selector, extra arguments), tried by
priority. A profile's fingerprint changes when anything that would change the
running engine changes; replicas started under another fingerprint are shown
as running a stale profile rather than being restarted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
import tomllib
import urllib.parse
import urllib.request

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from llmgw import gguf, modelnames, settings, store
from llmgw.control import capacity
from llmgw.egress import Egress, Refused

ENGINES = ("llamacpp", "vllm", "sglang", "sim")
log = logging.getLogger(__name__)


class CatalogError(Exception):
    """A model definition that cannot be used; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    engine: str
    gpu_class: str | None = None  # None: any, including no GPU
    gpus: int = 0  # on each node
    nodes: int = 1  # more than one: one engine a node, over nodes sharing a fabric (llmgw/control/multinode.py)
    min_memory_gb: float = 0.0
    node_selector: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    priority: int = 100
    weight: float = 1.0
    start_limit: float | None = None  # seconds its engine may take to answer /health; None: the agent's default
    # The weights in the form this engine loads, where it is not the model's source: vLLM a Hugging Face folder
    # (a mirror version's directory), llama.cpp a GGUF; None: the model's source.
    source: str | None = None


# How a profile is supervised, not how its engine runs: left out of the fingerprint, so changing it marks no
# running replica stale.
_SUPERVISION = ("start_limit",)
MOST_START_LIMIT = 24 * 3600.0


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    source: str
    profiles: tuple[Profile, ...]
    aliases: tuple[str, ...] = ()
    description: str = ""
    max_context: int | None = None
    max_output: int | None = None
    min_replicas: int = 1
    max_replicas: int = 1
    idle_timeout: float | None = None  # seconds; None: never stopped for being idle
    origin: str = "config"  # or "runtime"
    size_bytes: int | None = None  # the download's size, where known: nodes without the disk are skipped
    role: str = ""  # "guard": a judge of other models' traffic, never offered to clients
    guard: tuple[tuple[str, str], ...] = ()  # this model's guardrails over [guard]: (key, value) of model, check, fail
    routing_profile: str | None = None  # the [[routing_profiles]] entry its requests go by, where their key's names none

    def source_of(self, profile: Profile) -> str:
        """What PROFILE's engine is started from."""
        return profile.source or self.source

    def sources(self) -> list[str]:
        """Every source the model's replicas may be started from: its own, then its profiles' own."""
        return list(dict.fromkeys([self.source, *(p.source for p in self.profiles if p.source)]))

    def fingerprint(self, profile: Profile) -> str:
        """What a running engine was started from; a change means its replicas run a stale profile."""
        fields = {k: v for k, v in dataclasses.asdict(profile).items() if k not in _SUPERVISION}
        if fields["nodes"] == 1:
            del fields["nodes"]  # as before `nodes` existed: an upgrade marks no running replica stale
        data = json.dumps([self.source, self.max_context, fields], sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:12]


MOST_NODES = 64
_PROFILE_KEYS = {"name": str, "engine": str, "gpu_class": str, "gpus": int, "nodes": int, "min_memory_gb": (int, float),
                 "node_selector": dict, "args": list, "env": dict, "priority": int, "weight": (int, float),
                 "start_limit": (int, float), "source": str}


def _duration(value, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        from llmgw.people.keys import parse_duration

        try:
            return parse_duration(value)
        except ValueError as e:
            raise CatalogError(f"{where}: {e}") from None
    raise CatalogError(f"{where}: write a duration such as \"30m\" or a number of seconds")


def _parse_profile(raw, i: int, where: str) -> Profile:
    """Profile I (from 0) of the model WHERE names; raises CatalogError naming the field."""
    label = f"{where}, profile {i + 1}"
    if not isinstance(raw, dict):
        raise CatalogError(f"{label}: expected a table")
    for key, value in raw.items():
        if key not in _PROFILE_KEYS:
            raise CatalogError(f"{label}: unknown key {key!r}; allowed: {', '.join(_PROFILE_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, _PROFILE_KEYS[key]):
            raise CatalogError(f"{label}: {key} has the wrong type ({type(value).__name__})")
    engine = raw.get("engine")
    if engine not in ENGINES:
        raise CatalogError(f"{label}: engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if raw.get("gpus", 0) < 0:
        raise CatalogError(f"{label}: gpus cannot be negative")
    if not 1 <= raw.get("nodes", 1) <= MOST_NODES:
        raise CatalogError(f"{label}: nodes is how many nodes one replica spans, 1 to {MOST_NODES}, not {raw['nodes']}")
    if raw.get("nodes", 1) > 1 and engine not in ("vllm", "sim"):
        raise CatalogError(f"{label}: a replica over several nodes runs on vLLM (engine = \"vllm\"; the sim engine "
                           f"too, for tests); {engine} serves from one node")
    # NaN or Infinity (the serve form's memory field takes any float) once reached the placer, whose
    # int() of it raised there.
    for key in ("min_memory_gb", "weight"):
        if key in raw and not (math.isfinite(raw[key]) and raw[key] >= 0):
            raise CatalogError(f"{label}: {key} is a number, 0 or more, not {raw[key]!r}")
    if "start_limit" in raw and not (math.isfinite(raw["start_limit"]) and 0 < raw["start_limit"] <= MOST_START_LIMIT):
        raise CatalogError(f"{label}: start_limit is the seconds its engine may take to answer its health check, "
                           f"more than 0 and at most {MOST_START_LIMIT:.0f}, not {raw['start_limit']!r}")
    if "source" in raw and not raw["source"]:
        raise CatalogError(f"{label}: source, where given, is the weights this engine loads (a mirror version's "
                           "URL for a Hugging Face folder); leave it out to use the model's")
    return Profile(
        name=raw.get("name", f"{engine}-{i + 1}"), engine=engine, gpu_class=raw.get("gpu_class"),
        gpus=raw.get("gpus", 1 if raw.get("gpu_class") else 0), nodes=raw.get("nodes", 1), min_memory_gb=float(raw.get("min_memory_gb", 0)),
        node_selector=tuple(sorted((str(k), str(v)) for k, v in raw.get("node_selector", {}).items())),
        args=tuple(str(a) for a in raw.get("args", [])),
        env=tuple(sorted((str(k), str(v)) for k, v in raw.get("env", {}).items())),
        priority=raw.get("priority", 100), weight=float(raw.get("weight", 1.0)),
        start_limit=float(raw["start_limit"]) if "start_limit" in raw else None, source=raw.get("source"))


def parse_model(table: dict, origin: str = "config") -> Model:
    """A Model from a `[[models]]` table (or a model file); raises CatalogError naming the field."""
    name = table.get("name")
    if name is None or name == "":
        raise CatalogError("a model needs a name")
    # Checked here, where every way in passes (the admin API, the serve form, model files, the configuration).
    if why := modelnames.refusal(name):
        raise CatalogError(f"the model's name {why}")
    where = f"model {name}"
    source = table.get("source")
    if not isinstance(source, str) or not source:
        raise CatalogError(f"{where}: source is required: a path on the nodes, or an http(s) URL to fetch")
    scaling = table.get("scaling", {})
    if not isinstance(scaling, dict):
        raise CatalogError(f"{where}: scaling must be a table such as {{min = 1, max = 2}}")
    low, high = scaling.get("min", 1), scaling.get("max", max(1, scaling.get("min", 1)))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (low, high)) or high < low:
        raise CatalogError(f"{where}: scaling needs whole numbers with 0 <= min <= max, got min={low}, max={high}")
    raw_profiles = table.get("profiles") or []
    if not raw_profiles:
        raise CatalogError(f"{where}: at least one profile is needed, such as [[models.profiles]] engine = \"llamacpp\"")
    profiles = [_parse_profile(raw, i, where) for i, raw in enumerate(raw_profiles)]
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or len(aliases) > modelnames.MOST_ALIASES:
        raise CatalogError(f"{where}: aliases must be a list of at most {modelnames.MOST_ALIASES} names")
    for alias in aliases:
        if why := modelnames.refusal(alias):
            raise CatalogError(f"{where}: the alias {why}")
    # Checked here because they travel in every snapshot: one model's max_output of "abc" made every
    # gateway refuse every snapshot that followed.
    for key in ("max_context", "max_output"):
        value = table.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31):
            raise CatalogError(f"{where}: {key} is a number of tokens, a whole number from 1 to {2**31 - 1}, "
                               f"not {str(value)[:40]!r}")
    role = table.get("role", "")
    if role not in ("", *settings.ROLES):
        raise CatalogError(f"{where}: role is {str(role)[:40]!r}; the only role is \"guard\" (a judge of other models)")
    guard = table.get("guard", {})
    try:
        settings.check_guard_override(guard, where, judge=role == "guard")
        settings.check_profile_name(table.get("routing_profile"), f"{where}: routing_profile")
    except ValueError as e:
        raise CatalogError(str(e)) from None
    return Model(name=name, source=source, profiles=tuple(sorted(profiles, key=lambda p: -p.priority)),
                 aliases=tuple(aliases), description=str(table.get("description", "")),
                 max_context=table.get("max_context"), max_output=table.get("max_output"),
                 min_replicas=low, max_replicas=high,
                 idle_timeout=_duration(scaling.get("idle_timeout"), f"{where}: scaling.idle_timeout"), origin=origin,
                 size_bytes=table.get("size_bytes") if isinstance(table.get("size_bytes"), int) else None,
                 role=role, guard=settings.guard_pairs(guard), routing_profile=table.get("routing_profile"))


def read_model_file(path: str) -> dict:
    """The table of a model file for `llmgw ctl model add -f`: the keys of one [[models]] entry at top level."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise CatalogError(f"cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise CatalogError(f"{path} is not valid TOML: {e}") from None


def source_checks(allow: list[str], mirror_base_url: str) -> Egress:
    """Where the controller may check a model's source: public addresses, ALLOW (`controller.source_allow`),
    and its own mirror's files at MIRROR_BASE_URL, the usual home of sources, wherever that listens."""
    try:
        mirror = urllib.parse.urlsplit(mirror_base_url)
        trusted = ((mirror.hostname, mirror.port or (443 if mirror.scheme == "https" else 80)),) \
            if mirror.scheme in ("http", "https") and mirror.hostname else ()
    except ValueError:
        raise CatalogError(f"mirror.base_url is {mirror_base_url[:200]!r}, which is not an http(s) URL; give the "
                           "address nodes fetch files at, such as http://models.internal:8081") from None
    return Egress(allow, "controller.source_allow", "the controller", trusted)


def check_source(source: str, egress: Egress, timeout: float = 10.0) -> int | None:
    """Refuse early a source that is not there, rather than failing later on every node.

    A URL must answer a HEAD request; a path must be absolute and exist here
    (a path only the nodes see cannot be checked, and `--no-source-check`
    skips the check). Returns the download's size when the server says it.
    Both the HEAD and the GGUF header's read go through EGRESS
    (`controller.source_allow`, llmgw/egress.py): whether a URL answered is
    itself an answer, and an address inside the network is not the admin
    API's caller's to probe.

    Which paths a node may read is the node's to say (`agent.local_sources`),
    so a path accepted here can still be refused there: the replica fails with
    the reason, and no engine ever opens the file.
    """
    is_url = source.startswith(("http://", "https://"))
    if not is_url and not os.path.isabs(source):
        raise CatalogError(f"the source {source} is neither an http(s) URL nor an absolute path; give the mirror's "
                           "URL for it, or a path inside a directory the nodes list in agent.local_sources")
    if is_url:
        try:
            egress.check(source)
        except Refused as e:
            raise CatalogError(f"the controller does not check the source {source}: {e}; or add the model with "
                               "--no-source-check if only the nodes can reach it") from None
    if source.split("?", 1)[0].endswith(".gguf"):
        why = gguf.refusal(source, urlopen=egress.open)
        if why:
            raise CatalogError(f"the source {source} cannot be served: {why}")
    if is_url:
        req = urllib.request.Request(source, method="HEAD")
        try:
            with egress.open(req, timeout=timeout) as resp:
                length = resp.headers.get("Content-Length")
                return int(length) if length and length.isdigit() else None
        except Exception as e:
            raise CatalogError(f"the source {source} does not answer ({e}); check the URL, or add the model with "
                               "--no-source-check if only the nodes can reach it") from None
    if not os.path.exists(source):
        raise CatalogError(f"the source {source} does not exist on the controller's machine; if it exists only on "
                           "the nodes, add the model with --no-source-check")
    return None


def _stored_model(row) -> Model | None:
    """The runtime model a store row holds; None, logged, for one the rules of today refuse (a name from before
    names had a rule, say): one bad row must not keep the controller from starting or reloading."""
    name, spec = row
    try:
        return parse_model(json.loads(spec), origin="runtime")
    except (CatalogError, ValueError, TypeError, AttributeError) as e:
        log.error("catalog: skipped the stored model %r, which cannot be used: %s. Remove it with `llmgw ctl model "
                  "remove NAME` (or delete its row in catalog_models) and add it again under a name that fits",
                  name[:100], e)
        return None


def _check_clash(model: Model, models: dict[str, Model]) -> None:
    """Refuse MODEL when one of its aliases is another model's name, or its name another model's alias: the
    gateway would route that name to one of them silently."""
    for other in models.values():
        if other.name == model.name:
            continue
        if other.name in model.aliases:
            raise CatalogError(f"model {model.name}: the alias {other.name} is the name of another model; "
                               "choose another alias")
        if model.name in other.aliases:
            raise CatalogError(f"model {model.name}: {other.name} has it as an alias; choose another name or "
                               f"remove the alias from {other.name}")


class Catalog:
    """Configuration models plus runtime ones from the store; runtime changes are written through. Beside
    them, what each profile was measured to take (llmgw/control/capacity.py)."""

    def __init__(self, engine: Engine, config_models: list[dict]):
        self.engine = engine
        self.config = {m.name: m for m in (parse_model(t) for t in config_models if t.get("profiles"))}
        self.runtime: dict[str, Model] = {}
        # Replaced whole, never changed in place: the loop's thread reads it while the admin API's writes.
        self.capacities: dict[tuple[str, str], capacity.Capacity] = {}
        self.revision = 0  # counted up at every change: the loop makes the gateways' snapshot again when it moves
        self.reload()

    def reload(self) -> None:
        """Read the runtime models and the measured capacities from the store again (another controller may
        have changed them while this one stood by)."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(store.catalog_models.c.name, store.catalog_models.c.spec)).all()
        self.runtime = {m.name: m for m in map(_stored_model, rows) if m is not None}
        self.capacities = capacity.read_all(self.engine)
        self.revision += 1

    def profile_of(self, model: str, fingerprint: str | None) -> Profile | None:
        """MODEL's profile whose fingerprint is FINGERPRINT as it is defined now; None: none is (edited since)."""
        found = self.models().get(model)
        return next((p for p in found.profiles if found.fingerprint(p) == fingerprint), None) if found else None

    def save_capacity(self, model: str, fingerprint: str | None, max_in_flight, figures: dict) -> capacity.Capacity:
        """File a measurement of a replica of MODEL started from FINGERPRINT under that profile, replacing the
        last one; raises capacity.CapacityError."""
        profile = self.profile_of(model, fingerprint)
        if profile is None:
            raise capacity.CapacityError(f"the replica measured runs a profile of {model} that has been edited or "
                                         "removed since it started, so the figure would be filed under the wrong "
                                         "profile. Measure a replica shown without `(stale profile)` in `llmgw "
                                         f"ctl replicas --model {model}`")
        measured = capacity.measured_now(model, profile.name, fingerprint, max_in_flight, figures)
        capacity.save(self.engine, measured)
        self.capacities = {**self.capacities, (model, profile.name): measured}
        self.revision += 1
        return measured

    def forget_capacity(self, model: str, profile: str | None = None) -> int:
        """Drop what was measured of MODEL's PROFILE (None: of all its profiles); how many were dropped."""
        dropped = capacity.forget(self.engine, model, profile)
        self.capacities = {k: v for k, v in self.capacities.items()
                           if not (k[0] == model and profile in (None, k[1]))}
        self.revision += 1
        return dropped

    def current_fingerprint(self, model: str, profile: str) -> str | None:
        """The fingerprint MODEL's profile named PROFILE has now; None when there is no such profile."""
        found = self.models().get(model)
        return next((found.fingerprint(p) for p in found.profiles if p.name == profile), None) if found else None

    def limits(self) -> dict[tuple[str, str], int]:
        """(model, profile fingerprint) -> requests in flight, for each profile measured as it is now."""
        return {(model, cap.fingerprint): cap.max_in_flight for (model, name), cap in self.capacities.items()
                if self.current_fingerprint(model, name) == cap.fingerprint}

    def models(self) -> dict[str, Model]:
        return {**self.runtime, **self.config}

    def add(self, table: dict) -> Model:
        model = parse_model(table, origin="runtime")
        if model.name in self.config:
            raise CatalogError(f"{model.name} is defined in the configuration file; edit it there")
        _check_clash(model, self.models())
        with store.writing(self.engine) as conn:
            conn.execute(store.catalog_models.delete().where(store.catalog_models.c.name == model.name))
            conn.execute(store.catalog_models.insert().values(name=model.name, spec=json.dumps(table),
                                                              updated_at=time.time()))
        self.runtime[model.name] = model
        self.revision += 1
        return model

    def remove(self, name: str) -> None:
        if name in self.config:
            raise CatalogError(f"{name} is defined in the configuration file; remove it there and restart")
        # By its row, not by self.runtime: a stored model skipped on load (a name the rules now refuse) is
        # removed this way too, as the log line says.
        with store.writing(self.engine) as conn:
            removed = conn.execute(store.catalog_models.delete().where(store.catalog_models.c.name == name)).rowcount
        if not removed and name not in self.runtime:
            raise CatalogError(f"no model {name!r}; `llmgw ctl models` lists them")
        self.runtime.pop(name, None)
        self.revision += 1
        self.forget_capacity(name)  # a model added again later is measured again

    def scale(self, name: str, low: int | None, high: int | None) -> Model:
        if name in self.config:
            raise CatalogError(f"{name} is defined in the configuration file; change its scaling there")
        if name not in self.runtime:
            raise CatalogError(f"no model {name!r}; `llmgw ctl models` lists them")
        with self.engine.connect() as conn:
            table = json.loads(conn.execute(sa.select(store.catalog_models.c.spec).where(
                store.catalog_models.c.name == name)).scalar_one())
        scaling = dict(table.get("scaling", {}))
        if low is not None:
            scaling["min"] = low
        if high is not None:
            scaling["max"] = high
        if high is None and scaling.get("max", 1) < scaling.get("min", 1):
            scaling["max"] = scaling["min"]  # raising min alone raises max with it
        return self.add({**table, "scaling": scaling})
