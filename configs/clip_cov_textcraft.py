"""Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models") on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

PPO's clipped loss whose gradient is detached from 2e-4 of the trained tokens, drawn among those
whose advantage-log-prob covariance lies in (1, 5): the paper's values for Qwen2.5-7B, in place of
the entropy bonus.
"""

from agentgym_jax.config import experiment

get_config = experiment("textcraft", {
    "algorithm.policy_loss": "clip_cov",
    "algorithm.entropy_coef": 0.0,
})
