"""REINFORCE++ on SciWorld with each turn's reward on its own turn; everything else as
grpo_sciworld.py.

SciWorld's score rises step by step as subgoals are met. With algorithm.reward_placement=turn
each increment sits on the last token of the turn that earned it, so a token's return counts
what it and the turns after it earned (the token-level estimators' credit; GRPO would credit
every turn with the final score). The process backend keeps one JVM per slot.
"""

from agentgym_jax.config import experiment

get_config = experiment(
    "sciworld", {
        "env.backend": "process",
        "rollout.tasks_per_step": 16,
        "rollout.max_new_tokens": 200,
        "algorithm.advantage": "reinforce_plus_plus",
        "algorithm.reward_placement": "turn",
    })
