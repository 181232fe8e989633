"""The feature-deletion environment end to end on the CI corpus (no network): build, generate,
grade; the oracle scores 1, the no-op 0, and every scripted hacker 0.

The corpus is built and the tasks generated once per module (~30-60 s on 2 cores); each grade
is two sandboxed runs (~1 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import py_compile
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ENV_DIR = Path(__file__).resolve().parents[2] / "environments/feature_deletion"
sys.path.insert(0, str(ENV_DIR))

from feature_deletion import agents, corpus, deletion, generate  # noqa: E402
from feature_deletion.environment import Limits, open_sandbox, other_site_packages  # noqa: E402
from feature_deletion.episode import Episode, FeatureDeletion  # noqa: E402
from feature_deletion.spec import CI_MANIFEST, Store, load_manifest  # noqa: E402
from feature_deletion.tasks import Task, write_tasks  # noqa: E402

# The module's fixtures build the CI corpus and generate its tasks (~20-60 s on 2 cores) and every
# grade is two sandboxed runs: ~2 min of worker time in all, so the whole module is out of the
# fast lane, which keeps the environment's unit tests (tests/unit/test_feature_deletion_*.py).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="isolated runs need root"),
]

HIDDEN = [p for p in (Path("/work"),) if p.is_dir()]
"""Other checkouts of this repository on the development machines (they hold the CI sources)."""


@dataclass
class Built:
    store: Store
    projects: list[corpus.Project]
    tasks: list[Task]
    attempts: list[generate.Attempt]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    store = Store(tmp_path_factory.mktemp("fd") / "store")
    store.ensure()
    limits = Limits()
    with open_sandbox(store, HIDDEN) as sandbox:
        projects = [
            corpus.build_project(spec, "ci", store, sandbox, limits=limits.test())
            for spec in load_manifest(CI_MANIFEST)
        ]
        tasks, attempts = generate.generate(
            projects, store, sandbox, generate.GenerationConfig(), limits.test(), limits.probe()
        )
    (store.taskset("ci")).mkdir(parents=True)
    write_tasks(store.taskset("ci") / "tasks.jsonl", tasks)
    return Built(store, projects, tasks, attempts)


@pytest.fixture(scope="module")
def env(built: Built) -> Iterator[FeatureDeletion]:
    with FeatureDeletion(built.store, "ci", hidden_paths=HIDDEN) as env:
        yield env


def task(built: Built, suffix: str) -> Task:
    return next(t for t in built.tasks if t.id.endswith(suffix))


SAMPLE = (
    "textkit/rle.py::rle_decode",  # function
    "src/ledger/account.py::Account.withdraw",  # method, src layout, unittest tests
    "textkit/wrap.py::LineBuilder",  # class
    "canary/__init__.py::secret_token",  # the canary
)


def play(env: FeatureDeletion, task_id: str, agent: agents.Agent) -> tuple[float, agents.Outcome, Episode]:
    with env.episode(task_id) as episode:
        outcome = agent.act(episode)
        grade = episode.grade()
    return grade.reward, outcome, episode


# -- corpus and generation -------------------------------------------------------------------


def test_the_ci_corpus_builds_and_every_suite_passes(built: Built) -> None:
    assert [p.spec.name for p in built.projects] == ["textkit", "ledger", "intervals"]
    for project in built.projects:
        assert project.pass_rate == 1.0 and not project.failing and not project.flaky
        assert len(project.passed) == project.num_tests
        names = {p.name for p in project.tree(built.store).rglob("*")}
        assert not names & corpus.CACHE_DIRS and not any(n.endswith((".pyc", ".egg-info")) for n in names)


def test_generation_yields_validated_tasks_of_every_kind(built: Built) -> None:
    kinds = {t.kind for t in built.tasks}
    assert kinds == {"function", "method", "class"}
    assert len(built.tasks) >= 20
    for t in built.tasks:
        assert t.targeted and t.probes
        assert {p.test for p in t.probes} == set(t.targeted)
        assert not set(t.targeted) & set(t.others) and not set(t.unscored) & set(t.others)
        assert "NotImplementedError" in t.workspace_files[t.file]
    reasons = {(a.candidate, a.reason) for a in built.attempts if a.status != "accepted"}
    assert ("count_matching", "no test reaches it through a plain-data call") in reasons  # takes a lambda
    assert ("_build_tokenizer_table", "runs at import or collection time") in reasons
    assert sum(t.corpus == "canary" for t in built.tasks) == 1


def test_a_class_task_keeps_only_probes_that_do_not_depend_on_its_layout(built: Built) -> None:
    line_builder = task(built, "textkit/wrap.py::LineBuilder")
    assert line_builder.targeted == ["tests/test_wrap.py::test_wrap"]
    assert line_builder.unscored == ["tests/test_wrap.py::test_line_builder"]  # it inspects the object
    assert all(p.call["target"][:2] == ["textkit.wrap", "wrap"] for p in line_builder.probes)


def test_generation_is_deterministic_by_seed(built: Built) -> None:
    project = next(p for p in built.projects if p.spec.name == "intervals")
    config = generate.GenerationConfig(max_tasks_per_project=3)
    limits = Limits()
    with open_sandbox(built.store, HIDDEN) as sandbox:
        first, _ = generate.project_tasks(
            project, built.store, sandbox, config, limits.test(), limits.probe()
        )
        again, _ = generate.project_tasks(
            project, built.store, sandbox, config, limits.test(), limits.probe()
        )
    assert [t.model_dump() for t in first] == [t.model_dump() for t in again]
    everything = [t for t in built.tasks if t.project == project.spec.slug]
    assert [t.id for t in first] == [t.id for t in everything[:3]]  # a lower cap takes a prefix


# -- what the agent's workspace holds ------------------------------------------------------------


def test_no_workspace_holds_anything_to_recover_the_feature_from(built: Built, env: FeatureDeletion) -> None:
    for t in built.tasks:
        with env.episode(t.id) as episode:
            root = episode.workspace.path
            names = {p.name for p in root.rglob("*")}
            assert not names & corpus.CACHE_DIRS, t.id
            assert not any(n.endswith((".pyc", ".egg-info", ".dist-info", ".whl", ".tar.gz")) for n in names)
            assert "PKG-INFO" not in names and "SOURCES.txt" not in names and "RECORD" not in names
            texts = {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}
            assert deletion.find_leaks(texts, t.leak_needles) == [], t.id
            assert all(body.strip() not in texts[t.file] for body in t.removed)


def test_sandboxed_code_sees_no_installed_copy_and_no_other_python_packages(env: FeatureDeletion) -> None:
    with env.episode(task_id_of(env, "rle_decode")) as episode:
        probe = agents.run(
            episode,
            "cd / && python -c 'import textkit' 2>&1 | tail -1; "
            + "; ".join(f"ls {p} | wc -l" for p in other_site_packages())
            + "; python -c 'import pytest, sys; print(sys.prefix)'",
        ).splitlines()
    assert probe[0] == "ModuleNotFoundError: No module named 'textkit'"
    assert probe[1:-1] == ["0"] * len(other_site_packages())  # hidden, though exposed with the interpreter
    assert probe[-1] == str(env.sandbox.config.python_env)


def task_id_of(env: FeatureDeletion, suffix: str) -> str:
    return next(i for i in env.tasks if i.endswith(suffix))


# -- scores ------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", SAMPLE)
def test_oracle_scores_one_and_noop_zero(env: FeatureDeletion, suffix: str) -> None:
    task_id = task_id_of(env, suffix)
    assert play(env, task_id, agents.Oracle())[0] == 1.0
    assert play(env, task_id, agents.NoOp())[0] == 0.0


@pytest.mark.slow
def test_oracle_scores_one_and_noop_zero_on_every_task(env: FeatureDeletion) -> None:
    for task_id in env.tasks:
        assert play(env, task_id, agents.Oracle())[0] == 1.0, task_id
        assert play(env, task_id, agents.NoOp())[0] == 0.0, task_id


@pytest.mark.parametrize("hacker", agents.HACKERS, ids=[h.name for h in agents.HACKERS])
@pytest.mark.parametrize("suffix", [SAMPLE[0], SAMPLE[3]], ids=["function", "canary"])
def test_every_hacker_scores_zero(env: FeatureDeletion, hacker: type[agents.Agent], suffix: str) -> None:
    reward, outcome, _ = play(env, task_id_of(env, suffix), hacker())
    assert reward == 0.0
    assert outcome.found == []  # the channel it tried was empty, not just unrewarded


@pytest.mark.slow
@pytest.mark.parametrize("hacker", agents.HACKERS, ids=[h.name for h in agents.HACKERS])
def test_every_hacker_scores_zero_on_a_method_and_a_class_task(
    env: FeatureDeletion, hacker: type[agents.Agent]
) -> None:
    for suffix in (SAMPLE[1], SAMPLE[2]):
        assert play(env, task_id_of(env, suffix), hacker())[0] == 0.0, suffix


@pytest.mark.parametrize(
    "hacker", [agents.PytestPatcher, agents.ReportRewriter, agents.AlwaysEqual, agents.TestReader]
)
def test_hacks_that_fool_pytest_are_stopped_by_the_probe(
    env: FeatureDeletion, hacker: type[agents.Agent]
) -> None:
    suffix = SAMPLE[3] if hacker is agents.TestReader else SAMPLE[0]
    with env.episode(task_id_of(env, suffix)) as episode:
        hacker().act(episode)
        grade = episode.grade()
    assert grade.pytest_passed >= 1  # the test process was fooled...
    assert grade.probes_matched == 0 and grade.reward == 0.0  # ...the values were not


def test_proc_shows_only_the_sandbox(env: FeatureDeletion) -> None:
    _, outcome, _ = play(env, task_id_of(env, SAMPLE[3]), agents.ProcSnoop())
    pids = json.loads(outcome.notes[0].removeprefix("pids: "))
    assert pids and max(pids) < 20 and os.getpid() not in pids  # its own pid namespace


# -- the hackers are real: they win when the channel is open -----------------------------------


def test_file_search_wins_when_a_copy_is_readable(built: Built, env: FeatureDeletion) -> None:
    t = task(built, SAMPLE[0])
    with env.episode(t.id) as episode:
        backup = episode.workspace.path / "notes" / "rle_backup.py"
        backup.parent.mkdir()
        shutil.copy(env.tree(t) / t.file, backup)
        outcome = agents.FileSearch().act(episode)
        assert episode.grade().reward == 1.0
    assert outcome.found == ["./notes/rle_backup.py"]


def test_bytecode_wins_when_a_pyc_is_readable(built: Built, env: FeatureDeletion) -> None:
    t = task(built, SAMPLE[0])
    with env.episode(t.id) as episode:
        pyc = episode.workspace.path / "textkit" / "__pycache__" / "rle.cpython-311.pyc"
        py_compile.compile(str(env.tree(t) / t.file), cfile=str(pyc), doraise=True)
        outcome = agents.Bytecode().act(episode)
        grade = episode.grade()
    assert outcome.found and grade.reward == 1.0  # why no bytecode may reach a workspace


def test_the_visibility_scan_finds_a_readable_copy(built: Built) -> None:
    from feature_deletion import runs

    project = next(p for p in built.projects if p.spec.name == "textkit")
    # The test Python is visible to sandboxed code whatever else is hidden: plant the copy there.
    planted = runs.test_python(built.store) / f"fd-scan-test-{os.getpid()}"
    planted.mkdir(parents=True)
    try:
        shutil.copy(project.tree(built.store) / "textkit" / "case.py", planted / "case.py")
        planted.chmod(0o755)
        (planted / "case.py").chmod(0o644)
        with open_sandbox(built.store, HIDDEN) as sandbox:
            found = corpus.scan_visible(sandbox, project.spec, project.tree(built.store), Limits().scan())
            shutil.rmtree(planted)
            clean = corpus.scan_visible(sandbox, project.spec, project.tree(built.store), Limits().scan())
    finally:
        shutil.rmtree(planted, ignore_errors=True)
    assert [f.split(" (", 1)[0] for f in found] == [str(planted / "case.py")]
    assert clean == []


# -- the verifiers side ------------------------------------------------------------------------


class FakeTrace:
    def __init__(self) -> None:
        from feature_deletion.taskset import FeatureDeletionState

        self.info: dict[str, object] = {}
        self.state = FeatureDeletionState()


def test_the_taskset_loads_through_the_orchestrator_and_rewards_with_the_grader(built: Built) -> None:
    import feature_deletion

    from prime_composer.config.env import EnvConfig
    from prime_composer.orchestrator.envs import load_env

    args = {"store": str(built.store.root), "hidden_paths": [str(p) for p in HIDDEN]}
    loaded = load_env(EnvConfig(id="feature-deletion", args=args, eval_args={"split": "eval"}), 0)
    train, held_out = loaded.tasks("train"), loaded.tasks("eval")
    assert len(train) + len(held_out) == len(built.tasks) and not {t.data.id for t in train} & {
        t.data.id for t in held_out
    }
    first = train[0]
    assert isinstance(first, feature_deletion.FeatureDeletionTask)
    record = next(t for t in built.tasks if t.id == first.data.id)
    wire = json.dumps(first.data.model_dump())
    assert not any(body.strip() in wire for body in record.removed)  # nothing of the answer on traces

    async def episode(solve: bool) -> tuple[float, dict[str, object]]:
        trace = FakeTrace()
        if solve:
            await first.setup(trace, None)  # type: ignore[arg-type]
            opened = feature_deletion.episode_for(trace)  # type: ignore[arg-type]
            assert opened is not None and {d["function"]["name"] for d in opened.tools.definitions()} >= {
                "read_file",
                "run_tests",
            }
            agents.Oracle().act(opened)
        reward = await first.restored(trace)  # type: ignore[arg-type]
        return reward, trace.info

    solved, info = asyncio.run(episode(True))
    assert solved == 1.0 and info["feature_deletion_grade"]["probes_matched"] > 0  # type: ignore[index]
    unopened, info = asyncio.run(episode(False))
    assert unopened == 0.0 and "never opened" in info["feature_deletion_grade"]["error"]  # type: ignore[index]


# -- through the agent harness ---------------------------------------------------------------


@pytest.mark.slow  # a tokenizer, a token-in server and two graded episodes: ~35-60 s
def test_episodes_run_through_the_agent_harness_in_the_environments_sandbox(built: Built) -> None:
    """A token-in scripted model drives the real harness (prime_composer.orchestrator.agent_harness)
    through ``RolloutRunner``: the oracle's one ``write_file`` call restores the feature (1.0), an
    agent that only answers scores 0, and the tools ran in this environment's workspace."""
    sys.path.insert(0, str(ENV_DIR.parent / "pyfix"))
    from pyfix.scripted import ScriptedServer
    from transformers import AutoTokenizer

    from prime_composer.config.env import EnvConfig, RolloutConfig, SamplingConfig
    from prime_composer.model.resolve import resolve_model_name
    from prime_composer.orchestrator.envs import load_env
    from prime_composer.orchestrator.rollout import RolloutRunner
    from prime_composer.orchestrator.sample import Sample

    tokenizer_path = resolve_model_name("builtin:tiny-qwen3")
    args = {"store": str(built.store.root), "hidden_paths": [str(p) for p in HIDDEN], "eval_fraction": 0}
    agent = {"tokenizer": tokenizer_path, "max_turns": 3, "time_limit_s": 120}
    loaded = load_env(EnvConfig(id="feature-deletion", args=args, agent=agent), 0)
    tasks = loaded.tasks("train")
    index = next(i for i, t in enumerate(tasks) if t.data.id.endswith(SAMPLE[0]))
    data = tasks[index].data
    original = (corpus.load_project(built.store, data.project).tree(built.store) / data.file).read_text()

    class Scripted(ScriptedServer):
        def reply(self, policy: str, prompt_text: str) -> str:
            assert data.prompt in prompt_text
            if policy == "oracle" and prompt_text.count(self.assistant_marker) == 1:
                call = {"name": "write_file", "arguments": {"path": data.file, "content": original}}
                return f"<tool_call>{json.dumps(call)}</tool_call>"
            return "Done."

    os.environ["PC_TEST_FD_SECRET"] = "s3cret"
    scripted = Scripted(
        AutoTokenizer.from_pretrained(tokenizer_path), [], max_model_len=32768, secret="s3cret"
    )

    async def play(policy: str) -> Sample:
        async with RolloutRunner(
            [loaded],
            base_url=base_url,
            model=policy,
            sampling=SamplingConfig(max_tokens=4000),
            rollout=RolloutConfig(max_concurrent=2, timeout_s=300),
            api_key_var="PC_TEST_FD_SECRET",
        ) as runner:
            (sample,) = await runner.run_group(
                loaded, tasks[index], group_size=1, example_id=index, group_id=0, policy_step=0
            )
            return sample

    with scripted.serve() as base_url:
        oracle, noop = asyncio.run(play("oracle")), asyncio.run(play("noop"))
    del os.environ["PC_TEST_FD_SECRET"]
    assert oracle.error is None and oracle.reward == 1.0, oracle.error
    assert oracle.metrics["agent/num_tool_calls"] == 1.0
    assert noop.error is None and noop.reward == 0.0
    assert noop.episode.feedback[0]["kind"] == "failing_test"


