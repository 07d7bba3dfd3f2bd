"""The mirror page's registry explorer, as pure values: what to ask the registry, what each repository is
said to be, which the filters keep, and a repository's weight files with a shard set as one row.

One registry call per listing (`expand[]`: the GGUF's parameters, architecture and context, the card's
licence and base model, age, task), cached by the page for ten minutes. Size, context, licence and
"only what these nodes can run" are applied here to what it answered, so they cost no call of their
own; the task goes to the registry (`pipeline_tag`), which filters before its limit. "Only what these
nodes can run" is on by default: it hides a GGUF whose architecture the installed llama.cpp does not
know and adapters (a LoRA is no model on its own), and says how many it hid.
"""

from __future__ import annotations

import datetime
import urllib.parse

from llmgw import gguf, shardsets

SORTS = {"trending": "trendingScore", "downloads": "downloads", "new": "createdAt"}
TASKS = {"text-generation": "text generation", "image-text-to-text": "images and text",
         "feature-extraction": "embeddings"}
SIZES = {"small": (0, 4e9, "under 4 B"), "medium": (4e9, 15e9, "4 to 15 B"), "large": (15e9, 80e9, "15 to 80 B"),
         "huge": (80e9, float("inf"), "over 80 B")}
CONTEXTS = {"8k": 8192, "32k": 32768, "128k": 131072}
LICENCES = ("apache-2.0", "mit", "llama3.1", "llama3.2", "llama3.3", "gemma", "qwen", "other")
SHOWS = {"runnable": "what these nodes can run", "all": "everything"}
ASKED = 100  # repositories one listing asks for, before the filters here
EXPANDED = ("downloads", "likes", "pipeline_tag", "tags", "createdAt", "gguf", "cardData")


class Filters:
    """The explorer's choices from a request's ARGS, each one of its known values (else its default)."""

    def __init__(self, args):
        pick = lambda name, known, default: args.get(name) if args.get(name) in known else default  # noqa: E731
        self.sort = pick("sort", SORTS, "trending")
        self.q = (args.get("q") or "").strip()[:200]
        self.task = pick("task", TASKS, "")
        self.size = pick("size", SIZES, "")
        self.context = pick("context", CONTEXTS, "")
        self.licence = pick("licence", LICENCES, "")
        self.show = pick("show", SHOWS, "runnable")

    def query(self) -> str:
        """The registry's listing path, with what it filters itself."""
        params = [("sort", SORTS[self.sort]), ("direction", "-1"), ("limit", str(ASKED)), ("filter", "gguf")]
        params += [("search", self.q)] if self.q else []
        params += [("pipeline_tag", self.task)] if self.task else []
        params += [("expand[]", field) for field in EXPANDED]
        return "/api/models?" + urllib.parse.urlencode(params)


def describe(repo: dict, now: datetime.datetime, library: bytes | None = None) -> dict:
    """What the explorer shows of one repository of a listing: its figures as numbers and words."""
    info = repo.get("gguf") if isinstance(repo.get("gguf"), dict) else {}
    card = repo.get("cardData") if isinstance(repo.get("cardData"), dict) else {}
    tags = [t for t in repo.get("tags") if isinstance(t, str)] if isinstance(repo.get("tags"), list) else []
    arch = info.get("architecture") if isinstance(info.get("architecture"), str) else None
    licence = card.get("license") or next((t.split(":", 1)[1] for t in tags if t.startswith("license:")), None)
    base = card.get("base_model")
    created = _date(repo.get("createdAt"))
    params, context = info.get("total"), info.get("context_length")
    return {
        "id": str(repo.get("id") or ""), "downloads": _number(repo.get("downloads")), "likes": _number(repo.get("likes")),
        "task": repo.get("pipeline_tag") if isinstance(repo.get("pipeline_tag"), str) else None,
        "params": _number(params), "size": _parameters(_number(params)), "arch": arch,
        "loads": gguf.loadable(arch, library) if arch else None,
        "context": _number(context), "licence": licence if isinstance(licence, str) else None,
        "base": (base[0] if isinstance(base, list) and base else base) if isinstance(base, (str, list)) else None,
        "age_days": (now - created).days if created else None,
        "adapter": card.get("base_model_relation") == "adapter" or any(t in ("lora", "adapter") for t in tags),
    }


