"""Config of the environments the orchestrator samples from, and of sampling itself.

``[[orchestrator.env]]`` entries name a verifiers v1 environment (a taskset package) and the
arguments of its taskset config, and, for environments whose episodes use tools, the limits of
the agent loop (``[orchestrator.env.agent]``); ``[orchestrator.sampling]`` holds the knobs sent
with every model call. No verifiers import here: the ids are resolved by
``prime_composer.orchestrator.envs`` when the orchestrator starts.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from prime_composer.config.base import BaseConfig
from prime_composer.config.client import RetryConfig
from prime_composer.config.sandbox import SandboxConfig, ToolsConfig


class McpServerConfig(BaseConfig):
    """One MCP tool server whose tools the agent loop offers beside (or instead of) the sandbox's.

    ``command`` is a stdio server: it runs in the episode's sandbox, in its workspace, one run per
    tool call (``orchestrator/mcp_tools.py`` says why), so it sees the episode's files and nothing
    else, without network. ``url`` is a streamable-HTTP server that is already running; it is
    called from the orchestrator's process, not sandboxed.
    """

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_-]+$")
    """Label of the server in errors and tool records."""

    command: list[str] | None = None
    """The stdio server's argv, run in the sandbox's workspace (e.g. ``["python", "server.py"]``)."""

    url: str | None = None
    """The streamable-HTTP endpoint (e.g. ``http://127.0.0.1:8000/mcp``)."""

    tools: list[str] | None = None
    """Offer only these of the server's tools; ``None`` offers all it lists."""

    timeout_s: float = Field(default=30.0, gt=0)
    """Wall-clock limit of one tool call (server start-up included for stdio servers)."""

    @model_validator(mode="after")
    def _check_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError(
                f"mcp server {self.name!r}: set exactly one of command (a stdio server) or url "
                "(a streamable-HTTP server)"
            )
        if self.command is not None and not self.command:
            raise ValueError(f"mcp server {self.name!r}: command is empty; give the server's argv")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"mcp server {self.name!r}: url must start with http:// or https://, got {self.url!r}"
            )
        return self


class AgentLoopConfig(BaseConfig):
    """The multi-turn, tool-using episode loop (``orchestrator/episode.py``): its budgets, how tool
    calls are read from the model's text, and the sandbox the tools run in.

    An episode ends when the model replies without a tool call, or at the first budget it reaches:
    ``max_turns`` model calls, ``max_context_tokens`` in one call's context, ``max_episode_tokens``
    sampled tokens, or ``time_limit_s`` of wall time. Every ending is recorded on the samples
    (``info["stop"]``); one that comes from a budget marks them truncated.
    """

    max_turns: int = Field(default=16, ge=1)
    """Most model calls per episode."""

    max_context_tokens: int | None = Field(default=None, ge=16)
    """Most tokens of one model call's context (prompt + the reply it may write); ``None`` is the
    server's own limit (``max_model_len`` from ``/v1/models``). Each reply is also capped by
    ``orchestrator.sampling.max_tokens``."""

    max_episode_tokens: int | None = Field(default=None, ge=1)
    """Most tokens the model may sample over the whole episode; ``None``: no budget beyond the others."""

    time_limit_s: float = Field(default=300.0, gt=0)
    """Wall-clock budget of the loop (model calls and tools). Checked before every model call and
    tool call, so it must sit below ``orchestrator.rollout.timeout_s``, which kills the episode
    outright."""

    tool_call_format: str = "hermes"
    """How tool calls are written in the model's text (a parser of ``prime_composer.tool_calls``:
    ``hermes`` is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``)."""

    max_tool_calls_per_turn: int = Field(default=8, ge=1)
    """Tool calls run from one reply; further ones get an error result instead of running."""

    render_tools: bool = True
    """Pass the tool definitions to the chat template (``apply_chat_template(..., tools=...)``);
    templates without tool support ignore them, so environments also describe their tools in the
    prompt."""

    tokenizer: str | None = None
    """Tokenizer (and chat template) to render with; ``None`` is the policy model's. Set it when
    the served model name is not a loadable model (a scripted test server, say)."""

    tools: ToolsConfig = ToolsConfig()
    """Output caps of the coding tools; which tools are offered is each task's choice."""

    mcp_servers: list[McpServerConfig] = Field(default_factory=list)
    """MCP tool servers whose tools every episode is offered after the task's own tools (a task
    can list more in ``AgentTaskData.mcp_servers``); tool names must not clash."""

    sandbox: SandboxConfig = SandboxConfig()
    """Where and how tool calls and test runs execute (see ``prime_composer.sandbox``)."""

    request: RetryConfig = RetryConfig(timeout_s=300.0, max_retries=2)
    """Time limit and retries of one token-in model call (``/inference/v1/generate``); a call that
    still fails makes the episode an error sample."""

    @model_validator(mode="after")
    def _check_mcp_names(self) -> AgentLoopConfig:
        names = [server.name for server in self.mcp_servers]
        if len(set(names)) != len(names):
            raise ValueError(f"mcp_servers: two servers share a name in {names}; give each its own name")
        return self


