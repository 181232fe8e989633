"""MCP tool servers as agent tools through the real launcher on CPU.

``rl`` runs the orchestrator and the trainer for two RL steps of the tiny Qwen3 on ``mcp_notes``
(``mcp_envs/``), whose episodes are offered MCP tools only: ``append_note`` of the tests' ``mcp``
SDK server over stdio, listed by each task and run in the episode's sandbox from the task's
files, and ``add`` of the same server over streamable HTTP on 127.0.0.1, listed in the run's
config. The policy is scripted, because a tiny random model writes no tool call: a token-in
server in this process stands for the inference server (``launch.remote_inference``); its first
reply calls both tools (the right word in one rollout of a group, a wrong one in the other, so
the group has a reward to learn from), its second states the sum the ``add`` tool answered.

Checked: the prompt the policy saw renders both tools' schemas as the servers declare them; the
servers' answers (the notes file the stdio server wrote in the workspace, the sum the HTTP server
computed) come back in the conversation and in the trained samples, as context and not as
targets; the reward read from the workspace and the run's metrics count the calls.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from transformers import AutoTokenizer

from prime_composer.inference.local import running_app
from prime_composer.model.resolve import resolve_model_name
from prime_composer.transport.batch import decode_rank_batch

from .conftest import REPO, free_port, metric_steps

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the episodes' sandbox needs root"),
]

SERVER = REPO / "tests" / "integration" / "mcp_calc_server.py"
ENVS = Path(__file__).resolve().parent / "mcp_envs"
ASSISTANT = "<|im_start|>assistant"
TASK = re.compile(r"Save the word (\w+) with append_note, then add (\d+) and (\d+) with add\.")
TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)

CONFIG = """
max_steps = 2
seed = 0
max_async_level = 1

[model]
name = "builtin:tiny-qwen3"

[launch]
overwrite = true
remote_inference = true

[orchestrator]
base_url = "{policy_url}"
batch_size = 2
group_size = 2
seq_len = 1024
micro_batch_size = 2
max_refill_rounds = 0

[orchestrator.sampling]
max_tokens = 160

[orchestrator.rollout]
timeout_s = 300

[[orchestrator.env]]
id = "mcp-notes"
args = {{ server = "{server}" }}

[orchestrator.env.agent]
max_turns = 3
max_context_tokens = 1024
time_limit_s = 280

[[orchestrator.env.agent.mcp_servers]]
name = "calc"
url = "{http_url}"
tools = ["add"]
timeout_s = 60

[trainer]
num_threads = 1

