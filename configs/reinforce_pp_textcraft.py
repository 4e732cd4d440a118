"""REINFORCE++ (batch-whitened token returns) on TextCraft with ScalingInter-RL; everything else
as grpo_textcraft.py."""

from agentgym_jax.config import experiment

get_config = experiment("textcraft", {"algorithm.advantage": "reinforce_plus_plus"})
