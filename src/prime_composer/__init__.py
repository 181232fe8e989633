"""prime-composer: asynchronous RL post-training of coding agents.

Three processes (inference / orchestrator / trainer) started together by ``rl``; see
``docs/architecture.md``.
"""

__version__ = "0.1.0"
