"""What the gateway's master learns as it starts and hands to the workers it forks: not configuration.

The configuration (`settings.Config`) is what the operator wrote, read the same by every role; this
is what the master found or made at its start, and what it heard since. A worker inherits the object
with the rest of the master's memory when it is forked, so one forked later (a crashed one replaced)
starts from what the master knows now.
"""

from __future__ import annotations

from typing import Any


class MasterState:
    __slots__ = ("controller_keys", "local_accountant", "local_accountant_keys", "last_word")

    def __init__(self, controller_keys=None) -> None:
        # CURVE keys (llmgw.wire.curve.ClientKeys) for the controller's sockets, read from gateway.key_file by
        # gateway.py; None when no controller is followed, or it is followed in plain text.
        self.controller_keys = controller_keys
        # Without a controller, the master runs the accountant its workers share (llmgw/control/standin.py):
        # its address, and the keys made for it then, known only to this master and its workers.
        self.local_accountant: str | None = None
        self.local_accountant_keys = None
        # The controller's latest snapshot (with the address it came from), key table (with whether the master
        # trusts it: llmgw/gateway/keytable.py's HeldKeys) and leading addresses as the master heard them
        # (llmgw/gateway/server.py): what a worker forked later starts from. An entry is replaced whole, never
        # changed in place: no lock is needed, and none may be held at a fork.
        self.last_word: dict[str, Any] = {}

    def accountant_keys(self, following: bool):
        """The keys a worker dials its accountant with: the controller's when FOLLOWING one, else the master's."""
        return self.controller_keys if following else self.local_accountant_keys
