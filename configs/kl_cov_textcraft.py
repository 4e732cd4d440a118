"""KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models") on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

The unclipped policy-gradient loss plus |log ratio| (coefficient 1) on the 2e-3 of the trained
tokens of largest advantage-log-prob covariance: the paper's value for Qwen2.5-7B (2e-4 for the
32B model), in place of the entropy bonus.
"""

from agentgym_jax.config import experiment

get_config = experiment("textcraft", {
    "algorithm.policy_loss": "kl_cov",
    "algorithm.kl_cov_ratio": 2e-3,
    "algorithm.entropy_coef": 0.0,
})
