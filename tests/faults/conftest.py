"""The fault suite's seed: every randomly drawn fault (a kill point, how full a disk is) comes from
it. It varies per run (so repeated runs explore other moments) unless fixed with
``FAULTS_SEED``; pytest's header and ``bench/faults.py`` print it, so a failure can
be replayed exactly."""

from __future__ import annotations

import os
import random
import secrets

import pytest

SEED_ENV = "FAULTS_SEED"


def pytest_configure(config: pytest.Config) -> None:
    # Drawn once in the controlling process, before any xdist worker starts (they inherit it).
    os.environ.setdefault(SEED_ENV, str(secrets.randbelow(2**32)))


def pytest_report_header(config: pytest.Config) -> str:
    return f"fault seed: {os.environ[SEED_ENV]} (set {SEED_ENV} to replay)"


@pytest.fixture
def fault_rng(request: pytest.FixtureRequest) -> random.Random:
    """A random stream for this test, from the suite's seed and the test's id."""
    seed = os.environ[SEED_ENV]
    print(f"fault seed {seed} ({SEED_ENV}={seed} replays {request.node.nodeid})")
    return random.Random(f"{seed}/{request.node.nodeid}")
