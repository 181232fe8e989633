"""One typed record of the episode a Sample came from, from the rollout to the teacher service.

``rollout.py`` fills it once from the verifiers trace (``episode_record``); SDPO's hint builder
reads the conversation, the tools and the environment's error location from it; advantages and
process rewards group a split episode's Samples by ``trace_id``; ``trace_export.py`` turns the
Samples of one episode into the teacher service's trace (the only converter). Every field is
typed; a Sample of a failed rollout keeps what was known (often only ``env``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prime_composer.orchestrator.episode import TurnInfo


@dataclass
class EpisodeRecord:
    """Where a Sample came from and what its episode did (see the module docstring)."""

    env: str = "env"
    """Label of its environment (``orchestrator.env[i]``)."""
    trace_id: str | None = None
    """The verifiers trace id; the Samples of an episode split in several share it."""
    task_idx: int | None = None
    task_id: str | None = None
    task: dict[str, Any] | None = None
    """The task's data as JSON (``prompt``, ``answer``, ...)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation in OpenAI wire format."""
    stop_condition: str | None = None
    """Why verifiers stopped the trace."""
    turns: list[TurnInfo] | None = None
    """One record per assistant turn of this Sample (token span, tool calls, results); None: the
    rollout kept no per-turn records (an error Sample)."""

    # Agent episodes (``orchestrator/episode.py``).
    tools: list[dict[str, Any]] | None = None
    """Tool definitions offered (OpenAI format)."""
    render_tools: bool = False
    """Whether the chat template rendered ``tools`` (SDPO re-renders with them)."""
    tool_call_format: str | None = None
    """The parser that read the replies' tool calls."""
    stop: str | None = None
    """Why the agent loop stopped (``final_answer``, a budget, ``timeout``)."""
    segment: int | None = None
    """Which Sample of a split episode this is (0-based), of ``num_segments``."""
    num_segments: int | None = None

    # Where the error is, for SDPO's hint sources (``orchestrator/sdpo/sources.py``): what the
    # environment set on ``trace.info``, as it set it (validated by the hint builder), or what
    # ``episode.localize_error`` found; in this Sample's own turn numbering for agent episodes.
    feedback: Any = None
    """Environment feedback: a string, a ``{"text", "turn", "kind"}`` dict, or a list of them."""
    error_turn: Any = None
    """The turn the error is in (an int; anything else is counted as a bad error turn)."""
    error_kind: Any = None
    """The kind of error (picks the hint template)."""
