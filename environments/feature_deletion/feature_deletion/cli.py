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
from feature_deletion.spec import CI_MANIFEST, PYPI_MANIFEST, CorpusName, ProjectSpec, Store, load_manifest
from feature_deletion.tasks import write_json, write_tasks
from prime_composer.sandbox import Sandbox


def _common(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--corpus", choices=["pypi", "ci"], default=None, help="a shipped manifest (default pypi)"
    )
    source.add_argument(
        "--manifest",
        type=Path,
        default=None,
        help="your own manifest of projects (a TOML list of [[project]]; see the README, 'Adding a project')",
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
        help="another folder sandboxed code must not see (repeatable; stored with the projects built)",
    )
    parser.add_argument(
        "--test-timeout-s",
        type=float,
        default=Limits().test_timeout_s,
        help="wall-clock limit of one test-suite run (default %(default)g; a manifest entry's "
        "test_timeout_s overrides it for its project)",
    )
    parser.add_argument(
        "--probe-timeout-s",
        type=float,
        default=Limits().probe_timeout_s,
        help="wall-clock limit of one probe run (default %(default)g)",
    )


def manifest(name: CorpusName) -> Path:
    return PYPI_MANIFEST if name == "pypi" else CI_MANIFEST


def _source(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[ProjectSpec], CorpusName, str]:
    """The projects named on the command line, the corpus they build as, and the default taskset
    (and report) name: the shipped corpus's name, or the manifest file's stem."""
    try:
        if args.manifest is not None:
            return load_manifest(args.manifest), "user", args.manifest.stem
        name: CorpusName = args.corpus or "pypi"
        return load_manifest(manifest(name)), name, name
    except ValueError as e:
        parser.error(str(e))


def _limits(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Limits:
    try:
        return Limits(test_timeout_s=args.test_timeout_s, probe_timeout_s=args.probe_timeout_s)
    except ValueError as e:
        parser.error(f"--test-timeout-s / --probe-timeout-s: {e}")


def build_projects(
    specs: list[ProjectSpec],
    corpus_name: CorpusName,
    store: Store,
    sandbox: Sandbox,
    limits: Limits,
    *,
    scan: bool = True,
    min_pass_rate: float = 1.0,
) -> tuple[list[corpus.Project], dict[str, str]]:
    """Build each project (printing one line each); the built ones and why the others were refused."""
    built: list[corpus.Project] = []
    refused: dict[str, str] = {}
    for spec in specs:
        t0 = time.monotonic()
        try:
            project = corpus.build_project(
                spec,
                corpus_name,
                store,
                sandbox,
                limits=limits.test(),
                scan_limits=limits.scan() if scan else None,
                min_pass_rate=min_pass_rate,
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
    return built, refused


def build_corpus_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fetch (PyPI or a manifest's sdists) or copy (CI) the corpus projects, check them, "
        "run and record their tests."
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
    all_specs, corpus_name, report_name = _source(parser, args)
    limits = _limits(parser, args)
    store = Store(args.store)
    store.ensure()
    specs = [s for s in all_specs if not args.only or s.name in args.only]
    start = time.monotonic()
    with open_sandbox(store, args.hide) as sandbox:
        built, refused = build_projects(
            specs,
            corpus_name,
            store,
            sandbox,
            limits,
            scan=not args.no_scan,
            min_pass_rate=args.min_pass_rate,
        )
    # The report covers every project of the manifest built so far, not only this run's.
    rebuilt = {p.spec.slug for p in built}
    for spec in all_specs:
        if (
            spec.slug not in rebuilt
            and spec.slug not in refused
            and (store.project(spec.slug) / "project.json").exists()
        ):
            built.append(corpus.load_project(store, spec.slug))
    summary = corpus.corpus_summary(built, refused)
    summary["seconds"] = round(time.monotonic() - start, 1)
    write_json(store.root / f"corpus-{report_name}.json", summary)
    print(json.dumps(summary, indent=1))
    return 0 if built else 1


def generate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Generate and validate feature-deletion tasks from a built corpus."
    )
    _common(parser)
    parser.add_argument(
        "--taskset",
        default=None,
        help="name of the taskset folder (default: the corpus name, or the manifest file's stem)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-per-project", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-canary", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    specs, corpus_name, default_name = _source(parser, args)
    limits = _limits(parser, args)
    store = Store(args.store)
    if args.manifest is not None:
        # A user's own projects are built here when missing or changed (scan, baseline, record).
        missing = [s for s in specs if not _built_as(store, s)]
        if missing:
            store.ensure()
            with open_sandbox(store, args.hide) as sandbox:
                _, refused = build_projects(missing, corpus_name, store, sandbox, limits)
            for slug, why in refused.items():
                print(f"not generating tasks for {slug}: {why}", flush=True)
    wanted = _built_as if args.manifest is not None else _built
    projects = [corpus.load_project(store, s.slug) for s in specs if wanted(store, s)]
    if not projects:
        what = args.manifest if args.manifest is not None else f"the {corpus_name} corpus"
        parser.error(f"no project of {what} is built in {store.root}: run build_corpus.py first")
    config = generate.GenerationConfig(
        seed=args.seed,
        max_tasks_per_project=args.max_per_project,
        num_workers=args.workers,
        include_canary=not args.no_canary,
    )
    start = time.monotonic()
    # The folders hidden when the projects were built stay hidden (they may hold copies).
    with open_sandbox(store, [*corpus.stored_hidden(projects), *args.hide]) as sandbox:
        tasks, attempts = generate.generate(projects, store, sandbox, config, limits.test(), limits.probe())
    seconds = time.monotonic() - start
    out = store.taskset(args.taskset or default_name)
    out.mkdir(parents=True, exist_ok=True)
    write_tasks(out / "tasks.jsonl", tasks)
    (out / "attempts.jsonl").write_text("".join(json.dumps(asdict(a)) + "\n" for a in attempts))
    summary = generate.summary(tasks, attempts, seconds)
    summary["config"] = config.model_dump()
    write_json(out / "summary.json", summary)
    print(json.dumps(summary, indent=1))
    return 0 if tasks else 1


def _built(store: Store, spec: ProjectSpec) -> bool:
    return (store.project(spec.slug) / "project.json").exists()


def _built_as(store: Store, spec: ProjectSpec) -> bool:
    """The store holds this project built from this very manifest entry."""
    return _built(store, spec) and corpus.load_project(store, spec.slug).spec == spec
