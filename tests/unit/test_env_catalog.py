"""``rl envs``: local folders, installed verifiers environment packages (a distribution that
depends on verifiers and ships the module) and verifiers' built-in tasksets; libraries that only
use verifiers and packages without the module are left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prime_composer.launch.rl import main as rl_main
from prime_composer.orchestrator.env_ids import catalog


def _dist(site: Path, name: str, requires: list[str], *, module: str | None) -> None:
    info = site / f"{name.replace('-', '_')}-0.3.dist-info"
    info.mkdir(parents=True)
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        "Version: 0.3",
        *(f"Requires-Dist: {r}" for r in requires),
    ]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    if module:
        (site / module).mkdir()
        (site / module / "__init__.py").write_text("")


def test_catalog_lists_local_installed_and_builtin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    envs = tmp_path / "envs"
    (envs / "my-task" / "my_task").mkdir(parents=True)
    (envs / "my-task" / "my_task" / "__init__.py").write_text("")
    (envs / "notes").mkdir()  # no package inside: not an environment
    site = tmp_path / "site"
    _dist(site, "wordle-env", ["verifiers>=0.4", "httpx; extra == 'x'"], module="wordle_env")
    _dist(site, "verifiers-helpers", ["verifiers"], module=None)  # no module of its name
    _dist(site, "plain-lib", ["numpy"], module="plain_lib")  # not built on verifiers
    _dist(site, "my-task", ["verifiers"], module="my_task")  # shadowed by the local folder
    monkeypatch.syspath_prepend(str(site))

    entries = {e.id: e for e in catalog([envs])}
    assert entries["my_task"].kind == "local" and entries["my_task"].where == str(
        (envs / "my-task").resolve()
    )
    assert entries["wordle-env"].kind == "installed" and entries["wordle-env"].where == "wordle-env 0.3"
    assert "verifiers-helpers" not in entries and "plain-lib" not in entries and "notes" not in entries
    assert "my-task" not in entries and "prime-composer" not in entries
    assert entries["openenv"].kind == "builtin"  # verifiers ships an OpenEnv taskset


def test_rl_envs_prints_one_json_object_per_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "arith2" / "arith2").mkdir(parents=True)
    (tmp_path / "arith2" / "arith2" / "__init__.py").write_text("")
    with pytest.raises(SystemExit) as exited:
        rl_main(["envs", "--env-dir", str(tmp_path), "--json"])
    assert exited.value.code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == {"id": "arith2", "kind": "local", "where": str((tmp_path / "arith2").resolve())}
    assert {row["kind"] for row in rows} <= {"local", "installed", "builtin", "openenv"}


def test_installed_openenv_packages_are_listed_with_the_app_that_serves_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    # OpenEnv's layout (openenv init): openenv-<name> ships <name>/server/app.py.
    _dist(site, "openenv-echo_env", ["openenv>=0.2.2"], module="echo_env")
    (site / "echo_env" / "server").mkdir()
    (site / "echo_env" / "server" / "app.py").write_text("app = None\n")
    # Any name, depending on openenv-core, its manifest naming another app module.
    _dist(site, "grid-game", ["openenv-core>=0.2", "numpy"], module="grid_game")
    (site / "grid_game" / "openenv.yaml").write_text("spec_version: 1\nname: grid\napp: server.main:app\n")
    (site / "grid_game" / "server").mkdir()
    (site / "grid_game" / "server" / "main.py").write_text("app = None\n")
    # Built on openenv but no server app (a client library), and a package that only shares a prefix.
    _dist(site, "openenv-client-extras", ["openenv"], module="client_extras")
    _dist(site, "openenvy", ["openenvy-core"], module="openenvy")
    (site / "openenvy" / "server").mkdir()
    (site / "openenvy" / "server" / "app.py").write_text("app = None\n")
    monkeypatch.syspath_prepend(str(site))

    entries = {e.id: e for e in catalog([tmp_path / "none"])}
    assert entries["echo_env"].kind == "openenv"
    assert entries["echo_env"].where == "openenv-echo_env 0.3: openenv.app = 'echo_env.server.app:app'"
    assert entries["grid_game"].where == "grid-game 0.3: openenv.app = 'grid_game.server.main:app'"
    assert "client_extras" not in entries and "openenvy" not in entries
    assert [e.kind for e in catalog([tmp_path / "none"])].count("openenv") == 2
