"""Reading usage back for the pages: when each key was last used, and a person's own recent use.

Reads go through the `usage_key_at` index (key, time), so a person's page
touches only their keys' rows. Roll-ups for organisation-wide reports over
millions of rows come with the usage pages.
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from llmgw import store

DAY = 86400


def last_used(engine: Engine, key_ids: list[str]) -> dict[str, float]:
    """key id -> when it last made a request (absent: never)."""
    if not key_ids:
        return {}
    u = store.usage
    with engine.connect() as conn:
        rows = conn.execute(sa.select(u.c.key_id, sa.func.max(u.c.at)).where(u.c.key_id.in_(key_ids))
                            .group_by(u.c.key_id)).all()
    return {key_id: at for key_id, at in rows}


def daily_use(engine: Engine, key_ids: list[str], days: int = 30, now: float | None = None) -> list[dict]:
    """Per day (UTC) of the last DAYS, oldest first: requests, prompt and completion tokens."""
    now = now if now is not None else time.time()
    first_day = int(now // DAY) - days + 1
    out = {first_day + i: {"day": time.strftime("%Y-%m-%d", time.gmtime((first_day + i) * DAY)), "requests": 0,
                           "prompt_tokens": 0, "completion_tokens": 0} for i in range(days)}
    if key_ids:
        u = store.usage
        day = sa.cast(sa.func.floor(u.c.at / DAY), sa.Integer)
        query = (sa.select(day, sa.func.count(), sa.func.coalesce(sa.func.sum(u.c.prompt_tokens), 0),
                           sa.func.coalesce(sa.func.sum(u.c.completion_tokens), 0))
                 .where(u.c.key_id.in_(key_ids), u.c.at >= first_day * DAY).group_by(day))
        with engine.connect() as conn:
            for d, requests, prompt, completion in conn.execute(query):
                if d in out:
                    out[d].update(requests=requests, prompt_tokens=int(prompt), completion_tokens=int(completion))
    return [out[d] for d in sorted(out)]
