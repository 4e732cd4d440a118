r"""PPO (GAE advantages from a value head, clipped value loss) on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

  python launch/train.py --config=configs/ppo_textcraft.py --workdir=runs/ppo_textcraft
  python launch/train.py --config=configs/ppo_textcraft.py:local --workdir=runs/ppo_local

Variants: `local` (embedded SmolLM2 on a CPU), `short` / `long` (fixed 10 / 30 turns).
"""

from agentgym_jax.config import apply_variants, base_config, standard_variants


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "textcraft"
  c.algorithm.advantage = "gae"
  return apply_variants(c, variant, standard_variants())
