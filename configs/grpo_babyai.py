"""GRPO on BabyAI with ScalingInter-RL: 16 tasks x 8 samples, turn caps [6, 13, 20] every 100
steps (the paper's BabyAI script), otherwise the TextCraft recipe; `short` / `long` are fixed
caps of 6 / 20 turns."""

from agentgym_jax.config import experiment

get_config = experiment("babyai", {
    "rollout.tasks_per_step": 16,
    "horizon.caps": (6, 13, 20),
    "horizon.turns": 20,
}, short=6, long=20)