# -- a project the interpreter's bundled wheels vendor: copies inside archives ------------------

BUNDLED = sorted(
    Path(
        sys.base_prefix,
        "lib",
        f"python{sys.version_info.major}.{sys.version_info.minor}",
        "ensurepip",
        "_bundled",
    ).glob("setuptools-*.whl")
)
"""setuptools' wheel, shipped with the interpreter the test Python is a venv of (so visible in the
sandbox); it vendors ``more_itertools``."""

VENDORED_TESTS = """\
from more_itertools import chunked, first, windowed, unique_everseen


def test_chunked():
    assert list(chunked([1, 2, 3, 4, 5], 2)) == [[1, 2], [3, 4], [5]]
    assert list(chunked("abcdefg", 3)) == [["a", "b", "c"], ["d", "e", "f"], ["g"]]


def test_first():
    assert first([7, 8]) == 7
    assert first([], default="none") == "none"


def test_windowed():
    assert list(windowed([1, 2, 3, 4], 2)) == [(1, 2), (2, 3), (3, 4)]
    assert list(windowed([1, 2, 3], 2, step=2)) == [(1, 2), (3, None)]


def test_unique_everseen():
    assert list(unique_everseen("AAAABBBCCDAABBB")) == ["A", "B", "C", "D"]
    assert list(unique_everseen([3, 1, 3, 2, 1])) == [3, 1, 2]
"""


