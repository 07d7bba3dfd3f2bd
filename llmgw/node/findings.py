"""What the doctor concludes, one finding each: its level, its area, what it found and how to fix it."""

from __future__ import annotations

import dataclasses

FAIL, WARN, OK = "FAIL", "WARN", "OK"
ORDER = {FAIL: 0, WARN: 1, OK: 2}


@dataclasses.dataclass(frozen=True)
class Finding:
    level: str
    area: str
    message: str
    fix: str = ""
