"""CISPO (MiniMax-M1, 2025) on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

GRPO's group advantages with CISPO's policy loss: REINFORCE whose per-token importance weight is
clipped (at most 1 + algorithm.cispo_clip_eps_high, no lower bound) and not differentiated, so
no token loses its gradient to a clip; every token weighs the same (token-mean).
"""

from agentgym_jax.config import experiment

get_config = experiment("textcraft", {"algorithm.policy_loss": "cispo"})
