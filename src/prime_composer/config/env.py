"""Config of the environments the orchestrator samples from, and of sampling itself.

``[[orchestrator.env]]`` entries name a verifiers v1 environment (a taskset package) and the
arguments of its taskset config, and, for environments whose episodes use tools, the limits of
the agent loop (``[orchestrator.env.agent]``); ``[orchestrator.sampling]`` holds the knobs sent
with every model call. No verifiers import here: the ids are resolved by
``prime_composer.orchestrator.envs`` when the orchestrator starts.
"""

from __future__ import annotations

import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from prime_composer.config.base import BaseConfig
from prime_composer.config.client import RetryConfig
from prime_composer.config.sandbox import SandboxConfig, ToolsConfig
from prime_composer.netaddr import is_loopback


def _one_plain_reset() -> list[dict[str, Any]]:
    """One task: ``reset()`` without arguments."""
    return [{}]


class McpServerConfig(BaseConfig):
    """One MCP tool server whose tools the agent loop offers beside (or instead of) the sandbox's.

    ``command`` is a stdio server: it runs in the episode's sandbox, in its workspace, one process
    for the episode (or one run per call, ``lifetime``; ``orchestrator/mcp_tools.py``), so it sees
    the episode's files and nothing else, without network. ``url`` is a streamable-HTTP server that is already running; it is
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

    lifetime: Literal["episode", "call"] = "episode"
    """A stdio server's life: ``episode`` starts it at the episode's first MCP call, keeps it
    (paused between its calls) for every later call and stops it with the episode; ``call``
    starts it afresh for each call (nothing kept in memory between calls; each pays the start-up)."""

    max_restarts: int = Field(default=2, ge=0)
    """With ``lifetime = "episode"``: how many times a stdio server that died (crashed, timed
    out, was killed by a limit) is started again in one episode; past that, its calls fail."""

    headers_env: dict[str, str] = Field(default_factory=dict)
    """HTTP headers of a ``url`` server's requests, each value read from the environment variable
    named here when the orchestrator calls it (``{Authorization = "SEARCH_MCP_AUTH"}`` with
    ``SEARCH_MCP_AUTH="Bearer ..."``), so no secret is written in a config. Sent only over
    ``https://`` or to a loopback host."""

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
        if self.headers_env:
            self._check_headers_env()
        return self

    def _check_headers_env(self) -> None:
        where = f"mcp server {self.name!r}: headers_env"
        if self.url is None:
            raise ValueError(f"{where} is for a url server; a stdio server (command) gets no HTTP headers")
        for header, variable in self.headers_env.items():
            if not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", header):
                raise ValueError(f"{where}: {header!r} is not an HTTP header name")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", variable):
                raise ValueError(
                    f"{where}.{header} = {variable!r}: give the name of an environment variable that holds "
                    "the value (the value itself never goes in a config)"
                )
        host = urlsplit(self.url).hostname or ""
        if self.url.startswith("http://") and not is_loopback(host):
            raise ValueError(
                f"{where}: {self.url} is plain http to a host that is not loopback, so the headers would "
                "cross the network in the clear; use https:// (or a loopback address)"
            )


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


