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

ENV_DIR = Path(__file__).resolve().parents[2] / "orchestrator/environments/feature_deletion"
sys.path.insert(0, str(ENV_DIR))

from feature_deletion import agents, corpus, deletion, generate  # noqa: E402
from feature_deletion.environment import Limits, open_sandbox, other_site_packages  # noqa: E402
from feature_deletion.episode import Episode, FeatureDeletion  # noqa: E402
from feature_deletion.spec import CI_MANIFEST, Store, load_manifest  # noqa: E402
from feature_deletion.tasks import Task, write_tasks  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="isolated runs need root")

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


@pytest.mark.slow  # a find / over the whole file system: 185 s on 2 shared, loaded cores
def test_the_visibility_scan_finds_a_readable_copy(built: Built) -> None:
    project = next(p for p in built.projects if p.spec.name == "textkit")
    planted = Path("/usr/local/share") / f"fd-scan-test-{os.getpid()}"  # visible: under /usr
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
    assert found == [str(planted / "case.py")]
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
