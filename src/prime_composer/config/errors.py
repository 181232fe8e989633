"""The exception types entry points turn into one-line errors: config mistakes and failed runs."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(Exception):
    """A mistake in a config file, an environment variable or the command line.

    Its message is meant for the user as it is: it names where the value came from, the dotted
    key, the bad value, and how to fix it. Entry points print it on one line and exit 2, with no
    traceback.
    """


class RunError(Exception):
    """A run that must stop, and why: every rollout failed, nothing trainable for several steps,
    the policy diverged. Its message says which and what to change. Entry points print it on one
    line and exit with ``RUN_ERROR_EXIT_CODE``, which tells the launcher that resuming the run as
    it is would fail the same way."""


RUN_ERROR_EXIT_CODE = 3


class DamagedInputError(Exception):
    """A file or message another process wrote fails its checks (a digest, the batch format).

    Its message names the file and what to do; entry points print it on one line and exit
    ``DAMAGED_INPUT_EXIT_CODE``. Unlike a ``RunError``, resuming can help: the writer writes the
    input again. ``IntegrityError`` and ``BatchFormatError`` are kinds of it.
    """


DAMAGED_INPUT_EXIT_CODE = 1


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or ``''`` when none is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {matches[0]!r}?)" if matches else ""
