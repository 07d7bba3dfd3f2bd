"""What a model's profile was measured to take: requests in flight at once within a service level.

`llmgw ctl bench MODEL --save` measures each replica through a gateway and
sends the controller the last level that held; the controller files it under
the replica's profile (it is never asked of the operator: a figure filed
under the wrong profile is worse than none), in the store, so a restart
keeps it. Re-measuring replaces it. The routing snapshot then carries it on
every ready replica of that profile as `max_in_flight`, and each gateway
admits at most that many requests to such a replica at once; a replica whose
profile was not measured has no figure, and admission does what it did
before (`routing.max_outstanding`, or nothing).

A figure belongs to the profile as it was measured (its fingerprint): an
edited profile is another engine, so the figure is kept, shown as stale, and
not used until it is measured again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from llmgw import store
from llmgw.wire.gateways import MAX_IN_FLIGHT

# The figures a measurement carries besides the limit, each a number 0 or more (absent: not measured).
FIGURES = ("ttft_s", "tpot_s", "requests_per_s", "tokens_per_s", "slo_ttft_s", "slo_tpot_s", "percentile",
           "samples")
TEXTS = {"replica": 200, "gateway": 2000}  # and the words, bounded


class CapacityError(Exception):
    """A measurement that cannot be saved; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Capacity:
    model: str
    profile: str
    fingerprint: str
    max_in_flight: int
    measured: dict  # FIGURES and TEXTS, those known
    measured_at: float

    def to_dict(self, current: str | None) -> dict:
        """As the admin API shows it; CURRENT is the profile's fingerprint now (None: the profile is gone)."""
        return {"model": self.model, "profile": self.profile, "max_in_flight": self.max_in_flight,
                "measured_at": self.measured_at, "current": current == self.fingerprint, **self.measured}


def checked_figures(body: dict) -> dict:
    """The figures of a PUT body, each bounded; raises CapacityError naming the one that is wrong."""
    out: dict[str, int | float | str] = {}
    for name in FIGURES:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                  and 0 <= value < 1e12):
            raise CapacityError(f"{name} is a number, 0 or more, not {str(value)[:40]!r}")
        out[name] = value
    for name, most in TEXTS.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or len(value) > most:
            raise CapacityError(f"{name} is a text of at most {most} characters")
        out[name] = value
    return out


def checked_limit(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_IN_FLIGHT:
        raise CapacityError(f"max_in_flight is a whole number of requests from 1 to {MAX_IN_FLIGHT}, not "
                            f"{str(value)[:40]!r}; a level of 0 (not even one request within the service level) "
                            "is not saved, since admission would then refuse everything")
    return value


def read_all(engine: Engine) -> dict[tuple[str, str], Capacity]:
    """Every saved measurement, by (model, profile)."""
    c = store.capacities
    with engine.connect() as conn:
        rows = conn.execute(sa.select(c)).all()
    return {(r.model, r.profile): Capacity(r.model, r.profile, r.fingerprint, r.max_in_flight, json.loads(r.measured),
                                           r.measured_at) for r in rows}


def save(engine: Engine, capacity: Capacity) -> None:
    """Keep CAPACITY, replacing what was measured of that profile before."""
    c = store.capacities
    with store.writing(engine) as conn:
        conn.execute(c.delete().where(c.c.model == capacity.model, c.c.profile == capacity.profile))
        conn.execute(c.insert().values(model=capacity.model, profile=capacity.profile,
                                       fingerprint=capacity.fingerprint, max_in_flight=capacity.max_in_flight,
                                       measured=json.dumps(capacity.measured), measured_at=capacity.measured_at))


def forget(engine: Engine, model: str, profile: str | None) -> int:
    """Drop what was measured of MODEL's PROFILE (every profile: None); how many were dropped."""
    c = store.capacities
    query = c.delete().where(c.c.model == model)
    if profile is not None:
        query = query.where(c.c.profile == profile)
    with store.writing(engine) as conn:
        return conn.execute(query).rowcount


def measured_now(model: str, profile: str, fingerprint: str, max_in_flight, body: dict) -> Capacity:
    """A new measurement from an admin API body; raises CapacityError."""
    return Capacity(model, profile, fingerprint, checked_limit(max_in_flight), checked_figures(body), time.time())
