"""arith: a verifiers v1 taskset of sums of two small numbers (the quickstart task)."""

from arith.taskset import ArithConfig, ArithData, ArithTask, ArithTaskset, sft_examples

__all__ = ["ArithConfig", "ArithData", "ArithTask", "ArithTaskset", "sft_examples"]
