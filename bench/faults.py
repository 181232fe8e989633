"""The fault-injection suite as a table: every scenario of ``tests/faults/``, survived or not.

Each test in ``tests/faults/`` is one scenario: a damaged file of some kind, a hostile request, a
process killed at a random point of a step, a full disk, a run that would train on nothing. Each
asserts that nothing was lost, nothing wrong was accepted silently, and the message says what
happened. This script runs them (``pytest tests/faults``, the slow ones included unless
``--fast``) and prints one row per test file, then

    seed=K
    scenarios=N survived=M silent=S

``seed`` is the fault seed every randomly drawn fault came from (a kill point, how full a disk is):
drawn afresh on each run unless given (``--seed``, or ``FAULTS_SEED``), so repeated
runs explore other moments and any one can be replayed; ``--from-report`` reads it from the
report (each scenario's ``fault_seed`` property). ``survived`` counts passing scenarios.
``silent`` counts failures where the fault went unnoticed
(the test expected an error and none came: pytest's "DID NOT RAISE", or an assertion whose message
says the damaged input was accepted) — the number that must be 0.

    uv run python bench/faults.py            # ~12 min (kills and resumes real runs)
    uv run python bench/faults.py --fast     # without the end-to-end scenarios, ~3 min
    uv run python bench/faults.py --seed 1234  # replay the faults of an earlier run
    uv run python bench/faults.py --from-report ci.xml   # the table from a full run's JUnit report
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEED_ENV = "FAULTS_SEED"  # read by tests/faults/conftest.py
SEED_PROPERTY = "fault_seed"  # the JUnit property tests/faults/conftest.py gives every scenario
SILENT_MARKERS = ("DID NOT RAISE", "accepted", "resumed from the damaged", "did not happen")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fast", action="store_true", help="leave out the slow (end-to-end) scenarios")
    parser.add_argument(
        "--from-report",
        type=Path,
        help="summarize an existing JUnit XML report (e.g. of a full `pytest --junitxml=...` run) "
        "instead of running the scenarios; only its tests/faults cases count",
    )
    parser.add_argument(
        "--seed", type=int, help=f"the fault seed (default: ${SEED_ENV}, else a fresh random one)"
    )
    args = parser.parse_args()
    if args.from_report is not None:
        summarize(args.from_report)
        return
    seed = args.seed if args.seed is not None else int(os.environ.get(SEED_ENV) or secrets.randbelow(2**32))
    print(f"fault seed: {seed} (replay with --seed {seed})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "faults.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "tests/faults",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
        ]
        if args.fast:
            command += ["-m", "not slow"]
        subprocess.run(command, cwd=REPO, env={**os.environ, SEED_ENV: str(seed)})
        summarize(report, seed)


def summarize(report: Path, seed: int | str | None = None) -> None:
    """The table and the last lines, from the JUnit XML report of a run that included tests/faults."""
    cases = [
        case
        for case in ET.parse(report).getroot().iter("testcase")
        if case.get("classname", "").startswith("tests.faults.")
    ]
    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    failures = []
    # Every scenario carries the run's seed (tests/faults/conftest.py); one run has one.
    recorded = sorted(
        {
            prop.get("value", "")
            for case in cases
            for prop in case.iter("property")
            if prop.get("name") == SEED_PROPERTY
        }
    )
    if seed is None and recorded:
        seed = ",".join(recorded)
    elif seed is not None and recorded and recorded != [str(seed)]:
        failures.append(f"the report's scenarios ran with seed {','.join(recorded)}, not {seed}")
    for case in cases:
        where = case.get("classname", "?").rsplit(".", 1)[-1]
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if case.find("skipped") is not None:
            failures.append(
                f"{where}::{case.get('name')}: skipped (a skipped scenario does not count as survived)"
            )
            rows[where][0] += 1
            continue
        rows[where][0] += 1
        if problem is None:
            rows[where][1] += 1
            continue
        text = (problem.get("message") or "") + (problem.text or "")
        if any(marker in text for marker in SILENT_MARKERS):
            rows[where][2] += 1
        failures.append(f"{where}::{case.get('name')}: {(problem.get('message') or '').splitlines()[:1]}")
    print(f"{'scenario file':32s} {'scenarios':>9s} {'survived':>8s} {'silent':>6s}")
    for where, (total, survived, silent) in sorted(rows.items()):
        print(f"{where:32s} {total:9d} {survived:8d} {silent:6d}")
    for line in failures:
        print("  not survived:", line)
    total, survived, silent = (sum(r[i] for r in rows.values()) for i in range(3))
    print(f"seed={seed if seed is not None else 'unknown'}")
    print(f"scenarios={total} survived={survived} silent={silent}")


if __name__ == "__main__":
    main()