@dataclass
class Vendored:
    store: Store
    wheel: Path
    refusal: str
    """Why the build was refused before the copies were hidden."""
    found: list[str]
    hide: list[Path]
    project: corpus.Project
    tasks: list[Task]


def _hide_for(found: list[str]) -> list[Path]:
    """The folders to hide for the scan's findings: an archive's folder, a copy's package folder."""
    folders = set()
    for line in found:
        path = Path(line.split(" (", 1)[0].split("!", 1)[0])
        folders.add(path if path.is_dir() else path.parent)
    return sorted(folders)


@pytest.fixture(scope="module")
def vendored(tmp_path_factory: pytest.TempPathFactory) -> Vendored:
    if not BUNDLED:
        pytest.skip(f"the base interpreter ({sys.base_prefix}) ships no ensurepip setuptools wheel")
    import zipfile

    from feature_deletion.spec import ProjectSpec

    wheel = BUNDLED[-1]
    root = tmp_path_factory.mktemp("fd-vendored")
    source = root / "more_itertools-src"
    (source / "more_itertools").mkdir(parents=True)
    (source / "tests").mkdir()
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("setuptools/_vendor/more_itertools/") and name.endswith(".py"):
                (source / "more_itertools" / Path(name).name).write_bytes(archive.read(name))
            if name.startswith("setuptools/_vendor/more_itertools-") and name.endswith("/LICENSE"):
                (source / "LICENSE").write_bytes(archive.read(name))
    (source / "tests" / "test_vendored.py").write_text(VENDORED_TESTS)
    spec = ProjectSpec(
        name="more-itertools",
        version="vendored",
        licence="MIT",
        kind="iterator utilities (the copy setuptools vendors)",
        packages=["more_itertools"],
        tests=["tests"],
    )
    store = Store(root / "store")
    store.ensure()
    limits = Limits()
    tree = root / "tree"
    corpus.make_tree(spec, source, tree)
    with open_sandbox(store, HIDDEN) as sandbox:
        found = corpus.scan_visible(sandbox, spec, tree, limits.scan())
        with pytest.raises(corpus.ProjectError) as refused:
            corpus.build_project(
                spec, "ci", store, sandbox, limits=limits.test(), scan_limits=limits.scan(), source=source
            )
    hide = _hide_for(found)
    with open_sandbox(store, [*HIDDEN, *hide]) as sandbox:
        project = corpus.build_project(
            spec, "ci", store, sandbox, limits=limits.test(), scan_limits=limits.scan(), source=source
        )
        config = generate.GenerationConfig(max_tasks_per_project=2, include_canary=False, kinds=["function"])
        tasks, _ = generate.generate([project], store, sandbox, config, limits.test(), limits.probe())
    store.taskset("vendored").mkdir(parents=True)
    write_tasks(store.taskset("vendored") / "tasks.jsonl", tasks)
    return Vendored(store, wheel, str(refused.value), found, hide, project, tasks)


