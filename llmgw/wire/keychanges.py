"""What changed in the key set between two revisions: the `key_changes` message's fields, and the view they are taken from.

A `keys` message (llmgw/wire/gateways.py) holds every key with the rules it
is resolved by. It grows with the organisation: about 330 bytes a key with
its limit, so 330 MB at a million keys, and reading one stops a gateway
worker's loop for seconds (bench/keys.py). When the store's keys change, the
controller sends `key_changes` before it: only what differs from the set at
`base`, so a revocation costs every worker a few entries, whatever the size.

Both ends see a key set as one `view`: each part a mapping from an identity
(a key's hash, a limit's scope and id, a project, a person) to its value, or
a set of people. The controller takes the difference of two views; a gateway
applies the entries to its table (llmgw/gateway/keytable.py). Limits are
seen merged: a `keys` message sends personal use's limits and the routing
profiles apart (for the gateways of the version before), and a change to
either arrives here as one row of all eight values.
"""

from __future__ import annotations

# The parts of a view that map an identity to a value, and the parts that are sets of people's ids.
MAPPINGS = ("keys", "limits", "parents", "team_org", "prices", "threads", "memory")
SETS = ("suspended", "active", "admins")


def limits_of(key_set: dict) -> dict[tuple[str, str], tuple]:
    """(scope, id) -> (rpm, tpm, budget, period, models, band, disabled, profile), from a `keys` message's
    `limits`, `personal` and `profiles` together."""
    out: dict[tuple[str, str], tuple] = {}
    for scope, sid, *values in key_set["limits"]:
        out[scope, sid] = (*values, None, None)
    if "personal" in key_set:
        *values, disabled = key_set["personal"]
        out["personal", ""] = (*values, disabled or None, None)
    for scope, sid, profile in key_set.get("profiles", ()):
        out[scope, sid] = (*out.get((scope, sid), (None,) * 7)[:7], profile)
    return out


def limit_value(scope: str, limits) -> tuple:
    """A scope's limits (a rules.Limits) as a view holds them, as `limits_of` makes them from a `keys` message:
    the personal scope alone carries `disabled`."""
    models = list(limits.models) if limits.models is not None else None
    disabled = (bool(limits.disabled) or None) if scope == "personal" else None
    return (limits.rpm, limits.tpm, limits.budget, limits.period, models, limits.band, disabled,
            limits.profile or None)


def view(key_set: dict) -> dict:
    """A `keys` message (or people.keys.key_set's answer) as identities and values."""
    return {"keys": {entry["hash"]: entry for entry in key_set["keys"]},
            "limits": limits_of(key_set),
            "parents": {project: tuple(up) for project, up in key_set["parents"].items()},
            "team_org": dict(key_set["team_org"]),
            "prices": {model: (i, o) for model, i, o in key_set["prices"]},
            "threads": dict(key_set.get("threads", ())),
            "memory": dict(key_set.get("memory", ())),
            **{name: frozenset(key_set.get(name, ())) for name in SETS}}


def _entry(part: str, identity, value) -> object:
    """One changed entry as the message carries it."""
    if part == "keys":
        return value  # the key's own object, its hash in it
    if part == "limits":
        return [*identity, *value]
    if part in ("parents", "prices"):
        return [identity, *value]
    return [identity, value]


def difference(old: dict, new: dict) -> dict:
    """The `key_changes` fields that take view OLD to view NEW: for each part that changed, its new or
    changed entries (PART) and the identities no longer there (PART_gone); nothing for a part unchanged."""
    out: dict = {}
    for part in MAPPINGS:
        before, after = old[part], new[part]
        changed = [_entry(part, identity, value) for identity, value in after.items() if before.get(identity) != value]
        gone = [list(identity) if isinstance(identity, tuple) else identity
                for identity in before if identity not in after]
        if changed:
            out[part] = changed
        if gone:
            out[f"{part}_gone"] = gone
    for part in SETS:
        if added := sorted(new[part] - old[part]):
            out[part] = added
        if gone := sorted(old[part] - new[part]):
            out[f"{part}_gone"] = gone
    return out


def advance(seen: dict, changed: dict) -> dict:
    """Take view SEEN to the store's state after CHANGED (people.keys.changed_since's answer), in place, and
    return the `key_changes` fields that do the same for a gateway: what `difference` would give against the
    whole set read again, found from what changed alone."""
    out: dict = {}
    keys = seen["keys"]
    for entry in changed["keys"]:
        if keys.get(entry["hash"]) != entry:
            keys[entry["hash"]] = entry
            out.setdefault("keys", []).append(entry)
    held = seen["limits"]
    for identity, limits in changed["limits"].items():
        if limits is None:
            if held.pop(identity, None) is not None:
                out.setdefault("limits_gone", []).append(list(identity))
            continue
        value = limit_value(identity[0], limits)
        if held.get(identity) != value:
            held[identity] = value
            out.setdefault("limits", []).append(_entry("limits", identity, value))
    for person, found in changed["people"].items():
        state, admin = found if found is not None else (None, False)
        inside = {"suspended": found is not None and state != "active", "active": state == "active",
                  "admins": admin and state == "active"}
        for part, now in inside.items():
            if now and person not in seen[part]:
                seen[part] = seen[part] | {person}
                out.setdefault(part, []).append(person)
            elif not now and person in seen[part]:
                seen[part] = seen[part] - {person}
                out.setdefault(f"{part}_gone", []).append(person)
    return out


def message_of(seen: dict, revision: int) -> dict:
    """A `keys` message's fields (people.keys.key_set's shape) from view SEEN at REVISION: the whole set, made
    from what the controller holds rather than read again."""
    limits, profiles, personal = [], [], None
    for (scope, sid), (rpm, tpm, budget, period, models, band, disabled, profile) in seen["limits"].items():
        if scope == "personal":
            personal = [rpm, tpm, budget, period, models, band, bool(disabled)]
        else:
            limits.append([scope, sid, rpm, tpm, budget, period, models, band])
        if profile:
            profiles.append([scope, sid, profile])
    return {"revision": revision, "keys": list(seen["keys"].values()),
            **({"personal": personal} if personal is not None else {}), "profiles": profiles, "limits": limits,
            "parents": {project: list(up) for project, up in seen["parents"].items()},
            "team_org": dict(seen["team_org"]),
            "prices": [[model, i, o] for model, (i, o) in seen["prices"].items()],
            **{name: sorted(seen[name]) for name in SETS},
            "threads": sorted([project, hours] for project, hours in seen["threads"].items()),
            "memory": sorted([project, hours] for project, hours in seen["memory"].items())}
