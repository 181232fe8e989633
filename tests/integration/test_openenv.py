"""OpenEnv environments through the orchestrator's rollout stage: real OpenEnv servers (written
with openenv's server API in ``openenv_envs.py``), the agent harness, and scripted policies behind
a token-in server on 127.0.0.1.

Checked: a plain environment's observations become user turns and the replies its actions, the
reward is the sum of the environment's step rewards, an MCP environment's tools are offered and
called as tool calls, bad actions are observations the model sees, every sample's tokens are what
the policy server saw and sampled, and a server that is gone makes error samples. The servers are
one served by the orchestrator from ``app`` (``serve_app``), one the test starts (``url``), and
one run from an ``image`` by a fake ``docker`` the tests write on ``PATH`` (it stands for the
container runtime's CLI: there is no container engine here) that serves the guess game; the
argv is also checked against the real docker CLI's parser when it is installed. A ``space``
source is only its URL (no network in the tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from transformers import AutoTokenizer

from prime_composer.config.env import EnvConfig, OpenEnvConfig, RolloutConfig, SamplingConfig
from prime_composer.config.ports import free_port
from prime_composer.inference.local import running_app
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator import envs, openenv_container
from prime_composer.orchestrator.openenv_env import action_instructions, parse_action
from prime_composer.orchestrator.rollout import RolloutRunner
from prime_composer.orchestrator.sample import Sample
from prime_composer.process_group import stop_group

HERE = Path(__file__).resolve().parent
ASSISTANT = "<|im_start|>assistant"


def _guess_in_order(prompt: str, step: int) -> str:
    return "abc"[step % 3]


def _guess_json(prompt: str, step: int) -> str:
    return '```json\n{"guess": "b"}\n```'


def _bad_action(prompt: str, step: int) -> str:
    return ['{"nope": 1}', '{"guess": 7}', "c"][step % 3]


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _counter(prompt: str, step: int) -> str:
    return [_call("add", n=2), _call("add", n=3), "done"][min(step, 2)]


def _counter_bad(prompt: str, step: int) -> str:
    return [_call("add", n="x"), _call("nope"), "I give up."][min(step, 2)]


POLICIES: dict[str, Callable[[str, int], str]] = {
    "guess": _guess_in_order,
    "json": _guess_json,
    "bad": _bad_action,
    "counter": _counter,
    "counter_bad": _counter_bad,
}


class ScriptedPolicy:
    """``POST /inference/v1/generate`` answered by ``POLICIES[model](prompt text, step)`` (step: the
    number of assistant turns already in the prompt); ``calls`` keeps (prompt ids, reply ids)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls: list[tuple[list[int], list[int]]] = []
        self.app = FastAPI()
        self.app.post("/inference/v1/generate")(self._generate)
        self.app.get("/v1/models")(self._models)
        self.app.get("/health")(lambda: {"status": "ok"})

    async def _generate(self, request: Request) -> JSONResponse:
        body = await request.json()
        prompt = list(body["token_ids"])
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        reply = POLICIES[body["model"]](text, text.count(ASSISTANT) - 1)
        ids = [*self.tokenizer.encode(reply, add_special_tokens=False), self.tokenizer.eos_token_id]
        self.calls.append((prompt, ids))
        content = [{"token": f"token_id:{t}", "logprob": -0.5, "top_logprobs": []} for t in ids]
        choice = {"index": 0, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": "stop"}
        return JSONResponse({"request_id": "r", "choices": [choice], "prompt_token_ids": prompt})

    async def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "max_model_len": 4096} for m in POLICIES]}

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        """Serve on a free port of 127.0.0.1 in a thread; yields the OpenAI base URL."""
        with running_app(self.app, startup_timeout_s=30) as url:
            yield f"{url}/v1"


@pytest.fixture(scope="module")
def tokenizer_path() -> str:
    return resolve_model_name("builtin:tiny-qwen3")


@pytest.fixture(scope="module")
def policy(tokenizer_path: str) -> Iterator[tuple[ScriptedPolicy, str]]:
    scripted = ScriptedPolicy(AutoTokenizer.from_pretrained(tokenizer_path))
    with scripted.serve() as base_url:
        yield scripted, base_url


def _agent(tokenizer_path: str, **extra: Any) -> dict[str, Any]:
    return {"tokenizer": tokenizer_path, "max_turns": 5, "time_limit_s": 60, "render_tools": True, **extra}


