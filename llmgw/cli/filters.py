"""`llmgw ctl nodes` and `llmgw ctl replicas` filters: one predicate for the table and for `--json`.

The filters run here, on the whole list the controller gives, so that the table
and `--json` cannot disagree; a filter of the controller's own would be a
second implementation to drift. A filter that matches nothing says so beside
how many there are in all: a mistyped fabric must not read as an empty fleet.
"""

from __future__ import annotations

import dataclasses

import click


def labels_wanted(given: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """`--label k=v` and `--label k` (present, any value) as (key, value or None); raises click.BadParameter."""
    wanted = []
    for text in given:
        key, sep, value = text.partition("=")
        if not key.strip():
            raise click.BadParameter(f"{text!r} names no label: write KEY or KEY=VALUE", param_hint="--label")
        wanted.append((key.strip(), value if sep else None))
    return wanted


def node_fabrics(node: dict) -> list[str]:
    status, facts = node.get("status") or {}, node.get("facts") or {}
    return [f.get("name", "") for f in status.get("fabrics", facts.get("fabrics")) or [] if isinstance(f, dict)]


def node_classes(node: dict) -> list[str]:
    return [g.get("class") or g.get("name") or "" for g in (node.get("facts") or {}).get("gpus") or []
            if isinstance(g, dict)]


def pool_of(replica: dict, nodes: dict[str, dict]) -> str:
    """A replica's pool, FABRIC/CLASS of its node: `ib-a/h100-80g`, `none/cpu`."""
    node = nodes.get(replica.get("node"), {})
    cards = {g.get("index"): g for g in (node.get("facts") or {}).get("gpus") or [] if isinstance(g, dict)}
    classes = sorted({cards[i].get("class") or "gpu" for i in replica.get("gpus") or () if i in cards})
    return f"{(node_fabrics(node) or ['none'])[0]}/{','.join(classes) or 'cpu'}"


@dataclasses.dataclass(frozen=True)
class NodeFilter:
    fabric: str | None = None
    gpu_class: str | None = None
    state: str | None = None
    labels: tuple[tuple[str, str | None], ...] = ()

    def empty(self) -> bool:
        return not (self.fabric or self.gpu_class or self.state or self.labels)

    def describe(self) -> str:
        parts = [f"fabric {self.fabric}" if self.fabric else "", f"class {self.gpu_class}" if self.gpu_class else "",
                 f"state {self.state}" if self.state else ""]
        parts += [f"label {k}={v}" if v is not None else f"label {k}" for k, v in self.labels]
        return ", ".join(p for p in parts if p)

    def matches(self, node: dict) -> bool:
        labels = (node.get("facts") or {}).get("labels") or {}
        return ((not self.fabric or self.fabric in node_fabrics(node))
                and (not self.gpu_class or self.gpu_class in node_classes(node))
                and (not self.state or str(node.get("state", "")).startswith(self.state.lower()))
                and all(k in labels and (v is None or labels[k] == v) for k, v in self.labels))


@dataclasses.dataclass(frozen=True)
class ReplicaFilter:
    model: str | None = None
    node: str | None = None
    state: str | None = None
    pool: str | None = None

    def empty(self) -> bool:
        return not (self.model or self.node or self.state or self.pool)

    def describe(self) -> str:
        return ", ".join(f"{what} {value}" for what, value in (("model", self.model), ("node", self.node),
                                                                ("state", self.state), ("pool", self.pool)) if value)

    def matches(self, replica: dict, nodes: dict[str, dict]) -> bool:
        return ((not self.model or replica.get("model") == self.model)
                and (not self.node or replica.get("node") == self.node)
                and (not self.state or str(replica.get("state", "")).lower().startswith(self.state.lower()))
                and (not self.pool or self.pool in pool_of(replica, nodes)))


def no_matches(kind: str, what: str, total: int) -> str:
    """What to say when a filter matched none of TOTAL KINDs (plural)."""
    return f"no {kind} match {what}. {total} {kind} in total; run without the filter to see them."
