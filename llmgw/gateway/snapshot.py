"""What the gateway knows about where a model can be served: one versioned value.

A `Snapshot` is the catalog (models, their aliases and limits) and the
replicas ready to serve each model. It is immutable and carries a version; a
worker swaps in a newer one whole, so a request in progress keeps the one it
started with. A worker starts from its configuration (`from_config`); behind a
controller, that first snapshot does not hold the catalog yet, and says so, so
that a name missing from it is waited for rather than refused (a worker that
had not yet heard the controller answered 404 "Models: none yet").
"""

from __future__ import annotations

import dataclasses
import time

from llmgw import rules, settings
from llmgw.settings import Config


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    aliases: tuple[str, ...] = ()
    description: str = ""
    max_context: int | None = None  # None: not known
    max_output: int | None = None
    created: int = 0
    on_demand: bool = False  # runs only while wanted: a request for it waits while it starts
    stopped: bool = False  # scaled to no replica by an operator: never offered, and a request refused at once
    # With no replica ready, the one nearest to serving: (state, bytes fetched, bytes to fetch); None: none.
    loading: tuple[str, int | None, int | None] | None = None
    role: str = ""  # "guard": a judge (llmgw/gateway/guard.py), never listed for clients nor served to them
    guard: tuple[tuple[str, str], ...] = ()  # this model's guardrails over [guard]: (key, value) pairs
    routing_profile: str | None = None  # the [[routing_profiles]] entry its requests go by, where their key's names none


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """One engine able to serve some models. Its id names it in metrics and logs;
    state the gateway learns about it (load, breaker) is kept by id across snapshots."""
    id: str
    url: str
    models: tuple[str, ...]
    weight: float = 1.0
    api_key: str | None = None  # sent to its engine as `Authorization: Bearer`; None: the engine wants none
    max_in_flight: int | None = None  # requests its profile was measured to take at once; None: not measured


@dataclasses.dataclass(frozen=True)
class Snapshot:
    version: int
    models: dict[str, ModelSpec]
    replicas: dict[str, ReplicaSpec]
    demand: str | None = None  # where to say a model is wanted (the controller's demand address), if anywhere
    accountant: str | None = None  # where requests are admitted against limits
    parts: tuple[str, ...] = ()  # the accountant's parts, where it has several (the first is `accountant`)
    epoch: str | None = None  # the controller start that published it (None: the gateway's own configuration)
    awaiting_catalog: bool = False  # True until the controller's first snapshot: a name missing may yet exist
    unhealthy: frozenset[str] = frozenset()  # replicas out of the snapshot because their engine is hung
    # Derived in __post_init__: every name and alias -> its model, and model -> replica ids.
    names: dict[str, str] = dataclasses.field(init=False, compare=False, repr=False)
    serving: dict[str, tuple[str, ...]] = dataclasses.field(init=False, compare=False, repr=False)

    def accountant_of(self, home: str) -> str | None:
        """The address of the accountant part that counts the pools of HOME (`rules.Level.home`)."""
        return self.parts[rules.part_of(home, len(self.parts))] if self.parts else self.accountant

    def __post_init__(self):
        names = {}
        for model in self.models.values():
            names[model.name] = model.name
        for model in self.models.values():
            for alias in model.aliases:
                # A model's own name wins over another model's alias.
                names.setdefault(alias, model.name)
        object.__setattr__(self, "names", names)
        serving: dict[str, list[str]] = {}
        for replica in self.replicas.values():
            for model in replica.models:
                serving.setdefault(model, []).append(replica.id)
        object.__setattr__(self, "serving", {m: tuple(ids) for m, ids in serving.items()})

    def resolve(self, name: str) -> ModelSpec | None:
        model = self.names.get(name)
        return self.models[model] if model is not None else None

    def replicas_for(self, model: str) -> tuple[str, ...]:
        return self.serving.get(model, ())

    def allows(self, allowlist: frozenset[str], served: str) -> bool:
        """Whether ALLOWLIST (a key's or person's model list) lets them use the served model SERVED:
        an alias on the list allows its model, and the model's name allows every alias."""
        return served in allowlist or any((m := self.resolve(name)) is not None and m.name == served
                                          for name in allowlist)

    def offered(self) -> list[ModelSpec]:
        """The models clients may use, by name: every one but the guard judges and the stopped."""
        return sorted((m for m in self.models.values() if m.role != "guard" and not m.stopped), key=lambda m: m.name)

    def listed_ids(self) -> list[tuple[str, ModelSpec]]:
        """Every name a client may ask for, each alias its own entry, as `/v1/models` lists them."""
        out = []
        for model in self.offered():
            out.append((model.name, model))
            out.extend((alias, model) for alias in model.aliases if self.names.get(alias) == model.name)
        return out


def from_config(cfg: Config, accountant: str | None = None, version: int = 1) -> Snapshot:
    """The snapshot of router-only mode: `[[endpoints]]` and `[[models]]` (or `--endpoint`); ACCOUNTANT: the
    address of the one the gateway's master runs, if it does."""
    created = int(time.time())
    models = {}
    for table in cfg.models:
        models[table["name"]] = ModelSpec(
            name=table["name"], aliases=tuple(table.get("aliases", ())), description=table.get("description", ""),
            max_context=table.get("max_context"), max_output=table.get("max_output"), created=created,
            role=table.get("role", ""), guard=settings.guard_pairs(table.get("guard", {})),
            routing_profile=table.get("routing_profile"))
    replicas = {}
    for ep in cfg.endpoints:
        replicas[ep["id"]] = ReplicaSpec(id=ep["id"], url=ep["url"].rstrip("/"), models=tuple(ep["models"]),
                                         weight=float(ep.get("weight", 1.0)))
        for name in ep["models"]:
            models.setdefault(name, ModelSpec(name=name, created=created))
    return Snapshot(version=version, models=models, replicas=replicas,
                    accountant=accountant, awaiting_catalog=bool(cfg["gateway.controller"]))
