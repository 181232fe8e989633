"""The one exception type for user mistakes in configs and command lines."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(Exception):
    """A mistake in a config file, an environment variable or the command line.

    Its message is meant for the user as it is: it names where the value came from, the dotted
    key, the bad value, and how to fix it. Entry points print it on one line and exit 2, with no
    traceback.
    """


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or ``''`` when none is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {matches[0]!r}?)" if matches else ""