@pytest.fixture(scope="module")
def guess(tokenizer_path: str) -> envs.LoadedEnv:
    """The guess game served by the orchestrator itself (``app``), seeds 0-2 (targets a, b, c)."""
    source = {
        "app": "openenv_envs:guess_app",
        "app_dir": str(HERE),
        "resets": [{"seed": s} for s in range(3)],
    }
    entry = EnvConfig(
        name="guess", openenv=source, agent=_agent(tokenizer_path), eval_args={"resets": [{"seed": 4}]}
    )
    return envs.load_env(entry, 0)


@pytest.fixture(scope="module")
def counter_url() -> Iterator[str]:
    """The MCP counter, started by the test: the ``url`` source."""
    port = free_port("127.0.0.1")
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "openenv_envs:counter_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    child = subprocess.Popen(command, cwd=HERE, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert child.poll() is None and time.monotonic() < deadline, "the counter server did not start"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        time.sleep(0.2)
    yield url
    stop_group(child, 10)


@pytest.fixture(scope="module")
def counter(counter_url: str, tokenizer_path: str) -> envs.LoadedEnv:
    source = {"url": counter_url, "resets": [{"goal": 5}]}
    return envs.load_env(EnvConfig(name="counter", openenv=source, agent=_agent(tokenizer_path)), 0)


def play(
    loaded: envs.LoadedEnv, base_url: str, model: str, task_indices: list[int], split: str = "train"
) -> list[Sample]:
    tasks = loaded.tasks(split)  # type: ignore[arg-type]

    async def main() -> list[list[Sample]]:
        async with RolloutRunner(
            [loaded],
            base_url=base_url,
            model=model,
            sampling=SamplingConfig(max_tokens=100),
            rollout=RolloutConfig(max_concurrent=8),
        ) as runner:
            return await asyncio.gather(
                *(
                    runner.run_group(loaded, tasks[i], group_size=1, example_id=i, group_id=i, policy_step=0)
                    for i in task_indices
                )
            )

    return [sample for group in asyncio.run(main()) for sample in group]


@pytest.mark.slow
def test_observations_are_user_turns_and_replies_are_actions(policy, guess) -> None:
    samples = play(guess, policy[1], "guess", [0, 1, 2])
    for seed, sample in enumerate(samples):
        assert sample.error is None, sample.error
        # The policy guesses a, b, c in turn: the right letter comes at guess seed+1, rewarded 1.
        assert sample.reward == 1.0 and sample.metrics["openenv_steps"] == seed + 1
        assert sample.episode.stop == "env_done" and not sample.is_truncated
        roles = [m["role"] for m in sample.episode.messages]
        assert roles == ["user"] + ["assistant", "user"] * seed + ["assistant"]
        assert sample.episode.messages[0]["content"].startswith("Guess a letter: a, b or c.")
        assert (
            "Reply with your action: a JSON object with the fields guess (string, required)"
            in (sample.episode.messages[0]["content"])
        )
        assert [m["content"] for m in sample.episode.messages[2::2]] == ["wrong"] * seed
    # An episode that never guesses right ends at the environment's 3 guesses with reward 0.
    (held_out,) = play(guess, policy[1], "json", [0], split="eval")  # seed 4: target b, guessed b
    assert held_out.reward == 1.0 and held_out.metrics["openenv_steps"] == 1


def test_sample_tokens_are_exactly_what_the_policy_saw_and_sampled(policy, guess) -> None:
    scripted, base_url = policy
    scripted.calls.clear()
    (sample,) = play(guess, base_url, "guess", [2])  # three turns
    turns = sample.episode.turns
    assert len(turns) == len(scripted.calls) == 3
    for turn, (prompt, reply) in zip(turns, scripted.calls, strict=True):
        start, end = turn.span
        assert prompt == sample.prompt_ids + sample.completion_ids[:start]
        assert reply == sample.completion_ids[start:end]
        assert all(sample.completion_mask[start:end]) and sample.completion_logprobs[start:end] == [-0.5] * (
            end - start
        )
    policy_tokens = {i for t in turns for i in range(*t.span)}
    assert all(
        m == (i in policy_tokens) for i, m in enumerate(sample.completion_mask)
    )  # observations: mask 0


def test_bad_actions_are_observations_the_model_sees(policy, guess) -> None:
    (sample,) = play(guess, policy[1], "bad", [2])  # target c: unknown field, wrong type, then right
    assert sample.error is None and sample.reward == 1.0
    assert sample.metrics["openenv_invalid_actions"] == 2.0 and sample.metrics["openenv_steps"] == 1.0
    errors = [m["content"] for m in sample.episode.messages if m["role"] == "user"][1:]
    assert errors[0].startswith("Error: the action has no field 'nope'")
    assert errors[1].startswith("Error: the environment refused this action")


