"""Config of the ``teacher`` process: the trace-replay service (``[teacher]`` of a run).

The service replays frozen agentic traces step by step, asks a pool of frozen external teacher
LLMs what they would do at the chosen steps, and turns their agreement or disagreement with the
trace's action into DPO pairs (``config/dpo.py`` is the loss side) and per-step process rewards.

    uv run teacher @ teacher.toml
    uv run teacher @ teacher.toml --no-serve          # replay what is in the store, then exit

A minimal file::

    model = { name = "builtin:tiny-qwen3" }       # the run's initial policy = the reference
    output_dir = "outputs/run"                    # store: <output_dir>/teacher/teacher.sqlite
    [traces]
    files = ["traces/train.jsonl"]
    [budget]
    per_trace_usd = 0.30
    per_run_usd = 50.0
    [[pool]]
    name = "teacher-a"
    base_url = "https://api.example/v1"
    model = "teacher-a-large"
    api_key_env = "TEACHER_A_KEY"
    input_usd_per_m = 3.0
    output_usd_per_m = 15.0

API keys are never in a config: ``api_key_env`` names the environment variable that holds one.

A teacher can also be a model the ``rl`` launcher serves itself (``[teacher.pool.local]``: no
``base_url``, no key; the quickstart-replay run's teachers are such)::

    [[pool]]
    name = "teacher-a"
    model = "teacher-a"
    local = { model = { name = "builtin:tiny-qwen3" }, warmup_steps = 300 }
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, model_validator

from prime_composer.config.base import DEFAULT_OUTPUT_DIR, MAX_LR, BaseConfig, ModelConfig
from prime_composer.config.client import RetryConfig

DEFAULT_INSTRUCTIONS = (
    "You are an expert software engineer acting as a coding agent. You are shown the task and the "
    "agent's work so far (its actions and the tool results). Decide the single best next action. "
    'Reply with exactly one JSON object and nothing else: {"tool": "<tool name>", "arguments": '
    '{...}} to call a tool, or {"message": "<text>"} to answer the user.'
)


class LocalTeacherConfig(BaseConfig):
    """A teacher that ``rl`` serves itself on this machine, with the embedded inference server.

    Before the run the launcher fine-tunes ``model`` for ``warmup_steps`` steps with the project's
    ``sft`` on the run's warm-up data: as it is for a teacher of ``protocol = "agent"``, rendered as
    the service's review prompts and answered in JSON for ``review`` (``teacher/sft_data.py``); the
    result is ``<output_dir>/teachers/<name>/sft/final``. Then
    starts ``uv run inference`` for it on a free loopback port (log ``logs/teacher-<name>.log``),
    waits for its ``/health``, fills in the endpoint's ``base_url``, and stops it with the run. The
    teacher is frozen during the run. Prices still apply (0 by default): the ledger and the budget
    work the same as for a hosted teacher.
    """

    model: ModelConfig = ModelConfig()
    """The teacher's starting weights (hub id, local directory or ``builtin:tiny-qwen3``); ignored
    with ``from_policy``."""

    from_policy: bool = False
    """Start from the policy's own starting weights (after the run's warm-up) instead of ``model``:
    with ``warmup_steps`` more SFT steps, the student's architecture trained longer, a teacher that
    knows more than the student it reviews."""

    warmup_steps: int = Field(default=0, ge=0)
    """SFT steps on the warm-up data in the teacher protocol; 0 serves ``model`` as it is (it must
    then already answer in the protocol the instructions ask for)."""

    warmup_batch_size: int = Field(default=16, ge=1)
    """Conversations per SFT step."""

    warmup_lr: float = Field(default=3e-3, gt=0.0, le=MAX_LR)
    """SFT learning rate (constant)."""

    warmup_label_smoothing: float = Field(default=0.0, ge=0.0, lt=1.0)
    """SFT label smoothing (0: the teacher becomes as sure of the reference answers as it can)."""

    seed: int = 0
    """Seed of the teacher's SFT (data order): teachers with different seeds make different mistakes."""

    seq_len: int = Field(default=1024, ge=16)
    """Longest teacher prompt plus answer in tokens, for the SFT and the server's ``max_model_len``."""

    device: str = "auto"
    """Device of the teacher's server (``auto``: cuda when present, else cpu)."""

    num_threads: int = Field(default=1, ge=1)
    """torch threads of the teacher's SFT and server on a CPU."""


