"""feature-deletion: delete a feature from a real project, reward the agent for rebuilding it.

A verifiers v1 taskset (``FeatureDeletionTaskset``) over tasks generated from a corpus of
permissively licensed PyPI projects (or the CI projects under ``corpus/ci``), graded outside the
agent's workspace so that each known reward hack scores 0 (README.md lists them). Modules:

    spec, corpus      manifests, fetching, cleaning, baseline runs, recording (build_corpus.py)
    deletion          what can be deleted and how (signature + docstring kept)
    generate, tasks   validated tasks and the taskset file (generate_tasks.py)
    sandboxed, runs   the code that runs inside the sandbox, and how it is run
    trees, grader     which files are graded where; the reward
    episode, agents   one attempt through the coding tools; scripted agents (oracle, no-op, hackers)
    taskset           the verifiers side
"""

from feature_deletion.taskset import (
    FeatureDeletionConfig,
    FeatureDeletionData,
    FeatureDeletionState,
    FeatureDeletionTask,
    FeatureDeletionTaskset,
    episode_for,
)

__all__ = [
    "FeatureDeletionConfig",
    "FeatureDeletionData",
    "FeatureDeletionState",
    "FeatureDeletionTask",
    "FeatureDeletionTaskset",
    "episode_for",
]