def _forget_hide_list(v: Vendored) -> None:
    """A corpus built before the hide list was stored (or with it edited out)."""
    path = v.store.project(v.project.spec.slug) / "project.json"
    path.write_text(v.project.model_copy(update={"hidden_paths": []}).model_dump_json())


def _restore_hide_list(v: Vendored) -> None:
    (v.store.project(v.project.spec.slug) / "project.json").write_text(v.project.model_dump_json())


def test_the_scan_finds_the_project_inside_the_bundled_wheel(vendored: Vendored) -> None:
    inside = f"{vendored.wheel}!setuptools/_vendor/more_itertools/more.py (source:"
    assert any(f.startswith(inside) for f in vendored.found), vendored.found
    assert str(vendored.wheel) in vendored.refusal and "more_itertools/more.py" in vendored.refusal
    assert vendored.project.scanned
    assert set(map(str, vendored.hide)) <= set(vendored.project.hidden_paths)  # stored with the project
    assert vendored.tasks and all(
        t.file == "more_itertools/more.py" or "recipes" in t.file for t in vendored.tasks
    )


def test_the_scan_reads_bytecode_and_archives_in_archives(vendored: Vendored, tmp_path: Path) -> None:
    import zipfile

    from feature_deletion import runs, visibility

    # The test Python is visible to sandboxed code whatever else is hidden: plant the copies there.
    planted = runs.test_python(vendored.store) / f"fd-scan-test-{os.getpid()}"
    planted.mkdir()
    try:
        more = vendored.project.tree(vendored.store) / "more_itertools" / "more.py"
        py_compile.compile(str(more), cfile=str(planted / "more.cpython-311.pyc"), doraise=True)
        inner = tmp_path / "inner.whl"
        with zipfile.ZipFile(inner, "w") as z:
            z.write(more, "pkg/more.py")
        with zipfile.ZipFile(planted / "outer.zip", "w") as z:
            z.write(inner, "wheels/inner.whl")
        for p in planted.rglob("*"):
            p.chmod(0o644)
        planted.chmod(0o755)
        with open_sandbox(vendored.store, [*HIDDEN, *vendored.hide]) as sandbox:
            found = visibility.scan(
                sandbox,
                [corpus.fingerprint(vendored.project.spec, vendored.project.tree(vendored.store))],
                Limits().scan(),
            )
    finally:
        shutil.rmtree(planted)
    paths = [f.split(" (", 1)[0] for f in found[vendored.project.spec.slug]]
    assert str(planted / "more.cpython-311.pyc") in paths
    assert f"{planted / 'outer.zip'}!wheels/inner.whl!pkg/more.py" in paths


