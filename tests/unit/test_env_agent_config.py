"""Which harness an environment gets, and the agent loop's settings: documented, and checked
against the environment and the rollout timeout when it loads."""

from __future__ import annotations

import pytest

from prime_composer.config.env import AgentLoopConfig, EnvConfig, RolloutConfig
from prime_composer.orchestrator import envs
from prime_composer.orchestrator.agent_harness import AGENT_HARNESS_ID, AgentHarness
from prime_composer.orchestrator.harness import HARNESS_ID, ChatHarness


def test_every_agent_loop_field_is_documented() -> None:
    assert [n for n, f in AgentLoopConfig.model_fields.items() if not f.description] == []


def test_tool_using_environments_get_the_agent_harness_with_their_settings() -> None:
    pyfix = envs.load_env(EnvConfig(id="pyfix", agent={"max_turns": 3}), 0)
    (harness,) = pyfix.env._harnesses.values()
    assert isinstance(harness, AgentHarness) and harness.config.id == AGENT_HARNESS_ID
    assert harness.config.loop.max_turns == 3 and pyfix.agent is not None and pyfix.agent.max_turns == 3
    # Without an agent table the defaults apply; chat environments keep the chat harness.
    assert envs.load_env(EnvConfig(id="pyfix"), 0).agent == AgentLoopConfig()
    arith = envs.load_env(EnvConfig(id="arith"), 0)
    (chat,) = arith.env._harnesses.values()
    assert isinstance(chat, ChatHarness) and chat.config.id == HARNESS_ID and arith.agent is None


def test_agent_settings_that_cannot_apply_are_errors() -> None:
    with pytest.raises(ValueError, match=r"orchestrator.env\[0\].*`agent` is set.*single chat calls"):
        envs.load_env(EnvConfig(id="arith", agent={}), 0)
    with pytest.raises(ValueError, match=r"time_limit_s = 700 exceeds orchestrator.rollout.timeout_s = 600"):
        envs.load_env(EnvConfig(id="pyfix", agent={"time_limit_s": 700}), 0, RolloutConfig(timeout_s=600))