class OpenEnvConfig(BaseConfig):
    """An OpenEnv environment (``orchestrator/openenv_env.py``): a server that is running, or the
    server app of an environment package that the orchestrator serves for the run.

    Each task is one ``reset``; the episode's replies are the environment's actions, its
    observations the next turns, its rewards (summed over the steps) the episode's reward. An
    environment whose actions are MCP tool calls (an OpenEnv ``MCPEnvironment``) offers its tools
    to the policy instead, and each tool call is one step.
    """

    url: str | None = None
    """A running OpenEnv server (``http://127.0.0.1:8000``); OpenEnv servers have no
    authentication, so only reach one over a network you trust."""

    app: str | None = None
    """``module:attribute`` of an OpenEnv server app (what ``openenv.core.env_server.create_app``
    returns, e.g. ``my_env.server.app:app``); the orchestrator serves it with uvicorn on a free
    port of 127.0.0.1 for as long as it runs, with this Python."""

    app_dir: str | None = None
    """Folder put first on the served app's ``PYTHONPATH`` (and its working directory), for an
    environment package that is not installed."""

    image: str | None = None
    """A container image of an OpenEnv server (``registry/owner/env:tag``): the orchestrator runs
    it with ``container_runtime`` (``docker run --rm -d -p 127.0.0.1:PORT:container_port IMAGE``, a
    free port), waits for its ``/health`` and stops it (``docker stop``) when it ends."""

    container_runtime: Literal["auto", "docker", "podman"] = "auto"
    """The container CLI that runs ``image``: ``auto`` takes ``docker``, else ``podman``, from
    ``PATH``; ``rl --dry-run`` fails when the one asked for is not there."""

    container_port: int = Field(default=8000, ge=1, le=65535)
    """The port the image's server listens on inside the container (OpenEnv images: 8000)."""

    space: str | None = None
    """A Hugging Face Space that serves an OpenEnv environment (``owner/name``): its server is
    ``https://owner-name.hf.space`` (lower case, ``_`` and ``.`` as ``-``), used like a ``url``."""

    token_env: str | None = None
    """The environment variable holding a token for a private server (``HF_TOKEN``: a Hugging
    Face token that can read a private ``space``). It is sent as ``Authorization: Bearer <token>``
    with every request of the entry (``/schema`` and each episode's WebSocket), only over https to
    the entry's own host (the Space's, or an ``https://`` ``url``'s); plain http is refused, and
    redirects to another host do not carry it. Read when the orchestrator loads the entry and at
    each episode; only the variable's name is in configs, never its value, nor in any log."""

    resets: list[dict[str, Any]] = Field(default_factory=_one_plain_reset, min_length=1)
    """One task per entry: the keyword arguments of its ``reset`` (e.g. ``{seed = 3}``)."""

    system_prompt: str | None = None
    """The episode's system prompt; ``None`` sends none."""

    describe_action: bool = True
    """Append to the first observation how to write an action (the action's JSON schema); an
    environment whose actions are tool calls describes them as tools instead."""

    connect_timeout_s: float = Field(default=30.0, gt=0)
    """Limit of opening an episode's session (WebSocket) with the server."""

    step_timeout_s: float = Field(default=60.0, gt=0)
    """Limit of one ``reset`` or ``step`` answer; a server that misses it fails the episode."""

    startup_timeout_s: float = Field(default=120.0, gt=0)
    """Limit of the served ``app``'s start (until its ``/health`` answers)."""

    @model_validator(mode="after")
    def _check_source(self) -> OpenEnvConfig:
        sources = [k for k in ("url", "app", "image", "space") if getattr(self, k) is not None]
        if len(sources) != 1:
            raise ValueError(
                "openenv: set exactly one of url (a running OpenEnv server), app (module:attribute "
                "of a server app for the orchestrator to serve), image (a container image for it to "
                "run) or space (a Hugging Face Space, owner/name)"
                + (f"; got {', '.join(sources)}" if sources else "")
            )
        if self.space is not None and not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", self.space):
            raise ValueError(
                f"openenv.space must be 'owner/name' (e.g. 'openenv/echo_env'), got {self.space!r}"
            )
        if self.image is not None and (not self.image.strip() or self.image.startswith("-")):
            raise ValueError(
                f"openenv.image must be an image reference (e.g. 'ghcr.io/me/env:1'), got {self.image!r}"
            )
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"openenv.url must start with http:// or https://, got {self.url!r}")
        if self.app is not None and (self.app.count(":") != 1 or not all(self.app.split(":"))):
            raise ValueError(
                f"openenv.app must be 'module:attribute' (e.g. 'my_env.server:app'), got {self.app!r}"
            )
        if self.token_env is not None:
            self._check_token_env()
        return self

    def _check_token_env(self) -> None:
        name = self.token_env
        if name is None or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(
                f"openenv.token_env = {name!r}: give the name of an environment variable that holds the "
                "token (e.g. 'HF_TOKEN'); the token itself never goes in a config"
            )
        if self.app is not None or self.image is not None:
            raise ValueError(
                f"openenv.token_env is for a remote server (space, or an https url); the orchestrator "
                f"serves openenv.{'app' if self.app is not None else 'image'} itself on loopback, with no "
                "token: remove token_env"
            )
        if self.url is not None and not self.url.startswith("https://"):
            raise ValueError(
                f"openenv.token_env: {self.url} is plain http, so the token would cross the network in "
                "the clear; use the server's https:// URL"
            )

    @property
    def space_url(self) -> str | None:
        """The https URL of ``space`` (``None`` without one)."""
        if self.space is None:
            return None
        owner, name = self.space.split("/")
        return "https://" + re.sub(r"[_.]", "-", f"{owner}-{name}".lower()) + ".hf.space"

    @property
    def source(self) -> str:
        """What the entry names as its environment (in task ids and messages)."""
        return next(v for v in (self.url, self.app, self.image, self.space) if v is not None)


