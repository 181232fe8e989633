"""The fault suite's seed reaches the JUnit report, one per run, and the random faults come from it.

A miniature suite (the real ``tests/faults/conftest.py`` and one scenario that draws a "kill
point") is run by pytest with two xdist workers, the way the whole suite runs (``pytest tests``,
where only the workers load the fault conftest) and the way ``bench/faults.py`` runs it."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCENARIO = """
import os
from pathlib import Path


def test_draws_a_kill_point(request, fault_rng):
    Path(os.environ["KILL_POINTS"], request.node.name).write_text(str(fault_rng.randrange(10**9)))


def test_draws_another(request, fault_rng):
    Path(os.environ["KILL_POINTS"], request.node.name).write_text(str(fault_rng.randrange(10**9)))
"""


def run_suite(tmp: Path, args: list[str], env: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """Run the miniature suite; the report and each scenario's recorded seed."""
    report = tmp / f"report-{len(list(tmp.glob('report-*')))}.xml"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *args,
            "-n",
            "2",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            f"--junitxml={report}",
        ],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seeds = {
        case.get("name", ""): prop.get("value", "")
        for case in ET.parse(report).getroot().iter("testcase")
        for prop in case.iter("property")
        if prop.get("name") == "fault_seed"
    }
    return report, seeds


@pytest.fixture
def suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, str]]:
    faults = tmp_path / "tests" / "faults"
    faults.mkdir(parents=True)
    shutil.copy(REPO / "tests" / "faults" / "conftest.py", faults / "conftest.py")
    (faults / "test_tiny_faults.py").write_text(SCENARIO)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "kill-points").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAULTS_", "PYTEST_"))}
    return tmp_path, {**env, "KILL_POINTS": str(tmp_path / "kill-points")}


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_faults", REPO / "bench" / "faults.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args", [["tests"], ["tests/faults"]], ids=["whole-suite", "fault-suite"])
def test_every_scenario_records_the_one_seed_of_its_run(suite, args, capsys) -> None:
    tmp, env = suite
    report, seeds = run_suite(tmp, args, env)
    assert set(seeds) == {"test_draws_a_kill_point", "test_draws_another"}
    assert len(set(seeds.values())) == 1, f"the two workers drew different seeds: {seeds}"
    (seed,) = set(seeds.values())
    load_bench().summarize(report)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == [f"seed={seed}", "scenarios=2 survived=2 silent=0"]


def test_a_fixed_seed_replays_the_same_kill_points(suite) -> None:
    tmp, env = suite
    env = {**env, "FAULTS_SEED": "1234"}
    _, seeds = run_suite(tmp, ["tests"], env)
    assert set(seeds.values()) == {"1234"}
    # The drawn kill point is the one a Random seeded by the suite's seed and the test's id gives.
    drawn = {path.name: int(path.read_text()) for path in (tmp / "kill-points").iterdir()}
    assert set(drawn) == {"test_draws_a_kill_point", "test_draws_another"}
    for name, value in drawn.items():
        node_id = f"tests/faults/test_tiny_faults.py::{name}"
        assert value == random.Random(f"1234/{node_id}").randrange(10**9)


def test_the_seed_varies_per_run_unless_fixed() -> None:
    spec = importlib.util.spec_from_file_location(
        "faults_conftest", REPO / "tests" / "faults" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    run_a, run_b = {"PYTEST_XDIST_TESTRUNUID": "9f" * 16}, {"PYTEST_XDIST_TESTRUNUID": "3c" * 16}
    assert conftest.run_seed(run_a) == conftest.run_seed(dict(run_a))  # the workers of one run agree
    assert conftest.run_seed(run_a) != conftest.run_seed(run_b)  # another run, another seed
    assert len({conftest.run_seed({}) for _ in range(5)}) > 1  # drawn afresh without xdist
    assert conftest.run_seed({**run_a, "FAULTS_SEED": "77"}) == "77"  # fixed wins
