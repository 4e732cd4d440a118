r"""CISPO (MiniMax-M1, 2025) on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

GRPO's group advantages with CISPO's policy loss: REINFORCE whose per-token importance weight is
clipped (at most 1 + algorithm.cispo_clip_eps_high, no lower bound) and not differentiated, so
no token loses its gradient to a clip; every token weighs the same (token-mean).

  python launch/train.py --config=configs/cispo_textcraft.py --workdir=runs/cispo_textcraft
  python launch/train.py --config=configs/cispo_textcraft.py:local --workdir=runs/cispo_local

Variants: `local` (embedded SmolLM2 on a CPU), `short` / `long` (fixed 10 / 30 turns).
"""

from agentgym_jax.config import apply_variants, base_config, standard_variants


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "textcraft"
  c.algorithm.policy_loss = "cispo"
  return apply_variants(c, variant, standard_variants())
