"""pyfix: fix a one-line bug in a Python function with sandboxed tools (the agentic quickstart task)."""

from pyfix.taskset import FUNCTIONS, PyfixConfig, PyfixData, PyfixTask, PyfixTaskset, oracle_replies

__all__ = ["FUNCTIONS", "PyfixConfig", "PyfixData", "PyfixTask", "PyfixTaskset", "oracle_replies"]
