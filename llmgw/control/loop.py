"""The controller's loop and what it tells the admin API: the reconciler's report.

The reconcile passes run in APScheduler's thread and the admin API answers in
threads of its own, so what one writes and the other reads is held here, under
a lock, rather than in the Flask app's config.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class ReconcileReport:
    """How long reconcile passes take, the models the last pass could not place and why, and a way to ask
    for a pass now. Made by the controller, written by its reconcile passes, read by the admin API."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seconds: float | None = None
        self._seconds_max: float | None = None
        self._unplaced: dict[str, dict[str, str]] = {}
        self._kick: Callable[[], None] = lambda: None  # until the scheduler runs, the first pass is due anyway

    def record_pass(self, seconds: float, unplaced: dict[str, dict[str, str]]) -> None:
        """A pass took SECONDS and could not place UNPLACED (model -> node -> why not)."""
        with self._lock:
            self._seconds = seconds
            self._seconds_max = max(seconds, self._seconds_max or 0.0)
            self._unplaced = dict(unplaced)

    def timings(self) -> tuple[float | None, float | None]:
        """The last pass's seconds and the longest pass's, or None before the first."""
        with self._lock:
            return self._seconds, self._seconds_max

    def unplaced_for(self, model: str) -> dict[str, str] | None:
        """Why the last pass could not place MODEL, node by node; None where it wanted none it could not place."""
        with self._lock:
            return self._unplaced.get(model)

    def on_kick(self, action: Callable[[], None]) -> None:
        """What kick does: the controller sets it once its scheduler runs."""
        self._kick = action

    def kick(self) -> None:
        """Ask for a reconcile pass now: a catalog change is acted on at once rather than at the next tick."""
        self._kick()
