"""``rl migrate``: print a PRIME-RL config in this project's own names.

    uv run rl migrate examples/basic/reverse-text/rl.toml > mine.toml
    uv run rl migrate --trainer @ train.toml --orchestrator @ orch.toml --inference @ infer.toml

Takes the same files and flags as ``rl`` (includes followed, ``--section @ file`` scoped). The
output is the TOML of every key that was given, translated (``prime_rl/names.py``), headed by
comments that say, key by key, what was renamed, what was dropped as already how this project
works, what was ignored and why, and what has no equivalent and must be edited. The translated
config is then validated like ``rl`` would; its errors (and the keys that have no equivalent) are
also printed to stderr and make the exit status 1. The environment is not read: the output is
the files and flags alone.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import tomli_w
from pydantic import ValidationError

from prime_composer.config.cli import _deep_merge, format_validation_error, parse_argv
from prime_composer.config.errors import ConfigError
from prime_composer.config.resolve import PRIME_RL_NAMES, RL_ALIASES, finalize_rl_config
from prime_composer.config.rl import RLConfig
from prime_composer.prime_rl.names import Finding, Translation, translate

USAGE = "usage: rl migrate <prime-rl.toml> [more files or --flags, as for rl]"


def migrate(argv: Sequence[str]) -> tuple[str, list[str]]:
    """``(toml_text, problems)`` for the config ``argv`` names; problems are one line each."""
    files, flags, _ = parse_argv(argv, RLConfig, RL_ALIASES, PRIME_RL_NAMES)
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for layer in (*files, flags):
        values = _deep_merge(values, layer.values)
        origins.update(layer.origins)
    result = translate(values, origins, RLConfig)
    problems = [f.line() for f in result.of_kind("unsupported")]
    if not problems:
        try:
            finalize_rl_config(RLConfig.model_validate(result.values), result.origins)
        except ValidationError as e:
            problems = format_validation_error(e, RLConfig, result.origins).splitlines()
        except ConfigError as e:
            problems = str(e).splitlines()
    return _header(result, problems) + tomli_w.dumps(_without_none(result.values)), problems


def _header(result: Translation, problems: list[str]) -> str:
    def block(title: str, findings: list[Finding] | list[str]) -> list[str]:
        lines = [f.line() if isinstance(f, Finding) else f for f in findings]
        return [f"# {title}:", *(f"#   {line}" for line in lines), "#"] if lines else []

    lines = [
        "# Translated from PRIME-RL's names by `uv run rl migrate` (the table: docs/prime-rl.md).",
        "#",
        *block("renamed", result.of_kind("rename")),
        *block("dropped: already how this project works", result.of_kind("same")),
        *block("dropped: ignored here", result.of_kind("ignored")),
        *block("TO EDIT before `uv run rl` accepts it", problems),
    ]
    return "\n".join(lines) + "\n\n"


def _without_none(values: Any) -> Any:
    """TOML has no null: a ``None`` is the same as leaving the key out."""
    if isinstance(values, dict):
        return {k: _without_none(v) for k, v in values.items() if v is not None}
    if isinstance(values, list):
        return [_without_none(v) for v in values]
    return values


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or "").strip())
        return 0 if argv else 2
    args = list(argv)
    if not args[0].startswith(("@", "--")):
        args.insert(0, "@")  # `rl migrate rl.toml` reads like `rl @ rl.toml`
    try:
        text, problems = migrate(args)
    except ConfigError as e:
        print(f"rl migrate: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    sys.stdout.flush()
    for line in problems:
        print(f"rl migrate: to edit: {line}", file=sys.stderr)
    return 1 if problems else 0
