"""GSPO (Zheng et al. 2025) on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

GRPO's group advantages with GSPO's policy loss: one length-normalised importance ratio per
trajectory, clipped to [1 - 3e-4, 1 + 4e-4] (the paper's range), each trajectory weighing the
same (seq-mean-token-mean).
"""

from agentgym_jax.config import experiment

get_config = experiment(
    "textcraft", {"algorithm.policy_loss": "gspo", "algorithm.aggregation": "seq-mean-token-mean"})
