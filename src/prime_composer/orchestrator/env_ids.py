"""Environment ids and where local environments live, without importing verifiers.

``envs.py`` loads environments (and imports verifiers, ~3 s); the launcher's pre-launch checks
only need to know whether an id resolves, which this module answers from the file system.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
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
