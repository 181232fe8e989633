"""Command lines of the environment: ``build_corpus.py`` and ``generate_tasks.py`` (thin wrappers
at the environment's root call ``build_corpus_main`` and ``generate_main``)."""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

from feature_deletion import corpus, generate
from feature_deletion.environment import Limits, open_sandbox
from feature_deletion.spec import CI_MANIFEST, PYPI_MANIFEST, CorpusName, Store, load_manifest
from feature_deletion.tasks import write_json, write_tasks


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--corpus", choices=["pypi", "ci"], default="pypi", help="which manifest (default pypi)"
    )
    parser.add_argument(
        "--store",
        type=Path,
        default=None,
        help="store folder (default ~/.cache/prime-composer/feature-deletion)",
    )
    parser.add_argument(
        "--hide",
        type=Path,
        action="append",
        default=[],
        help="another folder sandboxed code must not see (repeatable)",
    )


def manifest(name: CorpusName) -> Path:
    return PYPI_MANIFEST if name == "pypi" else CI_MANIFEST


def build_corpus_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fetch (PyPI) or copy (CI) the corpus projects, check them, run and record their tests."
    )
    _common(parser)
    parser.add_argument("--only", action="append", default=[], help="build only this project (repeatable)")
    parser.add_argument(
        "--no-scan", action="store_true", help="skip the search for visible copies of each project"
    )
    parser.add_argument(
        "--min-pass-rate", type=float, default=1.0, help="share of tests that must pass (default 1.0)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = Store(args.store)
    store.ensure()
    limits = Limits()
    specs = [s for s in load_manifest(manifest(args.corpus)) if not args.only or s.name in args.only]
    built: list[corpus.Project] = []
    refused: dict[str, str] = {}
    start = time.monotonic()
    with open_sandbox(store, args.hide) as sandbox:
        for spec in specs:
            t0 = time.monotonic()
            try:
                project = corpus.build_project(
                    spec,
                    args.corpus,
                    store,
                    sandbox,
                    limits=limits.test(),
                    scan_limits=None if args.no_scan else limits.scan(),
                    min_pass_rate=args.min_pass_rate,
                )
            except corpus.ProjectError as e:
                refused[spec.slug] = str(e)
                print(f"REFUSED {spec.slug}: {e}", flush=True)
                continue
            built.append(project)
            print(
                f"built {spec.slug:24s} {spec.licence:13s} {project.num_tests:5d} tests  pass rate "
                f"{project.pass_rate:6.1%}  suite {project.suite_s:5.1f}s  ({time.monotonic() - t0:.0f}s)",
                flush=True,
            )
    # The report covers every project of the manifest built so far, not only this run's.
    rebuilt = {p.spec.slug for p in built}
    for spec in load_manifest(manifest(args.corpus)):
        if (
            spec.slug not in rebuilt
            and spec.slug not in refused
            and (store.project(spec.slug) / "project.json").exists()
        ):
            built.append(corpus.load_project(store, spec.slug))
    summary = corpus.corpus_summary(built, refused)
    summary["seconds"] = round(time.monotonic() - start, 1)
    write_json(store.root / f"corpus-{args.corpus}.json", summary)
    print(json.dumps(summary, indent=1))
    return 0 if built else 1


def generate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Generate and validate feature-deletion tasks from a built corpus."
    )
    _common(parser)
    parser.add_argument(
        "--taskset", default=None, help="name of the taskset folder (default: the corpus name)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-per-project", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-canary", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = Store(args.store)
    specs = load_manifest(manifest(args.corpus))
    projects = [
        corpus.load_project(store, s.slug) for s in specs if (store.project(s.slug) / "project.json").exists()
    ]
    if not projects:
        parser.error(
            f"no project of the {args.corpus} corpus is built in {store.root}: run build_corpus.py first"
        )
    config = generate.GenerationConfig(
        seed=args.seed,
        max_tasks_per_project=args.max_per_project,
        num_workers=args.workers,
        include_canary=not args.no_canary,
    )
    limits = Limits()
    start = time.monotonic()
    with open_sandbox(store, args.hide) as sandbox:
        tasks, attempts = generate.generate(projects, store, sandbox, config, limits.test(), limits.probe())
    seconds = time.monotonic() - start
    out = store.taskset(args.taskset or args.corpus)
    out.mkdir(parents=True, exist_ok=True)
    write_tasks(out / "tasks.jsonl", tasks)
    (out / "attempts.jsonl").write_text("".join(json.dumps(asdict(a)) + "\n" for a in attempts))
    summary = generate.summary(tasks, attempts, seconds)
    summary["config"] = config.model_dump()
    write_json(out / "summary.json", summary)
    print(json.dumps(summary, indent=1))
    return 0 if tasks else 1