class TeacherEndpointConfig(BaseConfig):
    """One frozen teacher LLM behind an OpenAI-compatible ``/chat/completions`` endpoint."""

    name: str | None = None
    """Identity in the ledger, the response cache and the pairs' provenance; ``None`` uses ``model``.
    Names must be unique within the pool."""

    base_url: str | None = None
    """Endpoint up to ``/v1`` (e.g. ``https://api.example/v1`` or ``http://127.0.0.1:8001/v1``);
    required unless ``local`` is set (then ``rl`` fills it in)."""

    model: str
    """Model name sent in each request (a ``local`` teacher is served under this name)."""

    protocol: Literal["review", "agent"] = "review"
    """What the teacher is shown and how its reply is read. ``review``: the service's instructions
    and the state as a transcript to review, the reply one JSON object naming the next action
    (any instruction-following model; ``prompts.teacher_messages``). ``agent``: the state in the
    agent's own chat (``prompts.agent_messages``: the student's messages, its calls as
    ``tool_calls``), the reply read the way the student's turns are (tool calls, else its text as
    a message): for a teacher that is itself an agent model of the student's format, e.g. a larger
    model of its family, or a local teacher fine-tuned on the student's warm-up data. Each call
    reserves the worst case of its own prompt; the gate's and the cascade's cost estimates use the
    review prompt for both."""

    send_token_ids: bool = False
    """With ``protocol = "agent"``: send each step's exact context, the trace's
    ``prompt_token_ids`` (what the student was given), to ``/completions`` instead of the chat, and
    read the completion's text as the agent's turn. For a teacher with the student's tokenizer and
    format (a ``local`` teacher, or a larger model of its family): it then sees the student's
    context token for token, where a chat is rendered again by its server's template (tool calls
    in the template's own layout, which a small model trained on the student's exact text can
    misread). A step whose trace carries no ids is asked with the chat."""

    local: LocalTeacherConfig | None = None
    """Serve this teacher on this machine (``rl`` fine-tunes and starts it; see
    ``LocalTeacherConfig``) instead of calling ``base_url``."""

    api_key_env: str | None = None
    """Environment variable holding the API key (sent as a bearer token); None sends no key. The
    key itself never appears in configs, logs or the store."""

    input_usd_per_m: float = Field(default=0.0, ge=0.0)
    """Price in US dollars per million input (prompt) tokens."""

    output_usd_per_m: float = Field(default=0.0, ge=0.0)
    """Price in US dollars per million output (completion) tokens."""

    max_concurrency: int = Field(default=4, ge=1)
    """Requests to this teacher in flight at once."""

    retry: RetryConfig = RetryConfig()
    """Wall-clock limit per attempt (``retry.timeout_s``: the whole answer, however slowly it
    trickles in) and bounded retries with backoff on 429, 5xx,
    timeouts and connection errors. A call that still fails is a ledger row, never a crash."""

    max_tokens: int = Field(default=512, ge=1)
    """Longest answer; also the output side of the worst-case cost reserved before each call. Near
    the budget's end a call is sent with a lower ``max_tokens`` (what the money left covers, never
    below the realistic reply bound: ``BudgetConfig.reply_quantile``)."""

    max_reply_bytes: int = Field(default=1_000_000, ge=1024)
    """Longest answer body in bytes, enforced while it is read: a longer one is cut off there
    (ledger outcome ``too_large``, charged its reserved worst case unless it reported usage)."""

    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature (0 = greedy: the same state gets the same answer, which the response
    cache relies on to make a re-run free)."""

    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Extra request fields (e.g. ``{"seed": 0}``, ``{"reasoning_effort": "low"}``); part of the
    cache key."""

    @property
    def id(self) -> str:
        """The name used everywhere (``name``, else ``model``)."""
        return self.name or self.model

    @model_validator(mode="after")
    def _check_where(self) -> Self:
        if self.base_url is None and self.local is None:
            raise ValueError(
                f"teacher.pool ({self.id!r}): give base_url (an OpenAI-compatible endpoint up to /v1), or "
                "local = { ... } to have rl serve the teacher itself"
            )
        if self.send_token_ids and self.protocol != "agent":
            raise ValueError(
                f"teacher.pool ({self.id!r}).send_token_ids: the student's token ids are an agent's "
                'context; set protocol = "agent" or leave send_token_ids unset'
            )
        return self


