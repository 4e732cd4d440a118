"""GiGPO (Feng et al. 2025) on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

GRPO's episode-level advantage plus GiGPO's step level: the turns of a task's samples that
answer the same observation (the same inventory, the same error) form a step group, scored on
their discounted returns with the paper's gamma 0.95 and step weight 1. Logged:
gigpo/anchored_turns and gigpo/step_group_size (how many later turns share a state).
"""

from agentgym_jax.config import experiment

get_config = experiment("textcraft", {
    "algorithm.advantage": "gigpo",
    "algorithm.gigpo_step_weight": 1.0,
    "algorithm.gamma": 0.95,
})
