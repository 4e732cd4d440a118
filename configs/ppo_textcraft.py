"""PPO (GAE advantages from a value head, clipped value loss) on TextCraft with ScalingInter-RL;
everything else as grpo_textcraft.py."""

from agentgym_jax.config import experiment

get_config = experiment("textcraft", {"algorithm.advantage": "gae"})
