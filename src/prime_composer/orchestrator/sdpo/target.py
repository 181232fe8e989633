"""What SDPO distills on one sample, kept in ``Sample.channels["sdpo"]`` (set by ``hints.py``,
read by ``packing.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from prime_composer.orchestrator.sample import Sample

NAME = "sdpo"
"""The channel's name: its entry in ``Sample.channels``, its batch group."""


@dataclass(frozen=True)
class SDPOTarget:
    """The student's target-turn tokens and the teacher's context."""

    span: tuple[int, int]
    """``(start, end)`` indices into ``completion_ids`` of the hinted turn (policy tokens only)."""
    teacher_prefix_ids: list[int]
    """The tokens before the target turn with the hint inserted, rendered with the same chat template,
    so the teacher scores ``teacher_prefix_ids + completion_ids[start:end]``."""
    source: str | None = None
    """The hint source that wrote it (``sibling``, ``feedback``, ``template``, ``llm``)."""
    hint: str | None = None
    """The hint text."""
    template: str | None = None
    """Which template, for the template source."""


def sdpo_target(sample: Sample) -> SDPOTarget | None:
    """The sample's SDPO target, or None without a hint."""
    target = sample.channels.get(NAME)
    return target if isinstance(target, SDPOTarget) else None


def set_sdpo_target(
    sample: Sample,
    span: tuple[int, int],
    teacher_prefix_ids: list[int],
    *,
    source: str | None = None,
    hint: str | None = None,
    template: str | None = None,
) -> None:
    """Mark ``completion_ids[start:end]`` as the SDPO target scored after ``teacher_prefix_ids``."""
    start, end = span
    n = len(sample.completion_ids)
    if not 0 <= start < end <= n:
        raise ValueError(f"Sample: sdpo span {span} is not a non-empty range of the {n} completion tokens")
    if not all(sample.completion_mask[start:end]):
        raise ValueError(f"Sample: sdpo span {span} covers tokens the policy did not generate (mask 0)")
    if not teacher_prefix_ids:
        raise ValueError("Sample: the SDPO teacher prefix is empty")
    sample.channels[NAME] = SDPOTarget(
        span=(start, end),
        teacher_prefix_ids=list(teacher_prefix_ids),
        source=source,
        hint=hint,
        template=template,
    )


def clear_sdpo_target(sample: Sample) -> None:
    sample.channels.pop(NAME, None)