class TraceSourceConfig(BaseConfig):
    """Where traces come from (besides ``POST /v1/traces`` from the run's own rollouts)."""

    files: list[Path] = Field(default_factory=list)
    """JSONL trace files in the service's schema (``prime_composer.teacher.traces``), imported at
    start; a bad line is rejected with a message naming the file and line, the others still load.
    Re-importing a file adds nothing twice."""

    verifiers_files: list[Path] = Field(default_factory=list)
    """verifiers ``traces.jsonl`` files (one rollout episode per line), imported at start."""

    max_line_bytes: int = Field(default=4_000_000, ge=1024)
    """A JSONL line longer than this is rejected (a poisoned or runaway trace)."""

    max_turns: int = Field(default=500, ge=1)
    """A trace with more turns than this is rejected."""

    max_turn_chars: int = Field(default=200_000, ge=1)
    """A trace with a turn whose content is longer than this is rejected."""

    max_json_depth: int = Field(default=64, ge=8, le=512)
    """A trace whose objects and arrays nest deeper than this (the trace itself is depth 1; a tool
    call's arguments are depth 6) is rejected, and a ``POST /v1/traces`` body holding one is
    refused with 400."""


class GateConfig(BaseConfig):
    """The value-of-information gate: which steps of a trace are worth paying teachers for.

    A step's score, in [0, 1], is the evidence that it is a mistake times what is at stake:

        score = (1 - (1 - weight_uncertainty * u) * (1 - weight_error * e)) * stakes * novelty

    with ``u`` the student's uncertainty on its action (from the trace's logprobs), ``e`` its
    proximity to an error (a step whose own call failed, the step that caused a failing test run,
    a final answer given on a failure or before any tool ran, reverted edits, and the steps around
    them; ``error_attribution``), ``stakes = impact_floor + (1 - impact_floor) * impact`` (edits and commands over reads)
    and ``novelty`` 1 for an action at a state never evaluated before, else ``seen_state_factor``.
    Either signal alone can make a step suspicious (a noisy-or), a read costs little to get wrong,
    and the same action at a state already labeled adds nothing (its pair is known); another action
    there is new (the answers are cached, and a new mistake is a new pair). The gate keeps the ``max_steps_per_trace`` steps with the
    best score per expected dollar among those scoring at least ``min_score``.
    """

    enabled: bool = True
    """Off: every assistant step of every trace is asked (the ungated baseline)."""

    model: Literal["heuristic", "calibrated"] = "heuristic"
    """``heuristic``: rank by the score above. ``calibrated``: rank by the probability that the
    teachers disagree with the trace (``teacher/voi.py``): a logistic model with the score as its
    prior, learned online from the steps' labels (pair = disagreed, confirmed = agreed); with no
    label yet it equals the score. Either way the calibration of what ranked the steps is logged
    (``teacher/gate_ece``, ``teacher/gate_brier``)."""

    learning_rate: float = Field(default=0.5, gt=0.0)
    """SGD step of the ``calibrated`` model per label."""

    max_steps_per_trace: int = Field(default=4, ge=1)
    """B: steps asked per trace at most."""

    min_score: float = Field(default=0.15, ge=0.0, le=1.0)
    """Steps scoring below this are never asked."""

    weight_uncertainty: float = Field(default=1.0, ge=0.0, le=1.0)
    """How much the student's uncertainty ``u = 1 - exp(mean logprob of the action tokens)`` alone
    says about a mistake."""

    weight_error: float = Field(default=0.8, ge=0.0, le=1.0)
    """How much the proximity to an error alone says about a mistake."""

    impact_floor: float = Field(default=0.25, ge=0.0, le=1.0)
    """Stakes of an action of impact 0 (``stakes = floor + (1 - floor) * impact``)."""

    seen_state_factor: float = Field(default=0.2, ge=0.0, le=1.0)
    """Novelty of an action at a state that was evaluated before with that action (its answers
    are cached, its pair known)."""

    default_uncertainty: float = Field(default=0.5, ge=0.0, le=1.0)
    """Uncertainty of a step whose trace carries no logprobs for its action."""

    impact_edit: float = Field(default=1.0, ge=0.0, le=1.0)
    """Impact of a call to one of ``edit_tools``."""

    impact_command: float = Field(default=0.8, ge=0.0, le=1.0)
    """Impact of a shell command that is not read-only, or of a tool in neither list."""

    impact_read: float = Field(default=0.1, ge=0.0, le=1.0)
    """Impact of a call to one of ``read_tools`` or of a read-only shell command."""

    impact_message: float = Field(default=0.5, ge=0.0, le=1.0)
    """Impact of a plain message (no tool call)."""

    edit_tools: list[str] = Field(
        default_factory=lambda: [
            "edit",
            "edit_file",
            "write",
            "write_file",
            "str_replace",
            "apply_patch",
            "create",
            "insert",
        ]
    )
    """Tool names that change files."""

    read_tools: list[str] = Field(
        default_factory=lambda: ["read", "read_file", "view", "cat", "ls", "list", "grep", "search", "find"]
    )
    """Tool names that only read."""

    read_commands: list[str] = Field(
        default_factory=lambda: [
            "cat", "ls", "grep", "rg", "find", "head", "tail", "wc", "pwd", "echo", "tree", "which", "file",
            "cd",
        ]
    )  # fmt: skip
    """First words of shell commands that only read (``git status/diff/log/show`` count too)."""

    error_patterns: list[str] = Field(
        default_factory=lambda: [
            r"Traceback \(most recent call last\)",
            r"\bFAILED\b",
            r"\b[1-9]\d* failed\b",
            r"(?m)^\w*Error: ",
            r"\bcommand not found\b",
            r"(?i)exit (code|status):? *[1-9]",
        ]
    )
    """Regular expressions that mark a tool result as an error (besides a non-zero ``exit_code``)."""

    error_attribution: Literal["cause", "proximity"] = "cause"
    """Which step a failure marks. ``cause``: a failing check (one of ``check_tools`` or
    ``check_commands``: a test run observes the state, it does not change it) marks the latest step
    before it that changed the state (an edit or a command that is neither a read nor a check), or
    no step when none did (the task's own failing tests); any other failing step marks itself; a
    final answer given while the latest tool result is a failure marks itself. ``proximity`` (the
    gate before attribution): every failing step marks itself, so a test run that shows a mistake
    outranks the edit that made it."""

    check_tools: list[str] = Field(
        default_factory=lambda: ["run_tests", "run_test", "test", "tests", "pytest"]
    )
    """Tool names that run checks (tests): their failures are blamed on the step that caused them."""

    check_commands: list[str] = Field(
        default_factory=lambda: [
            r"(python3? -m )?(pytest|py\.test|unittest|tox|nox)\b",
            r"(npm|yarn|pnpm) (run )?test\b",
            r"(go|cargo|dotnet) test\b",
            r"make (test|check)\b",
        ]
    )
    """Regular expressions matched at the start of each part of a shell command (split at ``|``,
    ``&&``, ``||``, ``;``; words joined by one space) that mark it as a check (a command is one
    when every part is a check or a read)."""

    error_window: int = Field(default=2, ge=0)
    """Steps before a marked step and after one (the step after a mistake often builds on it) that
    count as close to it, with proximity ``1 - distance / (error_window + 1)``."""

    cascade: bool = True
    """Ask the cheapest teacher first and the others only when it disagrees with the trace, fails,
    or the step's uncertainty is at least ``escalate_uncertainty``. Off: all teachers at once."""

    escalate_uncertainty: float = Field(default=0.7, ge=0.0, le=1.0)
    """Uncertainty at which the cascade asks every teacher even when the cheapest agrees."""

    escalation_prior: float = Field(default=0.5, ge=0.0, le=1.0)
    """Assumed probability that the cascade escalates, for the expected cost of a step."""

    expected_output_tokens: int = Field(default=96, ge=1)
    """Answer length assumed for the expected cost of a call (the budget reserves ``max_tokens``)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        for i, pattern in enumerate([*self.error_patterns, *self.check_commands]):
            try:
                re.compile(pattern)
            except re.error as e:
                field = "error_patterns" if i < len(self.error_patterns) else "check_commands"
                raise ValueError(
                    f"teacher.gate.{field}: {pattern!r} is not a regular expression ({e})"
                ) from e
        if self.weight_uncertainty == 0 and self.weight_error == 0:
            raise ValueError(
                "teacher.gate: weight_uncertainty and weight_error are both 0, so every score is 0; "
                "make one positive, or turn the gate off (gate.enabled = false)"
            )
        return self


class BudgetConfig(BaseConfig):
    """Hard caps on teacher spend, enforced before each call (worst-case cost reserved, then
    settled to the real cost): concurrent calls can never overshoot them together."""

    per_trace_usd: float | None = Field(default=0.30, ge=0.0)
    """Dollars per trace at most; None = no cap."""

    per_run_usd: float | None = Field(default=None, ge=0.0)
    """Dollars for the whole run (every trace, every restart: the ledger is the record) at most;
    None = no cap."""

    reply_quantile: float = Field(default=0.99, gt=0.0, le=1.0)
    """The realistic reply bound of a teacher: this quantile of its observed completion tokens
    (``reply_margin`` times it, at most ``max_tokens``). Calls are reserved at their full worst case
    while that fits; when it no longer does, a call is sent with ``max_tokens`` lowered to what the
    money left covers, as long as that is at least this bound, so the cap holds in the provider's
    dollars and the budget is spent down to about one realistic call."""

    reply_margin: float = Field(default=1.25, ge=1.0)
    """Factor on the observed quantile (a reply a little longer than any seen still fits)."""

    reply_samples: int = Field(default=20, ge=1)
    """Observed replies of a teacher before its quantile is used (``max_tokens`` until then)."""

    prompt_overhead_tokens: int = Field(default=64, ge=0)
    """Tokens the endpoint's chat template may add to a prompt beyond its text (role markup,
    default system text), counted into the worst-case input of a call. The text itself is bounded
    by its UTF-8 bytes (a byte-level tokenizer spends at most one token per byte)."""


class OnPolicyConfig(BaseConfig):
    """Chosen sides sampled from the student itself (Step-DPO found self-generated chosen steps
    better than teacher-written ones): at a pair's state the student is sampled ``num_samples``
    times and a sample that matches the teacher majority becomes the chosen side."""

    enabled: bool = False
    """Sample the student at each pair's state."""

    base_url: str | None = None
    """The student's OpenAI-compatible endpoint up to ``/v1`` (the run's inference server); required
    when enabled."""

    model: str | None = None
    """Model name of the student requests; required when enabled."""

    api_key_env: str | None = None
    """Environment variable with the student endpoint's key, if it needs one."""

    num_samples: int = Field(default=4, ge=1)
    """Samples drawn at each pair's state (one request with ``n``)."""

    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature of the student samples."""

    max_tokens: int = Field(default=256, ge=1)
    """Longest student sample."""

    require_match: bool = False
    """Drop the pair when no student sample matches the majority (instead of using the teacher's
    action, rendered in the student's format, as the chosen side)."""

    send_token_ids: bool = False
    """Sample the student from the pair's exact context, the trace's ``prompt_token_ids``, on
    ``/completions`` (``return_token_ids``), instead of from the chat: the chosen side then
    continues exactly the context ids the pair is trained on (a chat is rendered again by the
    server's template, e.g. its own tool-call layout). A step whose trace has no ids is sampled
    with the chat."""

    retry: RetryConfig = RetryConfig()
    """Time limit and retries of the student requests."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.enabled and (self.base_url is None or self.model is None):
            raise ValueError(
                "teacher.pairs.on_policy.enabled needs teacher.pairs.on_policy.base_url and .model "
                "(the run's inference server, e.g. base_url = 'http://127.0.0.1:8000/v1')"
            )
        return self


class PairConfig(BaseConfig):
    """How teacher votes become labels: DPO pairs, confirmations and process rewards.

    Teachers' actions are canonicalized (tool name + normalized arguments, commands, code) and
    clustered; a step becomes a pair when a cluster other than the trace's action holds a vote
    share of at least ``kappa`` and beats the trace's own share by at least ``delta``; it is
    confirmed when the trace's action holds at least ``kappa``. Shares are over the teachers that
    answered with a valid action.
    """

    kappa: float = Field(default=0.6, gt=0.0, le=1.0)
    """Vote share the majority needs (for a pair or a confirmation)."""

    delta: float = Field(default=0.34, ge=0.0, le=1.0)
    """Margin by which the majority's share must exceed the trace action's share for a pair."""

    min_votes: int = Field(default=2, ge=1)
    """Valid answers a pair needs at least (a confirmation needs one)."""

    max_label_smoothing: float = Field(default=0.4, ge=0.0, lt=0.5)
    """Cap on a pair's label smoothing ``1 - share`` (robust DPO needs it below 0.5)."""

    max_pair_tokens: int = Field(default=4096, ge=8)
    """Context plus the longer side, in student tokens; a longer pair is recorded as too long and
    not trained on."""

    on_policy: OnPolicyConfig = OnPolicyConfig()
    """Take the chosen side from the student's own samples when one matches the majority."""

    step_dpo: bool = False
    """Step-DPO: label each trace's selected steps in order and stop at the first one the teachers
    judge wrong, whose pair (context = the trace up to that step, chosen = the student's own
    matching sample, rejected = the trace's step) is the trace's only pair; the steps after it are
    never asked (outcome ``after_error``). Needs ``on_policy.enabled`` and ``on_policy.require_match``
    (the chosen side is on-policy or there is no pair)."""

    @model_validator(mode="after")
    def _step_dpo(self) -> Self:
        if self.step_dpo and not (self.on_policy.enabled and self.on_policy.require_match):
            raise ValueError(
                "teacher.pairs.step_dpo = true takes the chosen side from the student's own samples: set "
                "teacher.pairs.on_policy.enabled = true and teacher.pairs.on_policy.require_match = true"
            )
        return self


class ReferenceConfig(BaseConfig):
    """Reference logprobs of both sides of every pair, computed once in the service with the
    reference weights (the run's initial policy, ``model``) and stored with the pair."""

    device: str = "cpu"
    """Device of the reference forward (``cpu`` keeps the GPUs for training)."""

    num_threads: int = Field(default=1, ge=1)
    """torch threads of the reference forward on a CPU."""

    batch_size: int = Field(default=8, ge=1)
    """Sequences per reference forward (a pair is two). The dtype is ``model.dtype`` (``auto``:
    float32 on a CPU, bfloat16 on a GPU)."""

    preload: bool = True
    """Load the tokenizer and weights when a serving process starts (off its event loop), so the
    first pairs do not wait for a cold import; false loads them at the first pair (a service that
    only takes traces, or a test of its routes, never imports torch)."""


class TeacherServiceConfig(BaseConfig):
    """The trace-replay teacher service."""

    model: ModelConfig = ModelConfig()
    """Shared: the run's initial policy. Its tokenizer renders the pairs' token ids and its weights
    compute the reference logprobs."""

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """Shared run directory; the store is ``<output_dir>/teacher/teacher.sqlite``."""

    seed: int = 0
    """Shared seed (tie-breaks are deterministic; it seeds the student samples)."""

    host: str = "127.0.0.1"
    """Address the HTTP routes bind. Anything but loopback requires ``secret_env``."""

    port: int = Field(default=8100, ge=0, le=65535)
    """TCP port of the HTTP routes (0 = a free port, logged at start)."""

    secret_env: str | None = None
    """Environment variable holding the shared secret every route but ``/health`` requires as
    ``Authorization: Bearer <secret>``."""

    serve: bool = True
    """Keep running: serve the routes, replay traces as they arrive. Off (``--no-serve``): import
    the configured files, replay everything pending, compute reference logprobs, and exit."""

    poll_s: float = Field(default=2.0, gt=0.0)
    """How often a serving process looks for new work when idle."""

    metrics_interval_s: float = Field(default=5.0, gt=0.0)
    """Least time between two rows of the service's summary metrics (``metrics/teacher.jsonl``; one
    more at the end). Each reads the whole store (counts, spend, the gate's calibration over every
    label), so a busy service that logged after every posted batch spent the RL step's CPU on them
    (725 rows in a 60-step quickstart-replay run at ``poll_s = 0.5``)."""

    nice: int = Field(default=0, ge=0, le=19)
    """CPU niceness the service adds to itself at start, and that ``rl`` adds to the servers of its
    local teachers (``pool[].local``). On a machine whose cores the run's own processes share (the
    CPU quickstart), a positive value lets the RL step's inference server and trainer run first:
    the teachers, the reference forward and the pair building fill the time those leave idle
    instead of slowing the step. 0 (the default) leaves the priority as it is."""

    max_concurrent_steps: int = Field(default=16, ge=1)
    """Steps being labeled at once (each may have several teacher calls in flight). A step the
    budget cannot pay for now waits for calls in flight to settle and tries again; it is refused
    (outcome ``budget``) only when nothing is in flight and it still does not fit."""

    step_timeout_s: float = Field(default=300.0, gt=0.0)
    """Wall-clock limit of one step's teacher calls (every teacher, attempt and backoff wait); a
    call still running then is cut off (ledger outcome ``step_deadline``). Each attempt also has
    its own wall-clock limit, ``pool[].retry.timeout_s``."""

    instructions: str = DEFAULT_INSTRUCTIONS
    """System message of every teacher request (part of the cache key)."""

    traces: TraceSourceConfig = TraceSourceConfig()
    """Trace files imported at start."""

    pool: list[TeacherEndpointConfig] = Field(default_factory=list)
    """The teachers (``[[teacher.pool]]``); at least one."""

    gate: GateConfig = GateConfig()
    """Which steps are asked, and the cascade."""

    budget: BudgetConfig = BudgetConfig()
    """Spend caps."""

    pairs: PairConfig = PairConfig()
    """How votes become pairs and process rewards."""

    reference: ReferenceConfig = ReferenceConfig()
    """The reference forward."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not self.pool:
            raise ValueError(
                "teacher.pool is empty: add at least one [[pool]] table with base_url and model "
                "(e.g. an OpenAI-compatible API or `uv run inference` on another port)"
            )
        seen: set[str] = set()
        for i, endpoint in enumerate(self.pool):
            if endpoint.id in seen:
                raise ValueError(
                    f"teacher.pool[{i}]: the name {endpoint.id!r} is used twice; give each teacher its own "
                    "`name` (it keys the ledger and the response cache)"
                )
            seen.add(endpoint.id)
        return self

    @property
    def store_path(self) -> Path:
        """The SQLite file of the trace store, response cache, cost ledger and pair store."""
        return Path(self.output_dir) / "teacher" / "teacher.sqlite"
