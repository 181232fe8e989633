"""strops: a verifiers v1 taskset of string transforms with held-out strings."""

from strops.taskset import (
    OPERATIONS,
    StropsConfig,
    StropsData,
    StropsTask,
    StropsTaskset,
    similarity,
    split_tasks,
    transform,
)

__all__ = [
    "OPERATIONS",
    "StropsConfig",
    "StropsData",
    "StropsTask",
    "StropsTaskset",
    "similarity",
    "split_tasks",
    "transform",
]
