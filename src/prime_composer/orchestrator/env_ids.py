"""Environment ids and where local environments live, without importing verifiers.

``envs.py`` loads environments (and imports verifiers, ~3 s); the launcher's pre-launch checks
only need to know whether an id resolves, which this module answers from the file system.
``rl envs`` (``main``) lists what resolves: local folders, installed verifiers environment
packages, verifiers' built-in tasksets and installed OpenEnv environment packages (each with the
``openenv.app`` that serves it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

DEFAULT_ENV_DIRS: tuple[Path, ...] = (Path("environments"),)
"""Where local environment folders are looked up (relative paths resolve against the cwd)."""


def module_name(env_id: str) -> str:
    """The import name verifiers derives from an id (``owner/my-env@1`` -> ``my_env``)."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def local_environments(env_dirs: Sequence[Path] = DEFAULT_ENV_DIRS) -> dict[str, Path]:
    """Local environments by module name -> the folder to put on ``sys.path``."""
    found: dict[str, Path] = {}
    for env_dir in env_dirs:
        env_dir = Path(env_dir).resolve()
        if not env_dir.is_dir():
            continue
        for folder in sorted(env_dir.iterdir()):
            module = module_name(folder.name)
            if (folder / module / "__init__.py").is_file():
                found.setdefault(module, folder)
    return found


def environment_exists(env_id: str, env_dirs: Sequence[Path] = DEFAULT_ENV_DIRS) -> bool:
    """Whether ``env_id`` names a local environment, an installed package or a verifiers built-in
    taskset (found on disk; nothing is imported)."""
    module = module_name(env_id)
    if module in local_environments(env_dirs) or importlib.util.find_spec(module) is not None:
        return True
    spec = importlib.util.find_spec("verifiers")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        tasksets = Path(location) / "v1" / "tasksets"
        if (tasksets / module).is_dir() or (tasksets / f"{module}.py").is_file():
            return True
    return False


@dataclass(frozen=True)
class EnvironmentEntry:
    """One environment ``[[orchestrator.env]] id = ...`` can load, for ``rl envs``."""

    id: str
    kind: str
    """``local`` (a folder of ``environments/``), ``installed`` (a distribution that depends on
    verifiers and ships the module), ``builtin`` (a taskset of verifiers itself) or ``openenv`` (an
    installed OpenEnv environment package, loaded with an ``openenv`` table, not by ``id``)."""
    where: str


_OPENENV_CORE = ("openenv", "openenv-core")
_MANIFEST_APP = re.compile(r"^app:\s*['\"]?([\w.]+:[\w.]+)['\"]?\s*$", re.MULTILINE)


def openenv_app(distribution: str) -> str | None:
    """The ``openenv.app`` (``module:attribute``) that serves an installed OpenEnv environment
    package, or ``None`` when ``distribution`` is not one. OpenEnv's layout (``openenv init``): a
    distribution ``openenv-<name>`` (or one that depends on ``openenv``/``openenv-core``) ships
    the package ``<name>`` (else another top-level package of its files) with ``server/app.py``;
    its ``openenv.yaml`` may name another app (``app: server.app:app``, relative to the package).
    Found on disk; nothing is imported."""
    named = re.sub(r"^openenv[-_.]", "", distribution.lower()).replace("-", "_").replace(".", "_")
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        files = []
    shipped = sorted({f.parts[0] for f in files if len(f.parts) > 1 and f.parts[0].isidentifier()})
    for module in [named, *(m for m in shipped if m != named)]:
        if not module.isidentifier() or importlib.util.find_spec(module) is None:
            continue
        spec = importlib.util.find_spec(module)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            manifest = Path(location) / "openenv.yaml"
            found = _MANIFEST_APP.search(manifest.read_text()) if manifest.is_file() else None
            relative = found.group(1) if found else "server.app:app"
            if (Path(location) / (relative.split(":")[0].replace(".", "/") + ".py")).is_file():
                return f"{module}.{relative}"
    return None


def _openenv_entries(seen: set[str]) -> list[EnvironmentEntry]:
    entries = []
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        name = dist.metadata["Name"] or ""
        requires = [r.split(";")[0].strip().lower() for r in dist.requires or []]
        normal = re.sub(r"[-_.]+", "-", name).lower()
        uses_openenv = normal.startswith("openenv-") or any(
            re.match(r"(openenv|openenv[-_]core)\b(?![-_])", r) for r in requires
        )
        if normal in _OPENENV_CORE or not uses_openenv:
            continue
        app = openenv_app(name)
        module = app.split(".", 1)[0] if app is not None else ""
        if app is None or module in seen:
            continue
        seen.add(module)
        entries.append(EnvironmentEntry(module, "openenv", f"{name} {dist.version}: openenv.app = {app!r}"))
    return entries


def catalog(env_dirs: Sequence[Path] = DEFAULT_ENV_DIRS) -> list[EnvironmentEntry]:
    """Every environment id that resolves here, found on disk and in installed metadata (nothing
    is imported); local folders shadow installed packages of the same module name."""
    entries = [
        EnvironmentEntry(m, "local", str(folder)) for m, folder in local_environments(env_dirs).items()
    ]
    seen = {entry.id for entry in entries}
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        name = dist.metadata["Name"] or ""
        requires = [r.split(";")[0] for r in dist.requires or []]
        if name in ("verifiers", "prime-composer") or not any(
            re.match(r"verifiers\b", r.strip()) for r in requires
        ):
            continue
        module = module_name(name)
        if module in seen or importlib.util.find_spec(module) is None:
            continue  # a library built on verifiers, not an environment of the same name
        seen.add(module)
        entries.append(EnvironmentEntry(name, "installed", f"{name} {dist.version}"))
    spec = importlib.util.find_spec("verifiers")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        tasksets = Path(location) / "v1" / "tasksets"
        for path in sorted(tasksets.iterdir()) if tasksets.is_dir() else []:
            module = path.stem if path.suffix == ".py" else path.name
            if (
                module.startswith("_")
                or module in seen
                or not (path.suffix == ".py" or (path / "__init__.py").is_file())
            ):
                continue
            seen.add(module)
            entries.append(EnvironmentEntry(module, "builtin", "verifiers.v1.tasksets"))
    return entries + _openenv_entries(seen)


def main(argv: Sequence[str]) -> int:
    """``rl envs [--env-dir DIR ...] [--json]``: the environments ``[[orchestrator.env]]`` can load."""
    parser = argparse.ArgumentParser(prog="rl envs", description=main.__doc__)
    parser.add_argument(
        "--env-dir", action="append", type=Path, help="folder of local environments (default: environments/)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(list(argv))
    entries = catalog(args.env_dir or DEFAULT_ENV_DIRS)
    if args.json:
        for entry in entries:
            print(json.dumps(asdict(entry)))
        return 0
    width = max([len(e.id) for e in entries] + [2])
    print(f"{'id':<{width}}  {'kind':<9}  where")
    for entry in entries:
        print(f"{entry.id:<{width}}  {entry.kind:<9}  {entry.where}")
    print(
        "builtin tasksets mostly need containers or network; an openenv row is trained with "
        "[[orchestrator.env]] openenv = {app = '...'} (the app shown), not by id"
    )
    return 0
