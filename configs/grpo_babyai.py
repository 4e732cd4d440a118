r"""GRPO on BabyAI with ScalingInter-RL: 16 tasks x 8 samples, turn caps [6, 13, 20] every 100
steps (the paper's BabyAI script), otherwise the TextCraft recipe.

  python launch/train.py --config=configs/grpo_babyai.py --workdir=runs/grpo_babyai
  python launch/train.py --config=configs/grpo_babyai.py:local --workdir=runs/babyai_local

Variants: `local` (embedded SmolLM2 on a CPU), `short` / `long` (fixed 6 / 20 turns).
"""

from agentgym_jax.config import apply_variants, base_config, standard_variants


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "babyai"
  c.rollout.tasks_per_step = 16
  c.horizon.caps = (6, 13, 20)
  c.horizon.turns = 20
  return apply_variants(c, variant, standard_variants(6, 20))
