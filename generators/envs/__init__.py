"""Environments for multi-turn and agentic rollouts (docs/agents.md): the model's turn in, the
environment's reply out, until the episode is done. See :mod:`generators.envs.base`."""
