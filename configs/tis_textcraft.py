"""GRPO with truncated importance sampling on TextCraft; everything else as grpo_textcraft.py.

The rollout correction for a sampler whose probabilities differ from the learner's (another
precision or kernel): each token's policy-gradient loss is weighted by
min(pi_learner / pi_sampler, 2). The per-turn mismatch metrics (mismatch/turn_K/log_ratio,
mismatch/turn_K/kl) show how far apart the two are, turn by turn.
"""

from agentgym_jax.config import experiment

get_config = experiment("textcraft", {
    "algorithm.rollout_correction": "token_tis",
    "algorithm.rollout_correction_cap": 2.0,
})
