"""Is a copy of a project readable by sandboxed code? The host half of the visibility scan.

The same question is asked twice, in the sandbox the answer matters for:

- when a project is built (``corpus.build_project``): a project with a readable copy is refused,
  and the folders hidden while it was scanned are stored with it (``Project.hidden_paths``);
- when a taskset's episodes are about to start (``episode.FeatureDeletion``), in the episodes'
  own sandbox, which hides the stored folders whether or not the config names them: a taskset
  with a readable copy of one of its projects refuses to start.

``fingerprint`` says what a copy looks like (per module file name: its longest lines, and the
names and long strings its bytecode would hold); ``scanner.py`` runs inside the sandbox, walks
the whole file system as the sandboxed user sees it, and looks inside archives (wheels, zips,
eggs, tarballs, nested ones too) and bytecode. The scan reads what it may read, as the agent
would: a copy only root could read is no copy.
"""

from __future__ import annotations

import json
import math
import re
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from feature_deletion.spec import ProjectSpec
from prime_composer.config.sandbox import LimitsConfig
from prime_composer.sandbox import Sandbox

SCANNER_SOURCE = Path(__file__).with_name("scanner.py").read_text()
NUM_LONG_LINES = 5
"""Longest lines per module file kept as its source fingerprint."""
MIN_LINE_CHARS = 40
MIN_STRING_CHARS = 24
"""Shortest string constant (docstrings, messages) kept as a bytecode fingerprint."""
MIN_NAME_CHARS = 5
"""Shortest function or class name kept as a bytecode fingerprint (``get`` is everywhere)."""


class VisibilityError(RuntimeError):
    """The scan could not say (it timed out or died); the message says why."""


def dist_regex(name: str) -> str:
    """File or folder names of an installed, built or downloaded copy of distribution ``name``."""
    parts = [re.escape(p) for p in re.split(r"[-_.]+", name)]
    return (
        "^"
        + "[-_.]".join(parts)
        + r"-[0-9][^/]*\.(dist-info|egg-info|egg|whl|zip|tar\.gz|tgz|tar\.bz2|tar\.xz)$"
    )


def fingerprint(spec: ProjectSpec, slug: str, tree: Path, files: Sequence[Path]) -> dict[str, Any]:
    """What the scanner looks for, for one project whose source files are ``files`` (in ``tree``)."""
    modules: dict[str, dict[str, set[str]]] = {}
    for path in files:
        text = path.read_text()
        entry = modules.setdefault(path.name, {"lines": set(), "names": set()})
        long_lines = {s for s in (line.strip() for line in text.splitlines()) if len(s) >= MIN_LINE_CHARS}
        entry["lines"].update(sorted(long_lines, key=lambda s: (-len(s), s))[:NUM_LONG_LINES])
        try:
            code = compile(text, path.relative_to(tree).as_posix(), "exec", dont_inherit=True)
        except SyntaxError:
            continue
        entry["names"].update(_code_strings(code))
    out: dict[str, Any] = {}
    for name, entry in sorted(modules.items()):
        lines, names = sorted(entry["lines"]), sorted(entry["names"])
        out[name] = {
            "lines": lines,
            # One long line alone is often a common idiom; two are a copy.
            "need_lines": min(2, len(lines)),
            # Too few names to tell a module from another one of the same name: no bytecode check.
            "names": names if len(names) >= 2 else [],
            # Half of them: a compiled copy (even of another version) holds most; another module
            # of the same name shares a few common ones (``compare``, ``replace``, ...).
            "need_names": max(2, math.ceil(len(names) / 2)),
        }
    return {"slug": slug, "dist_regex": dist_regex(spec.name), "modules": out}


def _code_strings(code: types.CodeType) -> set[str]:
    """Names of the functions and classes a module defines and its long string constants: what its
    ``.pyc`` stores verbatim."""
    found: set[str] = set()
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            name = const.co_name
            if len(name) >= MIN_NAME_CHARS and not name.startswith(("<", "__")):
                found.add(name)
            found |= _code_strings(const)
        elif isinstance(const, str) and len(const) >= MIN_STRING_CHARS:
            found.add(const[:80])
    return found


def scan(
    sandbox: Sandbox, fingerprints: Sequence[dict[str, Any]], limits: LimitsConfig
) -> dict[str, list[str]]:
    """Every readable copy of the fingerprinted projects, as sandboxed code sees the file system:
    ``{slug: ["path (why)", ...]}`` (an archive member is ``archive!member``); raises
    ``VisibilityError`` when the scan does not finish."""
    job = {
        "roots": ["/"],
        "prune": ["/proc", "/sys", "/dev", str(sandbox.root_dir)],
        "projects": list(fingerprints),
    }
    found: dict[str, list[str]] = {f["slug"]: [] for f in fingerprints}
    with sandbox.workspace() as ws:
        run = sandbox.run(
            ws, ["python", "-s", "-B", "-c", SCANNER_SOURCE], limits=limits, stdin=json.dumps(job).encode()
        )
    ended = False
    for line in run.stdout.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if not isinstance(item, dict):
            continue
        if "end" in item:
            ended = True
        elif item.get("project") in found:
            found[item["project"]].append(f"{item.get('path')} ({item.get('why')})")
    if not ended:
        if run.timed_out:
            raise VisibilityError(
                f"the visibility scan timed out after {limits.timeout_s:g} s (scan_timeout_s); raise it"
            )
        raise VisibilityError(
            f"the visibility scan did not finish (exit {run.exit_code}, signal {run.signal}, limits hit "
            f"{list(run.limits_hit)}): {run.stderr.strip()[-500:] or run.stdout.strip()[-500:]}"
        )
    return {slug: sorted(set(paths)) for slug, paths in found.items()}