PIP_WHEELS = sorted(BUNDLED[-1].parent.glob("pip-*.whl")) if BUNDLED else []
"""pip's wheel beside setuptools'; it vendors ``packaging`` and ``tomli`` (among 20 more)."""


@pytest.mark.skipif(not PIP_WHEELS, reason="the base interpreter ships no ensurepip pip wheel")
def test_the_scan_finds_packaging_and_tomli_inside_pips_wheel(vendored: Vendored, tmp_path: Path) -> None:
    # packaging and tomli cannot be corpus projects here (pytest needs packaging in the test venv;
    # tomli is the standard library's tomllib), but what a task would delete of them must be found
    # in the wheel pip ships with the interpreter, which the sandbox shows.
    import zipfile

    from feature_deletion import visibility
    from feature_deletion.spec import ProjectSpec

    wheel = PIP_WHEELS[-1]
    fingerprints = []
    with zipfile.ZipFile(wheel) as archive:
        for name in ("packaging", "tomli"):
            source, tree = tmp_path / f"{name}-src", tmp_path / f"{name}-tree"
            (source / name).mkdir(parents=True)
            (source / "tests").mkdir()
            (source / "tests" / f"test_{name}.py").write_text("def test_nothing():\n    pass\n")
            members = [m for m in archive.namelist() if m.startswith(f"pip/_vendor/{name}/")]
            assert any(m.endswith(".py") for m in members), (wheel, name)
            for member in members:
                if member.endswith(".py"):
                    (source / name / Path(member).name).write_bytes(archive.read(member))
            spec = ProjectSpec(
                name=name,
                version="vendored",
                licence="MIT",
                kind="pip's copy",
                packages=[name],
                tests=["tests"],
            )
            corpus.make_tree(spec, source, tree)
            fingerprints.append(corpus.fingerprint(spec, tree))
    # Not the vendored project's hide list: it hides the folder of both wheels. The scan reports
    # 100 copies per project; a machine with more (the cloud SDK of the development machines holds
    # many of packaging) has those folders hidden for a second scan, so the wheel's are reported.
    hide: list[Path] = []
    for _ in range(2):
        with open_sandbox(vendored.store, [*HIDDEN, *hide]) as sandbox:
            found = visibility.scan(sandbox, fingerprints, Limits().scan())
        others = [f for fp in fingerprints for f in found[fp["slug"]] if not f.startswith(f"{wheel}!")]
        hide += [p for p in _hide_for(others) if p != wheel.parent]
    for fp, name in zip(fingerprints, ("packaging", "tomli"), strict=True):
        inside = [f for f in found[fp["slug"]] if f.startswith(f"{wheel}!pip/_vendor/{name}/")]
        assert inside, (name, found[fp["slug"]])


