"""``[[orchestrator.env]] package = "..."``: an environment package installed by name before it
loads, offline: wheels built here (zip files written by hand, no build backend), installed from a
local ``--find-links`` folder with ``--no-index`` into a throwaway venv that sees the project's
packages (so the project's own environment is never changed by the test).

Checked: a missing package is installed and its environment loads; an installed one is not
installed again, nor replaced by another version; a package that is not on the find-links, one without a Taskset export and one
without the module its id names are errors that say so; the installed versions of everything
else are held (a package that needs another version of an installed one fails)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from prime_composer.config.env import EnvConfig

TASKSET = """
import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=1.0)
    async def same(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 3


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self) -> list[EchoTask]:
        return [
            EchoTask(EchoData(id=str(i), prompt=f"Say {i}.", answer=str(i)), self.config.task)
            for i in range(self.config.num_tasks)
        ]


__all__ = ["EchoTaskset"]
"""


def build_wheel(
    folder: Path, name: str, version: str, files: dict[str, str], requires: list[str] = ()
) -> Path:
    """A pure-Python wheel of ``files`` (path -> text) with a valid RECORD."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    metadata = "\n".join(
        [
            "Metadata-Version: 2.1",
            f"Name: {name}",
            f"Version: {version}",
            *(f"Requires-Dist: {r}" for r in requires),
        ]
    )
    contents = {
        **files,
        f"{info}/METADATA": metadata + "\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    records = []
    for path, text in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        records.append(f"{path},sha256={digest},{len(text.encode())}")
    records.append(f"{info}/RECORD,,")
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in contents.items():
            archive.writestr(path, text)
        archive.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    build_wheel(folder, "echo-env", "0.1.0", {"echo_env/__init__.py": TASKSET})
    build_wheel(folder, "echo-env", "0.2.0", {"echo_env/__init__.py": TASKSET})
    build_wheel(folder, "not-an-env", "1.0", {"not_an_env/__init__.py": "VALUE = 1\n__all__ = ['VALUE']\n"})
    build_wheel(folder, "odd-name", "1.0", {"something_else/__init__.py": TASKSET})
    # Needs another version of a package the project has: the held versions refuse it.
    build_wheel(folder, "greedy-env", "1.0", {"greedy_env/__init__.py": TASKSET}, requires=["pydantic<2"])
    # An OpenEnv environment package in OpenEnv's layout (openenv init): the brevity game of the
    # OpenEnv tests as brevity_env/server/app.py.
    game = (Path(__file__).with_name("openenv_envs.py")).read_text() + "\napp = brevity_app\n"
    build_wheel(
        folder,
        "openenv-brevity",
        "0.1.0",
        {
            "brevity_env/__init__.py": "",
            "brevity_env/server/__init__.py": "",
            "brevity_env/server/app.py": game,
        },
    )
    return folder


@pytest.fixture()
def venv(tmp_path: Path) -> Path:
    """A venv of this Python whose ``site`` also reads the project's site-packages (last on the
    path, so what the test installs in the venv comes first); returns its python."""
    target = tmp_path / "venv"
    uv = os.environ.get("UV") or shutil.which("uv")  # as env_install finds it
    assert uv is not None, "uv is not on PATH"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(target)], check=True)
    (purelib,) = target.glob("lib/python*/site-packages")
    lines = [f"import site; site.addsitedir({p!r})" for p in site.getsitepackages()]
    (purelib / "_project.pth").write_text("\n".join(lines) + "\n")
    return target / "bin" / "python"


LOAD = """
import json, logging, sys
from prime_composer.config.env import EnvConfig
from prime_composer.orchestrator import envs
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
entry = EnvConfig.model_validate(json.loads(sys.argv[1]))
try:
    loaded = envs.load_env(entry, 0)
except ValueError as e:
    print(json.dumps({"error": str(e)}))
else:
    print(json.dumps({"tasks": [t.data.prompt for t in loaded.tasks()]}, default=str))
"""