class EnvConfig(BaseConfig):
    """One ``[[orchestrator.env]]`` entry: a verifiers v1 environment and how much of each batch it gets."""

    id: str
    """Environment id: a folder under ``environments/`` (e.g. ``arith``) or an installed
    verifiers v1 taskset package (``my-env`` imports ``my_env``)."""

    args: dict[str, Any] = Field(default_factory=dict)
    """Fields of the environment's taskset config (e.g. ``{max_operand = 9}``); unknown keys are
    errors raised by the environment when it loads."""

    eval_args: dict[str, Any] | None = None
    """Taskset fields that select the held-out evaluation split, applied over ``args`` (e.g.
    ``{split = "eval"}``); ``None`` means this environment is not evaluated."""

    num_eval_examples: int | None = Field(default=None, ge=1)
    """Evaluate on the first this-many tasks of the eval split; ``None`` evaluates all of them."""

    name: str | None = None
    """Label used in metrics (``env/<name>/reward``); defaults to ``id``. Must be unique."""

    ratio: float = Field(default=1.0, gt=0)
    """Relative share of training examples drawn from this environment when several are listed;
    shares are normalized over all entries."""

    agent: AgentLoopConfig | None = None
    """The agent loop of environments whose tasks use tools (their task data is an
    ``AgentTaskData``); ``None`` uses its defaults there. Episodes of other environments are one
    chat call each, and setting this for them is an error."""

    @property
    def label(self) -> str:
        """The name metrics use for this environment."""
        return self.name or self.id

    @model_validator(mode="after")
    def _check_eval(self) -> EnvConfig:
        if self.num_eval_examples is not None and self.eval_args is None:
            raise ValueError(
                f"orchestrator.env (id={self.id!r}): num_eval_examples is set but eval_args is not; "
                "set eval_args (e.g. {split = 'eval'}) to say which tasks are held out"
            )
        return self


class SamplingConfig(BaseConfig):
    """Sampling parameters sent with every rollout request (OpenAI chat-completions fields)."""

    temperature: float = Field(default=1.0, ge=0)
    """Softmax temperature; 1.0 samples from the policy itself (what on-policy RL assumes)."""

    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass; below 1.0 the sampled logprobs no longer match the policy."""

    top_k: int | None = Field(default=None, ge=-1)
    """Sample among the k most likely tokens (vLLM extension); ``None`` leaves it to the server."""

    min_p: float | None = Field(default=None, ge=0, le=1)
    """Drop tokens below this fraction of the top token's probability (vLLM extension)."""

    max_tokens: int = Field(default=64, ge=1)
    """Maximum completion tokens per model call; a completion that hits it is truncated."""

    stop: list[str] | None = None
    """Extra stop strings; the chat template's end-of-turn token always stops."""

    seed: int | None = Field(default=None, ge=0, lt=2**63)
    """When set, every request carries its own seed derived from this one, the example and the
    rollout index (reproducible sampling); ``None`` sends no seed."""

    repetition_penalty: float | None = Field(default=None, gt=0)
    """vLLM repetition penalty; ``None`` leaves it to the server."""

    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Further request fields passed through unchanged (server-specific knobs)."""

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: list[str] | None) -> list[str] | None:
        if stop is not None and any(s == "" for s in stop):
            raise ValueError('an empty stop string would end every completion at once: remove ""')
        return stop


class RolloutConfig(BaseConfig):
    """How rollouts are run: concurrency, retries and time limits (not sent to the server)."""

    max_concurrent: int = Field(default=64, ge=1)
    """Rollouts in flight at once, across all environments."""

    max_retries: int = Field(default=0, ge=0)
    """Times a failed rollout is run again before it is recorded as an error sample."""

    timeout_s: float | None = Field(default=600.0, gt=0)
    """Wall-clock limit of one rollout's model calls, in seconds; ``None`` waits forever."""
