"""Relay learner: DeepSpeed engine, advantages, off-policy-corrected losses, weight publication."""
