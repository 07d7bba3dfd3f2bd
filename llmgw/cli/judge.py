"""The baseline guard `llmgw init` adds: Llama Guard 3 1B judging every model's prompts and answers.

Added only when the configuration names no judge (no `guard` setting, no model with `role = "guard"`) and
the judge's weights are already in the mirror: nothing is downloaded during init (a cluster may have no
way out), and a guard section whose judge cannot be served would refuse every request (`guard.fail` is
`closed`). Where the judge is missing, init says how to fetch it; the next init adds the section.
"""

from __future__ import annotations

import re

NAME = "llama-guard-3-1b"
# Llama Guard 3 1B, quantised to about 900 MB: about half a second a short text on a CPU (the Go version's
# figure), so the judge takes no GPU from the models it guards.
SOURCE = "hf:QuantFactory/Llama-Guard-3-1B-GGUF/Llama-Guard-3-1B.Q4_K_M.gguf"
CONTEXT = 8192


def held_version(held: list[dict]) -> tuple[str, str] | None:
    """(version, file) of the judge among HELD (the mirror's versions, as MirrorDir.versions or the management
    API's listing gives them): the newest version holding one GGUF file, or None."""
    found = [(v["version"], ggufs[0]) for v in held if v["model"] == NAME
             for ggufs in [[f["name"] for f in v["files"] if f["name"].endswith(".gguf")]] if len(ggufs) == 1]
    return max(found, key=lambda pair: _natural(pair[0])) if found else None


def _natural(version: str) -> list[tuple[int, int | str]]:
    """VERSION compared as people read it: "10" after "9", "2026-10-05" after "2026-9-30"."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", version) if part]


def model(mirror_base_url: str, version: str, file: str) -> dict:
    """The judge's catalog entry. Two replicas, since every guarded request waits on one; a CPU profile, so
    it takes no GPU; never offered to clients (`role = "guard"`)."""
    return {"name": NAME, "role": "guard", "source": f"{mirror_base_url}/{NAME}/{version}/{file}",
            "max_context": CONTEXT, "scaling": {"min": 2, "max": 2}, "guard": {"format": "llamaguard3"},
            "profiles": [{"engine": "llamacpp"}]}


def configured(written: dict, models: list[dict]) -> bool:
    """Whether a configuration (its WRITTEN settings and MODELS) already says anything about guardrails: then
    init adds none, whatever it says (`guard.model = ""` is an operator's choice of none)."""
    return any(name.startswith("guard.") for name in written) or any(m.get("role") == "guard" for m in models)


def fetch_hint(llmgw: str) -> str:
    return (f"fetch the judge into the mirror with `{llmgw} mirror fetch {SOURCE} --model {NAME} --version 1`, "
            "then run init again")
