"""Dr. GRPO (Liu et al. 2025) on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

GRPO without its two length and difficulty biases: advantages are rewards minus the group mean
(no division by the group's std), and the loss sums each trajectory's tokens and divides by a
constant (seq-mean-token-sum-norm; algorithm.loss_scale_tokens = 0 takes 512 new tokens x 30
turns, the most a trajectory can have trained).
"""

from agentgym_jax.config import experiment

get_config = experiment("textcraft", {
    "algorithm.grpo_normalize_by_std": False,
    "algorithm.aggregation": "seq-mean-token-sum-norm",
})
