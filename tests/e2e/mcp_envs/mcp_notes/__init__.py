"""mcp_notes: an agent taskset whose only tools are MCP servers' (``tests/e2e/test_mcp_launcher.py``).

A task asks the model to save a word with ``append_note`` and to add two numbers with ``add``.
``append_note`` is a tool of a stdio MCP server that each task lists in its data
(``AgentTaskData.mcp_servers``); its script, the tests' ``mcp`` SDK server (``server`` in the
config: ``tests/integration/mcp_calc_server.py``), is one of the task's files, so it runs in the
episode's sandbox on the episode's workspace. ``add`` comes from a streamable-HTTP server that the
run's config lists (``orchestrator.env.agent.mcp_servers``). No sandbox tool is offered.

Reward ``noted``: 1 when the workspace's ``notes.txt``, which only the stdio server writes, holds
exactly the task's word; metric ``answered_sum``: whether the last reply states the sum ``a + b``.
"""

from __future__ import annotations

from pathlib import Path

import verifiers.v1 as vf
from pydantic import Field

from prime_composer.config.env import McpServerConfig
from prime_composer.orchestrator.agent_harness import AGENT_KEY
from prime_composer.orchestrator.agent_task import AgentState, AgentTaskData, read_files

NOTES = "notes.txt"
WORDS = ("apple", "cherry", "lemon", "plum")


def prompt_text(word: str, a: int, b: int) -> str:
    return f"Save the word {word} with append_note, then add {a} and {b} with add."


class NotesData(AgentTaskData):
    word: str
    a: int
    b: int


class NotesConfig(vf.TasksetConfig):
    server: str
    """Path of the stdio MCP server's script, copied into every task as ``mcp_server.py``."""
    num_tasks: int = Field(len(WORDS), ge=1, le=len(WORDS))
    timeout_s: float = Field(120.0, gt=0)
    """The stdio server's ``timeout_s`` (its first call includes the SDK's start-up)."""


class NotesTask(vf.Task[NotesData, AgentState]):
    @vf.reward(weight=1.0)
    async def noted(self, trace: vf.Trace) -> float:
        state = trace.state
        if not isinstance(state, AgentState) or state.workspace is None:
            return 0.0
        return float(read_files(state.workspace, [NOTES]).get(NOTES) == self.data.word + "\n")

    @vf.metric
    async def answered_sum(self, trace: vf.Trace) -> float:
        # Agent traces keep the conversation on the episode record, not in trace.messages.
        episode = trace.info.get(AGENT_KEY)
        replies = [m["content"] for m in episode.messages if m["role"] == "assistant"] if episode else []
        return float(bool(replies) and f"= {self.data.a + self.data.b}." in replies[-1])


class NotesTaskset(vf.Taskset[NotesTask, NotesConfig]):
    def load(self) -> list[NotesTask]:
        source = Path(self.config.server).read_text()
        server = McpServerConfig(
            name="notes",
            command=["python", "mcp_server.py"],
            tools=["append_note"],
            timeout_s=self.config.timeout_s,
        )
        tasks = []
        for i, word in enumerate(WORDS[: self.config.num_tasks]):
            a, b = i + 2, 3 * i + 5
            data = NotesData(
                id=word,
                prompt=prompt_text(word, a, b),
                files={"mcp_server.py": source},
                tools=[],
                mcp_servers=[server],
                word=word,
                a=a,
                b=b,
            )
            tasks.append(NotesTask(data, self.config.task))
        return tasks


__all__ = ["NotesConfig", "NotesData", "NotesTask", "NotesTaskset", "prompt_text"]
