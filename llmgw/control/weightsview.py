"""What a node's weights directory holds, as the admin API shows it: the node's listing joined with the
catalog and the replicas, and which entries may be reclaimed.

The node says what it holds (`weights_reply`: each entry's size, whether llmgw fetched it and from where,
which of its engines use it). The controller adds which catalog models and replicas use each entry, and
calls reclaimable only what llmgw fetched that none of them uses and that is not an operator's local
source. The node checks again when told to remove (`reclaim` in llmgw/weights.py): this is the
operator's view and the first guard, not the last.
"""

from __future__ import annotations

import posixpath


def holds(source: str, entry: dict, weights_dir: str) -> bool:
    """Whether the catalog SOURCE is what ENTRY of WEIGHTS_DIR holds: the URL it was fetched from, or a
    path to it or inside it."""
    if source == entry.get("source"):
        return True
    path = source[len("file://"):] if source.startswith("file://") else source
    if not posixpath.isabs(path):
        return False
    path, place = posixpath.normpath(path), posixpath.join(weights_dir, entry["name"])
    return path == place or path.startswith(place + "/")


def why_kept(entry: dict) -> str | None:
    """Why ENTRY (annotated) may not be reclaimed; None when it may."""
    if not entry.get("fetched"):
        return "not fetched by llmgw"
    if entry.get("local_source"):
        return "inside agent.local_sources"
    users = sorted(set(entry["replicas"]))
    if users:
        return "used by replica " + ", ".join(users)
    if entry["models"]:
        return "the catalog's " + ", ".join(entry["models"]) + " uses it"
    return None


def annotate(node_id: str, reply: dict, sources: dict[str, list[str]], replicas: list[tuple[str, str]]) -> dict:
    """The node's REPLY to `weights_request`, each entry with the catalog `models` and `replicas` that use it,
    `reclaimable`, and `kept` (why not). SOURCES: model name -> its sources; REPLICAS: (shard id, model) on
    this node, as the controller knows them."""
    weights_dir = reply.get("weights_dir", "")
    files = []
    for raw in reply.get("files", []):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("bytes"), int):
            continue  # the node's word, read as data: what cannot be read is left out
        entry = {k: raw.get(k) for k in ("name", "bytes", "fetched", "source", "partial", "local_source")}
        entry["models"] = sorted(name for name, its in sources.items()
                                 if any(holds(source, entry, weights_dir) for source in its))
        mine = [str(s) for s in raw.get("shards", []) if isinstance(s, str)]
        entry["replicas"] = sorted(set(mine) | {shard for shard, model in replicas if model in entry["models"]})
        entry["kept"] = why_kept(entry)
        entry["reclaimable"] = entry["kept"] is None
        files.append(entry)
    return {"node": node_id, "weights_dir": weights_dir, "entries": reply.get("entries"), "bytes": reply.get("bytes"),
            "fetched_bytes": reply.get("fetched_bytes"), "truncated": bool(reply.get("truncated")),
            "reclaimable_bytes": sum(f["bytes"] for f in files if f["reclaimable"]), "files": files}