[trainer.optim]
lr = 1e-4
"""


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ScriptedPolicy:
    """``/inference/v1/generate`` answered from the decoded prompt (see the module docstring);
    ``prompts`` keeps every prompt's text. Each token is reported with the logprob of a uniform
    choice over the vocabulary, about what the random tiny model gives it, so the trainer's
    importance ratios stay near 1."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.logprob = -math.log(len(tokenizer))
        self.prompts: list[str] = []
        self.first_turns: Counter[str] = Counter()
        self.app = FastAPI()
        self.app.post("/inference/v1/generate")(self._generate)
        self.app.post("/update_weights")(lambda: {"status": "ok"})
        self.app.get("/v1/models")(
            lambda: {"object": "list", "data": [{"id": "policy", "max_model_len": 2048}]}
        )
        self.app.get("/health")(lambda: {"status": "ok"})

    def reply(self, text: str) -> str:
        found = TASK.search(text)
        assert found is not None, text[-500:]
        word, a, b = found.groups()
        if text.count(ASSISTANT) == 1:  # the first turn: only the generation prompt
            rollout = self.first_turns[word]
            self.first_turns[word] += 1
            return (
                _call("append_note", text=word if rollout % 2 == 0 else "nothing")
                + "\n"
                + _call("add", a=int(a), b=int(b))
            )
        answers = TOOL_RESPONSE.findall(text)
        return f"Saved. {a} + {b} = {answers[-1] if answers else '?'}."

    async def _generate(self, request: Request) -> JSONResponse:
        body = await request.json()
        prompt = list(body["token_ids"])
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        self.prompts.append(text)
        ids = [
            *self.tokenizer.encode(self.reply(text), add_special_tokens=False),
            self.tokenizer.eos_token_id,
        ]
        content = [{"token": f"token_id:{t}", "logprob": self.logprob, "top_logprobs": []} for t in ids]
        choice = {"index": 0, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": "stop"}
        return JSONResponse({"request_id": "scripted", "choices": [choice], "prompt_token_ids": prompt})


@contextlib.contextmanager
def http_server() -> Iterator[str]:
    """The calc server over streamable HTTP on a free port of 127.0.0.1; its ``/mcp`` URL."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(SERVER), "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the HTTP MCP server did not start"
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(10)


def offered_tools(prompt: str) -> list[dict[str, Any]]:
    """The tool definitions the chat template rendered (one JSON object a line in ``<tools>``)."""
    block = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    return [json.loads(line)["function"] for line in block.splitlines()]


def trained_samples(out: Path, tokenizer: Any) -> list[tuple[str, str]]:
    """Per sample of every step's batch: (its whole text, the text of its loss tokens)."""
    samples = []
    for path in sorted((out / "rollouts").glob("step_*/rank_0.bin")):
        _, _, micro_batches = decode_rank_batch(path.read_bytes())
        for mb in micro_batches:
            for row in range(mb.num_rows):
                ids, mask, which = mb.input_ids[row], mb.loss_mask[row], mb.sample_ids[row]
                for sample in sorted(set(which.tolist()) - {-1}):
                    mine = which == sample
                    samples.append(
                        (
                            tokenizer.decode(ids[mine].tolist(), skip_special_tokens=False),
                            tokenizer.decode(ids[mine & mask].tolist(), skip_special_tokens=False),
                        )
                    )
    return samples


def test_mcp_tools_are_offered_called_and_counted_through_the_launcher(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))
    policy = ScriptedPolicy(tokenizer)
    out = tmp_path / "run"
    with running_app(policy.app, startup_timeout_s=60) as policy_url, http_server() as http_url:
        config = tmp_path / "mcp.toml"
        config.write_text(CONFIG.format(policy_url=f"{policy_url}/v1", server=SERVER, http_url=http_url))
        command = [
            sys.executable,
            "-m",
            "prime_composer.launch.rl",
            "@",
            str(config),
            "--output-dir",
            str(out),
            "--no-launch.progress",
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ENVS), os.environ.get("PYTHONPATH")])),
        }
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert metric_steps(out, "trainer") == [0, 1]
    assert (out / "broadcasts" / "step_2" / "STABLE").is_file()
    # The HTTP server's calls are not logged request by request (the SDK's client is httpx2).
    assert "HTTP Request" not in (out / "logs" / "orchestrator.log").read_text()

    # Offered: both servers' tools, nothing else, with the schemas their source declares.
    first_turns = [p for p in policy.prompts if p.count(ASSISTANT) == 1]
    assert len(first_turns) == 4 and sorted(policy.first_turns.values()) == [2, 2]
    for prompt in first_turns:
        tools = offered_tools(prompt)
        assert [t["name"] for t in tools] == ["append_note", "add"]
        note, add = tools
        assert (
            note["description"]
            == "Append a line to notes.txt in the current folder and return the whole file."
        )
        assert note["parameters"]["required"] == ["text"]
        assert note["parameters"]["properties"]["text"]["type"] == "string"
        assert add["description"] == "Add two integers."
        assert add["parameters"]["required"] == ["a", "b"]
        assert {add["parameters"]["properties"][k]["type"] for k in "ab"} == {"integer"}

    # The calls reached the servers and their answers came back: the second prompt holds the
    # notes file the stdio server wrote in the episode's workspace and the sum the HTTP server
    # computed, in the order of the calls.
    second_turns = [p for p in policy.prompts if p.count(ASSISTANT) == 2]
    assert len(second_turns) == 4
    seen = []
    for prompt in second_turns:
        word, a, b = TASK.search(prompt).groups()  # type: ignore[union-attr]
        seen.append(TOOL_RESPONSE.findall(prompt)[-2:])
        assert seen[-1][1] == str(int(a) + int(b))
    assert sorted(note for note, _ in seen) == sorted(
        ["nothing\n"] * 2 + [w + "\n" for w in policy.first_turns]
    )

    # The trained samples are the whole episodes: the calls are targets, the answers context.
    samples = trained_samples(out, tokenizer)
    assert len(samples) == 4
    for text, targets in samples:
        word, a, b = TASK.search(text).groups()  # type: ignore[union-attr]
        answers = TOOL_RESPONSE.findall(text)
        assert (
            len(answers) == 2
            and answers[1] == str(int(a) + int(b))
            and answers[0] in (f"{word}\n", "nothing\n")
        )
        assert '<tool_call>{"name": "append_note"' in targets and '<tool_call>{"name": "add"' in targets
        assert f"= {int(a) + int(b)}." in targets
        assert "<tool_response>" not in targets and "<tools>" not in targets

    # The reward (the workspace's notes file) and the metrics count what the servers did.
    rows = [json.loads(line) for line in (out / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for row in steps:
        assert row["samples/errors"] == 0
        assert row["reward/mean"] == 0.5  # one rollout of the group saved the right word
        assert row["env_metric/agent/mcp_calls"] == 2.0 and row["env_metric/agent/mcp_errors"] == 0.0
        assert row["env_metric/agent/num_tool_calls"] == 2.0 and row["env_metric/agent/tool_errors"] == 0.0
        assert row["env_metric/agent/mcp_call_s"] > 0.0
        assert row["env_metric/answered_sum"] == 1.0 and row["env_metric/num_turns"] == 2.0
