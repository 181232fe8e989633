"""The fault suite's seed: every randomly drawn fault (a kill point, how full a disk is) comes from
it. It varies per run (so repeated runs explore other moments) unless fixed with
``FAULTS_SEED``; pytest's header prints it, every scenario carries it as the JUnit property
``fault_seed``, and ``bench/faults.py`` (``--from-report`` too) prints it, so a failure can be
replayed exactly.

One seed per run, in every process: ``pytest tests/faults`` draws it in the controlling process
before any xdist worker starts (they inherit the variable); a run of the whole suite loads this
file in the workers only, so there each derives it from the run's id that xdist gives all its
workers alike (``PYTEST_XDIST_TESTRUNUID``)."""

from __future__ import annotations

import os
import random
import secrets

import pytest

SEED_ENV = "FAULTS_SEED"
XDIST_RUN_ID_ENV = "PYTEST_XDIST_TESTRUNUID"
SEED_PROPERTY = "fault_seed"


def run_seed(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The seed of this run: ``FAULTS_SEED`` when set, else one from xdist's run id, else fresh."""
    if environ.get(SEED_ENV):
        return environ[SEED_ENV]
    run_id = environ.get(XDIST_RUN_ID_ENV)
    if run_id:
        return str(int(run_id, 16) % 2**32)
    return str(secrets.randbelow(2**32))


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SEED_ENV] = run_seed()


def pytest_report_header(config: pytest.Config) -> str:
    return f"fault seed: {os.environ[SEED_ENV]} (set {SEED_ENV} to replay)"


@pytest.fixture(autouse=True)
def _record_fault_seed(request: pytest.FixtureRequest) -> None:
    # Straight into the report's properties (the `record_property` fixture warns under xunit2).
    request.node.user_properties.append((SEED_PROPERTY, os.environ[SEED_ENV]))


@pytest.fixture
def fault_rng(request: pytest.FixtureRequest) -> random.Random:
    """A random stream for this test, from the suite's seed and the test's id."""
    seed = os.environ[SEED_ENV]
    print(f"fault seed {seed} ({SEED_ENV}={seed} replays {request.node.nodeid})")
    return random.Random(f"{seed}/{request.node.nodeid}")