def test_the_stored_hide_list_holds_at_episode_start(vendored: Vendored) -> None:
    task_id = vendored.tasks[0].id
    with FeatureDeletion(vendored.store, "vendored", hidden_paths=HIDDEN) as env:  # no hide list named
        assert set(vendored.hide) <= {Path(p) for p in env.sandbox.config.hidden_paths}
        reward, outcome, _ = play(env, task_id, agents.ArchiveSplice())
        assert (reward, outcome.found) == (0.0, [])
        assert play(env, task_id, agents.Oracle())[0] == 1.0
    # The same through a taskset config, as the shipped configs give it (no hide list named).
    from feature_deletion import taskset

    config = taskset.FeatureDeletionConfig(
        store=str(vendored.store.root), taskset="vendored", hidden_paths=[str(p) for p in HIDDEN]
    )
    with taskset.runtime(config) as env:
        assert set(vendored.hide) <= {Path(p) for p in env.sandbox.config.hidden_paths}
    taskset._runtimes.pop(taskset._runtime_key(config))


def test_a_taskset_whose_hide_list_is_lost_refuses_to_start(vendored: Vendored) -> None:
    _forget_hide_list(vendored)
    try:
        with pytest.raises(ValueError, match="can read a copy of more-itertools-vendored") as refused:
            FeatureDeletion(vendored.store, "vendored", hidden_paths=HIDDEN)
    finally:
        _restore_hide_list(vendored)
    assert str(vendored.wheel) in str(refused.value)


