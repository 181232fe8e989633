"""The orchestrator: rollouts, rewards, advantages, packing; never imports trainer or model code."""