def load(python: Path, **entry: object) -> tuple[dict, str]:
    done = subprocess.run(
        [str(python), "-c", LOAD, json.dumps(entry)], capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def installed(python: Path, name: str) -> str | None:
    code = f"from importlib import metadata\ntry: print(metadata.version({name!r}))\nexcept metadata.PackageNotFoundError: print('-')"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    return None if out == "-" else out


@pytest.mark.slow  # a Python start-up importing verifiers per load, ~45 s on 2 cores
def test_a_package_is_installed_by_name_and_its_environment_loads(venv: Path, wheels: Path) -> None:
    entry = {"package": "echo-env==0.1.0", "package_find_links": [str(wheels)], "package_no_index": True}
    assert installed(venv, "echo-env") is None
    result, log = load(venv, **entry)
    assert result == {"tasks": ["Say 0.", "Say 1.", "Say 2."]} and "installing it into" in log
    assert installed(venv, "echo-env") == "0.1.0"
    assert installed(Path(sys.executable), "echo-env") is None  # the project's environment is untouched
    # Installed: loading again installs nothing; a pin the installed version misses is an error
    # (0.2.0 is on the find-links, and is not installed over 0.1.0).
    result, log = load(venv, **entry)
    assert "tasks" in result and "installing it" not in log
    result, log = load(venv, **{**entry, "package": "echo-env>=0.2"})
    assert "echo-env 0.1.0 is installed and does not satisfy it" in result["error"]
    assert "echo-env==0.1.0" in result["error"] and "installing it" not in log
    assert installed(venv, "echo-env") == "0.1.0"


@pytest.mark.slow  # a Python start-up importing verifiers per load, ~45 s on 2 cores
def test_install_errors_say_what_is_wrong(venv: Path, wheels: Path) -> None:
    local = {"package_find_links": [str(wheels)], "package_no_index": True}
    missing, _ = load(venv, package="no-such-env", **local)
    assert "orchestrator.env[0].package = 'no-such-env': uv pip install failed" in missing["error"]
    assert "no-such-env" in missing["error"].split("uv said:")[1]
    not_env, _ = load(venv, package="not-an-env", **local)
    assert "exports no verifiers Taskset subclass in __all__" in not_env["error"]
    odd, _ = load(venv, package="odd-name", **local)
    assert "has no module 'odd_name'" in odd["error"] and "it ships something_else" in odd["error"]
    greedy, _ = load(venv, package="greedy-env", **local)
    assert "uv pip install failed" in greedy["error"] and "pydantic" in greedy["error"]
    assert installed(venv, "greedy-env") is None


def test_package_config() -> None:
    assert EnvConfig(package="wordle-env==0.2.1").id == "wordle-env"
    assert EnvConfig(package="wordle-env", id="owner/wordle-env").id == "owner/wordle-env"
    with pytest.raises(ValueError, match="is not a requirement"):
        EnvConfig(package="wordle env")
    with pytest.raises(ValueError, match=r"drop package, or serve the package's app with openenv\.app"):
        EnvConfig(package="x", openenv={"url": "http://127.0.0.1:1"})
    served = EnvConfig(package="openenv-brevity", openenv={"app": "brevity_env.server.app:app"})
    assert served.id == "openenv" and served.package == "openenv-brevity"


def test_a_package_entry_through_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad requirement stops config resolution naming the entry and key; a good one passes the
    launcher's preflight before it is installed (the orchestrator installs it when it loads)."""
    from prime_composer.config.errors import ConfigError
    from prime_composer.config.ports import free_port
    from prime_composer.config.resolve import resolve_rl_config
    from prime_composer.launch.preflight import preflight

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    base = [
        "@",
        str(repo / "configs" / "quickstart.toml"),
        "--inference.port",
        str(free_port("127.0.0.1", set())),
    ]
    with pytest.raises(ConfigError) as info:
        resolve_rl_config([*base, "--orchestrator.env", "[{package = 'echo env'}]"])
    assert "orchestrator.env" in str(info.value) and "package = 'echo env' is not a requirement" in str(
        info.value
    )
    config, _ = resolve_rl_config([*base, "--orchestrator.env", "[{package = 'echo-env==0.1.0'}]"])
    assert config.orchestrator.env[0].id == "echo-env"
    preflight(config)  # echo-env is not installed here: no "no such environment"


@pytest.mark.slow  # an install, a served OpenEnv app and `rl envs` in the venv, ~40 s on 2 cores
def test_an_openenv_package_is_installed_and_its_app_served(venv: Path, wheels: Path) -> None:
    """``package`` with ``openenv.app``: the OpenEnv package is installed into the venv, then the
    orchestrator serves its app (a server process importing it from there) and reads its tasks;
    ``rl envs`` lists it with that app. A wrong app module is an error naming what it ships."""
    local = {"package": "openenv-brevity", "package_find_links": [str(wheels)], "package_no_index": True}
    assert installed(venv, "openenv-brevity") is None
    bad, _ = load(venv, **local, openenv={"app": "brevity.server.app:app"})
    assert "has no module 'brevity.server.app'" in bad["error"] and "it ships brevity_env" in bad["error"]
    app = {"app": "brevity_env.server.app:app", "resets": [{"seed": 0}, {"seed": 1}]}
    result, log = load(venv, **local, openenv=app)
    assert "tasks" in result and len(result["tasks"]) == 2, result
    assert (
        installed(venv, "openenv-brevity") == "0.1.0" and "installing it" not in log
    )  # the bad try installed it
    assert installed(Path(sys.executable), "openenv-brevity") is None
    listed = subprocess.run(
        [str(venv), "-m", "prime_composer.launch.rl", "envs", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [json.loads(line) for line in listed.splitlines()]
    assert {
        "id": "brevity_env",
        "kind": "openenv",
        "where": "openenv-brevity 0.1.0: openenv.app = 'brevity_env.server.app:app'",
    } in rows