def test_a_sandbox_given_without_the_stored_hide_list_is_refused(vendored: Vendored) -> None:
    with (
        open_sandbox(vendored.store, HIDDEN) as sandbox,
        pytest.raises(ValueError, match="the sandbox does not hide") as refused,
    ):
        FeatureDeletion(vendored.store, "vendored", sandbox=sandbox)
    assert any(str(p) in str(refused.value) for p in vendored.hide)


def test_archive_splice_wins_when_the_wheel_is_readable(vendored: Vendored) -> None:
    """The positive control: with the wheel readable (hide list lost, start check off), unzipping
    it and splicing the function back is the full reward the archive check exists to prevent."""
    _forget_hide_list(vendored)
    try:
        with FeatureDeletion(vendored.store, "vendored", hidden_paths=HIDDEN, check_visibility=False) as env:
            reward, outcome, _ = play(env, vendored.tasks[0].id, agents.ArchiveSplice())
    finally:
        _restore_hide_list(vendored)
    assert reward == 1.0
    assert outcome.found and "!" in outcome.found[0] and outcome.found[0].endswith(vendored.tasks[0].file)


# -- a user's own project: generate_tasks.py --manifest ------------------------------------------

TINY = {
    "PKG-INFO": "Metadata-Version: 2.1\nName: tinycalc\nVersion: 1.0\nLicense: MIT\n",
    "LICENSE": "MIT License (a project written for this test)\n",
    "README.md": "tinycalc: not kept in the tree\n",
    "tinycalc/__init__.py": "from tinycalc.ops import Unit, clamp, mean, running_total, parse_pairs\n",
    "tinycalc/ops.py": '''\
def mean(values):
    """The arithmetic mean of a non-empty list of numbers."""
    total = sum(values)
    count = len(values)
    return total / count


def clamp(x, low, high):
    """x limited to the closed interval [low, high]."""
    if x < low:
        return low
    return high if x > high else x


def running_total(values):
    """The list of partial sums of values."""
    out, acc = [], 0
    for value in values:
        acc += value
        out.append(acc)
    return out


def parse_pairs(text):
    """Parse 'a=1,b=2' into a dict of ints (spaces around items are ignored)."""
    pairs = {}
    for item in text.split(","):
        key, _, value = item.strip().partition("=")
        pairs[key] = int(value)
    return pairs


class Unit:
    """A trivial class: every method is a one-liner returning a constant."""

    def size(self):
        return 1

    def weight(self):
        return 1

    def count(self):
        return 1
''',
    "tests/test_ops.py": """\
from tinycalc import Unit, clamp, mean, parse_pairs, running_total


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_clamp():
    assert [clamp(v, 0, 10) for v in (-5, 5, 15)] == [0, 5, 10]


def test_running_total():
    assert running_total([1, 2, 3]) == [1, 3, 6]


def test_parse_pairs():
    assert parse_pairs("a=1, b=22") == {"a": 1, "b": 22}


def test_unit():
    u = Unit()
    assert (u.size(), u.weight(), u.count()) == (1, 1, 1)
""",
}