def _source_key(source: OpenEnvConfig) -> str:
    return next(k for k in ("url", "app", "image", "space") if getattr(source, k) is not None)


def _requirement_name(package: str) -> str:
    """The distribution name of a requirement string; ``ValueError`` naming the fix when it is none."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        return Requirement(package).name
    except InvalidRequirement as e:
        raise ValueError(
            f"package = {package!r} is not a requirement ({e}); write a distribution name, optionally with a "
            "version, e.g. 'wordle-env' or 'wordle-env==0.2.1'"
        ) from e


OPENENV_ID = "openenv"
"""The ``id`` of an ``[[orchestrator.env]]`` entry with an ``openenv`` table that gives none."""


class EnvConfig(BaseConfig):
    """One ``[[orchestrator.env]]`` entry: a verifiers v1 environment and how much of each batch it gets."""

    id: str
    """Environment id: a folder under ``environments/`` (e.g. ``arith``) or an installed
    verifiers v1 taskset package (``my-env`` imports ``my_env``). With ``openenv`` it only names
    the entry (default ``openenv``)."""

    package: str | None = None
    """A distribution holding the environment, installed before it loads when it is not installed:
    a requirement such as ``wordle-env`` or ``wordle-env==0.2.1``. ``uv pip install`` puts it in the
    orchestrator's own Python environment (``orchestrator/env_install.py``), holding every installed
    distribution at its version (it may add packages, never change one; an installed version the
    requirement refuses is an error). ``id`` defaults to its name. With ``openenv.app`` it is an
    OpenEnv environment package, installed so that the orchestrator can serve that app."""

    package_find_links: list[str] = Field(default_factory=list)
    """Folders or URLs of wheels the install may use (``uv pip install --find-links``)."""

    package_no_index: bool = False
    """Install only from ``package_find_links`` (``--no-index``): no package index is asked."""

    openenv: OpenEnvConfig | None = None
    """Train on an OpenEnv environment instead of a verifiers taskset (``id`` is then a label and
    ``args`` must stay empty; ``eval_args`` apply over this table, e.g. ``{resets = [{seed = 100}]}``).
    Its episodes run in the agent loop (``agent``)."""

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

    @model_validator(mode="before")
    @classmethod
    def _default_id(cls, data: Any) -> Any:
        if isinstance(data, dict) and "id" not in data:
            if data.get("openenv") is not None:
                return {**data, "id": OPENENV_ID}
            if isinstance(data.get("package"), str):
                return {**data, "id": _requirement_name(data["package"])}
        return data

    @field_validator("package")
    @classmethod
    def _check_package(cls, package: str | None) -> str | None:
        if package is not None:
            _requirement_name(package)
        return package

    @model_validator(mode="after")
    def _check_openenv(self) -> EnvConfig:
        if self.openenv is not None and self.package is not None and self.openenv.app is None:
            raise ValueError(
                f"orchestrator.env (id={self.id!r}): package with openenv.{_source_key(self.openenv)} installs "
                "a package for a server this process does not run; drop package, or serve the package's "
                "app with openenv.app"
            )
        if self.openenv is not None and self.args:
            raise ValueError(
                f"orchestrator.env (id={self.id!r}): args are verifiers taskset fields, and an openenv entry "
                "has none; put its settings in the openenv table (e.g. openenv.resets)"
            )
        return self

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
