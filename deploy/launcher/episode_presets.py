"""A multi-turn task's defaults for ``relay up`` (``TASK_NEEDS``, e.g. ``calc``), below the config file,
the ``RELAY_*`` variables, the flags and ``--set``: the generator's episode settings, the learner's, and the
reward route of episodes a budget ended. docs/agents.md ("Measured") has the runs that chose them."""

from __future__ import annotations

from broker.prompts.tasks import TASK_NEEDS

# the generator's: a few turns (call the tool, read its answer, answer); 32 episodes per prompt
EPISODE_DEFAULTS = {"episodes": {"max_turns": 3, "max_tokens": 32}, "sampling": {"n": 32}}
# and the learner's: 8 groups of 32 episodes a step, an entropy bonus and a higher upper clip keep the policy
# exploring the call's characters until it copies the prompt into them (with 16 groups of 16 it collapsed onto
# one call for every prompt; docs/agents.md, runs r1-r8); 2e-3 left the plateau sooner but settled, deterministic,
# on a partly copied call in 3 of 4 runs (docs/agents.md, Measured); steps: more than 15 minutes of them here
EPISODE_LEARNER_DEFAULTS = {
    "batch": {"groups": 8},
    "optim": {"lr": 1e-3},
    "regularization": {"entropy_coef": 0.03},
    "clip_eps_high": 0.28,
    "steps": 3000,
}


def call_tokens(max_digits: int) -> int:
    """The tiny model's compact call of one operation on two numbers of ``max_digits`` digits, in tokens:
    ``<tool_call>`` a ``*`` b ``</tool_call>`` (one token per digit)."""
    return 2 * max_digits + 3


def episode_defaults(needs: dict, max_digits, batch_groups, generators: int) -> dict:
    """The generator's episode settings for a task that needs an environment, else none.

    A turn is at most the call's tokens: turn 1 ends with its ``</tool_call>`` (nothing sampled after it is
    trained or read; the answer, a product of at most as many digits as the call, fits too). Each generator
    claims its share of a step's groups, so that at admission η = 0 (the next batch is sampled once the
    learner has trained the last) the generators sample one step's groups side by side, not one after the
    other."""
    if not needs.get("env"):
        return {}
    # the values as configured; one that is not a positive int is left to the config's validation to report
    max_digits = max_digits if isinstance(max_digits, int) and max_digits >= 1 else 1
    batch_groups = (
        batch_groups
        if isinstance(batch_groups, int) and batch_groups >= 1
        else EPISODE_LEARNER_DEFAULTS["batch"]["groups"]
    )
    share = -(-batch_groups // max(generators, 1))
    return {
        **EPISODE_DEFAULTS,
        "episodes": {**EPISODE_DEFAULTS["episodes"], "env": needs["env"]},
        "prompts_per_batch": max(share, 1),
        "sampling": {**EPISODE_DEFAULTS["sampling"], "max_tokens": call_tokens(max_digits)},
    }


def task_reward_defaults(task: str) -> dict:
    """A multi-turn task's reward route: the environment scores the episodes it ends; one ended by a budget
    (no answer in time) is scored by the reward service on its last turn, with the digit tasks' plugin
    (0 for an unfinished answer)."""
    if task not in TASK_NEEDS:
        return {}
    from reward_service.config import RewardConfig

    return {"task_plugins": {**RewardConfig.model_fields["task_plugins"].default_factory(), task: "digits"}}
