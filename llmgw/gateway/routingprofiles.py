"""Routing profiles: how one request is routed, named by its key or its model.

A profile is a policy (`prefix`, `least-load`, `round-robin`), the affinity
factor, the attempts and the three timeouts: what `routing.*` and `timeouts.*`
set for the whole gateway, given a name so that requests of different kinds
are routed differently on one gateway. A batch project's keys may go by load
with long timeouts and never take the interactive pool's prefix affinity,
while everyone's chats keep theirs.

A request goes by the nearest profile its key's scopes name (the key, then its
project, team, organisation and person: `llmgw keys create --profile`, `llmgw
limits set --profile`), else its model's `routing_profile`, else
`routing.default_profile`, else the settings themselves. Profiles are defined
in the gateway's file (`[[routing_profiles]]`), as the settings they stand in
for are; a name a gateway does not define routes as if none were named, and
the gateway says so once per name rather than refuse requests over it.
"""

from __future__ import annotations

import dataclasses
import logging

from llmgw.settings import Config

log = logging.getLogger("llmgw.routing")

# A profile's fields and the settings each stands in for.
FIELDS = {"policy": "routing.policy", "affinity_factor": "routing.affinity_factor", "attempts": "routing.attempts",
          "first_byte": "timeouts.first_byte", "idle": "timeouts.idle", "total": "timeouts.total"}


@dataclasses.dataclass(frozen=True)
class RoutingProfile:
    name: str  # "" for the settings themselves
    policy: str
    affinity_factor: float
    attempts: int
    first_byte: float
    idle: float
    total: float


class RoutingProfiles:
    """A gateway's profiles, resolved once from its configuration; `of` answers per request from a dict."""

    def __init__(self, cfg: Config):
        base = RoutingProfile("", **{field: cfg[setting] for field, setting in FIELDS.items()})
        self.named = {table["name"]: dataclasses.replace(base, **table) for table in cfg.routing_profiles}
        self.default = self.named.get(cfg["routing.default_profile"], base)
        self.unknown: set[str] = set()  # names asked for that this gateway does not define, each logged once

    def of(self, key_profile: str | None, model_profile: str | None) -> RoutingProfile:
        """The profile a request goes by: its key's, else its model's, else the default."""
        for name in (key_profile, model_profile):
            if not name:
                continue
            found = self.named.get(name)
            if found is not None:
                return found
            if name not in self.unknown:
                self.unknown.add(name)
                log.warning("routing profile %r is named by a key or a model but not defined here "
                            "([[routing_profiles]]); its requests are routed as if it were not named", name)
        return self.default
