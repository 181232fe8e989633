"""Install an ``[[orchestrator.env]] package = "..."`` before the environment loads, as PRIME-RL's
environment hub install does: ``uv pip install`` of the requirement into the orchestrator's own
Python environment.

Why this environment and not a venv per run: the orchestrator imports the taskset in-process
(verifiers loads it as a module), so the package must live beside the project's packages in the
interpreter that runs it; a venv of its own would need the whole project (torch, verifiers) again,
or a ``sys.path`` that mixes two resolutions. So that the install cannot move the project's own
packages, every installed distribution is passed at its version as a constraint: the install may
add packages, never upgrade or downgrade one (a package that needs another version fails, with
uv's resolver error). A later exact ``uv sync`` removes what it added; the next run installs it
again (from uv's cache).

It happens only for runs whose config names a ``package``, when the orchestrator (or ``eval``)
loads its environments (an ``openenv`` entry with ``app``: before the app is served), and only
when the distribution is not installed; an installed one of a
version the requirement refuses is an error (pin that version or uninstall it), never replaced. After
it the package must provide the module its ``id`` names, exporting a verifiers ``Taskset``
subclass in ``__all__`` (the environment entry point), or for an OpenEnv package the module of
``openenv.app``; else the run stops with an error that says what the package ships.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from prime_composer.config.env import EnvConfig
from prime_composer.orchestrator.env_ids import module_name

logger = logging.getLogger(__name__)

INSTALL_TIMEOUT_S = 900.0
"""Limit of one ``uv pip install``."""


def install_package(entry: EnvConfig, index: int) -> None:
    """Make ``entry.package`` installed and check it provides the environment ``entry.id``;
    raises ``ValueError`` naming the entry and what is wrong."""
    assert entry.package is not None
    where = f"orchestrator.env[{index}].package = {entry.package!r}"
    requirement = Requirement(entry.package)
    installed = _installed_version(requirement.name)
    if installed is not None and not requirement.specifier.contains(installed, prereleases=True):
        raise ValueError(
            f"{where}: {requirement.name} {installed} is installed and does not satisfy it; an install never "
            f"changes an installed version, so pin the installed one ({requirement.name}=={installed}) or "
            f"remove it first (uv pip uninstall --python {sys.executable} {requirement.name})"
        )
    if installed is None:
        _uv_install(entry, where)
        importlib.invalidate_caches()
        installed = _installed_version(requirement.name)
        if installed is None or not requirement.specifier.contains(installed, prereleases=True):
            raise ValueError(f"{where}: the install ran, but no distribution satisfying it is installed")
    if entry.openenv is not None and entry.openenv.app is not None:
        check_openenv_app(entry.openenv.app, requirement.name, where)
    else:
        check_entry_point(entry, requirement.name, where)


def check_openenv_app(app: str, distribution: str, where: str) -> None:
    """The module of ``openenv.app`` (``module:attribute``) exists after the install (the app is
    imported by the server process the orchestrator starts, not here)."""
    module = app.split(":", 1)[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        ships = ", ".join(_top_level_modules(distribution)) or "no module"
        raise ValueError(
            f"{where}: {distribution} is installed but has no module {module!r} (openenv.app = {app!r}); "
            f"it ships {ships}. Set openenv.app to the package's app (see `rl envs`)"
        )


def check_entry_point(entry: EnvConfig, distribution: str, where: str) -> None:
    """The module ``entry.id`` names exists and exports a verifiers ``Taskset`` subclass."""
    module = module_name(entry.id)
    if importlib.util.find_spec(module) is None:
        ships = ", ".join(_top_level_modules(distribution)) or "no module"
        raise ValueError(
            f"{where}: {distribution} is installed but has no module {module!r} (the module id = {entry.id!r} "
            f"names); it ships {ships}. Set id to the environment's id (its module name with '-' for '_')"
        )
    import verifiers.v1 as vf

    loaded = importlib.import_module(module)
    exported = [getattr(loaded, name, None) for name in getattr(loaded, "__all__", None) or []]
    if not any(
        isinstance(obj, type) and issubclass(obj, vf.Taskset) and obj is not vf.Taskset for obj in exported
    ):
        raise ValueError(
            f"{where}: module {module!r} of {distribution} exports no verifiers Taskset subclass in __all__, "
            "so it is not an environment package (an environment exports its taskset: "
            "__all__ = ['MyTaskset'])"
        )


def _installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _top_level_modules(distribution: str) -> list[str]:
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        return []
    tops = {
        f.parts[0].removesuffix(".py")
        for f in files
        if f.parts and not f.parts[0].endswith((".dist-info", ".pth"))
    }
    return sorted(t for t in tops if t.isidentifier())


def _uv_install(entry: EnvConfig, where: str) -> None:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        raise ValueError(
            f"{where}: installing it needs uv (not found on PATH); install uv, or install the package into "
            f"this environment yourself ({sys.executable} -m pip install {entry.package!r})"
        )
    assert entry.package is not None
    # One pin per distribution: the first on sys.path, the one that imports (a name found twice,
    # at two versions, would make the constraints unsatisfiable).
    held: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and canonicalize_name(name) != "prime-composer":
            held.setdefault(canonicalize_name(name), f"{name}=={dist.version}")
    pins = sorted(held.values())
    with tempfile.NamedTemporaryFile(
        "w", prefix="prime-composer-pins-", suffix=".txt", delete=False
    ) as pins_file:
        pins_file.write("\n".join(pins) + "\n")
    command = [uv, "pip", "install", "--python", sys.executable, "--constraint", pins_file.name]
    for link in entry.package_find_links:
        command += ["--find-links", link]
    if entry.package_no_index:
        command.append("--no-index")
    command.append(entry.package)
    logger.warning("%s: not installed; installing it into %s: %s", where, sys.prefix, " ".join(command))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise ValueError(f"{where}: uv pip install took more than {INSTALL_TIMEOUT_S:g} s") from e
    finally:
        Path(pins_file.name).unlink(missing_ok=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-3000:]
        raise ValueError(
            f"{where}: uv pip install failed (exit {done.returncode}); installed packages are held at their "
            f"versions, so one that needs another version cannot install here. uv said:\n{tail}"
        )
