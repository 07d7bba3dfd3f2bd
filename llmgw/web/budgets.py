"""The budgets that apply to a person, with what is spent of each, for the account page.

A person spends against their own budget (personal keys, the chat page) and
against each project they may use: the project's, its team's and its
organisation's budgets, and their share where a budget is per member. What is
spent comes from the accountant, which holds every pool; when it cannot be
asked, the figure is absent rather than zero.
"""

from __future__ import annotations

import dataclasses

from llmgw import rules
from llmgw.gateway.limiter import Unavailable


@dataclasses.dataclass(frozen=True)
class Budget:
    label: str
    limit: int  # micro-units
    period: str
    spent: int | None

    @property
    def share(self) -> float | None:
        return None if self.spent is None else min(1.0, self.spent / self.limit) if self.limit else 1.0

    @property
    def state(self) -> str:
        """How the bar is drawn: ok, amber past 80%, red when spent."""
        share = self.share
        return "unknown" if share is None else "spent" if share >= 1 else "warn" if share > 0.8 else "ok"


def _label(counter: str, tree, user_id: str) -> str:
    scope, _, rest = counter.partition(":")
    if scope == "default":
        return "the cluster's default for your own use"
    if scope == "user":
        return "you, everywhere"
    node_id = rest.split("/")[0]
    node = tree.by_id.get(node_id)
    path = node.path if node else node_id
    if scope.endswith("_member"):
        return f"your share of {path}"
    return f"{path} (shared)"


def for_person(runtime, user_id: str, project_ids: list[str], tree) -> list[Budget]:
    """Every budget pool USER_ID can spend in: their own and those of PROJECT_IDS."""
    table = runtime.keys
    seen: dict[str, rules.Level] = {}
    for access in [table.person(user_id)] + [table.rules.access(None, p, user_id) for p in project_ids]:
        for level in access.levels:
            if level.budget is not None:
                seen.setdefault(level.counter, level)
    out = []
    for counter, level in seen.items():
        out.append(Budget(_label(counter, tree, user_id), level.budget, level.period, spent(runtime, level)))
    return sorted(out, key=lambda b: b.label)


def spent(runtime, level: rules.Level) -> int | None:
    """What the accountant says is spent of LEVEL's budget this period; None when it does not answer."""
    try:
        answer = runtime.limiter.ask(runtime.router.snapshot.accountant_of(level.home),
                                     {"op": "status", "levels": [level.wire()]})
        limit, remaining = answer["status"]["budget"]
    except (Unavailable, KeyError, TypeError, ValueError):
        return None
    return limit - remaining