def test_mcp_tools_are_offered_and_each_call_is_a_step(policy, counter) -> None:
    (sample,) = play(counter, policy[1], "counter", [0])
    assert sample.error is None and sample.reward == 1.0, sample.error
    assert sample.episode.stop == "env_done" and sample.metrics["openenv_steps"] == 2.0
    assert [t["function"]["name"] for t in sample.episode.tools] == ["add"]
    assert sample.episode.tools[0]["function"]["parameters"]["required"] == ["n"]
    results = [r for t in sample.episode.turns for r in t.tool_results]
    assert [(r.name, r.content, r.ok) for r in results] == [("add", "2", True), ("add", "5", True)]
    assert sample.episode.messages[0]["content"] == json.dumps(
        {"metadata": {"task": "Make the counter reach 5 with the add tool."}}
    )


def test_mcp_tool_errors_are_tool_results(policy, counter) -> None:
    (sample,) = play(counter, policy[1], "counter_bad", [0])
    assert sample.error is None and sample.reward == 0.0 and sample.episode.stop == "final_answer"
    results = [r for t in sample.episode.turns for r in t.tool_results]
    assert [(r.ok, r.error) for r in results] == [(False, "invalid_arguments"), (False, "unknown_tool")]
    assert "must be of type integer" in results[0].content
    assert sample.metrics["openenv_steps"] == 0.0  # refused before reaching the environment


def test_a_server_that_is_gone_makes_error_samples(policy, tokenizer_path) -> None:
    gone = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    loaded = envs.load_env(
        EnvConfig(openenv={"url": gone, "connect_timeout_s": 2}, agent=_agent(tokenizer_path)), 0
    )
    (sample,) = play(loaded, policy[1], "guess", [0])
    assert sample.error is not None and "/schema" in sample.error and sample.reward == 0.0


def test_an_app_that_does_not_start_is_a_clear_error(tokenizer_path) -> None:
    entry = EnvConfig(
        openenv={"app": "no_such_module_here:app", "app_dir": str(HERE), "startup_timeout_s": 60}
    )
    with pytest.raises(ValueError, match=r"orchestrator.env\[0\].*no_such_module_here:app.*exited"):
        envs.load_env(entry, 0)


def test_config_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="exactly one of url"):
        OpenEnvConfig()
    with pytest.raises(ValueError, match="module:attribute"):
        OpenEnvConfig(app="my_env")
    with pytest.raises(ValueError, match="openenv table"):
        EnvConfig(openenv={"url": "http://127.0.0.1:1"}, args={"seed": 1})
    assert EnvConfig(openenv={"url": "http://127.0.0.1:1"}).label == "openenv"


