"""Benchmark: feature-deletion task generation speed, and what grading one episode costs.

1. **Generation.** From an already built corpus (``--corpus ci``, the default, builds the CI
   corpus into a temporary store first; ``--corpus pypi`` uses the store that ``build_corpus.py``
   filled), generate tasks with ``--workers`` validation threads and report accepted tasks per
   minute and validated candidates per minute (each validation = one suite run + three probes).
2. **Grading.** Grade ``--grades`` oracle episodes (the original code put back through the
   tools) and report the median time of one grade and of its parts: staging the trees, the
   sandboxed pytest run, the sandboxed probe run. The baseline, measured in the same run and
   alternated with the sandboxed grades, is the same two jobs run bare (``subprocess.run``, this
   process's user, no isolation, same Python and environment variables) on the same staged
   trees: the sandbox's share of a grade is ``(grade - bare) / grade``.

The last line is ``tasks_per_min=X grade_s=Y``.

Run (as root; ~2 min for the CI corpus on 2 shared cores, ~10-20 min for pypi)::

    uv run python bench/feature_deletion.py
    uv run python bench/feature_deletion.py --corpus pypi --hide /work --grades 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV_DIR = Path(__file__).resolve().parents[1] / "environments/feature_deletion"
sys.path.insert(0, str(ENV_DIR))

from feature_deletion import agents, corpus, generate, runs, trees  # noqa: E402
from feature_deletion.environment import Limits, open_sandbox  # noqa: E402
from feature_deletion.episode import FeatureDeletion  # noqa: E402
from feature_deletion.spec import CI_MANIFEST, PYPI_MANIFEST, Store, load_manifest  # noqa: E402
from feature_deletion.tasks import Task, write_tasks  # noqa: E402


def bare_job(python_env: Path, root: Path, job: dict[str, object], timeout_s: float) -> float:
    """Run one sandboxed.py job without the sandbox; its wall time."""
    env = {**runs.SANDBOX_ENV, "PATH": f"{python_env / 'bin'}:/usr/bin:/bin", "HOME": str(root)}
    start = time.monotonic()
    subprocess.run(
        ["python", "-s", "-B", "-c", runs.SANDBOXED_SOURCE],
        input=json.dumps(job).encode(),
        cwd=root,
        env=env,
        capture_output=True,
        timeout=timeout_s,
        executable=str(python_env / "bin" / "python"),
    )
    return time.monotonic() - start


def bare_grade(env: FeatureDeletion, task: Task, limits: Limits) -> float:
    """The grade's two jobs on the oracle's sources, unsandboxed (staging included, as in a grade)."""
    project = env.projects[task.project]
    tree = env.tree(task)
    spec = project.spec
    python_env = Path(env.sandbox.config.python_env or sys.prefix)
    start = time.monotonic()
    sources = trees.pristine_sources(spec, tree)
    with tempfile.TemporaryDirectory() as tmp:
        graded, probed = Path(tmp) / "graded", Path(tmp) / "probed"
        trees.stage_test_tree(spec, tree, sources, graded)
        trees.stage_probe_tree(spec, tree, sources, probed)
        pytest_job = {
            "mode": "pytest",
            "src": str(graded / spec.source_root),
            "packages": spec.import_names,
            "package_paths": spec.package_paths,
            "test_paths": spec.tests,
            "report": str(Path(tmp) / "report.jsonl"),
            "args": runs.pytest_args(spec, graded),
        }
        probe_job = {
            "mode": "probe",
            "src": str(probed / spec.source_root),
            "packages": spec.import_names,
            "calls": [p.call for p in task.probes],
            "out": str(Path(tmp) / "probe.jsonl"),
        }
        bare_job(python_env, graded, pytest_job, limits.test_timeout_s)
        bare_job(python_env, probed, probe_job, limits.probe_timeout_s)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", choices=["ci", "pypi"], default="ci")
    parser.add_argument(
        "--store", type=Path, default=None, help="store of a built pypi corpus (default: the usual one)"
    )
    parser.add_argument(
        "--hide", type=Path, action="append", default=[], help="folders sandboxed code must not see"
    )
    parser.add_argument("--max-per-project", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--grades", type=int, default=10, help="oracle episodes to grade")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the sandbox isolates runs only as root")
    limits = Limits()
    with tempfile.TemporaryDirectory(prefix="fd-bench-") as tmp:
        store = Store(Path(tmp) / "store") if args.corpus == "ci" else Store(args.store)
        store.ensure()
        with open_sandbox(store, args.hide) as sandbox:
            if args.corpus == "ci":
                t0 = time.monotonic()
                projects = [
                    corpus.build_project(s, "ci", store, sandbox, limits=limits.test())
                    for s in load_manifest(CI_MANIFEST)
                ]
                print(f"built the CI corpus in {time.monotonic() - t0:.1f}s")
            else:
                projects = [
                    corpus.load_project(store, s.slug)
                    for s in load_manifest(PYPI_MANIFEST)
                    if (store.project(s.slug) / "project.json").exists()
                ]
            config = generate.GenerationConfig(
                max_tasks_per_project=args.max_per_project, num_workers=args.workers, include_canary=False
            )
            start = time.monotonic()
            tasks: list[Task] = []
            attempts: list[generate.Attempt] = []
            for project in projects:
                found, tried = generate.project_tasks(
                    project, store, sandbox, config, limits.test(), limits.probe()
                )
                tasks += found
                attempts += tried
            gen_s = time.monotonic() - start
            num_validated = sum(a.status != "filtered" for a in attempts)
            print(f"\n{'project':24s} {'tasks':>6s} {'validated':>10s} {'filtered':>9s}")
            for project in projects:
                mine = [a for a in attempts if a.project == project.spec.slug]
                print(
                    f"{project.spec.slug:24s} {sum(a.status == 'accepted' for a in mine):6d} "
                    f"{sum(a.status != 'filtered' for a in mine):10d} {sum(a.status == 'filtered' for a in mine):9d}"
                )
            tasks_per_min = len(tasks) / (gen_s / 60)
            print(
                f"generation: {len(tasks)} tasks from {num_validated} validated candidates in {gen_s:.1f}s "
                f"({tasks_per_min:.1f} tasks/min, {num_validated / (gen_s / 60):.1f} validations/min, "
                f"validation rate {len(tasks) / max(num_validated, 1):.2f})"
            )

            name = f"bench-{os.getpid()}"
            store.taskset(name).mkdir(parents=True)
            write_tasks(store.taskset(name) / "tasks.jsonl", tasks)
            chosen = tasks[:: max(1, len(tasks) // args.grades)][: args.grades]
            grade_s, pytest_s, probe_s, bare_s = [], [], [], []
            with FeatureDeletion(store, name, sandbox=sandbox, limits=limits) as env:
                for task in chosen:
                    with env.episode(task.id) as episode:
                        agents.Oracle().act(episode)
                        grade = episode.grade()
                    assert grade.reward == 1.0, (task.id, grade)
                    grade_s.append(grade.total_s)
                    pytest_s.append(grade.pytest_s)
                    probe_s.append(grade.probe_s)
                    bare_s.append(bare_grade(env, task, limits))
            shutil.rmtree(store.taskset(name), ignore_errors=True)
    med = statistics.median
    share = (med(grade_s) - med(bare_s)) / med(grade_s)
    print(f"\ngrading {len(chosen)} oracle episodes (medians):")
    print(f"  grade            {med(grade_s):6.2f}s")
    print(f"    pytest run     {med(pytest_s):6.2f}s (sandboxed, set-up included)")
    print(f"    probe run      {med(probe_s):6.2f}s")
    print(f"    staging+copies {med(grade_s) - med(pytest_s) - med(probe_s):6.2f}s")
    print(f"  bare (baseline)  {med(bare_s):6.2f}s  -> the sandbox's share of a grade: {share:.0%}")
    print(f"tasks_per_min={tasks_per_min:.1f} grade_s={med(grade_s):.2f}")


if __name__ == "__main__":
    main()