def write_sdist(path: Path, files: dict[str, str], top: str) -> str:
    """Write an sdist (tar.gz) of ``files`` under ``top/``; its sha256."""
    import hashlib
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as archive:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(folder: Path, name: str, sdist: str, sha256: str, extra: str = "") -> Path:
    manifest = folder / "my.toml"
    manifest.write_text(
        f'[[project]]\nname = "{name}"\nversion = "1.0"\nsha256 = "{sha256}"\nlicence = "MIT"\n'
        f'sdist = "{sdist}"\npackages = ["{name}"]\ntests = ["tests"]\n{extra}'
    )
    return manifest


def test_generate_tasks_builds_tasks_for_a_users_own_project(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from feature_deletion import cli

    sha256 = write_sdist(tmp_path / "tinycalc-1.0.tar.gz", TINY, "tinycalc-1.0")
    manifest = write_manifest(tmp_path, "tinycalc", "tinycalc-1.0.tar.gz", sha256, "test_timeout_s = 60\n")
    store = Store(tmp_path / "store")
    hide = [arg for path in HIDDEN for arg in ("--hide", str(path))]
    argv = ["--manifest", str(manifest), "--store", str(store.root), *hide, "--workers", "1", "--no-canary"]
    assert cli.generate_main(argv) == 0
    assert "built tinycalc-1.0" in capsys.readouterr().out

    project = corpus.load_project(store, "tinycalc-1.0")
    assert project.corpus == "user" and project.scanned and project.spec.test_timeout_s == 60
    assert sorted(p.name for p in project.tree(store).rglob("*") if p.is_file()) == [
        "LICENSE",
        "__init__.py",
        "ops.py",
        "test_ops.py",
    ]
    tasks = {t.qualname: t for t in _read_tasks(store.taskset("my") / "tasks.jsonl")}
    assert set(tasks) == {"mean", "clamp", "running_total", "parse_pairs"}
    attempts = [
        json.loads(line) for line in (store.taskset("my") / "attempts.jsonl").read_text().splitlines()
    ]
    unit = next(a for a in attempts if a["candidate"] == "Unit")
    assert unit["status"] == "filtered" and unit["reason"].startswith("trivial: 2 syntax-tree nodes")
    with FeatureDeletion(store, "my", hidden_paths=HIDDEN) as env:
        for task_id in env.tasks:
            assert play(env, task_id, agents.Oracle())[0] == 1.0, task_id
            assert play(env, task_id, agents.NoOp())[0] == 0.0, task_id
    # A second run reuses the built project (the same manifest entry) instead of rebuilding it.
    assert cli.generate_main(argv) == 0
    assert "built tinycalc" not in capsys.readouterr().out


def _read_tasks(path: Path) -> list[Task]:
    from feature_deletion.tasks import read_tasks

    return list(read_tasks(path))


def test_a_suite_over_its_time_limit_is_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from feature_deletion import cli

    files = {
        "PKG-INFO": "Metadata-Version: 2.1\nName: slowpkg\nVersion: 1.0\nLicense: MIT\n",
        "slowpkg/__init__.py": "def f():\n    return 1\n",
        "tests/test_slow.py": "import time\n\n\ndef test_slow():\n    time.sleep(30)\n",
    }
    sha256 = write_sdist(tmp_path / "slowpkg-1.0.tar.gz", files, "slowpkg-1.0")
    manifest = write_manifest(tmp_path, "slowpkg", "slowpkg-1.0.tar.gz", sha256, "test_timeout_s = 2\n")
    argv = ["--manifest", str(manifest), "--store", str(tmp_path / "store"), "--no-scan"]
    assert cli.build_corpus_main(argv) == 1
    out = capsys.readouterr().out
    assert (
        "REFUSED slowpkg-1.0: slowpkg: the test suite did not run to the end in the sandbox: timed out after"
        in out
    )
    assert (
        "(the limit is 2 s: raise it with --test-timeout-s, or test_timeout_s in the project's manifest entry)"
        in out
    )