def test_action_parsing_against_a_schema() -> None:
    schema = {
        "title": "GuessAction",
        "type": "object",
        "additionalProperties": False,
        "properties": {"metadata": {"type": "object"}, "guess": {"type": "string"}},
        "required": ["guess"],
    }
    assert parse_action(' {"guess": "a"} ', schema) == {"guess": "a"}
    assert parse_action('```\n{"guess": "a"}\n```', schema) == {"guess": "a"}
    assert parse_action("  b\n", schema) == {"guess": "b"}  # the one required field's bare value
    assert parse_action("7", schema) == {"guess": "7"}  # a string field keeps the text
    with pytest.raises(ValueError, match="no field 'x'"):
        parse_action('{"x": 1}', schema)
    with pytest.raises(ValueError, match="empty"):
        parse_action("   ", schema)
    two = {
        **schema,
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    with pytest.raises(ValueError, match="needs the field 'b'"):
        parse_action('{"a": 1}', two)
    with pytest.raises(ValueError, match="not a JSON object"):
        parse_action("1 2", two)
    assert (
        action_instructions(two)
        == "Reply with your action: a JSON object with the fields a (integer, required), b (integer, required)."
    )


# -- container images (openenv.image) and Hugging Face Spaces (openenv.space) ------------------

FAKE_DOCKER = r'''#!{python}
"""A stand-in for the docker CLI (no container engine here): `run` serves the tests' guess game
with uvicorn on the host port of its -p flag, `inspect`, `logs` and `stop` act on that process.
Every call is logged as a JSON argv line to calls.jsonl beside this file."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

HOME = Path(__file__).resolve().parent
args = sys.argv[1:]
with open(HOME / "calls.jsonl", "a") as f:
    f.write(json.dumps(args) + "\n")
if args[0] == "run":
    assert args[1:4] == ["--rm", "-d", "-p"], args
    host, port, inner = args[4].split(":")
    image = args[5]
    if image.endswith("broken"):
        command = [sys.executable, "-c", "import sys; print('boom: no such env'); sys.exit(3)"]
    else:
        command = [sys.executable, "-m", "uvicorn", "openenv_envs:guess_app", "--host", host, "--port", port]
    log = open(HOME / "container.log", "w")
    child = subprocess.Popen(
        command, cwd={envs_dir!r}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    print(f"c0ffee{{child.pid}}")
elif args[0] == "inspect":
    pid = int(args[-1].removeprefix("c0ffee"))
    try:
        state = Path(f"/proc/{{pid}}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        sys.exit(1)
    print("false" if state == "Z" else "true")
elif args[0] == "logs":
    print((HOME / "container.log").read_text())
elif args[0] == "stop":
    pid = int(args[-1].removeprefix("c0ffee"))
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        sys.exit(1)
    print(args[-1])
'''


@pytest.fixture
def fake_docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``docker`` executable first on ``PATH`` (see ``FAKE_DOCKER``); returns its folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(FAKE_DOCKER.format(python=sys.executable, envs_dir=str(HERE)))
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


def docker_calls(bin_dir: Path) -> list[list[str]]:
    path = bin_dir / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_an_image_is_run_on_a_free_loopback_port_and_stopped_at_the_end(
    policy, tokenizer_path, fake_docker
) -> None:
    image = "ghcr.io/example/guess-env:1"
    entry = EnvConfig(
        name="guess-image",
        openenv={"image": image, "resets": [{"seed": s} for s in range(3)]},
        agent=_agent(tokenizer_path),
    )
    loaded = envs.load_env(entry, 0)
    (run,) = [c for c in docker_calls(fake_docker) if c[0] == "run"]
    host, port, inner = run[4].split(":")
    assert run == ["run", "--rm", "-d", "-p", f"127.0.0.1:{port}:8000", image]
    assert (host, inner) == ("127.0.0.1", "8000")
    samples = play(loaded, policy[1], "guess", [0, 1, 2])
    for seed, sample in enumerate(samples):
        assert sample.error is None, sample.error
        assert sample.reward == 1.0 and sample.metrics["openenv_steps"] == seed + 1
    openenv_container.stop_all()
    stops = [c for c in docker_calls(fake_docker) if c[0] == "stop"]
    assert len(stops) == 1 and stops[0][1].startswith("c0ffee")
    server_pid = int(stops[0][1].removeprefix("c0ffee"))
    deadline = time.monotonic() + 30
    while pid_alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(server_pid)
    # Its environment gone, an episode is an error sample, not a crash.
    (sample,) = play(loaded, policy[1], "guess", [0])
    assert sample.error is not None and sample.reward == 0.0


@pytest.mark.slow
def test_a_killed_orchestrator_still_stops_its_container(fake_docker) -> None:
    """The process that ran the image is SIGKILLed (no atexit): its watcher stops the container."""
    script = (
        "from prime_composer.config.env import OpenEnvConfig\n"
        "from prime_composer.orchestrator.openenv_container import serve_image\n"
        "print(serve_image(OpenEnvConfig(image='ghcr.io/example/guess-env:1')), flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        url = child.stdout.readline().strip()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    finally:
        child.kill()
        child.wait()
    assert [c[0] for c in docker_calls(fake_docker)].count("run") == 1
    deadline = time.monotonic() + 60
    while not any(c[0] == "stop" for c in docker_calls(fake_docker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    (stop,) = [c for c in docker_calls(fake_docker) if c[0] == "stop"]
    server_pid = int(stop[1].removeprefix("c0ffee"))
    while pid_alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(server_pid)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


def test_an_image_that_does_not_serve_is_a_clear_error(fake_docker) -> None:
    entry = EnvConfig(openenv={"image": "ghcr.io/example/broken", "startup_timeout_s": 60})
    with pytest.raises(
        ValueError, match=r"orchestrator.env\[0\].*ghcr.io/example/broken.*did not answer"
    ) as e:
        envs.load_env(entry, 0)
    assert "boom: no such env" in str(e.value)  # the end of `docker logs`
    assert [c[0] for c in docker_calls(fake_docker)][-1] == "stop"


def test_no_container_runtime_is_a_config_error_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # neither docker nor podman
    entries = [EnvConfig(id="arith"), EnvConfig(openenv={"image": "ghcr.io/example/env:1"})]
    (problem,) = openenv_container.runtime_problems(entries)
    assert problem.startswith("orchestrator.env[1]: openenv.image = 'ghcr.io/example/env:1'")
    assert "docker or podman is not on PATH" in problem
    with pytest.raises(ValueError, match=r"orchestrator.env\[1\] .*openenv.image.*docker or podman"):
        envs.load_env(entries[1], 1)
    podman_only = EnvConfig(openenv={"image": "x:1", "container_runtime": "podman"})
    assert "podman is not on PATH" in openenv_container.runtime_problems([podman_only])[0]


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI to parse the argv")
def test_the_argv_parses_with_the_real_docker_cli(tmp_path: Path) -> None:
    """The real CLI parses the flags before it needs a daemon: a wrong flag is a usage error
    (exit 125, "unknown flag"); a right one gets as far as the daemon (or runs, with one)."""
    docker = shutil.which("docker")
    assert docker is not None
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "DOCKER_HOST": f"unix://{tmp_path}/none.sock"}
    bad = subprocess.run([docker, "run", "--no-such-flag", "x"], capture_output=True, text=True, env=env)
    assert bad.returncode == 125 and "unknown flag" in bad.stderr
    argvs = [
        openenv_container.run_argv(docker, "ghcr.io/example/env:1", free_port("127.0.0.1"), 8000),
        [docker, "stop", "c0ffee1"],
        [docker, "logs", "c0ffee1"],
        [docker, "inspect", "--format", "{{.State.Running}}", "c0ffee1"],
    ]
    for argv in argvs:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        assert "unknown flag" not in proc.stderr and "Usage:" not in proc.stderr, (argv, proc.stderr)
        assert "Cannot connect to the Docker daemon" in proc.stderr, (argv, proc.stderr)


def test_a_space_is_its_https_url_without_any_call(tokenizer_path) -> None:
    assert OpenEnvConfig(space="openenv/echo_env").space_url == "https://openenv-echo-env.hf.space"
    assert OpenEnvConfig(space="Some.Owner/My_Env.v2").space_url == "https://some-owner-my-env-v2.hf.space"
    with pytest.raises(ValueError, match="owner/name"):
        OpenEnvConfig(space="just-a-name")
    with pytest.raises(ValueError, match=r"exactly one of url.*got url, space"):
        OpenEnvConfig(url="http://127.0.0.1:1", space="a/b")
    # Loading the entry makes its tasks, which talk to the Space's URL once an episode opens
    # (nothing is called here: the sessions open in each episode's setup).
    loaded = envs.load_env(EnvConfig(openenv={"space": "openenv/echo_env"}, agent=_agent(tokenizer_path)), 0)
    (task,) = loaded.tasks("train")  # type: ignore[arg-type]
    assert task.url == "https://openenv-echo-env.hf.space"
    assert task.data.source == "openenv/echo_env"


# -- a private Space: the token of token_env, over https only --------------------------------

TOKEN = "hf_" + os.urandom(12).hex()


def _behind_token(inner: Any, seen: list[tuple[str, str, str]]) -> Any:
    """``inner`` answering only requests with ``Authorization: Bearer TOKEN`` (HTTP 401, or a
    refused WebSocket handshake, otherwise); ``seen`` gets (kind, path, header) of each request."""

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            header = dict(scope["headers"]).get(b"authorization", b"").decode()
            seen.append((scope["type"], scope["path"], header))
            if header != f"Bearer {TOKEN}":
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                else:
                    await send({"type": "http.response.start", "status": 401, "headers": []})
                    await send({"type": "http.response.body", "body": b"unauthorized"})
                return
        await inner(scope, receive, send)

    return guarded


@pytest.fixture(scope="module")
def private_space(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Path, list[tuple[str, str, str]]]]:
    """The guess game standing in for a private Space: https on 127.0.0.1 with a self-signed
    certificate (its ``cert.pem`` is what clients must trust), behind ``TOKEN``. Yields the URL,
    the certificate and the log of requests."""
    import threading

    import uvicorn
    from openenv_envs import guess_app

    from prime_composer.wire.tls import generate

    folder = tmp_path_factory.mktemp("space-tls")
    generate(folder, "space-stand-in", hosts=("127.0.0.1",))
    seen: list[tuple[str, str, str]] = []
    port = free_port("127.0.0.1")
    server = uvicorn.Server(
        uvicorn.Config(
            _behind_token(guess_app, seen),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            ssl_certfile=str(folder / "cert.pem"),
            ssl_keyfile=str(folder / "key.pem"),
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the https stand-in did not start"
        time.sleep(0.05)
    yield f"https://127.0.0.1:{port}", folder / "cert.pem", seen
    server.should_exit = True
    thread.join(timeout=10)


def test_a_private_space_gets_the_token_over_https_and_nowhere_else(
    policy, private_space, tokenizer_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The stand-in's URL is injected where a Space's would be (``url``: the same code path once
    the Space's URL is known). With the token, /schema and every episode's WebSocket carry it and
    the episode plays; with a wrong one the episode is an error sample that names neither."""
    url, cert, seen = private_space
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # httpx and websockets trust the stand-in's certificate
    monkeypatch.setenv("PC_TEST_SPACE_TOKEN", TOKEN)
    entry = EnvConfig(
        openenv={"url": url, "token_env": "PC_TEST_SPACE_TOKEN", "resets": [{"seed": 1}]},
        agent=_agent(tokenizer_path),
    )
    loaded = envs.load_env(entry, 0)
    caplog.set_level("DEBUG")
    (sample,) = play(loaded, policy[1], "guess", [0])  # target b: a, then b
    assert sample.error is None and sample.reward == 1.0, sample.error
    kinds = {(kind, path) for kind, path, _ in seen}
    assert ("http", "/schema") in kinds and ("websocket", "/ws") in kinds, seen
    assert {header for _, _, header in seen} == {f"Bearer {TOKEN}"}
    # The token is in no config the entry made, no task, no sample and no log line.
    dumps = [
        entry.model_dump_json(),
        json.dumps([t.data.model_dump(mode="json") for t in loaded.tasks("train")]),  # type: ignore[arg-type]
        json.dumps(sample.episode.messages),
        caplog.text,
    ]
    assert all(TOKEN not in text for text in dumps) and "PC_TEST_SPACE_TOKEN" in dumps[0]
    assert "> Authorization: <hidden>" in caplog.text  # websockets logs the handshake at DEBUG

    seen.clear()
    wrong = "hf_wrong_" + TOKEN[::-1]
    monkeypatch.setenv("PC_TEST_SPACE_TOKEN", wrong)
    from prime_composer.orchestrator import openenv_env

    openenv_env._schemas.clear()  # asked once per server and process: ask it again
    (refused,) = play(loaded, policy[1], "guess", [0])
    assert refused.error is not None and "401" in refused.error, refused.error
    assert wrong not in refused.error and TOKEN not in refused.error and wrong not in caplog.text
    assert seen == [("http", "/schema", f"Bearer {wrong}")]


def test_token_env_is_refused_over_plain_http_and_for_local_servers(tokenizer_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"token_env: http://127.0.0.1:1 is plain http"):
        OpenEnvConfig(url="http://127.0.0.1:1", token_env="HF_TOKEN")
    with pytest.raises(ValueError, match="name of an environment variable"):
        OpenEnvConfig(space="me/env", token_env="hf_abc def")
    with pytest.raises(ValueError, match=r"serves openenv\.app itself"):
        OpenEnvConfig(app="openenv_envs:guess_app", token_env="HF_TOKEN")
    # A Space's URL is https by construction; loading it needs the variable set (no call is made).
    monkeypatch.delenv("PC_TEST_SPACE_TOKEN", raising=False)
    entry = EnvConfig(
        openenv={"space": "me/private_env", "token_env": "PC_TEST_SPACE_TOKEN"}, agent=_agent(tokenizer_path)
    )
    with pytest.raises(ValueError, match=r"openenv.token_env = 'PC_TEST_SPACE_TOKEN'.*not set"):
        envs.load_env(entry, 0)
    monkeypatch.setenv("PC_TEST_SPACE_TOKEN", TOKEN)
    (task,) = envs.load_env(entry, 0).tasks("train")  # type: ignore[arg-type]
    assert (
        task.url == "https://me-private-env.hf.space"
        and task.source_config.token_env == "PC_TEST_SPACE_TOKEN"
    )
    # The last check before a token leaves: no header for a plain-http URL, whatever the config said.
    from prime_composer.orchestrator.openenv_env import OpenEnvError, auth_headers

    with pytest.raises(OpenEnvError, match="only sent over https"):
        auth_headers(task.source_config.model_copy(), "http://127.0.0.1:1")
    assert auth_headers(task.source_config, task.url) == {"Authorization": f"Bearer {TOKEN}"}