def keep(repos: list[dict], filters: Filters) -> tuple[list[dict], int]:
    """REPOS (as `describe` made them) that FILTERS keep, and how many "only what these nodes can run" hid."""
    shown, hidden = [], 0
    for r in repos:
        if filters.size:
            low, high, _ = SIZES[filters.size]
            if r["params"] is None or not low <= r["params"] < high:
                continue
        if filters.context and (r["context"] is None or r["context"] < CONTEXTS[filters.context]):
            continue
        if filters.licence and not _licence_matches(r["licence"], filters.licence):
            continue
        if filters.show == "runnable" and (r["loads"] is False or r["adapter"]):
            hidden += 1
            continue
        shown.append(r)
    return shown, hidden


def weight_files(siblings, sha: str | None) -> list[dict]:
    """A repository's weight files (GGUF, safetensors), one row each, a shard set as one row: its name with
    `0000N`, its parts' size together (None where one is not known), no single checksum, and the first part's
    name to fetch it by (a shard brings its set); a set whose listing lacks parts is `incomplete` and offers no
    fetch. Projectors and importance matrices are marked: they are no model. A name a source could not carry
    whole (`..`, `@`, `?`, `#`, a backslash, a control character), or a commit that is not 40 hex digits,
    offers no fetch either: the source is pinned to that commit, or not offered."""
    pinned = isinstance(sha, str) and len(sha) == 40 and all(c in "0123456789abcdef" for c in sha)
    rows: dict[str, dict] = {}
    for s in siblings if isinstance(siblings, list) else []:
        name = s.get("rfilename") if isinstance(s, dict) else None
        if not isinstance(name, str) or not name.endswith((".gguf", ".safetensors")):
            continue
        lfs = s.get("lfs") if isinstance(s.get("lfs"), dict) else {}
        size = _number(lfs.get("size")) if lfs.get("size") is not None else _number(s.get("size"))
        shown = shardsets.set_name(name)
        parts = shardsets.siblings(name)
        row = rows.setdefault(shown, {"name": shown, "fetch": name, "size": 0, "parts": 0, "expected": len(parts or [1]),
                                      "sha256": lfs.get("sha256") if not parts else None,
                                      "not_a_model": "mmproj" in name or "imatrix" in name,
                                      "fetchable": pinned})
        row["size"] = None if size is None or row["size"] is None else row["size"] + size
        row["parts"] += 1
        row["fetch"] = min(row["fetch"], name)
        if ".." in name.split("/") or name.startswith("/") or any(c in name for c in "@?#\\") \
                or not name.isprintable():
            row["fetchable"] = False
    for row in rows.values():
        row["incomplete"] = row["parts"] != row["expected"]
        row["fetchable"] = row["fetchable"] and not row["incomplete"] and not row["not_a_model"]
    return list(rows.values())


def _parameters(count: int | None) -> str:
    if not count:
        return "parameters not given"
    return f"{count / 1e9:.1f} B parameters" if count >= 1e8 else f"{count / 1e6:.0f} M parameters"


def _licence_matches(licence: str | None, wanted: str) -> bool:
    if wanted == "other":
        return licence is None or not any(licence.startswith(k) for k in LICENCES if k != "other")
    return licence is not None and licence.startswith(wanted)


def _number(value) -> int | None:
    """VALUE when it is a count a registry could mean (0 to 2**53), else None: not a flag, a negative or a
    number too large to divide."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1 << 53 else None


def _date(value) -> datetime.datetime | None:
    """VALUE as a moment in UTC (a date without a zone is taken as UTC), or None."""
    try:
        moment = datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)
