"""A start gate: a process the launcher starts early does its setup, then waits here until the
services it calls are healthy (stdlib only; ``launch/launcher.py`` opens the gate).

The launcher starts such a process (``ProcessSpec.starts_early``) together with the inference
server, so its imports, environments and tokenizer load while the server loads its model, and
passes it ``PRIME_COMPOSER_START_GATE``: a file that does not exist yet. The launcher creates it
once every service the process waits for answers its health URL; ``wait_start_gate`` returns
then. The launcher stays the one judge of the services' health: if one dies or never answers it
stops the run (this process included), so the wait here has no timeout of its own. Without the
variable (a process run alone) the gate is open.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

GATE_ENV = "PRIME_COMPOSER_START_GATE"


def wait_start_gate(poll_s: float = 0.05) -> float:
    """Block until the launcher opens this process's gate; returns the seconds waited (0 when
    there is no gate)."""
    gate = os.environ.pop(GATE_ENV, None)  # not passed on to this process's children
    if not gate:
        return 0.0
    start = time.monotonic()
    path = Path(gate)
    while not path.exists():
        time.sleep(poll_s)
    return time.monotonic() - start
