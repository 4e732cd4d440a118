r"""REINFORCE++ (batch-whitened token returns) on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

  python launch/train.py --config=configs/reinforce_pp_textcraft.py --workdir=runs/reinforce_pp_textcraft
  python launch/train.py --config=configs/reinforce_pp_textcraft.py:local --workdir=runs/reinforce_pp_local

Variants: `local` (embedded SmolLM2 on a CPU), `short` / `long` (fixed 10 / 30 turns).
"""

from agentgym_jax.config import apply_variants, base_config, standard_variants


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "textcraft"
  c.algorithm.advantage = "reinforce_plus_plus"
  return apply_variants(c, variant, standard_variants())
