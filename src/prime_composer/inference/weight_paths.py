"""Which weight directory ``POST /update_weights {"path": ...}`` may name, checked before any file
is read; both backends use it, so they refuse the same inputs with the same status and message.

  400  the body is not a JSON object whose only field ``path`` is a string (bad JSON, too deeply
       nested, a list, a number, extra fields); the path is empty, holds a NUL byte, is longer
       than the OS allows, or cannot be resolved (a symlink loop); it resolves to something that
       is not a ``step_<N>`` directory directly under the root
  403  it resolves, symlinks followed, outside ``<output_dir>/broadcasts`` (or to the root itself)
  404  the step directory does not exist
  409  it has no ``STABLE`` marker (still being written)

A relative path is taken relative to the root (``"step_3"``). What is *in* the directory (digests,
finite values, matching the served model) is checked when it is read (``transport.weights``);
those refusals are 409s too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prime_composer.transport.weights import STABLE_MARKER, parse_step

MAX_PATH_CHARS = 4096
"""Longest path accepted (Linux's PATH_MAX); longer ones are refused before touching the disk."""
_SHOWN_CHARS = 200


class WeightPathError(ValueError):
    """A refused update request; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def update_path_from_body(body: bytes) -> str:
    """The ``path`` of an ``/update_weights`` body, or ``WeightPathError(400)`` saying what is wrong."""
    try:
        data: Any = json.loads(body)
    except RecursionError:
        raise WeightPathError(400, "the request body is nested too deeply to parse") from None
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise WeightPathError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise WeightPathError(
            400, f'the request body must be a JSON object {{"path": ...}}, got a {type(data).__name__}'
        )
    extra = sorted(k for k in data if k != "path")
    if extra:
        raise WeightPathError(
            400, f"invalid request: unknown fields {extra[:5]}; the body is {{'path': ...}}"
        )
    if "path" not in data:
        raise WeightPathError(400, "invalid request: path: field required")
    path = data["path"]
    if not isinstance(path, str):
        raise WeightPathError(400, f"invalid request: path must be a string, got {type(path).__name__}")
    return path


def checked_step_dir(raw: str, root: Path) -> Path:
    """Resolve ``raw`` (relative to ``root`` unless absolute) and return the published step
    directory it names, or raise ``WeightPathError`` with the status in the module docstring."""
    shown = _shown(raw)
    if not raw:
        raise WeightPathError(400, "path is empty; name a published step directory such as 'step_3'")
    if "\x00" in raw:
        raise WeightPathError(400, f"path {shown} contains a NUL byte")
    if len(raw) > MAX_PATH_CHARS:
        raise WeightPathError(400, f"path {shown} is {len(raw)} characters long; at most {MAX_PATH_CHARS}")
    root = Path(root).resolve()
    try:
        candidate = Path(raw).expanduser()
        path = (candidate if candidate.is_absolute() else root / candidate).resolve()
        is_dir = path.is_dir()
        exists = is_dir or path.exists()
    except RuntimeError as e:  # Python 3.11 reports a symlink loop this way
        raise WeightPathError(400, f"path {shown} cannot be resolved: {e}") from None
    except OSError as e:  # ELOOP, ENAMETOOLONG, EACCES, ...
        raise WeightPathError(400, f"path {shown} cannot be resolved: {e.strerror or e}") from None
    if path == root or not path.is_relative_to(root):
        raise WeightPathError(
            403,
            f"weight path {shown} is outside the broadcast root {root}: only step directories "
            "published there by the trainer are accepted",
        )
    if path.parent != root or parse_step(path) is None:
        raise WeightPathError(
            400,
            f"weight path {shown} resolves to {_shown(str(path))}, which is not a step directory: "
            f"only {root}/step_<N> directories (as the trainer publishes them) are accepted",
        )
    if not exists:
        raise WeightPathError(404, f"weight directory {path} does not exist")
    if not is_dir:
        raise WeightPathError(400, f"weight path {path} is not a directory")
    if not (path / STABLE_MARKER).is_file():
        raise WeightPathError(
            409, f"weight directory {path} has no {STABLE_MARKER} marker (still being written?)"
        )
    return path


def _shown(text: str) -> str:
    """``text`` quoted for a message, cut to a readable length."""
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return repr(text[:_SHOWN_CHARS]) + f"... ({len(text)} characters)"
